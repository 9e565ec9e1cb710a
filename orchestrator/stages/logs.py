"""`sglfleet logs`: read, follow and bundle the server logs of a fleet.

Round trips (all through fleet/remote_call.call and remote/logs.py):
- read: one `read` call per page (4 MB of lines at most) per host until the host says there is no
  more; the hosts are read at once, one page ahead each, and merged by timestamp as they come, so
  the controller holds about one page per host whatever the log size.
- follow (`-f`): per host a loop of `read` calls with `wait`: the host answers as soon as a new
  line lands (within ~0.15 s) or after WAIT_S with nothing; the cursor it returns is sent back
  with the next call, so a host whose connection drops is reconnected and resumes exactly where
  it was (no line lost, none twice).
- bundle: one `bundle` call (the host writes and compresses the tar.gz itself), then the file in
  CHUNK-sized `dd` reads over the same connection (at most FETCH_SLOTS chunks in flight over all
  hosts: bounded memory), checked against the host's sha256, then one `bundle_done` call.

`--since last`: after each read that reached the end of a host's log, the host's cursor (journald
cursor, or file inode + offset) is kept on the controller (CursorStore), so the next run fetches
only what is new.
"""

from __future__ import annotations

import hashlib
import heapq
import json
import math
import queue
import re
import shlex
import threading
import time
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any, Callable, Iterator


from ..errors import ConfigError, ConnectError, RemoteError
from ..fleet.remote_call import call
from ..fleet.ssh_library import paramiko
from . import runs

SCRIPT = "logs.py"
PAGE_BYTES = 4 << 20
WAIT_S = 10.0
CHUNK = 2 << 20
FETCH_SLOTS = 4  # chunks in flight over all hosts; each costs ~2 x CHUNK of controller memory
_DURATION = re.compile(r"^(\d+(?:\.\d+)?)\s*(s|sec|m|min|h|d|w)$")
_UNITS = {"s": 1, "sec": 1, "m": 60, "min": 60, "h": 3600, "d": 86400, "w": 604800}
PROFILE_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,62}$")
# Connection trouble: reconnect and resume. Anything else a host says is its answer.
DROPPED = (ConnectError, OSError, EOFError, paramiko.SSHException)


def parse_time(value: str | None, option: str, now: float | None = None) -> float | None:
    """`10m`, `2h`, `90s`, `1d` ago, or an ISO date/time (no zone: this machine's local time)."""
    if value is None:
        return None
    now = time.time() if now is None else now
    text = value.strip()
    match = _DURATION.match(text)
    if match:
        return now - float(match.group(1)) * _UNITS[match.group(2)]
    try:
        moment = datetime.fromisoformat(text.replace("Z", "+00:00"))
    except ValueError:
        raise ConfigError(f"{option} {value!r}: give a duration ago (90s, 10m, 2h, 1d) or an ISO time "
                          f"(2026-12-03T09:30, 2026-12-03 09:30:00+00:00)") from None
    return moment.timestamp()


def profile_name(value: str | None) -> str | None:
    """A profile as the host knows it: a name, or the name inside a profile .yaml."""
    if value is None:
        return None
    if value.endswith((".yaml", ".yml")):
        from ..spec.profile import load_profile

        return load_profile(value).name
    if not PROFILE_NAME.match(value):
        raise ConfigError(f"profile {value!r} is not a profile name (letters, digits, '.', '_', '-')")
    return value


@dataclass
class Query:
    """What to read from each host's server log."""

    profile: str | None = None
    since: float | None = None
    until: float | None = None
    tail: int | None = None
    grep: str | None = None
    page_bytes: int = PAGE_BYTES
    extra: dict[str, Any] = field(default_factory=dict)  # log_dir/state_dir/source (tests)

    def __post_init__(self) -> None:
        if self.grep:
            try:
                re.compile(self.grep)
            except re.error as exc:
                raise ConfigError(f"--grep {self.grep!r} is not a regular expression: {exc}") from None
        if self.tail is not None and self.tail < 0:
            raise ConfigError(f"--tail must be 0 or more, got {self.tail}")
        if self.since is not None and self.until is not None and self.until < self.since:
            raise ConfigError("--until is before --since")

    def args(self, cursor: dict | None = None, wait: float = 0.0, tail: bool = True) -> dict[str, Any]:
        return {"profile": self.profile, "since": self.since, "until": self.until,
                "tail": self.tail if tail and cursor is None else None, "grep": self.grep,
                "max_bytes": self.page_bytes, "cursor": cursor, "wait": wait, **self.extra}


