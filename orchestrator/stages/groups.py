"""A server group (one SGLang server over N hosts) deployed, stopped and read as one unit.

Not a fork of the single-host path: `GroupDeploy` runs one `stages.deploy.HostDeploy` per rank,
each on its own host's one connection with its own round trips (a no-op deploy is 2 per host, a
first deploy 5), and the ranks meet in a `GroupSync` where the group decides as one:

    plan     each rank plans and renders its own argv (its --node-rank); then they agree: if any
             rank must restart (its argv, release, environment changed, or its server is down),
             every rank restarts, each saying why ("the server group restarts whole: ..."); if one
             is refused or fails, none changes anything
    push, smoke   on every rank, SGLang's own validation with that rank's flags; every smoke must
             pass before any rank launches (a failed one: every rank's push rolled back, the
             running group untouched). Ctrl-C is decided once for the group at this point
    launch   rank 0 first: its launch stops the old rank 0 (SGLang's drain; the old ranks then end
             on its shutdown broadcast) and starts the new one, which hosts the rendezvous on
             --dist-init-addr; then the other ranks at once, each stopping what is left of its
             old server (a short grace: a non-zero rank ignores SIGTERM) and starting its new
             one, which connects to rank 0. Every rank waits for rank 0's launch whatever it
             answered (unless it refused before stopping anything: then nobody launches), so
             every rank has the same generation to revert from
    health   every rank's process alive and its /health (the dummy server SGLang runs on a
             non-zero rank), and rank 0's whole staged health (/generate, /server_info ...), then
             min_ready on every rank; one rank failing ends the others' waits
    record   on every rank: the deployment record names the group, the rank, every rank's host
             and the release, under one deploy id
    revert   any failure after a launch reverts every rank (rank 0 first, as at the launch): the
             previous deployment of the group serves again, or the group is left stopped

`stop_group`: rank 0 first (its drain: the router's worker), then the others (their schedulers
end on rank 0's shutdown; what is left is stopped with a short grace). `group_status`: one row per
group from the ranks' own records and processes: running only when every rank is alive and rank
0 answers /health, else down with each rank's state and the error its log ended with.
"""

from __future__ import annotations

import dataclasses
import re
import threading
import time
from typing import Any, Callable

from ..errors import SglfleetError
from ..fleet.group import in_this_run, stopping
from ..spec.profile import Artifacts, Profile
from . import deploy as deploy_stage
from . import health as health_stage
from .units import Unit

INTERRUPTED = "the run was interrupted"


def _label(doc: dict[str, Any], rank: int) -> str:
    return f"{doc.get('host')} (rank {rank})"


