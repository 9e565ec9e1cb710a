"""`deploy`: push, smoke, launch and health-check one profile's server on a host; safe to rerun,
and a failed deploy leaves the host serving what it served before.

Per host, on its one SSH connection (exec round trips numbered; health polls not counted):
  1 plan      remote/server.py plan: server facts + release inspection + doctor's facts
              (server_facts.py, release.py, doctor.py, gather_facts.py sent along as companions,
              same process) + what runs + who holds the port; takes the deploy lease (a second
              deploy is refused naming the holder)
    decide    render (stages.render), the release plan (stages.release.make_plan), restart or
              not and why; doctor's checks on the plan's facts (stages.doctor.plan_checks): a
              failing one refuses the host with doctor's own text, nothing changed. Nothing to
              do: 2 finish (drops the lease) -> "unchanged: running release X since T". A
              foreign process on the port: refused, nothing changed.
  2 apply     remote/release.py apply: only the changed files (skipped when there are none),
              and, inside its transaction after the import check, in the same process (one
              SGLang import), the smoke probe below: a failing one undoes the swap there, so
              nothing is committed (with --no-revert the smoke is step 3, as with nothing to push)
  3 smoke     remote/smoke_probe.py probe: SGLang's own validation of the argv. The gate: a
              failure stops here with the traceback and the diagnosis; the running server is
              untouched (a release this deploy applied is rolled back). Not a round trip of its
              own when the push carried it
  4 launch    remote/server.py launch: env file, launch script, unit; stop the old server
              (SIGTERM, drain, SIGKILL after the grace); start the new one
    health    stages.health: alive, port, /health, /health_generate, /generate, /server_info
  5 finish    remote/server.py finish: the deployment record; the lease is dropped
A failure after the old server was stopped: its log stored under runs/<time>-deploy/, the
release rolled back, the previous deployment started again and health-checked (revert), unless
--no-revert. First deploy: 4 round trips, whether or not it pushes (5 with --no-revert and a push); no-op: 2.

A multi-node server deploys as one unit (stages/groups.py): one HostDeploy per rank, with these
same steps and round trips on each rank's host, meeting the other ranks where the group decides.
"""

from __future__ import annotations

import hashlib
import json
import os
import secrets
import socket
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from ..errors import ConfigError, RemoteError, SglfleetError
from ..fleet import remote_call
from ..fleet.group import stopping
from ..remote.hostlib import describe_holder, server_paths
from ..spec.profile import Artifacts, Profile
from . import doctor
from . import health as health_stage
from . import kernels, release, runs, sglang_options
from .render import Rendered, RenderError, render
from .units import Placement
from .smoke import PROBE, PROBE_COMPANIONS, diagnose, probe_request, received, run_probe, simulate_for

SERVER = "server.py"
COMPANIONS = ("server_facts.py", "release.py")
DEFAULT_STOP_GRACE_S = 120.0  # SGLang's drain has no timeout of its own: this bounds it
# A new server must stay healthy this long after its staged health passed (Kubernetes'
# minReadySeconds): a server that dies or turns unhealthy right after its first healthy answers
# (a scheduler fault on the first real batch, a leak) is a failed deploy, reverted.
DEFAULT_MIN_READY_S = 3.0
# A non-zero rank of a multi-node server ignores SIGTERM (SGLang stops its schedulers on rank 0's
# shutdown broadcast, and rank 0 is stopped first): past this grace it is killed.
RANK_STOP_GRACE_S = 30.0
# The lease's time-to-live is built from these and the deploy's own timeouts (HostDeploy.lease_ttl).
PUSH_AND_SMOKE_S = 1200.0   # the apply and the smoke probe, 600 s each at most
LAUNCH_CALL_S = 300.0       # a launch or revert call beyond the stop grace
LEASE_MARGIN_S = 120.0


@dataclass
class DeployOptions:
    command: str
    dry_run: bool = False
    revert: bool = True
    force: bool = False
    stop_grace: float = DEFAULT_STOP_GRACE_S
    timeouts: dict[str, float] = field(default_factory=dict)
    runs_dir: Path | None = None
    manager: str | None = None  # systemd | supervisor; None: the host decides (systemd if PID 1)
    min_ready: float = DEFAULT_MIN_READY_S  # seconds of staying healthy after the staged health (0: none)
    lease_wait_s: float = 0.0  # how long the host may wait, prepared, before its launch (a rollout's batches)
    # One release id for every host of a run (as `push` gives), when the run pushes anything.
    release_id: str = field(default_factory=release.new_release_id)


class Counted:
    """The host's connection, counting exec round trips (health polls apart)."""

    def __init__(self, conn: Any):
        self._conn, self.exec, self.polls = conn, 0, 0
        self.host = conn.host
        self._polling = threading.local()

    def run(self, *args: Any, **kwargs: Any) -> Any:
        if getattr(self._polling, "on", False):
            self.polls += 1
        else:
            self.exec += 1
        return self._conn.run(*args, **kwargs)

    def polling(self) -> "_Polling":
        return _Polling(self._polling)


class _Polling:
    def __init__(self, flag: threading.local):
        self.flag = flag

    def __enter__(self) -> None:
        self.flag.on = True

    def __exit__(self, *exc: Any) -> None:
        self.flag.on = False