@dataclass
class Line:
    host: str
    ts: float | None
    text: str


@dataclass
class HostRead:
    """How one host's read went: its cursor at the end, what it cost, a gap or an error."""

    host: str
    cursor: dict | None = None
    lines: int = 0
    bytes_read: int = 0  # log bytes the host read
    answer_bytes: int = 0  # size of the JSON answers that crossed the wire
    calls: int = 0
    source: str | None = None
    gaps: list[str] = field(default_factory=list)
    error: BaseException | None = None
    complete: bool = False  # read to the end of the log (the cursor may be kept for --since last)

    def to_json(self) -> dict[str, Any]:
        return {"host": self.host, "ok": self.error is None, "lines": self.lines, "source": self.source,
                "bytes_read": self.bytes_read, "answer_bytes": self.answer_bytes, "calls": self.calls,
                "gaps": self.gaps, "error": str(self.error) if self.error else None}


def read_pages(conn: Any, query: Query, cursor: dict | None, state: HostRead) -> Iterator[list[Line]]:
    """The host's log as pages of lines, one `read` call each, until the end."""
    first = True
    while True:
        page = call(conn, SCRIPT, "read", query.args(cursor, tail=first), timeout=600)
        first = False
        state.calls += 1
        state.answer_bytes += len(json.dumps(page))
        state.bytes_read += page.get("bytes_read", 0)
        state.source = page.get("source")
        if page.get("gap"):
            state.gaps.append(page["gap"])
        cursor = page.get("cursor") or cursor
        state.cursor = cursor
        lines = [Line(conn.host.name, ts, text) for ts, text in page["lines"]]
        state.lines += len(lines)
        yield lines
        if not page.get("more"):
            state.complete = query.until is None
            return


class _Prefetch:
    """One host's pages read in a thread, one page ahead of the merge."""

    def __init__(self, conn: Any, query: Query, cursor: dict | None, state: HostRead):
        self.pages: queue.Queue = queue.Queue(maxsize=1)
        self.state = state
        self.thread = threading.Thread(target=self._run, args=(conn, query, cursor), daemon=True)
        self.thread.start()

    def _run(self, conn: Any, query: Query, cursor: dict | None) -> None:
        try:
            for page in read_pages(conn, query, cursor, self.state):
                self.pages.put(page)
        except Exception as exc:  # kept per host; the other hosts go on
            self.state.error = exc
        finally:
            self.pages.put(None)

    def lines(self) -> Iterator[Line]:
        while (page := self.pages.get()) is not None:
            yield from page


def _order(line: Line) -> float:
    return -math.inf if line.ts is None else line.ts


def read_merged(conns: list[Any], query: Query, cursors: dict[str, dict | None]) -> tuple[Iterator[Line],
                                                                                            dict[str, HostRead]]:
    """All hosts' lines merged by timestamp (stable: a host's own order is kept on ties), and the
    per-host read states (filled in as the iterator is consumed)."""
    states = {c.host.name: HostRead(c.host.name) for c in conns}
    readers = [_Prefetch(c, query, cursors.get(c.host.name), states[c.host.name]) for c in conns]
    return heapq.merge(*(r.lines() for r in readers), key=_order), states


# ---------------------------------------------------------------- follow


