"""Rolling restart and rolling deploy behind SGLang routers: one batch at a time, never more
than `max_unavailable` hosts out of routing, a failure budget per batch, automatic revert.

The plan (no host touched):
    batches       Ansible's `serial`: a number, a percentage or a list ("1,25%": a canary, then a
                  quarter of the hosts at a time; the last entry repeats)
    capacity      a host counts as unavailable while it is out of any router fronting it, or when
                  it was down before the rollout; the rollout refuses to start when those already
                  fill `max_unavailable`, with the table of who is down
Per host, in its batch (the batch's hosts in parallel, each taking a capacity slot):
    prepare       stages.deploy.HostDeploy up to its launch: plan, push, smoke (SGLang's own
                  validation) while the host still serves; a host that needs nothing ("unchanged")
                  is never taken out. A restart skips the smoke when the host's deployment record
                  vouches for it (smoke_vouched: that release, argv and environment passed it when
                  deployed); in restart mode the next batch prepares while this one is out
    take out      (right before the launch stops the old server) remove the worker from every
                  router fronting it (`sglfleet_router_url`), wait until none lists it; wait until its
                  in-flight requests (/metrics) reach 0, bounded by `drain_timeout`
    replace       HostDeploy's launch: SIGTERM, SGLang's drain, SIGKILL after `stop_grace`; start;
                  staged health (alive, port, /health, /health_generate, /generate, /server_info);
                  on failure HostDeploy reverts to the previous deployment
    min_ready     the worker must stay healthy that long (Kubernetes' minReadySeconds)
    put back      add it to every router and wait until each reports it healthy (also after a
                  revert: the previous deployment serves again)
After each batch: failed / batch size above `max_fail_percentage` (exceeded, not equalled) halts
the rollout; hosts not reached are untouched; `resume=True` (CLI --continue) picks up at the first
host not done, from the state file.

A multi-node server (a server group, stages/units.py) is one unit of the rollout: it takes one
place in a batch and one `max_unavailable` slot; only its rank 0 is a router worker (its
sglfleet_router_url and worker URL are rank 0's); it is taken out of routing once, before rank 0's
launch, all its ranks are replaced as `stages.groups.GroupDeploy` does (rank 0 first, health on
every rank, a failure reverting every rank), and its min_ready is every rank alive and healthy for
that long (inside the group's deploy, so a failure there reverts the whole group too); then it
goes back in. A pattern must select whole groups.

Canary analysis (`canary`, CLI --canary N): the first batch is the canary. Once it is back in
routing (its min_ready passed), stages.canary observes it and the baseline (the selected hosts
still on what served before) for the analysis window, judges, and decide()s: continue, revert the
canary (HostRoll.revert_canary: out of routing, drained, HostDeploy's revert, back in; the rest
untouched, exit 1), or pause. Paused, the controller waits for a decision file that `sglfleet
rollout continue|abort` writes beside the state file; the controller holds a lock on the state
(`<state>.lock`) its whole run, so those commands know whether one is waiting, and when none is
(it exited), they resume or revert from the state file themselves: the state keeps the
inventory, the profile, the options and what each canary host's revert needs.

Round trips per host are HostDeploy's (see stages/deploy.py; a vouched restart: plan, launch,
record); the router calls are HTTP from this machine (fleet/router.py), each URL checked by the
loopback guard. Each host's document keeps its phase times and, on the rollout's one clock,
when it was prepared, taken out and put back (prepare_at_s, out_at_s, back_at_s).
"""

from __future__ import annotations

import dataclasses
import fcntl
import hashlib
import json
import os
import socket
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from decimal import Decimal
from fractions import Fraction
from pathlib import Path
from typing import Any, Callable

from ..errors import ConfigError, SglfleetError
from ..fleet.group import Group, TaskOutcome, in_this_run
from ..fleet.hostkeys import KnownHosts
from ..fleet.inventory import Host, Inventory
from ..fleet.router import (RouterClient, RouterError, normalize_url, worker_healthy, worker_in_flight)
from ..numbers import check_number
from ..spec.profile import Artifacts, Profile, with_overrides
from ..fleet.server_groups import server_groups
from . import canary as canary_stage
from . import deploy as deploy_stage
from . import groups as groups_stage
from . import health as health_stage
from . import units as units_stage
from . import metrics as metrics_stage
from .logs import Query
from .runs import run_dir

WILDCARD_BINDS = ("0.0.0.0", "::", "")

# (kind, host or None, text): kinds "batch", "stage", "host-done", "halt", "note"
Events = Callable[[str, str | None, str], None]


class RolloutRefused(SglfleetError):
    """The fleet is already below the capacity the plan needs (exit 1), with the table."""

    def __init__(self, message: str, table: list[dict[str, Any]]):
        super().__init__(message)
        self.table = table


class Aborted(SglfleetError):
    """The rollout stopped before this host was taken out (halt or interrupt)."""


# ---------------------------------------------------------------- planning (no host touched)


def parse_serial(text: str | int | list[Any], option: str = "--batch") -> list[int | str]:
    """'1,25%' -> [1, '25%']; each entry a positive count or a percentage in (0, 100]."""
    items = text if isinstance(text, list) else [p.strip() for p in str(text).split(",")]
    out: list[int | str] = []
    for item in items:
        item = str(item).strip()
        if item.endswith("%"):
            try:
                value = float(Decimal(item[:-1]))
            except (ArithmeticError, ValueError):
                raise ConfigError(f"{option} entry '{item}' is not a percentage like 25%") from None
            if not 0 < value <= 100:
                raise ConfigError(f"{option} percentage must be in (0, 100], got '{item}'")
            out.append(item)
            continue
        try:
            count = int(item)
        except ValueError:
            raise ConfigError(f"{option} entry '{item}' is neither a host count nor a percentage "
                              f"(e.g. {option} 1, {option} 25%)") from None
        if count < 1:
            raise ConfigError(f"{option} host count must be at least 1, got '{item}'")
        out.append(count)
    if not out:
        raise ConfigError(f"{option} is empty (e.g. {option} 1, {option} 25%" + (", --batch 1,25%)" if option ==
                                                                                  "--batch" else ")"))
    return out


def parse_canary(text: str | int | None) -> int | str | None:
    """--canary: one host count or percentage (the first batch); None or '': no canary."""
    if text is None or str(text).strip() == "":
        return None
    entries = parse_serial(str(text), "--canary")
    if len(entries) != 1:
        raise ConfigError(f"--canary is one host count or percentage (the first batch), got '{text}'")
    return entries[0]