def new_deploy_id() -> str:
    return time.strftime("%Y%m%dT%H%M%SZ", time.gmtime()) + "-d" + secrets.token_hex(3)


def holder(command: str) -> dict[str, Any]:
    return dict(release.holder(command), controller_pid=os.getpid())


def digest(text: str) -> str:
    return hashlib.sha256(text.encode("utf-8", "surrogateescape")).hexdigest()[:16]


def render_files(rendered: Rendered, stop_grace: float = DEFAULT_STOP_GRACE_S) -> dict[str, str]:
    """The launch script, env file and unit; the unit's TimeoutStopSec is the stop grace, so a
    systemd host drains exactly as long as a supervised one."""
    paths = server_paths(rendered.profile)
    return {"launch_script": rendered.template("launch.sh.j2", env_file=paths["env_file"]),
            "env": rendered.template("sglang.env.j2"),
            "unit": rendered.template("sglang-server.service.j2", launch_script=paths["launch_script"],
                                      stop_timeout_s=max(1, int(stop_grace)))}


def program_texts() -> dict[str, str]:
    """What the detached supervisor runs on the host: this script and the host library."""
    return {"server.py": remote_call.script_bytes(SERVER).decode(),
            "sglfleet_hostlib.py": remote_call.script_bytes("hostlib.py").decode()}


def clashes(address: str, bind: str) -> bool:
    """A listener on `address` keeps a server from binding `bind` on the same port."""
    wild = ("0.0.0.0", "::", "", "[::]")
    return bind in wild or address in wild or address == bind


def describe_port_holder(h: dict[str, Any]) -> str:
    if h.get("profile"):  # another profile's server that sglfleet deployed here (remote/server.py name_profiles)
        return f"profile {h['profile']}'s server (pid {h['pid']}, deployed by sglfleet on {since(h.get('deployed'))})" \
            f" is listening on {h.get('address')}"
    who = f"pid {h['pid']} ({' '.join(h.get('cmdline') or ['?'])})" if h.get("pid") else \
        "a process this host cannot see (another pid namespace or container)"
    return f"{who} is listening on {h.get('address')}"


def port_taken(host: str, port: int, holders: list[dict[str, Any]]) -> str:
    """The refusal of a port someone else listens on; another sglfleet profile is named as such."""
    ours = sorted({h["profile"] for h in holders if h.get("profile")})
    then = (f"stop it (`sglfleet stop {host} {ours[0]}`) or give this profile another port" if ours else
            "sglfleet did not start it and will not stop it")
    return (f"{host}: port {port} is taken: " + "; ".join(describe_port_holder(h) for h in holders)
            + f"; {then} (nothing was changed)")


def plan_call(conn: Any, profile: Profile, artifacts: Artifacts | None, extra: dict[str, Any],
              recover: bool = True, inventory_path: str = "inventory", checks: bool = False) -> dict[str, Any]:
    """Round trip 1: facts, release inspection, what runs, port holders (and the lease); with
    `checks`, doctor's facts too (stages.doctor.plan_checks judges them). The model, draft and
    port asked about are the profile's as this host runs it (its inventory
    sglfleet_profile_overrides applied, as render applies them); overrides of the wrong shape
    are render's error to report, so they are left out here."""
    try:
        mine = doctor.host_profile(conn.host, profile, inventory_path)[0].model
    except ConfigError:
        mine = profile.model
    model, spec = mine.model, mine.speculative
    args: dict[str, Any] = {"profile": profile.name,
                            "facts": {"model": model.path if model else None,
                                      "draft": spec.draft_model if spec else None,
                                      "known_options": sglang_options.known()},
                            "port": mine.server.port, **extra}
    companions = tuple(name for name in COMPANIONS if name != "release.py" or artifacts is not None)
    if checks and artifacts is not None:
        try:
            args["doctor"] = doctor.request(conn.host, profile, artifacts, inventory_path, port=False)
            companions += doctor.PLAN_COMPANIONS
        except ConfigError:
            pass  # overrides of the wrong shape: render reports them
    if artifacts is not None:
        package = artifacts.patchset.manifest.package if artifacts.patchset else "sglang"
        # with the builds per fingerprint (build-kernels), one of which may be chosen for the host
        targets = release.inspect_targets(artifacts, also=kernels.candidate_keys(profile))
        args["inspect"] = {"package": package, "recover": recover, "holder": extra.get("holder") or holder("plan"),
                           "targets": targets}
    planned = remote_call.call(conn, SERVER, "plan", args, timeout=600, companions=companions)
    if planned.get("facts") is not None:
        sglang_options.complete(planned["facts"])
    return planned


def restart_reasons(running: dict[str, Any], desired: dict[str, Any], changes: int, mode: str) -> list[str]:
    record = running.get("record")
    if not record:
        return ["nothing deployed by sglfleet yet"]
    reasons = []
    if changes:
        reasons.append(f"release: {changes} file(s) change")
    elif record.get("release") != desired["release"]:
        reasons.append(f"release changed ({record.get('release') or 'pristine'} -> {desired['release'] or 'pristine'})")
    if record.get("argv_hash") != desired["argv_hash"]:
        reasons.append("launch command changed")
    if record.get("env_hash") != desired["env_hash"]:
        reasons.append("environment changed")
    if record.get("files_hash") != desired["files_hash"] and not reasons:
        reasons.append("launch script or unit changed")
    if record.get("mode") != mode:
        reasons.append(f"manager changed ({record.get('mode')} -> {mode})")
    if not running.get("alive"):
        reasons.append("server not running" + (f" (exited with code {running['exit_code']})"
                                               if running.get("exit_code") is not None else ""))
    return reasons