class GroupSync:
    """Where the ranks of one group deploy meet (each rank's HostDeploy, in a thread of its own).
    A rank meets the others by posting what it reached and waiting until every rank has posted
    the same point or ended; a rank that ended without posting is a rank that failed."""

    def __init__(self, names: list[str], deploy_id: str):
        self.names, self.deploy_id = names, deploy_id
        self.cond = threading.Condition()
        self.posts: dict[str, dict[str, Any]] = {}
        self.decided: dict[str, Any] = {}     # phase -> what the group decided there, once
        self.ended_docs: dict[str, dict[str, Any]] = {}
        self.abort = health_stage.Abort()

    def rank_of(self, name: str) -> int:
        return self.names.index(name)

    # ------------------------------------------------------------ the meeting points

    def _post(self, phase: str, name: str, value: Any, first_only: bool = False) -> None:
        """`name` reached `phase` with `value` (its first value stays, with first_only)."""
        with self.cond:
            posted = self.posts.setdefault(phase, {})
            if not (first_only and name in posted):
                posted[name] = value
            self.cond.notify_all()

    def _meet(self, phase: str, name: str, value: Any, wanted: list[str] | None = None) -> dict[str, Any]:
        if name:
            self._post(phase, name, value)
        with self.cond:
            wanted = self.names if wanted is None else wanted
            while not all(n in self.posts.get(phase, {}) or n in self.ended_docs for n in wanted):
                self.cond.wait(0.5)
            if phase not in self.decided:  # the first rank through decides for all (Ctrl-C included)
                self.decided[phase] = INTERRUPTED if stopping() else None
            return dict(self.posts.get(phase, {}))

    def _missing(self, posts: dict[str, Any], wanted: list[str] | None = None) -> str | None:
        """Why the group cannot go on: the first rank that ended without reaching this point."""
        for name in wanted or self.names:
            if name not in posts:
                doc = self.ended_docs.get(name) or {}
                first = (doc.get("summary") or "it failed").splitlines()[0]
                return f"{name} (rank {self.rank_of(name)}) failed: {first}"
        return None

    def agree(self, rank: Any, reasons: list[str]) -> list[str] | str:
        """After the plan: the reasons this rank restarts for (every rank restarts if one must),
        or why nothing may change (a text)."""
        posts = self._meet("plan", rank.host.name, list(reasons))
        failed = self._missing(posts)
        if failed:
            return failed
        if reasons or not any(posts.values()):
            return list(reasons)
        others = [f"{n} (rank {self.rank_of(n)}): {'; '.join(r)}" for n, r in posts.items() if r]
        return [f"the server group restarts whole: {', '.join(others)}"]

    def launch_turn(self, rank: Any) -> str | None:
        """Before a rank's launch: None to go (rank 0 first, then the others once its launch
        answered), or why this rank must not touch its running server."""
        posts = self._meet("smoked", rank.host.name, True)
        why = self._missing(posts) or self.decided["smoked"]
        if why or rank.rank == 0:
            return why
        first = self.names[0]
        launched = self._meet("launched", "", None, [first])
        if first not in launched:
            return self._missing(launched, [first])
        if launched[first] == "refused":
            return f"{first} (rank 0) was refused before it stopped anything; the group serves on"
        return None

    def launched(self, rank: Any, outcome: str) -> None:
        self._post("launched", rank.host.name, outcome)

    def healthy(self, rank: Any, result: health_stage.HealthResult) -> health_stage.HealthResult:
        """After a rank's health and min_ready: its result, failed too when another rank's failed."""
        if not result.ok:
            return result  # it reverts: HostDeploy tells the others (failing)
        posts = self._meet("healthy", rank.host.name, True)
        why = self._missing(posts) or next((f"{n} (rank {self.rank_of(n)}) is not healthy" for n, ok in posts.items()
                                            if not ok), None)
        if why and self.abort.is_set():
            why = self.abort.why
        if not why:
            return result
        return health_stage.HealthResult(ok=False, stages=result.stages, server_info=result.server_info,
                                         generated=result.generated,
                                         failed={"stage": "group", "message": f"another rank failed: {why}"})

    def failing(self, rank: Any, why: str) -> None:
        """A rank goes to revert: the others' health waits end, and it counts as not healthy."""
        self.abort.fire(f"{rank.host.name} (rank {rank.rank}): {why}")
        self._post("healthy", rank.host.name, False, first_only=True)

    def revert_turn(self, rank: Any) -> None:
        if rank.rank > 0:
            self._meet("reverted", "", None, [self.names[0]])

    def reverted(self, rank: Any) -> None:
        self._post("reverted", rank.host.name, True)

    def ended(self, name: str, doc: dict[str, Any]) -> None:
        with self.cond:
            self.ended_docs[name] = doc
            self.cond.notify_all()
        if not doc.get("ok") and doc.get("action") not in ("unchanged", "dry-run"):
            self.abort.fire(f"{name} (rank {self.rank_of(name)}): {(doc.get('summary') or 'failed').splitlines()[0]}")