def percent_of(percent: str, total: int) -> int:
    """'30%' of `total` hosts as Ansible's serial counts it: rounded down, at least 1. Exact
    (decimal) arithmetic: in floats 0.35% of 2000 came out as 6.999... and rounded down to 6."""
    return max(1, int(Fraction(Decimal(percent.strip()[:-1])) * total // 100))


def batch_size(entry: int | str, total: int) -> int:
    """Ansible's rule: a percentage of all the play's hosts, rounded down, at least 1."""
    if isinstance(entry, str) and entry.endswith("%"):
        return percent_of(entry, total)
    return int(entry)


def plan_batches(hosts: list[str], serial: list[int | str], total: int | None = None) -> list[list[str]]:
    """Consecutive batches of `hosts`; the last serial entry repeats until every host is in one.
    `total` (default len(hosts)) is what percentages are of (a resumed rollout keeps the fleet's)."""
    total = len(hosts) if total is None else total
    batches, i, k = [], 0, 0
    while i < len(hosts):
        size = batch_size(serial[min(k, len(serial) - 1)], total)
        batches.append(hosts[i:i + size])
        i += size
        k += 1
    return batches


def parse_max_unavailable(text: str | int | None, total: int) -> int | None:
    """A count or a percentage of the fleet (rounded down, at least 1); None: no limit."""
    if text is None or text == "":
        return None
    item = str(text).strip()
    if item.endswith("%"):
        try:
            value = float(Decimal(item[:-1]))
        except (ArithmeticError, ValueError):
            raise ConfigError(f"--max-unavailable '{item}' is not a count or a percentage") from None
        if not 0 < value <= 100:
            raise ConfigError(f"--max-unavailable percentage must be in (0, 100], got '{item}'")
        return percent_of(item, total)
    try:
        count = int(item)
    except ValueError:
        raise ConfigError(f"--max-unavailable '{item}' is not a count or a percentage") from None
    if count < 1:
        raise ConfigError(f"--max-unavailable must be at least 1 (a rollout takes hosts out), got {count}")
    return count


def batch_halts(failed: int, size: int, max_fail_percentage: float) -> bool:
    """Ansible's max_fail_percentage: the batch's failed share must EXCEED it to halt."""
    if size <= 0 or failed <= 0:
        return False
    return failed * 100.0 / size > max_fail_percentage


# ---------------------------------------------------------------- who fronts whom


def host_routers(host: Host) -> list[str]:
    """`sglfleet_router_url` (one URL or a list) from the host's merged vars."""
    value = host.vars.get("sglfleet_router_url")
    if not value:
        return []
    urls = [value] if isinstance(value, str) else list(value)
    return [normalize_url(str(u)) for u in urls]


def worker_url(host: Host, profile: Profile) -> str:
    """How a router reaches the host's server: `sglfleet_router_worker_url`, else http://BIND:PORT with the
    profile (and the host's sglfleet_profile_overrides) and sglfleet_server_bind, a wildcard bind meaning the host's
    address."""
    if host.vars.get("sglfleet_router_worker_url"):
        return normalize_url(str(host.vars["sglfleet_router_worker_url"]))
    overrides = (host.vars.get("sglfleet_profile_overrides") or {}).get(profile.name) if \
        isinstance(host.vars.get("sglfleet_profile_overrides"), dict) else None
    p = with_overrides(profile, overrides, host.name).model
    bind = str(host.vars.get("sglfleet_server_bind") or p.server.host)
    if bind in WILDCARD_BINDS:
        bind = host.address
    if ":" in bind and not bind.startswith("["):
        bind = f"[{bind}]"
    return f"http://{bind}:{p.server.port}"


# ---------------------------------------------------------------- guardrails (before any host is touched)


NO_ROUTER = "(no router)"


def without_router(hosts: list[Host]) -> list[str]:
    return [h.name for h in hosts if not host_routers(h)]


def routing_refusal(hosts: list[Host]) -> str | None:
    """Why a rolling operation may not run on these hosts without --no-router (None: it may)."""
    bare = without_router(hosts)
    if not bare:
        return None
    return (f"{', '.join(bare)}: no router fronts {'it' if len(bare) == 1 else 'them'} (the inventory var "
            "sglfleet_router_url is not set there). A rolling operation takes each host out of its routers before "
            "stopping its server, so clients never reach a stopping one. Set sglfleet_router_url (usually a group "
            "var), or pass --no-router: hosts are then restarted in batches without routing, and clients will see "
            "errors. Nothing was done.")


def outage_refusals(batches: list[list[str]], fronted: dict[str, set[str]], fleet: dict[str, int],
                    limit: int | None, limit_text: Any = None) -> list[str]:
    """Each router that the plan could leave with no serving worker: a batch that holds all of its
    hosts (`fronted`: the selected hosts it fronts; `fleet`: how many hosts of the inventory it
    fronts), or a --max-unavailable that lets all of them be out at once. NO_ROUTER stands for
    the hosts no router fronts (--no-router): all of them stopped at once is the same outage."""
    out = []
    for router, names in fronted.items():
        total = fleet.get(router, len(names))
        where = "the hosts no router fronts" if router == NO_ROUTER else f"router {router}"
        for index, batch in enumerate(batches, 1):
            taken = len(set(batch) & names)
            if limit is not None:
                taken = min(taken, limit)
            if taken >= total:
                out.append(f"batch {index} of {len(batch)} host(s) would take {taken} of the {total} serving "
                           f"host(s) of {where} out at once, leaving it 0 serving workers")
                break
        else:
            if limit is not None and limit >= total and len(names) >= total:
                out.append(f"--max-unavailable {limit_text if limit_text is not None else limit} ({limit} host(s)) "
                           f"would let all {total} serving host(s) of {where} be out of routing at once, leaving "
                           "it 0 serving workers")
    return out


# ---------------------------------------------------------------- capacity


class Capacity:
    """Never more than `limit` hosts unavailable: those down before the rollout count from the
    start; a host holds a slot from its removal from routing until it is healthy in every router."""

    def __init__(self, limit: int | None, down: set[str], stop: threading.Event):
        self.limit, self.out, self.stop = limit, set(down), stop
        self.cond = threading.Condition()
        self.peak = len(self.out)

    def acquire(self, host: str) -> None:
        with self.cond:
            while self.limit is not None and host not in self.out and len(self.out) >= self.limit:
                if self.stop.is_set():
                    raise Aborted(f"{host}: not taken out: the rollout is stopping")
                self.cond.wait(0.2)
            if self.stop.is_set() and host not in self.out:
                raise Aborted(f"{host}: not taken out: the rollout is stopping")
            self.out.add(host)
            self.peak = max(self.peak, len(self.out))

    def release(self, host: str) -> None:
        with self.cond:
            self.out.discard(host)
            self.cond.notify_all()


class RouterWatch:
    """Polls every router and keeps the fewest healthy fleet workers seen (a test's witness)."""

    def __init__(self, routers: dict[str, set[str]], interval: float = 0.1):
        self.routers, self.interval = routers, interval  # router URL -> the fleet's worker URLs
        self.min_healthy: dict[str, int] = {}
        self.samples = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)

    def _loop(self) -> None:
        clients = {url: RouterClient(url, timeout=3) for url in self.routers}
        while not self._stop.is_set():
            for url, client in clients.items():
                try:
                    healthy = sum(1 for w in client.workers() if w.healthy and w.url in self.routers[url])
                except RouterError:
                    continue
                self.min_healthy[url] = min(self.min_healthy.get(url, healthy), healthy)
            self.samples += 1
            self._stop.wait(self.interval)

    def __enter__(self) -> "RouterWatch":
        if self.routers:
            self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()


# ---------------------------------------------------------------- options and state


@dataclass
class RolloutOptions:
    mode: str                      # "restart" (same deployment) | "deploy" (the profile's, new)
    serial: list[int | str] = field(default_factory=lambda: [1])
    max_unavailable: str | int | None = None
    max_fail_percentage: float = 0.0
    drain_timeout: float = 120.0   # seconds for in-flight requests to reach 0 once out of routing
    min_ready: float = 10.0
    router_timeout: float = 60.0   # seconds for a router to show a removal / a healthy worker
    resume: bool = False
    # restart mode: the next batch plans (and smoke-tests, unless vouched: read-only) while this one is out
    pipeline: bool = True
    deploy: deploy_stage.DeployOptions | None = None
    state_dir: Path = Path("runs")
    no_router: bool = False            # hosts no router fronts are rolled anyway (clients see errors)
    allow_full_outage: bool = False    # a batch / max_unavailable may take all of a router's hosts out
    canary: str | int | None = None        # the first batch: hosts or a percentage (None: no canary analysis)
    analysis_window: float | None = None   # seconds (None: the profile's analysis.window)
    analysis_mode: str = "auto"            # auto: the verdict decides | pause: wait for a human after it
    # TEST ONLY: SIGTERM without taking the host out of routing or waiting for its requests (the
    # control run that proves the zero-failure test can fail). Never exposed on the CLI.
    unsafe_skip_drain: bool = False


# What the state file keeps of the options (so `rollout continue` can resume without the command line).
KEPT_OPTIONS = ("mode", "serial", "max_unavailable", "max_fail_percentage", "drain_timeout", "min_ready",
                "router_timeout", "no_router", "allow_full_outage", "canary", "analysis_window", "analysis_mode")
KEPT_DEPLOY = ("command", "revert", "force", "stop_grace", "timeouts", "manager")


def options_doc(options: RolloutOptions) -> dict[str, Any]:
    doc = {k: getattr(options, k) for k in KEPT_OPTIONS}
    doc["deploy"] = {k: getattr(options.deploy, k) for k in KEPT_DEPLOY} if options.deploy else None
    return doc


def options_from(doc: dict[str, Any], state_dir: Path, command: str) -> RolloutOptions:
    """The options a state file kept, to resume with (`resume=True`); `command` is who resumes."""
    kept = {k: doc[k] for k in KEPT_OPTIONS if k in doc}
    deploy = doc.get("deploy")
    try:
        kept["serial"] = parse_serial(kept.get("serial") or [1])
        return RolloutOptions(**kept, resume=True, state_dir=state_dir,
                              deploy=deploy_stage.DeployOptions(**dict(deploy, command=command)) if deploy else None)
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"the rollout state's options cannot be read back ({exc}): resume it with the command "
                          "that started it and --continue") from None