def since(epoch: float | None) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(epoch)) if epoch else "?"


def server_diagnosis(log: str, rendered: Rendered | None) -> list[str]:
    """The smoke rules applied to a server's log, plus what only a running server shows."""
    fixes = diagnose({"ok": False, "traceback": log}, rendered)
    if "Address already in use" in log:
        fixes.append("the port was taken when the server started: `sglfleet status` names what listens there")
    if "out of memory" in log.lower():
        fixes.append("GPU memory: lower server.mem_fraction or the DDTree budget, or free the GPU")
    if "Repo id must" in log or "HFValidationError" in log:
        fixes.append("a model path that does not exist was read as a Hugging Face repo id: check model.path and "
                     "speculative.draft_model on the host")
    return fixes


class HostDeploy:
    """One host's deploy, step by step; `run()` returns the document the CLI reports and stores.

    As one rank of a multi-node server (`placement`, `group`: stages/groups.py runs one per rank),
    it renders that rank's flags and meets the other ranks where the group decides as one: after
    its plan (restart all or none), before its launch (every smoke passed; rank 0 launches first),
    after its health (revert all or none), before its revert (rank 0 first). A non-zero rank
    stops its old server with a short grace (it ends on rank 0's shutdown, not on SIGTERM) and
    passes the rank stages of health (SGLang serves it no API)."""

    def __init__(self, conn: Any, profile: Profile, artifacts: Artifacts, inventory_path: str,
                 options: DeployOptions, note: Callable[[str], None] = lambda text: None,
                 placement: Placement | None = None, group: Any = None):
        self.conn = Counted(conn)
        self.host = conn.host
        self.profile, self.artifacts, self.inventory_path = profile, artifacts, inventory_path
        self.options, self._note = options, note
        self.placement, self.group = placement, group  # group: stages.groups.GroupSync
        self.rank = placement.rank if placement else 0
        self.stop_grace = options.stop_grace if self.rank == 0 else min(options.stop_grace, RANK_STOP_GRACE_S)
        self.steps: dict[str, float] = {}  # step -> seconds, in order (the bench's breakdown)
        self._step: tuple[str, float] | None = None
        self.deploy_id = group.deploy_id if group is not None else new_deploy_id()
        self.holder = holder(options.command)
        self.doc: dict[str, Any] = {"host": self.host.name, "profile": profile.name, "deploy_id": self.deploy_id,
                                    "ok": False, "action": None}
        self.rendered: Rendered | None = None
        self.leased = False
        self.relaunch_current = False  # a revert starts the recorded server again (its launch was refused)
        self.plan_sent = self.plan_answered = 0.0  # this machine's clock around the plan (doctor's clock check)

    # ------------------------------------------------------------ plumbing

    STEPS = ("plan", "push", "smoke", "launch", "health", "record", "revert")

    def note(self, text: str) -> None:
        """Live progress; a note that names a step also starts its clock."""
        step = text.split(" ", 1)[0].rstrip(":")
        if step in self.STEPS and (self._step is None or self._step[0] != step):
            self._close_step()
            self._step = (step, time.monotonic())
        self._note(text)

    def _close_step(self) -> None:
        if self._step is not None:
            name, began = self._step
            self.steps[name] = round(self.steps.get(name, 0.0) + time.monotonic() - began, 3)
            self._step = None

    def server_args(self, **extra: Any) -> dict[str, Any]:
        return {"profile": self.profile.name, "deploy_id": self.deploy_id, "holder": self.holder, **extra}

    def server(self, command: str, timeout: float = 600, **extra: Any) -> Any:
        return remote_call.call(self.conn, SERVER, command, self.server_args(**extra), timeout=timeout)

    def finish(self, record: dict[str, Any] | None) -> None:
        self.server("finish", record=record)
        self.leased = False

    def fail(self, phase: str, message: str, **extra: Any) -> dict[str, Any]:
        self.doc.update(ok=False, action=self.doc.get("action") or "failed", phase=phase, summary=message, **extra)
        return self.doc

    # ------------------------------------------------------------ the pipeline

    def run(self) -> dict[str, Any]:
        started = time.monotonic()
        try:
            doc = self._run()
            taken = self.doc.get("lease_taken_over")
            if taken:  # said in the result, not only in the progress line
                doc["summary"] = (f"{doc.get('summary') or ''}; took over the lease of deploy {taken.get('id')} "
                                  f"(interrupted at {taken.get('step') or '?'}: {taken.get('why')})")
            return doc
        finally:
            if self.leased:  # an early end (an exception): give the host back
                try:
                    self.server("unlease")
                except SglfleetError:
                    pass
            self._close_step()
            self.doc["steps"] = self.steps
            self.doc["round_trips"] = {"exec": self.conn.exec, "health_polls": self.conn.polls}
            self.doc["seconds"] = round(time.monotonic() - started, 3)
            if self.group is not None:
                self.group.ended(self.host.name, self.doc)

    def _plan(self) -> dict[str, Any]:
        lease = None if self.options.dry_run else {"id": self.deploy_id, "holder": self.holder,
                                                   "ttl": self.lease_ttl()}
        extra = {"holder": self.holder, "lease": lease}
        self.plan_sent = time.time()
        try:
            # A dry run changes nothing: not even the recovery of an interrupted push.
            planned = plan_call(self.conn, self.profile, self.artifacts, extra, recover=not self.options.dry_run,
                                inventory_path=self.inventory_path, checks=True)
        except RemoteError as exc:
            held = exc.detail.get("lease")
            if not held or not lease or not _controller_gone(held.get("holder") or {}):
                raise
            self.note(f"taking over the lease of deploy {held.get('id')} (its controller process is gone)")
            lease["take_over"] = held.get("id")
            self.plan_sent = time.time()
            planned = plan_call(self.conn, self.profile, self.artifacts, extra, inventory_path=self.inventory_path,
                                checks=True)
        self.plan_answered = time.time()
        self.leased = lease is not None
        if planned.get("lease_took_over"):
            self.doc["lease_taken_over"] = planned["lease_took_over"]
        return planned

    def extension_for_host(self, inspected: dict[str, Any]) -> Artifacts:
        """The profile's artifacts with the extension build that matches this host's fingerprint
        (from build-kernels' cache), when the profile deploys an extension."""
        chosen = kernels.artifacts_for_host(self.profile, self.artifacts, inspected)
        if chosen.extension is not None and chosen.extension is not self.artifacts.extension:
            self.doc["extension"] = {"dir": str(chosen.extension.directory), "fingerprint": chosen.extension.fingerprint}
        return chosen

    def lease_ttl(self, step: str = "plan") -> float:
        """How long the lease holds the host before the deploy's next leased step renews it (plan,
        launch, revert each do): the longest the steps until then may take with this deploy's own
        timeouts, plus a margin; a controller that dies leaves the host to others that much later
        at most (one on this machine takes it over at once: the dead pid is seen)."""
        timeouts = {**health_stage.DEFAULT_TIMEOUTS, **self.options.timeouts}
        started = self.stop_grace + LAUNCH_CALL_S + sum(timeouts.values())  # a launch or revert + health
        if step == "revert":
            return started + LEASE_MARGIN_S
        if step == "launch":
            return started + self.options.min_ready + LEASE_MARGIN_S
        return PUSH_AND_SMOKE_S + self.options.lease_wait_s + LEASE_MARGIN_S  # plan: until the launch renews it

    def _run(self) -> dict[str, Any]:
        self.note("plan")
        try:
            planned = self._plan()
        except RemoteError as exc:
            return self.fail("plan", str(exc), refused=exc.exit_status == 3, holder=exc.detail.get("holder"))
        running = planned["running"]
        self.doc["running_before"] = _running_summary(running)
        if planned.get("inspect_error"):
            return self.fail("plan", f"{self.host.name}: {planned['inspect_error']['message']}")
        self.artifacts = self.extension_for_host(planned["inspect"])
        host_plan = release.make_plan(self.host.name, planned["inspect"], self.artifacts, self.options.force)
        # Flags the patchset adds are unknown to the host's SGLang until it is pushed: then
        # the smoke probe (SGLang's own parser, after the push) is the check.
        patching = any(f.key.startswith("pkg/") for f in host_plan.changes)
        try:
            self.rendered = rendered = render(self.host, self.profile, planned["facts"], self.inventory_path,
                                              check_flags=not patching, placement=self.placement)
        except (RenderError, SglfleetError) as exc:
            return self.fail("render", str(exc), exit_code=getattr(exc, "exit_code", 1))
        files = render_files(rendered, self.stop_grace)
        mode = self.options.manager or self.host.vars.get("sglfleet_server_manager") or \
            ("systemd" if planned.get("systemd") else "supervisor")
        if mode not in ("systemd", "supervisor"):
            return self.fail("plan", f"sglfleet_server_manager must be systemd or supervisor, got {mode!r}", exit_code=2)
        if mode == "systemd" and not planned.get("systemd"):
            return self.fail("plan", f"{self.host.name}: sglfleet_server_manager is systemd but PID 1 there is not systemd")
        desired = {"release": planned["inspect"].get("current"), "argv_hash": digest(json.dumps(rendered.command)),
                   "env_hash": digest(files["env"]),
                   "files_hash": digest(files["launch_script"] + files["env"] + files["unit"])}
        changes = host_plan.changes
        reasons = restart_reasons(running, desired, len(changes), mode)
        self.doc.update(mode=mode, restart_reasons=reasons, notes=host_plan.notes, command=rendered.command,
                        bind=rendered.bind, port=rendered.port, release_changes=[f.key for f in changes],
                        argv_hash=desired["argv_hash"], env_hash=desired["env_hash"])
        foreign = [h for h in planned.get("foreign") or [] if clashes(h["address"], rendered.bind)]
        unfit = self._doctor(planned)
        if self.options.dry_run:
            return self._dry_run(planned, host_plan.refusals + ([unfit] if unfit else []), foreign, reasons, files,
                                 desired)
        if unfit:
            self.finish(None)
            return self.fail("plan", unfit, refused=True)
        if host_plan.refusals:
            return self.fail("plan", f"{self.host.name}: refused: " + "; ".join(host_plan.refusals), refused=True)
        if foreign:
            return self.fail("plan", port_taken(self.host.name, rendered.port, foreign), refused=True, foreign=foreign)
        if self.group is not None:  # the server restarts whole, or not at all
            agreed = self.group.agree(self, reasons)
            if isinstance(agreed, str):
                self.finish(None)
                return self.fail("plan", f"{self.host.name}: not deployed: {agreed}; nothing was changed here")
            reasons = self.doc["restart_reasons"] = agreed
        if not reasons:
            self.finish(None)
            record = running["record"]
            self.doc.update(ok=True, action="unchanged", pid=running.get("pid"), release=desired["release"],
                            started=record.get("started"),
                            summary=f"unchanged: running release {desired['release'] or 'pristine'} since "
                                    f"{since(record.get('started'))}")
            return self.doc
        return self._change(planned, host_plan, files, desired, mode)

    def _doctor(self, planned: dict[str, Any]) -> str | None:
        """Doctor's checks on the plan's facts (no round trip of their own), kept in the result;
        the failing ones as doctor prints them (None: none fails)."""
        if "doctor" not in planned:
            return None
        checks = doctor.plan_checks(self.host, self.profile, self.artifacts, planned, self.plan_sent,
                                    self.plan_answered, self.inventory_path)
        self.doc["doctor"] = [c.to_json() for c in checks]
        return doctor.refusal_text(self.host.name, checks) if doctor.failing(checks) else None

    def _dry_run(self, planned: dict[str, Any], drift: list[str], foreign: list[dict[str, Any]], reasons: list[str],
                 files: dict[str, str], desired: dict[str, Any]) -> dict[str, Any]:
        """What the real run would do, and every refusal it would hit (drifted files, the port, a
        lease that binds): `would deploy` / `would restart: WHY` / `unchanged` / `would be refused`."""
        running = planned["running"]
        refusals = list(drift)
        if foreign:
            refusals.append(port_taken(self.host.name, self.rendered.port if self.rendered else 0, foreign))
        held = planned.get("lease_holder")
        if held and lease_binds(held, planned.get("time")):
            refusals.append(f"host is being deployed by another sglfleet run: {describe_holder(held.get('holder'))} "
                            f"(deploy {held.get('id')}, lease until {since(held.get('since', 0) + held.get('ttl', 0))})")
        if refusals:
            summary = "would be refused: " + "; ".join(refusals)
        elif not running.get("record"):
            summary = "would deploy: " + "; ".join(reasons)
        elif reasons:
            summary = "would restart: " + "; ".join(reasons)
        else:
            summary = (f"unchanged: running release {desired['release'] or 'pristine'} since "
                       f"{since((running.get('record') or {}).get('started'))}")
        self.doc.update(ok=True, action="dry-run", files=files, refusals=refusals, foreign=foreign, summary=summary)
        return self.doc

    def _change(self, planned: dict[str, Any], host_plan: release.HostPlan, files: dict[str, str],
                desired: dict[str, Any], mode: str) -> dict[str, Any]:
        rendered = self.rendered
        assert rendered is not None
        previous_release = planned["inspect"].get("current")
        applied = None
        if stopping():  # Ctrl-C: no new step starts on this host; nothing was changed yet
            self.finish(None)
            return self.fail("push", f"{self.host.name}: stopped before changing anything: the run was interrupted",
                             stopped=True)
        probe, restored = None, ""
        if host_plan.changes:
            # The smoke runs inside the push's transaction, after its import check and in the same
            # process: one import of SGLang instead of two, one round trip less, and a failing
            # smoke leaves nothing committed. --no-revert keeps a failing release for a look, so
            # it pushes, then smokes on its own, as before.
            smoke = probe_request(rendered, simulate_for(self.host, None)) if self.options.revert else None
            self.note(f"push {len(host_plan.changes)} file(s)" + (" + smoke" if smoke else ""))
            try:
                applied = self._apply(planned, host_plan, smoke)
            except RemoteError as exc:
                probe = exc.detail.get("probe") if smoke else None
                if not isinstance(probe, dict):
                    return self.fail("push", str(exc))
                restored = "; the pushed files were restored in the push's own transaction (nothing was committed)"
            else:
                desired["release"] = applied["release"]
                self.doc["pushed"] = {"release": applied["release"], "files": applied["files"],
                                      "content_bytes": applied["content_bytes"]}
                probe = applied.get("probe")
            if probe is not None:
                probe = received(probe)
        if probe is None:
            probe = self._smoke(rendered, planned)
        self.doc["smoke"] = {k: probe.get(k) for k in ("ok", "phase", "fields", "exception", "timings")}
        if not probe.get("ok"):
            self.doc["traceback"] = probe.get("traceback")
            self.doc["diagnosis"] = diagnose(probe, rendered)
            undo = restored or self._undo_release(applied, previous_release)
            exc = probe.get("exception") or {}
            self.finish(None)
            return self.fail("smoke", f"smoke failed ({probe.get('phase')}): {exc.get('type')}: "
                             f"{(exc.get('message') or '').splitlines()[0] if exc.get('message') else ''}; "
                             f"the running server was not touched{undo}")
        expected = probe.get("fields") or {}
        # Ctrl-C before the running server is touched: leave it serving what it served. A rank of a
        # multi-node server learns it with the group's answer (every rank the same), and whether
        # another rank failed its push or smoke; rank 0 launches first, the others after it.
        held = self.group.launch_turn(self) if self.group is not None else \
            ("the run was interrupted" if stopping() else None)
        if held:
            undo = self._undo_release(applied, previous_release)
            self.finish(None)
            return self.fail("launch", f"{self.host.name}: stopped before touching the running server: {held}{undo}",
                             stopped=held == "the run was interrupted")
        self.note("launch")
        try:
            launched = self.server("launch", timeout=self.stop_grace + LAUNCH_CALL_S, files=files, mode=mode,
                                   bind=rendered.bind, port=rendered.port, stop_grace=self.stop_grace,
                                   programs=program_texts(), lease_ttl=self.lease_ttl("launch"),
                                   release=desired["release"])
        except RemoteError as exc:
            refused = exc.detail.get("port_taken") or exc.exit_status == 3  # before anything was stopped
            if self.group is not None:
                self.group.launched(self, "refused" if refused else "failed")
            if refused and self.rank == 0:  # (a later rank fails with its group, reverted as after a start)
                undo = self._undo_release(applied, previous_release)
                return self.fail("launch", f"{exc}{undo}", port_taken=exc.detail.get("port_taken"))
            self.relaunch_current = bool(refused)  # its recorded server ran on here until rank 0 stopped
            # It failed after it may have stopped the old server: revert as after a failed start.
            return self._failed_after_launch(health_stage.HealthResult(ok=False, failed={
                "stage": "launch", "message": str(exc)}), applied, previous_release, mode)
        if self.group is not None:
            self.group.launched(self, "ok")
        self.doc["stopped"] = launched.get("stopped")
        self.doc["launched"] = {k: launched.get(k) for k in ("pid", "started", "mode", "start_id")}
        result = self._health(mode, rendered, expected)
        if result.ok and self.options.min_ready > 0:
            self.note(f"health: stay healthy {self.options.min_ready:g}s")
            with self.conn.polling():
                health_stage.stays_healthy(self.conn, self.server_args(mode=mode, bind=rendered.bind,
                                                                       port=rendered.port),
                                           self.options.min_ready, result, self.note,
                                           self.group.abort if self.group is not None else None)
        if self.group is not None:  # healthy only if every rank is: else every rank reverts
            result = self.group.healthy(self, result)
        record = {"profile": self.profile.name, "deploy_id": self.deploy_id, "release": desired["release"],
                  "argv": rendered.command, "argv_hash": desired["argv_hash"], "env_hash": desired["env_hash"],
                  "files_hash": desired["files_hash"], "pid": launched.get("pid"), "started": launched.get("started"),
                  "start_id": launched.get("start_id"), "mode": mode, "bind": rendered.bind, "port": rendered.port,
                  "health": result.timings, "controller": self.holder, "expected": expected,
                  **({"placement": self.placement.to_json()} if self.placement else {})}
        if result.ok:
            self.note("record")
            self.finish(record)
            self.doc.update(ok=True, action="deployed", pid=launched.get("pid"), release=desired["release"],
                            started=launched.get("started"), health=result.timings,
                            server_info=result.server_info, generated=result.generated,
                            summary=f"deployed release {desired['release'] or 'pristine'}: pid {launched.get('pid')}, "
                                    f"{result.summary()}")
            return self.doc
        return self._failed_after_launch(result, applied, previous_release, mode)

    def _smoke(self, rendered: Rendered, planned: dict[str, Any]) -> dict[str, Any]:
        """Round trip 3: SGLang's own validation of the argv (a restart may vouch for it instead)."""
        self.note("smoke")
        return run_probe(self.conn, rendered, simulate_for(self.host, None))

    def _apply(self, planned: dict[str, Any], host_plan: release.HostPlan,
               smoke: dict[str, Any] | None = None) -> dict[str, Any]:
        """Round trip 2: the push's apply, on the plan made from round trip 1's inspection; with
        `smoke`, the smoke probe inside its transaction (round trip 3 then has nothing to do)."""
        changes = sorted(host_plan.changes, key=release._apply_order)
        tar = release._Tar(changes, None)
        artifacts_doc = []
        if self.artifacts.patchset:
            artifacts_doc.append({"kind": "patchset", "name": self.artifacts.patchset.name,
                                  "versions": self.artifacts.patchset.manifest.versions})
        if self.artifacts.extension and any(f.key == self.artifacts.extension.key for f in changes):
            artifacts_doc.append({"kind": "extension", "name": self.artifacts.extension.name,
                                  "fingerprint": self.artifacts.extension.fingerprint})
        args = {"package": planned["inspect"]["package"]["name"], "id": self.options.release_id,
                "holder": self.holder, "files": [{"key": f.key, "before": f.before, "after": f.after} for f in changes],
                "artifacts": artifacts_doc, "import_check": host_plan.import_check, "pace_s": 0.0}
        answer = release.call(self.conn, "apply", args if smoke is None else dict(args, smoke=smoke), payload=tar,
                              companions=() if smoke is None else (PROBE, *PROBE_COMPANIONS))
        return {"release": answer["release"], "files": answer["files"], "content_bytes": tar.content_bytes,
                "probe": answer.get("probe")}

    def _undo_release(self, applied: dict[str, Any] | None, previous: str | None) -> str:
        if not applied or not self.options.revert:
            return "; the pushed release stays (--no-revert)" if applied else ""
        try:
            package = (self.artifacts.patchset.manifest.package if self.artifacts.patchset else "sglang")
            release.rollback(self.conn, package, previous or "pristine", self.options.command)
        except RemoteError as exc:
            return f"; rolling back release {applied['release']} FAILED: {exc}"
        self.doc["rolled_back"] = {"release": applied["release"], "to": previous}
        return f"; release {applied['release']} rolled back to {previous or 'pristine'}"

    def _health(self, mode: str, rendered: Any, expected: dict[str, Any], interruptible: bool = True,
                rank: int | None = None) -> health_stage.HealthResult:
        """The staged health (rank 0 and single hosts) or the rank stages (a non-zero rank)."""
        base = self.server_args(mode=mode, bind=rendered.bind, port=rendered.port)
        rank = self.rank if rank is None else rank
        self.note("health")
        with self.conn.polling():
            return health_stage.check(self.conn, base, self.options.timeouts, expected, self.note, interruptible,
                                      health_stage.STAGES if rank == 0 else health_stage.RANK_STAGES,
                                      self.group.abort if self.group is not None and interruptible else None)

    def _failed_after_launch(self, result: health_stage.HealthResult, applied: dict[str, Any] | None,
                             previous_release: str | None, mode: str) -> dict[str, Any]:
        failed = result.failed or {}
        if self.group is not None:  # every rank reverts: the others stop waiting for their health
            self.group.failing(self, result.summary())
        if failed.get("interrupted"):
            self.doc["interrupted"] = True  # Ctrl-C while the new server was waited for: reverted (exit 130)
        log = failed.get("log") or ""
        self.doc.update(health=result.timings, failed_stage=failed.get("stage"), exit_code=failed.get("exit_code"),
                        server_info=result.server_info,
                        server_log=log, diagnosis=server_diagnosis(log, self.rendered))
        summary = result.summary()
        if not self.options.revert:
            self.finish(None)
            return self.fail("health", f"{summary}; --no-revert: the failed server and release were left as they "
                             "are for debugging")
        self.note("revert")
        undo = self._undo_release(applied, previous_release)
        if self.group is not None:
            self.group.revert_turn(self)  # rank 0 first, as at the launch
        try:
            reverted = self.server("revert", timeout=self.stop_grace + LAUNCH_CALL_S, mode=mode,
                                   stop_grace=self.stop_grace, programs=program_texts(),
                                   lease_ttl=self.lease_ttl("revert"), relaunch_current=self.relaunch_current)
        except RemoteError as exc:
            return self.fail("revert", f"{summary}{undo}; reverting the server FAILED: {exc}")
        finally:
            if self.group is not None:
                self.group.reverted(self)
        previous = reverted.get("restored")
        self.doc["reverted"] = {"stopped_failed": reverted.get("stopped"), "restored": bool(previous)}
        if not previous:
            self.finish(None)
            return self.fail("health", f"{summary}{undo}; nothing ran before, the host is left stopped")
        back = self._health(previous.get("mode") or "supervisor", _Bind(previous), previous.get("expected") or {},
                            interruptible=False,  # a revert under way finishes, Ctrl-C or not
                            rank=int((previous.get("placement") or {}).get("rank") or 0))
        record = dict(previous, pid=reverted.get("pid"), started=reverted.get("started"),
                      start_id=reverted.get("start_id"), health=back.timings, reverted_from=self.deploy_id)
        self.doc["reverted"].update(pid=reverted.get("pid"), healthy=back.ok, health=back.timings,
                                    release=previous.get("release"))
        if back.ok:
            self.finish(record)
            return self.fail("health", f"{summary}{undo}; reverted: the previous deployment (release "
                             f"{previous.get('release') or 'pristine'}) serves again, pid {reverted.get('pid')}, "
                             f"{back.summary()}")
        self.finish(None)
        return self.fail("revert", f"{summary}{undo}; the previous deployment was started again but is not "
                         f"healthy: {back.summary()}", revert_log=(back.failed or {}).get("log"))