@dataclass
class Follower:
    """`logs -f`: every host at once, until `stop` is set; each line to `emit`, connection
    events (lost, reconnected, failed) to `event`."""

    conns: list[Any]
    query: Query
    emit: Callable[[Line], None]
    event: Callable[[str, str, str], None]
    cursors: dict[str, dict | None] = field(default_factory=dict)
    wait_s: float = WAIT_S
    stop: threading.Event = field(default_factory=threading.Event)
    states: dict[str, HostRead] = field(default_factory=dict)
    threads: list[threading.Thread] = field(default_factory=list)

    def run(self) -> dict[str, HostRead]:
        self.threads = [threading.Thread(target=self._host, args=(c,), daemon=True) for c in self.conns]
        for thread in self.threads:
            thread.start()
        try:
            while any(t.is_alive() for t in self.threads):
                for thread in self.threads:
                    thread.join(0.2)
        finally:
            self.stop.set()
        return self.states

    def shut(self, timeout: float = 5.0) -> dict[str, HostRead]:
        """After Ctrl-C: stop, close every connection (which ends the long-poll reads under way)
        and give each host's thread `timeout` s to leave, so the states are final when reported;
        a thread still reconnecting is a daemon and ends with the process."""
        self.stop.set()
        for conn in self.conns:
            try:
                conn.close()
            except Exception:  # noqa: BLE001 - a dead transport may fail to close
                pass
        deadline = time.monotonic() + timeout
        for thread in self.threads:
            thread.join(max(0.0, deadline - time.monotonic()))
        return self.states

    def _host(self, conn: Any) -> None:
        name = conn.host.name
        state = self.states.setdefault(name, HostRead(name))
        cursor, first, more, backoff, lost = self.cursors.get(name), True, False, 0.5, False
        while not self.stop.is_set():
            try:
                page = call(conn, SCRIPT, "read", self.query.args(cursor, wait=0 if first or more else self.wait_s,
                                                                  tail=first),
                            timeout=self.wait_s + 60)
            except RemoteError as exc:
                if self.stop.is_set():  # Ctrl-C closed the connections under the call: not the host's doing
                    break
                if exc.error_type == "NoAnswer":  # the connection died under the call
                    lost = self._lost(conn, exc, lost)
                    backoff = self._pause(backoff)
                    continue
                self.event(name, "failed", str(exc))  # the host's own answer: e.g. no server there
                state.error = exc
                return
            except DROPPED as exc:
                if self.stop.is_set():
                    break
                lost = self._lost(conn, exc, lost)
                backoff = self._pause(backoff)
                continue
            if lost:
                self.event(name, "reconnected", "")
                lost = False
            first, more, backoff = False, bool(page.get("more")), 0.5
            state.calls += 1
            state.answer_bytes += len(json.dumps(page))
            state.bytes_read += page.get("bytes_read", 0)
            if page.get("gap"):
                self.event(name, "gap", page["gap"])
            cursor = page.get("cursor") or cursor
            state.cursor, state.source = cursor, page.get("source")
            for ts, text in page["lines"]:
                self.emit(Line(name, ts, text))
            state.lines += len(page["lines"])
        state.complete = True

    def _lost(self, conn: Any, exc: BaseException, already: bool) -> bool:
        if not already:
            first = (str(exc) or type(exc).__name__).splitlines()[0]
            self.event(conn.host.name, "lost", f"{first}; reconnecting")
        try:
            conn.close()
        except Exception:  # noqa: BLE001 - a dead transport may fail to close; we open a new one
            pass
        return True

    def _pause(self, backoff: float) -> float:
        self.stop.wait(backoff)
        return min(backoff * 2, 5.0)


# ---------------------------------------------------------------- the kept cursors