def state_path(options: RolloutOptions, inventory_path: str, pattern: str, profile: Profile) -> Path:
    key = hashlib.sha256(json.dumps([options.mode, str(Path(inventory_path).resolve()), pattern,
                                     str(Path(profile.path).resolve())]).encode()).hexdigest()[:12]
    return Path(options.state_dir) / "rollouts" / f"{options.mode}-{profile.name}-{key}.json"


# ---------------------------------------------------------------- the controller and its decisions


class ControllerLock:
    """Held by the process running (or reverting) a rollout, for its whole run: `<state>.lock`,
    flock'ed, with the holder's pid in it. A second controller of the same rollout is refused;
    `rollout continue|abort` tell a waiting controller from none by it."""

    def __init__(self, state_file: Path):
        self.path = Path(str(state_file) + ".lock")
        self.fd: int | None = None

    def holder(self) -> str:
        try:
            return self.path.read_text().strip() or "?"
        except OSError:
            return "?"

    def acquire(self) -> bool:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            return False
        os.ftruncate(fd, 0)
        os.write(fd, f"pid {os.getpid()} on {socket.gethostname()}".encode())
        self.fd = fd
        return True

    def release(self, remove: bool = False) -> None:
        if self.fd is None:
            return
        if remove:
            self.path.unlink(missing_ok=True)
        os.close(self.fd)
        self.fd = None

    def __enter__(self) -> "ControllerLock":
        if not self.acquire():
            raise ConfigError(f"another controller ({self.holder()}) is running this rollout (lock {self.path}); "
                              "`sglfleet rollout continue` or `sglfleet rollout abort` decides for it when it is "
                              "paused. Nothing was done.")
        return self

    def __exit__(self, *exc: Any) -> None:
        self.release()


def decision_path(state_file: Path) -> Path:
    return Path(str(state_file) + ".decision")


def send_decision(state_file: Path, action: str, command: str) -> None:
    """For a paused controller: continue or abort (it takes the file away when it acts)."""
    if action not in (canary_stage.CONTINUE, "abort"):
        raise ConfigError(f"a paused rollout is continued or aborted, not {action!r}")
    path = decision_path(state_file)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps({"action": action, "by": deploy_stage.holder(command), "at": time.time()}))
    tmp.replace(path)


def take_decision(state_file: Path) -> dict[str, Any] | None:
    path = decision_path(state_file)
    try:
        doc = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    path.unlink(missing_ok=True)
    return doc if isinstance(doc, dict) and doc.get("action") in (canary_stage.CONTINUE, "abort") else None


def saved_rollouts(state_dir: Path) -> list[tuple[Path, dict[str, Any]]]:
    """Every rollout state under STATE_DIR/rollouts (halted or paused ones: a finished one leaves none)."""
    out = []
    for path in sorted((Path(state_dir) / "rollouts").glob("*.json")):
        try:
            doc = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        if isinstance(doc, dict):
            out.append((path, doc))
    return out


# ---------------------------------------------------------------- one host


def smoke_vouched(record: dict[str, Any] | None, desired: dict[str, Any]) -> str | None:
    """Why the host's deployment record vouches for SGLang's validation of what is about to start
    (None: it does not, so the smoke gate runs). A record is written only after its smoke and
    health passed, and it keeps what the smoke resolved (`expected`); it vouches when the release,
    the argv and the environment it passed with are the ones starting now."""
    if not record or not isinstance(record.get("expected"), dict):
        return None  # no smoke result kept with it (written before records carried one)
    for key in ("release", "argv_hash", "env_hash"):
        if record.get(key) != desired.get(key):
            return None
    return (f"deployment {record.get('deploy_id')} passed its smoke with release "
            f"{record.get('release') or 'pristine'}, this argv and this environment")


class _RestartDeploy(deploy_stage.HostDeploy):
    """ADAPTER (until stages.deploy has a restart of its own): HostDeploy restarting the deployment
    that runs. It has the plan read the running server as needing a start, so the pipeline runs
    its launch (which stops the running server with its drain), health and revert; anything else
    that would change (a release to push, another argv) is refused: that is `deploy --rolling`.
    The smoke gate is skipped when the host's deployment record vouches for it (smoke_vouched):
    the same release, argv and environment already passed it when they were deployed."""

    vouched: str | None = None

    def _plan(self) -> dict[str, Any]:
        planned = super()._plan()
        running = planned.get("running") or {}
        self.was_alive = bool(running.get("alive"))
        if running.get("alive") and running.get("record"):
            planned["running"] = dict(running, alive=False)  # restart_reasons: "server not running"
        return planned

    def _smoke(self, rendered: Any, planned: dict[str, Any]) -> dict[str, Any]:
        record = (planned.get("running") or {}).get("record")
        self.vouched = smoke_vouched(record, self.desired)
        if self.vouched is None:
            return super()._smoke(rendered, planned)
        self.note(f"skip smoke: {self.vouched}")
        return {"ok": True, "phase": "skipped", "fields": record["expected"], "timings": {}}

    def _change(self, planned: dict[str, Any], host_plan: Any, files: dict[str, str], desired: dict[str, Any],
                mode: str) -> dict[str, Any]:
        # The same argv, env and release: only the rendered files' text may differ (their comments
        # name the inventory file), which a restart rewrites harmlessly.
        drift = [r for r in self.doc.get("restart_reasons") or []
                 if not r.startswith(("server not running", "launch script or unit changed"))]
        self.doc["running_before"]["alive"] = self.was_alive
        if drift or host_plan.changes:
            self.finish(None)
            return self.fail("plan", f"{self.host.name}: restart refused: what runs is not what the profile "
                             f"deploys ({'; '.join(drift) or f'{len(host_plan.changes)} release file(s) to push'}); "
                             f"use `sglfleet deploy --rolling` to change it", refused=True)
        self.doc["restart_reasons"] = ["rolling restart" if self.was_alive else "server not running"]
        self.desired = desired
        doc = super()._change(planned, host_plan, files, desired, mode)
        if self.vouched is not None and isinstance(doc.get("smoke"), dict):
            doc["smoke"]["skipped"] = self.vouched
        return doc