@dataclass
class _Bind:
    """The bind address and port of a recorded deployment (what health needs of a Rendered)."""

    record: dict[str, Any]

    @property
    def bind(self) -> str:
        return self.record.get("bind") or "127.0.0.1"

    @property
    def port(self) -> int:
        return int(self.record.get("port") or 0)


def _controller_gone(holder: dict[str, Any]) -> bool:
    """The lease's controller process ran on this machine and is gone (its SSH session with it)."""
    if holder.get("controller") != socket.gethostname() or not holder.get("controller_pid"):
        return False
    try:
        os.kill(int(holder["controller_pid"]), 0)
    except ProcessLookupError:
        return True
    except (PermissionError, ValueError):
        return False
    return False


def lease_binds(held: dict[str, Any], now: float | None) -> bool:
    """Whether a deploy lease found on a host would refuse this run: not expired (by the host's
    clock) and not left by a controller of this machine that is gone."""
    if now is not None and now - float(held.get("since") or 0) > float(held.get("ttl") or 0):
        return False
    return not _controller_gone(held.get("holder") or {})


def _running_summary(running: dict[str, Any]) -> dict[str, Any]:
    record = running.get("record") or {}
    return {"alive": running.get("alive"), "pid": running.get("pid"), "release": record.get("release"),
            "argv_hash": record.get("argv_hash"), "started": record.get("started"), "mode": running.get("mode"),
            "exit_code": running.get("exit_code")}


