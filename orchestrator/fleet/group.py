"""Fan-out: run one task per host with bounded concurrency (Fabric's Group idea).

A task is a function `task(conn) -> value` that gets the host's one `Connection`; the
connection is opened once per host per command run and shared by every task run on it.
A host that is down or whose task raises is recorded as failed, the exception kept in its
HostResult (as Fabric's GroupResult does); it never stops the others.

A unit of several hosts (the ranks of one multi-node server) runs as one task on all their
connections (`Group.run_units`), one result per unit; its task's own threads carry the run's
stop with them (`in_this_run`).

Stopping (Ctrl-C, SIGTERM): `Group.stop` is an Event. Once set, no host starts, and a task that
checks `stopping()` between its steps (from the worker thread running it) ends before the next
one; a step already running on a host finishes (or rolls back) there. Hosts that never started
are results with a `Stopped` exception, and `GroupResult.interrupted` says the run was cut short.
"""

from __future__ import annotations

import threading
import time
import traceback
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

from ..errors import ConfigError, SglfleetError
from .hostkeys import KnownHosts
from .inventory import Host, Inventory
from .local import LocalConnection
from .transport import Connection

DEFAULT_FORKS = 32

# (host name, event, detail): events are "connecting", "running", "ok", "failed".
ProgressCallback = Callable[[str, str, str], None]


class TaskFailed(SglfleetError):
    """The task reached the host and the host's answer is a failure (see TaskOutcome)."""


class Stopped(SglfleetError):
    """The run was interrupted before this host (or its next step) started."""


_current = threading.local()  # the Group whose task this worker thread is running


def stopping() -> bool:
    """Whether the run this task belongs to was asked to stop (a checkpoint between steps)."""
    group = getattr(_current, "group", None)
    return bool(group is not None and group.stop.is_set())


def in_this_run(fn: Callable[..., Any]) -> Callable[..., Any]:
    """`fn` for another thread that works for the calling task (one rank of a unit), so that
    `stopping()` there answers for this task's run."""
    group = getattr(_current, "group", None)

    def run(*args: Any, **kwargs: Any) -> Any:
        _current.group = group
        try:
            return fn(*args, **kwargs)
        finally:
            _current.group = None

    return run


@dataclass
class HostResult:
    host: str
    ok: bool
    value: Any = None
    exception: BaseException | None = None
    duration: float = 0.0

    @property
    def error(self) -> str | None:
        """The failure as text: an expected error's one paragraph, a bug's whole traceback."""
        exc = self.exception
        if exc is None:
            return None
        if isinstance(exc, SglfleetError):
            return str(exc)
        return f"{type(exc).__name__}: {exc}\n" + "".join(traceback.format_exception(exc))

    @property
    def exit_code(self) -> int:
        """0, or the exception's own code (2 for bad input, 1 otherwise)."""
        if self.ok:
            return 0
        return getattr(self.exception, "exit_code", 1)

    def to_json(self) -> dict[str, Any]:
        return {"host": self.host, "ok": self.ok, "value": self.value, "error": self.error,
                "duration_s": round(self.duration, 3)}


class GroupResult(dict[str, HostResult]):
    """Host name -> HostResult, with the succeeded/failed views of Fabric's GroupResult."""

    @property
    def succeeded(self) -> dict[str, HostResult]:
        return {k: v for k, v in self.items() if v.ok}

    @property
    def failed(self) -> dict[str, HostResult]:
        return {k: v for k, v in self.items() if not v.ok}

    interrupted: bool = False

    @property
    def not_started(self) -> dict[str, HostResult]:
        return {k: v for k, v in self.items() if isinstance(v.exception, Stopped)}

    @property
    def exit_code(self) -> int:
        if self.interrupted:
            return 130  # as a shell reports a command ended by SIGINT
        return 0 if not self.failed else 1


# How often the main thread wakes while it waits for the hosts (see `awaited`).
SIGNAL_CHECK_S = 0.2


def awaited(future: Future) -> Any:
    """A host's result, waited for in short naps. Python runs a signal handler in the main thread
    only when that thread wakes: a Ctrl-C the kernel hands to a host's thread (or one that does
    not interrupt the main thread's wait) would otherwise wait for the host's whole step, and a
    step that Ctrl-C should have stopped (a launch after the smoke) would start."""
    while True:
        try:
            return future.result(timeout=SIGNAL_CHECK_S)
        except FutureTimeout:
            continue