class HostRoll:
    """One unit's turn (a host, or the ranks of a multi-node server on `conns`, rank 0 first):
    prepare, take out, replace, min_ready, put back; returns its document."""

    def __init__(self, run: "Rollout", conn: Any, batch: int = 0, conns: list[Any] | None = None):
        self.run, self.conn, self.host, self.batch = run, conn, conn.host, batch
        self.unit = run.unit_of.get(conn.host.name) if hasattr(run, "unit_of") else None
        self.conns = conns or [conn]
        self.name = self.unit.name if self.unit is not None else conn.host.name
        self.url = run.worker_urls[self.name]
        self.routers = [RouterClient(u, timeout=10) for u in host_routers(self.host)]
        self.taken_out = False
        self.times: dict[str, float] = {}

    def stage(self, text: str) -> None:
        self.run.event("stage", self.name, text)

    def note(self, text: str) -> None:
        if text == "launch":  # HostDeploy is about to stop the old server: take the host out first
            self.take_out()
            text = "stop (SGLang's drain) and start"
        self.stage(text)

    def take_out(self, gated: bool = True) -> None:
        """Out of every router and drained; `gated`: only once the batch before is back (a
        canary's revert is not: it comes after its own batch, whatever halts)."""
        started = time.monotonic()
        gate = self.run.gates[self.batch] if gated and getattr(self.run, "gates", None) else None
        if gate is not None and not gate.is_set():
            self.stage("prepared; waiting for the previous batch")
            while not gate.wait(0.2):
                if self.run.stop.is_set():
                    break
        if gated and (self.run.stop.is_set() or getattr(self.run, "halting", threading.Event()).is_set()):
            raise Aborted(f"{self.name}: not taken out: the rollout halted before its batch")
        self.run.capacity.acquire(self.name)
        self.times["waited_for_slot_s"] = round(time.monotonic() - started, 3)
        self.times["out_at_s"] = self.run.clock()
        try:
            self._take_out()
        except BaseException:
            # Not stopped yet (the launch never ran): it keeps serving, so it goes back in routing.
            try:
                self.put_back()
            except RouterError:
                self.taken_out = True  # it stays out, and holds its slot
            raise
        self.taken_out = True

    def _take_out(self) -> None:
        if self.run.options.unsafe_skip_drain:
            return
        began = time.monotonic()
        for router in self.routers:
            self.stage(f"remove from {router.url}")
            router.remove_url(self.url)
            router.wait_absent(self.url, self.run.options.router_timeout)
        self.times["remove_s"] = round(time.monotonic() - began, 3)
        began = time.monotonic()
        deadline = began + self.run.options.drain_timeout
        in_flight = worker_in_flight(self.url)
        while in_flight and time.monotonic() < deadline:
            self.stage(f"drain: {in_flight} in flight ({time.monotonic() - began:.1f}s / "
                       f"{self.run.options.drain_timeout:.0f}s)")
            time.sleep(0.1)
            in_flight = worker_in_flight(self.url)
        self.times["drain_s"] = round(time.monotonic() - began, 3)
        self.times["in_flight_at_stop"] = in_flight if in_flight is not None else "unknown (no /metrics)"

    def put_back(self) -> None:
        began = time.monotonic()
        for router in self.routers:
            self.stage(f"add to {router.url}")
            router.ensure(self.url, self.run.options.router_timeout)
        self.times["add_s"] = round(time.monotonic() - began, 3)
        self.times["back_at_s"] = self.run.clock()
        self.run.capacity.release(self.name)
        self.taken_out = False

    MIN_READY_POLL_S = 0.25

    def stays_ready(self) -> str | None:
        """None when the worker answered /health 200 for min_ready seconds straight: polled every
        MIN_READY_POLL_S, the last poll when min_ready is over (not up to a poll before its end,
        nor a whole poll after it)."""
        min_ready = self.run.options.min_ready
        began = time.monotonic()
        while True:
            if not worker_healthy(self.url, timeout=5):
                return f"not healthy {time.monotonic() - began:.1f}s into min_ready ({min_ready:.0f}s)"
            elapsed = time.monotonic() - began
            if elapsed >= min_ready:
                break
            self.stage(f"min_ready {elapsed:.1f}s / {min_ready:.0f}s")
            time.sleep(min(self.MIN_READY_POLL_S, min_ready - elapsed))
        self.times["min_ready_s"] = round(time.monotonic() - began, 3)
        return None

    def revert_after_min_ready(self, doc: dict[str, Any], why: str) -> dict[str, Any]:
        """A server that passed health but did not stay healthy for min_ready goes back to the
        previous deployment (revert_deployed)."""
        self.stage(f"min_ready failed ({why}): revert")
        return self.revert_deployed(doc, why, "min_ready")

    def revert_canary(self, doc: dict[str, Any], why: str) -> dict[str, Any]:
        """A canary the analysis failed (or a human aborted): out of routing and drained, back on
        the deployment it served before (revert_deployed), back in routing."""
        started = time.monotonic()
        self.stage(f"revert the canary: {why}")
        try:
            self.take_out(gated=False)
        except (RouterError, Aborted) as exc:
            return dict(doc, ok=False, outcome="failed (canary not reverted)",
                        summary=f"{self.name}: {why}; taking it out of routing to revert it FAILED: {exc}")
        out = self.revert_deployed(doc, why, "canary")
        if (out.get("reverted") or {}).get("healthy"):
            out["outcome"] = "reverted (canary)"
            try:
                self.put_back()
            except RouterError as exc:
                out.update(summary=f"{out.get('summary')}; putting it back in routing FAILED: {exc}",
                           outcome="reverted (canary), out of routing")
        out["rollout_times"] = dict(doc.get("rollout_times") or {}, **{"revert_" + k: v for k, v in self.times.items()})
        out["revert_seconds"] = round(time.monotonic() - started, 3)
        return out

    def revert_deployed(self, doc: dict[str, Any], why: str, phase: str) -> dict[str, Any]:
        """ADAPTER (until stages.deploy can revert a recorded deployment itself): the host, out of
        routing, goes back to the deployment before `doc`'s with HostDeploy's own revert (lease,
        release rollback, server revert, health, record). `doc` needs only what a state file
        keeps: pushed, running_before, mode (a server group's: each rank's, under ranks)."""
        if self.unit is not None and self.unit.is_group:
            return self._revert_group(doc, why, phase)
        again = self._revert_one(self.conn, doc, why, phase)
        out = dict(doc, ok=False, phase=phase, reverted=again.get("reverted"),
                   rolled_back=again.get("rolled_back"), summary=f"{self.name}: {again.get('summary') or why}")
        out["outcome"] = "failed, reverted" if (again.get("reverted") or {}).get("healthy") else \
            "failed (out of routing)"
        return out

    def _revert_one(self, conn: Any, doc: dict[str, Any], why: str, phase: str, placement: Any = None,
                    sync: Any = None, note: Callable[[str], None] | None = None) -> dict[str, Any]:
        """One host (or rank: `placement`, meeting the others in `sync`) back on what it served
        before `doc`'s deployment; the revert's own document."""
        again = deploy_stage.HostDeploy(conn, self.run.profile, self.run.artifacts, self.run.inventory.path,
                                        self.run.deploy_options, note or self.stage, placement=placement, group=sync)
        try:
            again._plan()  # takes the deploy lease
            failed = health_stage.HealthResult(ok=False, failed={"stage": phase, "message": why})
            again._failed_after_launch(failed, doc.get("pushed"), (doc.get("running_before") or {}).get("release"),
                                       doc.get("mode") or "supervisor")
        except SglfleetError as exc:
            again.doc.update(summary=f"{why}; reverting FAILED: {exc}")
        finally:
            if again.leased:
                try:
                    again.server("unlease")
                except SglfleetError:
                    pass
            if sync is not None:  # a rank that ended before its revert turn lets the others go on
                sync.ended(conn.host.name, again.doc)
        return again.doc

    def _revert_group(self, doc: dict[str, Any], why: str, phase: str) -> dict[str, Any]:
        """Every rank of a server group back on the group's deployment before `doc`'s, as the
        group's deploy reverts after a failed launch: one HostDeploy per rank at once, meeting in
        a GroupSync (rank 0 reverts first: it hosts the rendezvous the others join)."""
        sync = groups_stage.GroupSync(self.unit.names, deploy_stage.new_deploy_id())
        ranks = doc.get("ranks") or {}
        reverts: dict[str, dict[str, Any]] = {}

        def one(conn: Any) -> None:
            name = conn.host.name
            place = self.unit.placements[name]
            reverts[name] = self._revert_one(conn, ranks.get(name) or {}, why, phase, place, sync,
                                             lambda text: self.stage(f"{name}/{place.rank}: {text}"))

        threads = [threading.Thread(target=in_this_run(one), args=(conn,), daemon=True) for conn in self.conns]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        each = {n: reverts.get(n) or {} for n in self.unit.names}
        healthy = all((d.get("reverted") or {}).get("healthy") for d in each.values())
        lead = each[self.unit.names[0]].get("reverted") or {}
        out = dict(doc, ok=False, phase=phase, reverted=dict(lead, healthy=healthy,
                                                             ranks={n: d.get("reverted") for n, d in each.items()}),
                   summary=f"{self.name}: " + "; ".join(f"{n} (rank {self.unit.placements[n].rank}): "
                                                        f"{d.get('summary') or why}" for n, d in each.items()))
        out["outcome"] = "failed, reverted" if healthy else "failed (out of routing)"
        return out

    def __call__(self) -> dict[str, Any]:
        run = self.run
        kind = _RestartDeploy if run.options.mode == "restart" else deploy_stage.HostDeploy
        started = time.monotonic()
        self.times["prepare_at_s"] = self.run.clock()
        self.stage("prepare")
        group = self.unit is not None and self.unit.is_group
        if group:  # every rank at once; its min_ready on every rank, inside (a failure reverts them all)
            options = dataclasses.replace(run.deploy_options, min_ready=run.options.min_ready)
            doc = groups_stage.GroupDeploy(self.unit, self.conns, run.profile, run.artifacts, run.inventory.path,
                                           options, self.note, lambda label, text: self.stage(f"{label}: {text}"),
                                           kind=kind).run()
        else:
            doc = kind(self.conn, run.profile, run.artifacts, run.inventory.path, run.deploy_options, self.note).run()
        doc["worker_url"], doc["routers"] = self.url, [r.url for r in self.routers]
        if not self.taken_out:
            # Nothing changed on the host (unchanged, refused, or failed before its launch).
            doc["outcome"] = "unchanged" if doc.get("ok") else "failed (untouched)"
            doc["rollout_times"], doc["rollout_seconds"] = self.times, round(time.monotonic() - started, 3)
            return doc
        reverted = doc.get("reverted") or {}
        if group and "min_ready" in (doc.get("health") or {}):
            self.times["min_ready_s"] = doc["health"]["min_ready"]
        if doc.get("ok"):
            why = None if group else self.stays_ready()
            if why:
                doc = self.revert_after_min_ready(doc, why)
                reverted = doc.get("reverted") or {}
            else:
                doc["outcome"] = "restarted" if run.options.mode == "restart" else "deployed"
        if not doc.get("outcome"):
            if reverted.get("healthy"):
                doc["outcome"] = "failed, reverted"
            elif worker_healthy(self.url):  # refused before it stopped anything: the old server serves on
                doc["outcome"] = "failed, still serving"
            else:
                doc["outcome"] = "failed (out of routing)"
        if doc["outcome"] == "failed (out of routing)":  # not serving: it stays out and holds its slot
            doc["rollout_times"], doc["rollout_seconds"] = self.times, round(time.monotonic() - started, 3)
            return doc
        try:
            self.put_back()
        except RouterError as exc:
            doc.update(ok=False, summary=f"{doc.get('summary') or ''}; putting it back in routing FAILED: {exc}",
                       outcome="failed (out of routing)")
        doc["rollout_times"], doc["rollout_seconds"] = self.times, round(time.monotonic() - started, 3)
        return doc