# ---------------------------------------------------------------- runs/<time>-deploy/


def store(directory: Path, host: str, document: dict[str, Any]) -> None:
    """<host>.json whole; the server's log and the probe's traceback also as plain files."""
    runs.write_json(directory / f"{host}.json", document)
    if document.get("server_log"):
        runs.write_text(directory / f"{host}.server.log", document["server_log"])
    if document.get("traceback"):
        runs.write_text(directory / f"{host}.traceback.txt", document["traceback"])


# ---------------------------------------------------------------- status and stop


def status_host(conn: Any, profile: Profile | None, inventory_path: str,
                placement: Placement | None = None) -> dict[str, Any]:
    """Desired (with a profile: rendered from fresh facts; a rank of a multi-node server with its
    `placement`) vs running, drift flagged. A row of a rank says its place (from its record)."""
    answer = remote_call.call(conn, SERVER, "status", {"profile": profile.name if profile else None})
    rows = []
    desired = None
    if profile is not None:
        artifacts = profile.artifacts()
        planned = plan_call(conn, profile, artifacts, {"holder": holder("status")}, recover=False,
                            inventory_path=inventory_path)
        try:
            rendered = render(conn.host, profile, planned["facts"], inventory_path, check_flags=False,
                              placement=placement)
            files = render_files(rendered)
            desired = {"release": planned["inspect"].get("current"), "argv_hash": digest(json.dumps(rendered.command)),
                       "env_hash": digest(files["env"]),
                       "pending_files": len(release.make_plan(conn.host.name, planned["inspect"], artifacts).changes)}
        except SglfleetError as exc:
            desired = {"error": str(exc)}
    lease = answer.get("lease")
    left = lease if lease and not lease_binds(lease, answer.get("time")) else None  # a deploy that never ended
    entries = dict(answer["profiles"])
    if left and left.get("profile") and left["profile"] not in entries and \
            (profile is None or profile.name == left["profile"]):
        entries[left["profile"]] = {"running": {}, "record": None}  # interrupted before it launched anything
    for name, entry in entries.items():
        running, record = entry["running"], entry.get("record") or {}
        drift = []
        interrupted = left if left and left.get("profile") == name else None
        if interrupted:
            drift.append(interrupted_deploy(interrupted, running, record))
        if desired and "error" in desired:
            drift.append(f"cannot render the profile: {desired['error']}")
        if desired and "error" not in desired:
            if not record and not interrupted:
                drift.append("not deployed")
            else:
                if record.get("release") != desired["release"]:
                    drift.append(f"release {record.get('release')} running, {desired['release']} installed")
                if record.get("argv_hash") != desired["argv_hash"]:
                    drift.append("launch command differs from the profile")
                if record.get("env_hash") != desired["env_hash"]:
                    drift.append("environment differs from the profile")
                if desired["pending_files"]:
                    drift.append(f"{desired['pending_files']} release file(s) not pushed")
        if record and not running.get("alive") and not record.get("stopped"):
            drift.append("server is down" + (f" (exit code {running.get('exit_code')})"
                                             if running.get("exit_code") is not None else ""))
        rows.append({"profile": name, "alive": running.get("alive"), "pid": running.get("pid"),
                     "mode": running.get("mode"), "release": record.get("release"),
                     "argv_hash": record.get("argv_hash"), "uptime_s": entry.get("uptime_s"),
                     "health": entry.get("health"), "accept_length": entry.get("accept_length"),
                     "stopped": record.get("stopped"), "drift": drift, "desired": desired,
                     "placement": record.get("placement"), "exit_code": running.get("exit_code"),
                     "log_tail": entry.get("log_tail"), "interrupted": interrupted,
                     "deploying": lease if lease and not left and lease.get("profile") == name else None})
    if profile is not None and not rows:
        rows.append({"profile": profile.name, "alive": False, "drift": ["not deployed"], "desired": desired})
    return {"profiles": rows, "lease": answer.get("lease")}


def interrupted_deploy(lease: dict[str, Any], running: dict[str, Any], record: dict[str, Any]) -> str:
    """What `status` says of a deploy whose lease was left behind (its controller died or it expired)."""
    if running.get("alive"):
        serving = (f"pid {running.get('pid')}, release {record.get('release') or 'pristine'} (recorded)" if record
                   else f"pid {running.get('pid')}, started by that deploy and never recorded")
    else:
        serving = "none (nothing runs)"
    what = f" of release {lease['release'] or 'pristine'}" if "release" in lease else ""
    return (f"deploy {lease.get('id')}{what} interrupted at "
            f"{lease.get('step') or '?'} by {describe_holder(lease.get('holder'))} at "
            f"{since(lease.get('step_since') or lease.get('since'))}; the server running is {serving}; rerun "
            "`sglfleet deploy` to finish or revert")


def stop_host(conn: Any, profile: str | None, grace: float, command: str) -> dict[str, Any]:
    return remote_call.call(conn, SERVER, "stop", {"profile": profile, "stop_grace": grace,
                                                   "holder": holder(command)}, timeout=grace + 120)