@dataclass
class Group:
    """The hosts of one command run and their connections."""

    hosts: list[Host]
    known_hosts: KnownHosts
    forks: int = DEFAULT_FORKS
    host_key_policy: str | None = None
    progress: ProgressCallback | None = None
    inventory: Inventory | None = None
    connections: dict[str, Connection] = field(default_factory=dict)
    stop: threading.Event = field(default_factory=threading.Event)

    @classmethod
    def from_inventory(cls, inventory: Inventory, pattern: str, **kwargs: Any) -> "Group":
        return cls(inventory.select(pattern), KnownHosts(inventory.known_hosts_path),
                   inventory=inventory, **kwargs)

    def __post_init__(self) -> None:
        if self.forks < 1:
            raise ConfigError(f"--forks must be at least 1, got {self.forks}")

    def connection(self, host: Host) -> Connection:
        if host.name not in self.connections and host.connection == "local":
            # ansible_connection: local (and Ansible's implicit localhost): this machine, no SSH
            self.connections[host.name] = LocalConnection(host)  # type: ignore[assignment]
        if host.name not in self.connections:
            jump = None
            if host.proxy_jump and self.inventory and host.proxy_jump in self.inventory.hosts:
                jump = self.inventory.hosts[host.proxy_jump]
            self.connections[host.name] = Connection(host, self.known_hosts, self.host_key_policy,
                                                     jump_host=jump)
        return self.connections[host.name]

    def _emit(self, host: str, event: str, detail: str = "") -> None:
        if self.progress:
            self.progress(host, event, detail)

    def _one(self, host: Host, task: Callable[[Connection], Any], label: str, name: str | None = None) -> HostResult:
        """The task on `host`'s connection; `name` (default the host's) names its result and progress."""
        name = name or host.name
        started = time.monotonic()
        if self.stop.is_set():
            result = HostResult(name, False, exception=Stopped("not started: the run was interrupted"))
            self._emit(name, "failed", result.error or "")
            return result
        conn = self.connection(host)
        _current.group = self
        try:
            self._emit(name, "connecting", host.target)
            conn.open()
            self._emit(name, "running", label)
            value = task(conn)
        except Exception as exc:  # kept whole; a bug in a task must not take the other hosts down
            result = HostResult(name, False, exception=exc, duration=time.monotonic() - started)
        else:
            if isinstance(value, TaskOutcome):  # reached the host, and it said how it went
                failure = None if value.ok else TaskFailed(value.error or "failed")
                result = HostResult(name, value.ok, value.value, failure, time.monotonic() - started)
            else:
                result = HostResult(name, True, value, None, time.monotonic() - started)
        finally:
            _current.group = None
            # Done with this host: its connection goes now, not when the last host is done (an idle
            # paramiko transport is a thread that wakes ten times a second, and holds its buffers).
            conn.close()
        self._emit(name, "ok" if result.ok else "failed", result.error or "")
        return result

    def run(self, task: Callable[[Connection], Any], label: str = "task") -> GroupResult:
        results = GroupResult()
        with ThreadPoolExecutor(max_workers=min(self.forks, max(1, len(self.hosts)))) as pool:
            futures = {h.name: pool.submit(self._one, h, task, label) for h in self.hosts}
            for name in (h.name for h in self.hosts):
                results[name] = awaited(futures[name])
        results.interrupted = self.stop.is_set()
        return results

    def run_units(self, units: dict[str, list[Host]], task: Callable[[list[Connection]], Any],
                  label: str = "task") -> GroupResult:
        """`task(connections)` once per unit (name -> its hosts, e.g. the ranks of one multi-node
        server), with every host's connection open; results and progress per unit name. A unit
        counts as one of the `forks`: its hosts work at once, within its task."""
        results = GroupResult()

        def one(name: str, hosts: list[Host]) -> HostResult:
            # The first host's connection is opened by _one; the others' here, in the task.
            def opened(first: Connection) -> Any:
                conns = [first]
                try:
                    for host in hosts[1:]:
                        self._emit(name, "connecting", host.target)
                        conn = self.connection(host)
                        conns.append(conn)
                        conn.open()
                    return task(conns)
                finally:  # done with the unit: its other connections go now too (_one closes the first)
                    for conn in conns[1:]:
                        conn.close()

            return self._one(hosts[0], opened, label, name)

        with ThreadPoolExecutor(max_workers=min(self.forks, max(1, len(units)))) as pool:
            futures = {name: pool.submit(one, name, hosts) for name, hosts in units.items()}
            for name in units:
                results[name] = awaited(futures[name])
        results.interrupted = self.stop.is_set()
        return results

    def close(self) -> None:
        for conn in self.connections.values():
            conn.close()
        self.connections.clear()

    def __enter__(self) -> "Group":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __iter__(self) -> Iterator[Host]:
        return iter(self.hosts)


@dataclass
class TaskOutcome:
    """What a task returns when it reached the host but the host's answer is a failure."""

    ok: bool
    value: Any = None
    error: str | None = None