class CursorStore:
    """Per profile, the cursor each host's log was last read to (runs/logs-cursors/PROFILE.json).
    A cursor is kept with the host's target (user@address:port): another machine under the same
    name starts over."""

    def __init__(self, runs: str | Path, profile: str | None):
        self.path = Path(runs) / "logs-cursors" / f"{profile or '_default'}.json"

    def load(self) -> dict[str, Any]:
        try:
            return json.loads(self.path.read_text())
        except (OSError, ValueError):
            return {}

    def cursors(self, hosts: list[Any]) -> dict[str, dict | None]:
        kept = self.load()
        return {h.name: (kept.get(h.name) or {}).get("cursor") if (kept.get(h.name) or {}).get("target") == h.target
                else None for h in hosts}

    def save(self, hosts: list[Any], states: dict[str, HostRead]) -> None:
        kept = self.load()
        for host in hosts:
            state = states.get(host.name)
            if state and state.error is None and state.complete and state.cursor:
                kept[host.name] = {"target": host.target, "cursor": state.cursor, "saved": time.time()}
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps(kept, indent=1, sort_keys=True) + "\n")
        tmp.replace(self.path)


# ---------------------------------------------------------------- bundle


def last_smoke(runs: str | Path, host: str) -> dict[str, Any] | None:
    """The newest smoke result for HOST on this controller: runs/*-smoke/HOST.json, or the smoke
    part of a deploy's runs/*-deploy/HOST.json (run dirs start with their time, so names sort)."""
    dirs = [d for d in Path(runs).glob("*-*") if d.name.split("-", 1)[1].startswith(("smoke", "deploy"))]
    for directory in sorted(dirs, key=lambda d: d.name, reverse=True):
        candidate = directory / f"{host}.json"
        try:
            document = json.loads(candidate.read_text())
        except (OSError, ValueError):
            continue
        if "-deploy" in directory.name:
            document = document.get("smoke") if isinstance(document, dict) else None
            if not document:
                continue  # a deploy that stopped before its smoke
        return {"from": str(candidate), "document": document}
    return None


def bundle_host(conn: Any, query: Query, out_dir: Path, runs: str | Path, slots: threading.Semaphore,
                chunk: int = CHUNK) -> dict[str, Any]:
    """The host's bundle, written on the host, fetched to out_dir/HOST.tar.gz in chunks."""
    started = time.monotonic()
    name = conn.host.name
    args = {"profile": query.profile, "python": conn.host.python, "smoke": last_smoke(runs, name), **query.extra}
    info = call(conn, SCRIPT, "bundle", args, timeout=3600, companions=("redact.py",))
    target = out_dir / f"{name}.tar.gz"
    partial = out_dir / f".{name}.tar.gz.part"
    digest = hashlib.sha256()
    remote = shlex.quote(info["path"])
    try:
        with open(partial, "wb") as out:
            blocks = chunk >> 20
            for index in range(math.ceil(info["size"] / chunk)):
                with slots:
                    result = conn.run(f"dd if={remote} bs=1M skip={index * blocks} count={blocks} status=none",
                                      timeout=600)
                    if not result.ok:
                        raise RemoteError(f"{name}: reading the bundle {info['path']} failed (exit "
                                          f"{result.exit_code}): {result.stderr_text.strip()}")
                    data = result.stdout
                    del result
                digest.update(data)
                out.write(data)
                del data
        size = partial.stat().st_size
        if size != info["size"] or digest.hexdigest() != info["sha256"]:
            raise RemoteError(f"{name}: the bundle arrived damaged ({size} of {info['size']} bytes, sha256 "
                              f"{digest.hexdigest()[:12]} vs {info['sha256'][:12]})")
        partial.replace(target)
    finally:
        partial.unlink(missing_ok=True)
        try:
            call(conn, SCRIPT, "bundle_done", {"path": info["path"]}, timeout=60)
        except (RemoteError, *DROPPED):
            pass  # a leftover under /var/tmp/sglfleet-bundles is harmless; the next bundle does not need it
    missing = [i["name"] for i in info["items"] if i["status"] != "ok"]
    return {"file": str(target), "bytes": info["size"], "sha256": info["sha256"], "source": info["source"],
            "items": info["items"], "not_collected": missing, "host_seconds": info["seconds"],
            "seconds": round(time.monotonic() - started, 3)}


def write_index(directory: Path, document: dict[str, Any]) -> Path:
    path = directory / "index.json"
    return runs.write_json(path, document)