# ---------------------------------------------------------------- the fleet


class Rollout:
    """`preflight()` then `run()`; the document `run()` returns is what the CLI prints (or --json)."""

    def __init__(self, inventory: Inventory, pattern: str, profile: Profile, artifacts: Artifacts | None,
                 options: RolloutOptions, events: Events = lambda kind, host, text: None,
                 host_key_policy: str | None = None):
        if options.mode not in ("restart", "deploy"):
            raise ConfigError(f"rollout mode must be restart or deploy, got {options.mode!r}")
        check_number("--max-fail-percentage", options.max_fail_percentage, low=0, high=100)
        for name, value in (("--drain-timeout", options.drain_timeout), ("--min-ready", options.min_ready)):
            check_number(name, value, low=0, unit="seconds")
        check_number("--router-timeout", options.router_timeout, above=0, unit="seconds")
        self.inventory, self.pattern, self.profile = inventory, pattern, profile
        self.artifacts = artifacts if artifacts is not None else profile.artifacts()
        self.options, self.events, self.host_key_policy = options, events, host_key_policy
        # The units of the rollout (stages/units.py): a host, or a server group under its own name
        # with rank 0's address, vars and routers (unit_host): what routing sees of it.
        self.units = units_stage.units(inventory, inventory.select(pattern), profile)
        self.hosts = [unit_host(u) for u in self.units]
        self.unit_of = {u.leader.name: u for u in self.units}
        self.unit_by_name = {u.name: u for u in self.units}
        if not self.hosts:
            raise ConfigError(f"pattern '{pattern}' selects no host")
        if not options.no_router and routing_refusal(self.hosts):
            raise ConfigError(f"{options.mode} --rolling refused: {routing_refusal(self.hosts)}")
        # The rollout's own min_ready (HostRoll.stays_ready, then back into routing) replaces deploy's;
        # a prepared host may wait for the batch before it (its drain, start, health, min_ready,
        # routers) with the lease held.
        deploy_options = options.deploy or deploy_stage.DeployOptions(command=f"sglfleet rollout {options.mode}")
        self.deploy_options = dataclasses.replace(
            deploy_options, min_ready=0, lease_wait_s=options.drain_timeout + 2 * options.router_timeout
            + options.min_ready + deploy_options.stop_grace + deploy_stage.LAUNCH_CALL_S
            + sum({**health_stage.DEFAULT_TIMEOUTS, **deploy_options.timeouts}.values()))
        self.worker_urls = {h.name: worker_url(h, profile) for h in self.hosts}
        self.max_unavailable = parse_max_unavailable(options.max_unavailable, len(self.hosts))
        self.canary_entry = parse_canary(options.canary)
        self.serial = ([self.canary_entry] if self.canary_entry is not None else []) + list(options.serial)
        self.window = 0.0
        if self.canary_entry is not None:
            self.window = self.check_analysis()
            self.samples_possible(batch_size(self.canary_entry, len(self.hosts)))
        elif options.analysis_window is not None or options.analysis_mode != "auto":
            raise ConfigError("--analysis-window and --analysis are for --canary only; add --canary N or leave them "
                              "out (nothing was done)")
        self.analysis: dict[str, Any] | None = None
        self.on_verdict: Callable[[dict[str, Any]], None] = lambda analysis: None  # the CLI shows the table
        if not options.allow_full_outage:
            refusals = outage_refusals(plan_batches([h.name for h in self.hosts], self.serial),
                                       self.fronted(), self.fleet_sizes(), self.max_unavailable,
                                       options.max_unavailable)
            if refusals:
                raise ConfigError(f"{options.mode} --rolling refused: " + "; ".join(refusals) + ". Use a smaller "
                                  "--batch or --max-unavailable (percentages round down, at least 1), or pass "
                                  "--allow-full-outage to accept that clients get no answer meanwhile. Nothing "
                                  "was done.")
        self.stop = threading.Event()
        self.capacity = Capacity(self.max_unavailable, set(), self.stop)
        self.state_file = state_path(options, inventory.path, pattern, profile)
        self.fleet: list[dict[str, Any]] = []
        self.started = time.monotonic()

    def event(self, kind: str, host: str | None, text: str) -> None:
        self.events(kind, host, text)

    def check_analysis(self) -> float:
        """The canary analysis' window, once its options and the profile's analysis: are seen to
        fit together (before any host is touched)."""
        metrics_stage._optional("prometheus_client", "--canary")  # /metrics is parsed with it
        if self.options.analysis_mode not in (canary_stage.PAUSE, "auto"):
            raise ConfigError(f"--analysis must be auto or pause, got '{self.options.analysis_mode}'")
        rules = self.profile.model.analysis
        window = rules.window if self.options.analysis_window is None else self.options.analysis_window
        check_number("--analysis-window", window, above=0, unit="seconds")
        if rules.interval > window:
            section = self.profile.source.get("analysis") if isinstance(self.profile.source, dict) else None
            line = section.line_of("interval") if hasattr(section, "line_of") else None
            raise ConfigError(f"--analysis-window {window:g} s is shorter than the profile's analysis.interval "
                              f"({rules.interval:g} s, {self.profile.path}{f':{line}' if line else ''}): no server "
                              "would be read twice in it. Give a longer window or a shorter interval.")
        return window

    def samples_possible(self, canary_hosts: int) -> None:
        """Refuse a window that cannot hold analysis.min_samples of the canary's intervals: every
        verdict would be inconclusive."""
        rules = self.profile.model.analysis
        most = int(self.window // rules.interval) * canary_hosts
        if most < rules.min_samples:
            raise ConfigError(f"canary analysis: a window of {self.window:g} s read every {rules.interval:g} s gives "
                              f"the canary ({canary_hosts} host(s)) at most {most} sample(s), fewer than the "
                              f"profile's analysis.min_samples {rules.min_samples} ({self.profile.path}): every "
                              "verdict would be inconclusive. Lengthen --analysis-window or analysis.window, or "
                              "shorten analysis.interval. Nothing was done.")

    def clock(self) -> float:
        """Seconds since run() began: the hosts' times on one timeline (out_at_s, back_at_s)."""
        return round(time.monotonic() - self.started, 3)

    # ------------------------------------------------------------ before anything changes

    def routers(self) -> dict[str, set[str]]:
        """Router URL -> the worker URLs of this fleet it fronts."""
        out: dict[str, set[str]] = {}
        for h in self.hosts:
            for url in host_routers(h):
                out.setdefault(url, set()).add(self.worker_urls[h.name])
        return out

    def fronted(self) -> dict[str, set[str]]:
        """Router URL (NO_ROUTER for none) -> the selected hosts it fronts."""
        out: dict[str, set[str]] = {}
        for h in self.hosts:
            for url in host_routers(h) or [NO_ROUTER]:
                out.setdefault(url, set()).add(h.name)
        return out

    def fleet_sizes(self) -> dict[str, int]:
        """Router URL -> how many hosts of the whole inventory it fronts (hosts outside the pattern
        keep serving through it); NO_ROUTER: the selected hosts without one."""
        sizes: dict[str, int] = {}
        followers = {r.host.name for g in server_groups(self.inventory).values() for r in g.ranks[1:]}
        for h in self.inventory.hosts.values():
            if h.name in followers:  # a server group's other ranks are no router workers
                continue
            for url in host_routers(h):
                sizes[url] = sizes.get(url, 0) + 1
        sizes[NO_ROUTER] = len(without_router(self.hosts))
        return sizes

    def preflight(self) -> list[dict[str, Any]]:
        """Each host: in which routers, healthy or why not. A healthy server missing from a router
        is added (that only adds capacity); a host still unavailable is down, and counts."""
        listed: dict[str, dict[str, Any]] = {}
        for url in self.routers():
            try:
                listed[url] = {w.url: w for w in RouterClient(url).workers()}
            except RouterError as exc:
                raise RolloutRefused(f"cannot read router {url}: {exc}", []) from None
        self.listed = listed
        table = []
        for h in self.hosts:
            url = self.worker_urls[h.name]
            row: dict[str, Any] = {"host": h.name, "worker_url": url, "routers": host_routers(h), "up": True,
                                   "why": "", "registered": []}
            # The server's own /health, not only the routers' view: a router sees a stopped server
            # only at its next health check (interval x failure threshold later).
            serving = worker_healthy(url)
            for router in host_routers(h):
                worker = listed[router].get(url)
                if worker is not None and worker.healthy and serving:
                    continue
                if worker is not None and worker.healthy:
                    row.update(up=False, why=f"{router} still lists it healthy, but its /health fails")
                    break
                if worker is None and serving:
                    try:
                        RouterClient(router).ensure(url, self.options.router_timeout)
                        row["registered"].append(router)
                        continue
                    except RouterError as exc:
                        row.update(up=False, why=f"healthy but could not be added to {router}: {exc}")
                        break
                if worker is not None and serving:
                    # Serving again (just restarted by hand or by a deploy): the router marks it
                    # healthy at its next health checks; give it the router timeout to catch up.
                    try:
                        RouterClient(router).wait_healthy(url, self.options.router_timeout)
                        continue
                    except RouterError:
                        pass
                row.update(up=False, why=(f"unhealthy in {router}" if worker is not None else
                                          f"not in {router}, and its server does not answer /health"))
                break
            if not host_routers(h) and not serving:
                row.update(up=False, why="its server does not answer /health (no router fronts it)")
            table.append(row)
        self.fleet = table
        return table

    def check_capacity(self, table: list[dict[str, Any]]) -> None:
        down = [r for r in table if not r["up"]]
        self.capacity = Capacity(self.max_unavailable, {r["host"] for r in down}, self.stop)
        if down and self.max_unavailable is not None and len(down) >= self.max_unavailable:
            names = ", ".join(f"{r['host']} ({r['why']})" for r in down)
            raise RolloutRefused(
                f"refusing to start: {len(down)} of {len(table)} host(s) are already unavailable ({names}) and "
                f"--max-unavailable is {self.max_unavailable}, so no host could be taken out without going below "
                f"{len(table) - self.max_unavailable} serving. Bring them back, raise --max-unavailable, or leave "
                f"them out of the pattern.", table)

    def check_outage(self, table: list[dict[str, Any]], batches: list[list[str]]) -> None:
        """With the hosts already down (the preflight's table) counted: refuse a plan that would leave
        a router with no serving worker (unless allow_full_outage). A router's serving workers are
        this fleet's hosts that are up plus the other workers it lists healthy."""
        if self.options.allow_full_outage:
            return
        up = {r["host"] for r in table if r["up"]}
        mine = set(self.worker_urls.values())
        down = len(table) - len(up)
        room = None if self.max_unavailable is None else max(self.max_unavailable - down, 0)
        fronted = {router: names & up for router, names in self.fronted().items()}
        serving = {router: len(names) + sum(1 for url, w in getattr(self, "listed", {}).get(router, {}).items()
                                            if w.healthy and url not in mine)
                   for router, names in fronted.items()}
        fronted = {router: names for router, names in fronted.items() if serving[router] > 0}
        refusals = [r for r in outage_refusals(batches, fronted, serving, room)
                    if not r.startswith("--max-unavailable")]  # that one is for the static plan
        if refusals:
            raise RolloutRefused("refusing to start: with the hosts already down counted, " + "; ".join(refusals)
                                 + ". Bring them back, use a smaller --batch, or pass --allow-full-outage.", table)

    # ------------------------------------------------------------ state (for --continue)

    def _load_state(self) -> dict[str, Any]:
        try:
            return json.loads(self.state_file.read_text())
        except (OSError, ValueError):
            return {}

    def _save_state(self, state: dict[str, Any]) -> None:
        self.state_file.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.state_file.with_suffix(".tmp")
        tmp.write_text(json.dumps(state, indent=2, default=str))
        tmp.replace(self.state_file)

    # ------------------------------------------------------------ the run

    def run(self) -> dict[str, Any]:
        lock = ControllerLock(self.state_file)
        with lock:
            decision_path(self.state_file).unlink(missing_ok=True)  # one left for a controller that is gone
            doc = self._run()
        if doc["state_file"] is None:
            lock.path.unlink(missing_ok=True)
        return doc

    def _run(self) -> dict[str, Any]:
        self.started = started = time.monotonic()
        names = [h.name for h in self.hosts]
        state = self._load_state() if self.options.resume else {}
        if self.options.resume and not state:
            raise ConfigError(f"--continue: no halted rollout to resume ({self.state_file} does not exist)")
        done = set(state.get("done") or []) & set(names)
        todo = [n for n in names if n not in done]
        judged = dict(state.get("canary") or {})
        if state.get("paused") and self.options.resume:  # resuming a paused canary is the human's "continue"
            judged["decision"] = {"action": canary_stage.CONTINUE, "by": deploy_stage.holder(self.options.deploy.command
                                  if self.options.deploy else "--continue"), "at": time.time()}
        canary_on = self.canary_entry is not None and \
            (judged.get("decision") or {}).get("action") != canary_stage.CONTINUE
        serial = self.serial if canary_on else list(self.options.serial)
        table = self.preflight()
        self.check_capacity(table)
        batches = plan_batches(todo, serial, total=len(names))
        self.check_outage(table, batches)
        baseline: list[str] = []
        if canary_on and batches:
            up = {r["host"] for r in table if r["up"]}
            baseline = [n for n in todo if n not in batches[0] and n in up]
            if not baseline:
                raise RolloutRefused(f"refusing to start: --canary {self.canary_entry} takes {', '.join(batches[0])}, "
                                     "and no other selected host serves what runs now to compare it with (the "
                                     "baseline). Select more hosts, or leave --canary out.", table)
        state = {"mode": self.options.mode, "pattern": self.pattern, "profile": self.profile.name,
                 "inventory": str(Path(self.inventory.path).resolve()), "profile_path": str(self.profile.path.resolve()),
                 "options": options_doc(self.options), "done": sorted(done), "hosts": state.get("hosts") or {},
                 "canary": judged, "paused": None, "halted": None}
        self._save_state(state)
        by_name = {h.name: h for h in self.hosts}
        known = KnownHosts(self.inventory.known_hosts_path)
        docs: dict[str, dict[str, Any]] = {}
        halted: dict[str, Any] | None = None
        batch_rows = []
        # Batch k may take hosts out once batch k-1 is back (gates[k]); with `pipeline`, batch k+1
        # already prepares (plan, smoke: read-only in restart mode) while batch k is out; not while
        # the canary is out and judged (a paused canary may wait for days).
        self.gates = [threading.Event() for _ in batches]
        self.halting = threading.Event()
        pipeline = self.options.mode == "restart" and self.options.pipeline
        pool = ThreadPoolExecutor(max_workers=2)
        futures: dict[int, Future] = {}

        def start_batch(k: int) -> None:
            if k < len(batches) and k not in futures:
                futures[k] = pool.submit(self._run_batch, k, batches[k], by_name, known)

        with RouterWatch(self.routers()) as watch, pool:
            if batches:
                self.gates[0].set()
            start_batch(0)
            for k, batch in enumerate(batches):
                index = k + 1
                self.event("batch", None, f"batch {index}/{len(batches)}: {', '.join(batch)}"
                           + (" (the canary)" if canary_on and k == 0 else ""))
                b_started = time.monotonic()
                if pipeline and not (canary_on and k == 0):
                    start_batch(k + 1)
                results = futures[k].result()
                failed, aborted = [], []
                for name, r in results.items():
                    if isinstance(r.exception, Aborted):
                        aborted.append(name)  # never taken out: untouched
                        continue
                    doc = r.value if isinstance(r.value, dict) else {"ok": False, "outcome": "failed",
                                                                     "summary": r.error}
                    docs[name] = doc
                    first = (doc.get("summary") or "").splitlines()[0] if doc.get("summary") else ""
                    self.event("host-done", name, f"{doc.get('outcome')}: {first}")
                    state["hosts"][name] = _kept(doc)
                    if doc.get("ok"):
                        state["done"] = sorted(set(state["done"]) | {name})
                    else:
                        failed.append(name)
                self._save_state(state)
                halts = batch_halts(len(failed), len(batch), self.options.max_fail_percentage)
                batch_rows.append({"batch": index, "hosts": batch, "failed": failed,
                                   "seconds": round(time.monotonic() - b_started, 3), "halted": halts})
                if results.interrupted or self.stop.is_set():
                    halted = {"batch": index, "why": "interrupted"}
                elif halts:
                    halted = {"batch": index, "why": f"{len(failed)} of {len(batch)} host(s) failed in batch {index} "
                              f"({len(failed) * 100.0 / len(batch):.0f}% > --max-fail-percentage "
                              f"{self.options.max_fail_percentage:g})", "failed": failed}
                    self.event("halt", None, halted["why"])
                elif canary_on and k == 0:
                    halted = self._judge_canary(batch, baseline, docs, state, known)
                    batch_rows[-1]["seconds"] = round(time.monotonic() - b_started, 3)
                if halted:
                    self.halting.set()
                    for gate in self.gates:
                        gate.set()  # hosts preparing ahead wake up, see the halt, and stay untouched
                    for later in futures.values():
                        later.result()
                    break
                if k + 1 < len(batches):
                    self.gates[k + 1].set()
                    start_batch(k + 1)
        untouched = [n for n in todo if n not in docs]
        state["halted"] = halted
        self._save_state(state)
        if halted is None and not any(not d.get("ok") for d in docs.values()):
            self.state_file.unlink(missing_ok=True)  # finished: nothing to continue
        hosts = {}
        for name in names:
            if name in docs:
                d = docs[name]
                hosts[name] = {"outcome": d.get("outcome"), "ok": bool(d.get("ok")),
                               "release": _release_now(d), "summary": d.get("summary"),
                               "times": d.get("rollout_times"), "health": d.get("health"),
                               "seconds": d.get("rollout_seconds"), "detail": d}
            elif name in done:
                hosts[name] = {"outcome": "done earlier (--continue)", "ok": True,
                               "release": (state["hosts"].get(name) or {}).get("release")}
            else:
                hosts[name] = {"outcome": "untouched", "ok": True, "release": None}
        failed_hosts = [n for n, d in docs.items() if not d.get("ok")]
        return {"command": f"{self.options.mode} --rolling", "pattern": self.pattern, "profile": self.profile.name,
                "batches": batch_rows, "planned_batches": batches, "hosts": hosts, "halted": halted,
                "untouched": untouched, "failed": failed_hosts, "preflight": table,
                "canary": state.get("canary") or None, "analysis": self.analysis,
                "max_unavailable": self.max_unavailable, "max_unavailable_peak": self.capacity.peak,
                "min_healthy_workers": watch.min_healthy, "router_samples": watch.samples,
                "state_file": str(self.state_file) if self.state_file.exists() else None,
                "seconds": round(time.monotonic() - started, 3),
                "exit_code": 130 if (halted or {}).get("why") == "interrupted" else (1 if failed_hosts or halted else 0)}

    # ------------------------------------------------------------ the canary

    def _judge_canary(self, batch: list[str], baseline: list[str], docs: dict[str, dict[str, Any]],
                      state: dict[str, Any], known: KnownHosts) -> dict[str, Any] | None:
        """After the canary batch is back in routing: analyse, then continue (None), revert the
        canary, or pause for a human; the halt to report otherwise."""
        rules = self.profile.model.analysis
        self.event("analysis", None, f"canary analysis: {', '.join(batch)} against the baseline {', '.join(baseline)} "
                   f"for {self.window:g}s, read every {rules.interval:g}s")
        self.analysis = analysis = canary_stage.analyse(
            batch, baseline, self.worker_urls, rules, self.window, self.stop,
            lambda hosts, since, until: self._decode_lines(hosts, since, until, known),
            run_dir(self.options.state_dir, "canary"), lambda text: self.event("stage", ANALYSIS, text))
        verdict = analysis["verdict"]
        state["canary"] = {"hosts": batch, "baseline": baseline, "verdict": verdict, "reasons": analysis["reasons"],
                           "run_dir": analysis["run_dir"], "decision": None}
        if analysis["interrupted"]:  # the canary serves, unjudged: paused, for `rollout continue|abort`
            state["paused"] = {"batch": 1, "canary": batch, "verdict": "none (interrupted during the analysis)",
                               "since": time.time(), "run_dir": analysis["run_dir"], "controller": os.getpid()}
            self._save_state(state)
            return {"batch": 1, "why": "interrupted", "paused": True}
        self._save_state(state)
        self.on_verdict(analysis)
        why = "; ".join(analysis["reasons"])
        self.event("analysis", None, f"canary analysis: {verdict}" + (f" ({why})" if why else ""))
        action = canary_stage.decide(verdict, self.options.analysis_mode, rules.inconclusive)
        decision = None
        if action == canary_stage.PAUSE:
            decision = self._pause(state, analysis)
            if decision is None:
                return {"batch": 1, "why": "interrupted", "paused": True}
            action = canary_stage.CONTINUE if decision["action"] == canary_stage.CONTINUE else canary_stage.REVERT
            why = f"aborted by {describe_by(decision.get('by'))} after the canary analysis said {verdict}"
        state["canary"]["decision"] = decision or {"action": action, "by": "the verdict", "at": time.time()}
        self._save_state(state)
        if action == canary_stage.CONTINUE:
            self.event("analysis", None, f"canary analysis: {verdict}; the rollout goes on")
            return None
        if not decision:
            why = f"the canary analysis said {verdict}: {why}"
        self.revert_canary(batch, docs, why, state, known)
        halted = {"batch": 1, "why": f"canary reverted: {why}", "canary": verdict}
        self.event("halt", None, halted["why"])
        return halted

    def _decode_lines(self, hosts: list[str], since: float, until: float, known: KnownHosts) -> dict[str, list[metrics_stage.Decode]]:
        """The window's decode log lines of hosts whose /metrics is off (the `metrics` stage's read;
        a server group's are its rank 0's, as `sglfleet metrics` reads them)."""
        leaders = {self.unit_by_name[n].leader.name: n for n in hosts}
        group = Group([self.unit_by_name[n].leader for n in hosts], known, forks=len(hosts),
                      host_key_policy=self.host_key_policy, inventory=self.inventory)
        query = Query(profile=self.profile.name, since=since - 1, until=until + 1)
        with group:
            results = group.run(lambda conn: metrics_stage.collect(conn, query)[0], "decode lines")
        return {leaders[name]: r.value for name, r in results.items() if r.ok}

    def _pause(self, state: dict[str, Any], analysis: dict[str, Any]) -> dict[str, Any] | None:
        """Wait for `sglfleet rollout continue|abort` (their decision file); None: interrupted
        first, and the state stays paused for those commands to act on without this process."""
        state["paused"] = {"batch": 1, "canary": analysis["canary"], "verdict": analysis["verdict"],
                           "since": time.time(), "run_dir": analysis["run_dir"], "controller": os.getpid()}
        self._save_state(state)
        self.event("pause", None, f"canary analysis {analysis['verdict']}: paused. `sglfleet rollout continue` "
                   "goes on with the other hosts, `sglfleet rollout abort` reverts the canary "
                   f"(--runs-dir {self.options.state_dir}; state {self.state_file})")
        while True:
            decision = take_decision(self.state_file)
            if decision is not None:
                break
            if self.stop.wait(0.2):
                return None
        state["paused"] = None
        self._save_state(state)
        self.event("pause", None, f"{decision['action']} from {describe_by(decision.get('by'))}")
        return decision

    def revert_canary(self, batch: list[str], docs: dict[str, dict[str, Any]], why: str, state: dict[str, Any],
                      known: KnownHosts) -> None:
        """Each canary host out of routing, back on what it served before, back in; the others
        untouched. A revert under way finishes, Ctrl-C or not (its own stop event)."""
        members = {n: self.unit_by_name[n].hosts for n in batch}  # a server group's ranks, rank 0 first

        def revert(conns: list[Any]) -> TaskOutcome:
            roll = HostRoll(self, conns[0], 0, conns)
            return _outcome(roll.revert_canary(docs.get(roll.name) or state["hosts"].get(roll.name) or {}, why))

        group = Group([h for n in batch for h in members[n]], known, forks=len(batch),
                      host_key_policy=self.host_key_policy, inventory=self.inventory, stop=threading.Event())
        with group:
            results = group.run_units(members, revert, "revert the canary")
        for name, r in results.items():
            doc = r.value if isinstance(r.value, dict) else {"ok": False, "outcome": "failed (canary not reverted)",
                                                             "summary": r.error}
            docs[name] = doc
            self.event("host-done", name, f"{doc.get('outcome')}: {(doc.get('summary') or '').splitlines()[0]}"
                       if doc.get("summary") else str(doc.get("outcome")))
            state["hosts"][name] = _kept(doc)
            state["done"] = sorted(set(state["done"]) - {name})
        state["paused"] = None
        self._save_state(state)

    def abort(self) -> dict[str, Any]:
        """`sglfleet rollout abort` when no controller waits: revert the paused canary from the
        state file, the rest untouched."""
        with ControllerLock(self.state_file):
            state = self._load_state()
            paused = state.get("paused")
            if not paused:
                raise ConfigError(f"nothing to abort: {self.state_file} is not a paused canary (a halted rollout "
                                  "leaves its hosts as they are; `--continue` resumes it)")
            batch = [n for n in paused.get("canary") or [] if n in {h.name for h in self.hosts}]
            docs: dict[str, dict[str, Any]] = {}
            why = (f"aborted by {describe_by(deploy_stage.holder(self.deploy_options.command))} after the canary "
                   f"analysis said {paused.get('verdict')}")
            self.revert_canary(batch, docs, why, state, KnownHosts(self.inventory.known_hosts_path))
            state["canary"] = dict(state.get("canary") or {}, decision={"action": "abort", "by": why, "at": time.time()})
            state["halted"] = {"batch": 1, "why": f"canary reverted: {why}"}
            self._save_state(state)
        return {"command": "rollout abort", "state_file": str(self.state_file), "pattern": self.pattern,
                "profile": self.profile.name, "why": why,
                "hosts": {n: {"outcome": d.get("outcome"), "ok": bool((d.get("reverted") or {}).get("healthy")),
                              "release": _release_now(d), "summary": d.get("summary"), "detail": d}
                          for n, d in docs.items()},
                "exit_code": 0 if all((d.get("reverted") or {}).get("healthy") for d in docs.values()) else 1}

    def _run_batch(self, k: int, batch: list[str], by_name: dict[str, Host], known: KnownHosts) -> Any:
        members = {u.name: u.hosts for u in self.units if u.name in batch}  # a unit's hosts, rank 0 first
        group = Group([h for n in batch for h in members[n]], known, forks=len(batch),
                      host_key_policy=self.host_key_policy, inventory=self.inventory, stop=self.stop)
        with group:
            return group.run_units({n: members[n] for n in batch}, lambda conns: self._host_task(conns[0], k, conns),
                                   "rollout")

    def _host_task(self, conn: Any, k: int, conns: list[Any] | None = None) -> Any:
        return _outcome(HostRoll(self, conn, k, conns)())


ANALYSIS = "(analysis)"  # the progress line of the canary analysis


def _kept(doc: dict[str, Any]) -> dict[str, Any]:
    """What the state file keeps of a host's turn: its result, and what reverting it needs (a
    server group's: each rank's)."""
    kept = {k: doc.get(k) for k in ("outcome", "release", "deploy_id", "summary", "pushed", "running_before", "mode")}
    if doc.get("ranks"):
        kept["ranks"] = {n: {k: (d or {}).get(k) for k in ("pushed", "running_before", "mode")}
                         for n, d in doc["ranks"].items()}
    return kept


def _outcome(doc: dict[str, Any]) -> TaskOutcome:
    return TaskOutcome(bool(doc.get("ok")), doc, None if doc.get("ok") else doc.get("summary"))


def describe_by(by: Any) -> str:
    if isinstance(by, dict):
        return f"{by.get('user', '?')}@{by.get('controller', '?')}"
    return str(by or "?")


def unit_host(unit: units_stage.Unit) -> Host:
    """A unit as routing sees it: a host as it is; a server group under its own name, with rank 0's
    address, vars and routers (the rollout's batches, slots and state are keyed by that name)."""
    return unit.leader if not unit.is_group else dataclasses.replace(unit.leader, name=unit.name)


def _release_now(doc: dict[str, Any]) -> str | None:
    """The release the host serves after its turn (the previous one when it was reverted)."""
    reverted = doc.get("reverted") or {}
    if reverted.get("healthy"):
        return reverted.get("release") or "pristine"
    if doc.get("release") is not None or doc.get("ok"):
        return doc.get("release") or "pristine"
    before = doc.get("running_before") or {}
    return before.get("release") or ("pristine" if before else None)


def rolling_deploy(inventory: Inventory, pattern: str, profile: Profile, options: RolloutOptions,
                   events: Events = lambda kind, host, text: None, host_key_policy: str | None = None,
                   artifacts: Artifacts | None = None) -> dict[str, Any]:
    """`deploy --rolling`: the profile's deployment, batch by batch behind the routers."""
    options.mode = "deploy"
    return Rollout(inventory, pattern, profile, artifacts, options, events, host_key_policy).run()


def rolling_restart(inventory: Inventory, pattern: str, profile: Profile, options: RolloutOptions,
                    events: Events = lambda kind, host, text: None, host_key_policy: str | None = None) -> dict[str, Any]:
    """`restart --rolling`: the deployment that runs, restarted batch by batch behind the routers."""
    options.mode = "restart"
    return Rollout(inventory, pattern, profile, None, options, events, host_key_policy).run()