class GroupDeploy:
    """A server group's deploy: one HostDeploy per rank at once (see the module docstring);
    `run()` returns the group's document with each rank's under `ranks`."""

    def __init__(self, unit: Unit, conns: list[Any], profile: Profile, artifacts: Artifacts, inventory_path: str,
                 options: deploy_stage.DeployOptions, note: Callable[[str], None] = lambda text: None,
                 rank_note: Callable[[str, str], None] | None = None, kind: type = deploy_stage.HostDeploy):
        self.unit, self.conns, self.kind = unit, conns, kind
        self.profile, self.artifacts, self.inventory_path = profile, artifacts, inventory_path
        # A non-zero rank waits, prepared and leased, for rank 0's launch (its drain and start).
        self.options = dataclasses.replace(options, lease_wait_s=options.lease_wait_s + options.stop_grace
                                           + deploy_stage.LAUNCH_CALL_S)
        self.note = note
        self.rank_note = rank_note or (lambda label, text: note(f"{label}: {text}"))
        self.sync = GroupSync(unit.names, deploy_stage.new_deploy_id())
        self.deploys: dict[str, deploy_stage.HostDeploy] = {}

    def _rank_note(self, host: str, rank: int) -> Callable[[str], None]:
        def note(text: str) -> None:
            if rank == 0 and text == "launch":
                self.note("launch")  # the group's own step (a rollout takes it out of routing here)
            self.rank_note(f"{host}/{rank}", text)

        return note

    def run(self) -> dict[str, Any]:
        started = time.monotonic()
        docs: dict[str, dict[str, Any]] = {}
        errors: dict[str, BaseException] = {}

        def one(conn: Any) -> None:
            name = conn.host.name
            placement = self.unit.placements[name]
            d = self.kind(conn, self.profile, self.artifacts, self.inventory_path, self.options,
                          self._rank_note(name, placement.rank), placement=placement, group=self.sync)
            self.deploys[name] = d
            try:
                docs[name] = d.run()
            except BaseException as exc:  # kept: the group reports it; HostDeploy.run has ended the rank
                docs[name] = dict(d.doc, ok=False, action="failed",
                                  summary=str(exc) if isinstance(exc, SglfleetError) else f"{type(exc).__name__}: {exc}")
                errors[name] = exc

        threads = [threading.Thread(target=in_this_run(one), args=(conn,), daemon=True) for conn in self.conns]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        doc = summarize(self.unit, {n: docs[n] for n in self.unit.names if n in docs}, self.sync.deploy_id)
        doc["seconds"] = round(time.monotonic() - started, 3)
        leader = self.unit.names[0]
        for name, exc in errors.items():
            # a bug, or rank 0 ending before its launch (nothing changed on any rank: a rollout that
            # halted as it was about to take it out): raised as a single host's would be
            if not isinstance(exc, SglfleetError) or (name == leader and leader not in
                                                      self.sync.posts.get("launched", {})):
                raise exc
        return doc


def summarize(unit: Unit, ranks: dict[str, dict[str, Any]], deploy_id: str) -> dict[str, Any]:
    """The group's document from its ranks': one action for the group, rank 0's pid and health."""
    docs = list(ranks.values())
    first = docs[0] if docs else {}
    actions = {d.get("action") for d in docs}
    ok = bool(docs) and all(d.get("ok") for d in docs)
    action = actions.pop() if len(actions) == 1 and ok else ("dry-run" if "dry-run" in actions else "failed")
    failing = [(i, d) for i, d in enumerate(docs) if not d.get("ok")]
    if ok:
        summary = f"{action}: " + (first.get("summary") or "")
        if action == "dry-run":
            would = [d.get("summary") or "" for d in docs]
            restarting = [s for s in would if s.startswith(("would deploy", "would restart"))]
            summary = (f"would restart the whole group: {restarting[0]}" if restarting and
                       len(restarting) < len(would) else would[0])
    else:
        # the rank whose own failure it was, not those that stopped because of it
        own = [(i, d) for i, d in failing if "another rank failed" not in (d.get("summary") or "")
               and "not deployed:" not in (d.get("summary") or "")
               and "stopped before touching the running server: " not in (d.get("summary") or "")] or failing
        # each rank that failed on its own (a rank that died and the ones whose collectives failed
        # with it: which came first, their logs tell)
        summary = "; ".join(f"{_label(d, unit.placements[d['host']].rank if d.get('host') in unit.placements else i)}"
                            f": {d.get('summary') or 'failed'}" for i, d in own)
    reasons = first.get("restart_reasons") or []
    return {"host": unit.name, "server_group": unit.name, "profile": first.get("profile"), "deploy_id": deploy_id,
            "ok": ok, "action": action, "summary": summary, "ranks": ranks, "release": first.get("release"),
            "pid": first.get("pid"), "health": first.get("health"), "restart_reasons": reasons,
            "running_before": first.get("running_before"), "reverted": first.get("reverted"),
            "exit_code": 2 if docs and all(d.get("exit_code") == 2 for d in docs if not d.get("ok")) and not ok
            else None,
            "round_trips": {n: (d.get("round_trips") or {}).get("exec") for n, d in ranks.items()}}


# ---------------------------------------------------------------- stop and status


def stop_group(conns: list[Any], profile: str | None, grace: float, command: str) -> dict[str, Any]:
    """Rank 0 first (SGLang's drain, then its shutdown ends the other ranks' schedulers), then the
    other ranks at once with a short grace for what is left of them."""
    out: dict[str, Any] = {}
    out[conns[0].host.name] = deploy_stage.stop_host(conns[0], profile, grace, command)
    rest = conns[1:]
    errors: dict[str, BaseException] = {}

    def one(conn: Any) -> None:
        try:
            out[conn.host.name] = deploy_stage.stop_host(conn, profile, min(grace, deploy_stage.RANK_STOP_GRACE_S),
                                                         command)
        except SglfleetError as exc:
            errors[conn.host.name] = exc

    threads = [threading.Thread(target=in_this_run(one), args=(c,), daemon=True) for c in rest]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    if errors:
        name, exc = next(iter(errors.items()))
        raise type(exc)(f"{name}: {exc}") if isinstance(exc, SglfleetError) else exc
    return {"ranks": {c.host.name: out.get(c.host.name) for c in conns}}


ERROR_LINE = re.compile(r"(Error|error|Exception|exited with code|Traceback|NCCL|killed)")


def last_error(log_tail: str | None) -> str | None:
    """The last line of a dead server's log that says what went wrong (or its last line)."""
    lines = [line for line in (log_tail or "").splitlines() if line.strip()]
    for line in reversed(lines):
        if ERROR_LINE.search(line) and "sglfleet supervisor" not in line:
            return line.strip()
    return lines[-1].strip() if lines else None


def group_status(rows: dict[str, dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per server group found in the hosts' status rows (host -> its status_host value):
    its ranks (host, rank, state, pid, exit code, error), running or down, and why."""
    groups: dict[tuple[str, str], dict[str, Any]] = {}
    for host, value in rows.items():
        for row in (value or {}).get("profiles") or []:
            place = row.get("placement")
            if not place:
                continue
            key = (place["server_group"], row["profile"])
            group = groups.setdefault(key, {"server_group": key[0], "profile": key[1], "hosts": place["ranks"],
                                            "ranks": {}, "release": None})
            exit_code = row.get("exit_code")
            group["ranks"][host] = {"rank": place["rank"], "alive": bool(row.get("alive")), "pid": row.get("pid"),
                                    "health": row.get("health"), "exit_code": exit_code,
                                    "stopped": bool(row.get("stopped")), "release": row.get("release"),
                                    "error": None if row.get("alive") else last_error(row.get("log_tail")),
                                    "drift": row.get("drift") or []}
            if place["rank"] == 0:
                group["release"] = row.get("release")
    out = []
    for group in groups.values():
        ranks = group["ranks"]
        leader = next((h for h, r in ranks.items() if r["rank"] == 0), None)
        missing = [h for h in group["hosts"] if h not in ranks]
        running = not missing and all(r["alive"] for r in ranks.values()) and leader is not None and \
            ranks[leader]["health"] == 200
        stopped = all(r["stopped"] for r in ranks.values())
        why = []
        for host, r in sorted(ranks.items(), key=lambda item: item[1]["rank"]):
            if not r["alive"] and not r["stopped"]:
                code = r["exit_code"]
                killed = f" (killed by signal {code - 128})" if isinstance(code, int) and code > 128 else ""
                why.append(f"{host} (rank {r['rank']}) is down" + (f": exited with code {code}{killed}"
                                                                   if code is not None else "")
                           + (f": {r['error']}" if r["error"] else ""))
            elif r["alive"] and r["rank"] == 0 and r["health"] != 200:
                why.append(f"{host} (rank 0) answers /health {r['health']}")
        if missing:
            why.append(f"not read: {', '.join(missing)} (not selected, or unreachable)")
        group.update(state="running" if running else ("stopped" if stopped else "down"), why=why)
        out.append(group)
    return out
