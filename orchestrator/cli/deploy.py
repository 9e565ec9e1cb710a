"""`deploy`, `status`, `stop`: the profile's server on hosts (stages.deploy does the work)."""

from __future__ import annotations

import sys
import threading
import time
from pathlib import Path
from typing import Any, Callable, Optional

import typer

from ..errors import ConfigError, RemoteError, SglfleetError
from ..fleet.group import GroupResult, TaskOutcome
from ..spec.profile import load_profile
from ..stages import deploy as stage
from ..stages import groups, kernels
from ..stages.units import Unit, placements, units
from ..stages.runs import run_dir
from ..stages.health import DEFAULT_TIMEOUTS
from . import output
from .option_paths import output_dir
from . import rollout as rolling
from .common import (ForksOpt, InventoryOpt, JsonOpt, PatternArg, PolicyOpt, ProfileArg, command_line,
                     health_timeouts, inventory, run_group, run_units)
from .option_checks import POSITIVE_SECONDS, SECONDS_OR_MORE, number, refuse_without


def register(app: typer.Typer) -> None:
    app.command()(deploy)
    app.command()(status)
    app.command()(stop)
    app.command("build-kernels")(build_kernels)


class StepLines:
    """Off a terminal (CI, a pipe), one line per step per host on stderr, as rollouts print: the
    live table shows nothing there, and a long health wait would look like a hang. A health
    stage's ticking elapsed time prints once, when the stage starts."""

    def __init__(self, enabled: bool):
        self.enabled, self.last, self.started = enabled, {}, time.monotonic()
        self.lock = threading.Lock()

    def __call__(self, host: str, text: str) -> None:
        if not self.enabled:
            return
        key = " ".join(text.split(" ", 2)[:2]) if text.startswith("health:") else text.split(" ", 1)[0]
        with self.lock:
            if self.last.get(host) == key:
                return
            self.last[host] = key
            output.stderr.print(f"{time.monotonic() - self.started:7.1f}s " + output.escape(f"{host}: {text}"),
                                highlight=False)


def _run(inv: Any, pattern: str, task: Callable[[Any, Callable[[str], None]], Any], label: str, forks: int,
         policy: Optional[str], quiet: bool) -> GroupResult:
    """common.run_group with a per-host `note(text)` for live step progress (StepLines off a terminal)."""
    lines = StepLines(enabled=not quiet and not output.stderr.is_terminal)

    def noted(conn: Any, note: Callable[[str], None]) -> Any:
        def both(text: str) -> None:
            lines(conn.host.name, text)
            note(text)

        return task(conn, both)

    return run_group(inv, pattern, noted, label, forks, policy, quiet, notes=True)


def _run_units(inv: Any, found: list[Unit], task: Callable[..., Any], label: str, forks: int,
               policy: Optional[str], quiet: bool) -> GroupResult:
    """common.run_units with `task(unit, conns, note, rank_note)`: the unit's live progress, and
    one StepLines line per rank (`host/rank`) off a terminal."""
    lines = StepLines(enabled=not quiet and not output.stderr.is_terminal)
    by_leader = {u.leader.name: u for u in found}

    def noted(conns: list[Any], note: Callable[[str], None]) -> Any:
        unit = by_leader[conns[0].host.name]

        def rank_note(label: str, text: str) -> None:
            lines(label, text)
            note(f"{label}: {text}")

        def unit_note(text: str) -> None:
            lines(unit.name, text)
            note(text)

        return task(unit, conns, unit_note, rank_note)

    return run_units(inv, {u.name: u.hosts for u in found}, noted, label, forks, policy, quiet)


def deploy(ctx: typer.Context, pattern: str = PatternArg, profile: str = ProfileArg,
           inventory_path: Optional[str] = InventoryOpt, forks: int = ForksOpt, as_json: bool = JsonOpt,
           dry_run: bool = typer.Option(False, "--dry-run", help="Print the plan: files, flags, whether a restart "
                                        "would happen and why. Changes nothing."),
           no_revert: bool = typer.Option(False, "--no-revert", help="On failure keep the failed state (server, "
                                          "release) for debugging instead of restoring the previous deployment."),
           force: bool = typer.Option(False, "--force", help="Replace drifted package files (as push --force)."),
           stop_grace: float = rolling.GraceOpt,
           load_timeout: Optional[float] = typer.Option(None, "--load-timeout", callback=number(**POSITIVE_SECONDS),
                                                        help="Seconds for the model load (until the port opens; "
                                                        f"default {DEFAULT_TIMEOUTS['port']:.0f})."),
           health_timeout: Optional[float] = rolling.HealthTimeoutOpt,
           manager: Optional[str] = typer.Option(None, "--manager", help="systemd | supervisor (default: systemd "
                                                 "where it is PID 1; inventory var sglfleet_server_manager)."),
           runs: str = typer.Option("runs", "--runs-dir", callback=output_dir(),
                                    help="Where results and failure logs are stored."),
           rolling_opt: bool = typer.Option(False, "--rolling", help="One batch at a time behind the routers "
                                            "(sglfleet_router_url): out, drained, deployed, healthy, back in."),
           min_ready: Optional[float] = typer.Option(
               None, "--min-ready", callback=number(**SECONDS_OR_MORE),
               help=f"Seconds the new server must stay healthy after its staged health passed (default "
               f"{stage.DEFAULT_MIN_READY_S:g}; with --rolling {rolling.DEFAULT_MIN_READY_S:g}, before it goes back "
               "in routing); a server that dies or turns unhealthy meanwhile is a failed deploy, reverted."),
           batch: str = rolling.BatchOpt, max_unavailable: Optional[str] = rolling.MaxUnavailableOpt,
           max_fail_percentage: float = rolling.MaxFailOpt, drain_timeout: float = rolling.DrainOpt,
           router_timeout: float = rolling.RouterTimeoutOpt, resume: bool = rolling.ContinueOpt,
           no_router: bool = rolling.NoRouterOpt, allow_full_outage: bool = rolling.FullOutageOpt,
           canary: Optional[str] = rolling.CanaryOpt, analysis_window: Optional[float] = rolling.AnalysisWindowOpt,
           analysis_mode: str = rolling.AnalysisOpt,
           host_key_policy_opt: Optional[str] = PolicyOpt) -> None:
    """Push, smoke-test, launch and health-check PROFILE's server on each host; safe to rerun."""
    if manager not in (None, "systemd", "supervisor"):
        raise ConfigError(f"--manager must be systemd or supervisor, got '{manager}'")
    if not rolling_opt:
        refuse_without(ctx, rolling.ROLLING_ONLY, "--rolling")
    elif dry_run:
        raise ConfigError("--dry-run shows the plan without --rolling; drop --rolling to see it")
    elif not canary:
        refuse_without(ctx, ("analysis_window", "analysis_mode"), "--canary")
    inv, prof = inventory(inventory_path), load_profile(profile)
    artifacts = prof.artifacts()
    options = stage.DeployOptions(command=command_line(), dry_run=dry_run, revert=not no_revert, force=force,
                                  stop_grace=stop_grace, timeouts=health_timeouts(load_timeout, health_timeout),
                                  manager=manager,
                                  min_ready=stage.DEFAULT_MIN_READY_S if min_ready is None else min_ready)
    if rolling_opt:
        rolling.run_rollout("deploy", inv, pattern, profile, rolling.rollout_options(
            "deploy", batch, max_unavailable, max_fail_percentage, drain_timeout,
            rolling.DEFAULT_MIN_READY_S if min_ready is None else min_ready, stop_grace, router_timeout, resume,
            load_timeout, health_timeout, runs, deploy_options=options, no_router=no_router,
            allow_full_outage=allow_full_outage, canary=canary, analysis_window=analysis_window,
            analysis_mode=analysis_mode), as_json, host_key_policy_opt)
    directory = None if dry_run else run_dir(runs, "deploy")
    found = units(inv, inv.select(pattern), prof)

    def task(conn, note):
        doc = stage.HostDeploy(conn, prof, artifacts, inv.path, options, note).run()
        if directory is not None:
            stage.store(directory, conn.host.name, doc)
        return TaskOutcome(doc["ok"], doc, None if doc["ok"] else doc.get("summary"))

    def unit_task(unit, conns, note, rank_note):
        if not unit.is_group:
            return task(conns[0], note)
        doc = groups.GroupDeploy(unit, conns, prof, artifacts, inv.path, options, note, rank_note).run()
        if directory is not None:
            for name, rank_doc in doc["ranks"].items():
                stage.store(directory, name, rank_doc)
            stage.store(directory, unit.name, {k: v for k, v in doc.items() if k != "ranks"})
        return TaskOutcome(doc["ok"], doc, None if doc["ok"] else doc.get("summary"))

    if any(u.is_group for u in found):  # a multi-node server: its ranks as one unit
        results = _run_units(inv, found, unit_task, "deploy", forks, host_key_policy_opt, quiet=as_json)
    else:
        results = _run(inv, pattern, task, "deploy", forks, host_key_policy_opt, quiet=as_json)
    docs = {}
    for name, r in results.items():
        docs[name] = r.value if r.value is not None else {"ok": False, "action": "failed", "summary": r.error}
        if directory is not None and r.value is None:
            stage.store(directory, name, docs[name])
    code = _exit_code(results, docs)
    if as_json:
        output.print_json({"command": "deploy", "pattern": pattern, "profile": profile, "dry_run": dry_run,
                           "run_dir": str(directory) if directory else None, "hosts": docs,
                           "summary": {"ok": sum(d["ok"] for d in docs.values()),
                                       "failed": sum(not d["ok"] for d in docs.values())}, "exit_code": code})
        raise typer.Exit(code)
    _deploy_report(profile, docs, directory, dry_run)
    raise typer.Exit(code)


def _exit_code(results: GroupResult, docs: dict[str, dict[str, Any]]) -> int:
    if results.interrupted:
        return 130
    if any(not d["ok"] for d in docs.values()):
        # Bad input everywhere (a render error on every host) is a usage error, not a host failure.
        return 2 if all(d.get("exit_code") == 2 for d in docs.values() if not d["ok"]) and \
            all(not d["ok"] for d in docs.values()) else 1
    return 0


def _deploy_report(profile: str, docs: dict[str, dict[str, Any]], directory: Optional[Path], dry_run: bool) -> None:
    table = output.Table(title=f"deploy {profile}" + (f" -> {directory}" if directory else " (dry run)"))
    for col in ("host", "result", "release", "pid", "why", "health", "round trips", "seconds"):
        table.add_column(col)
    shown: dict[str, dict[str, Any]] = {}  # what gets its details below: hosts, and each group's ranks
    for name, d in docs.items():
        rows = [(name, d)] + [(f"  {host}/{rank}", r) for rank, (host, r) in enumerate((d.get("ranks") or {}).items())]
        for label, row in rows:
            style = "green" if row["ok"] else "red"
            health = row.get("health") or {}
            rt = row.get("round_trips") or {}
            trips = ("+".join(str(v) for v in rt.values()) + " (per rank)") if "ranks" in row else \
                f"{rt.get('exec', '-')}" + (f" (+{rt['health_polls']} polls)" if rt.get("health_polls") else "")
            table.add_row(output.escape(label), f"[{style}]{row.get('action') or 'failed'}[/]",
                          output.escape(str(row.get("release") or (row.get("running_before") or {}).get("release")
                                            or "-")),
                          str(row.get("pid") or "-"), output.escape("; ".join(row.get("restart_reasons") or []) or "-"),
                          f"{sum(health.values()):.1f}s" if health else "-", trips, f"{row.get('seconds', 0):.1f}")
        shown[name] = d
        if d.get("ranks") and (dry_run or not d["ok"]):
            shown.update({f"{name} {host}": r for host, r in d["ranks"].items() if dry_run or not r.get("ok")})
    output.stdout.print(table)
    for name, d in shown.items():
        if dry_run:
            output.stdout.rule(f"{output.escape(name)}: {output.escape(d.get('summary') or '')}")
            output.stdout.print(output.escape(" ".join(d.get("command") or [])), highlight=False, soft_wrap=True)
            for what, text in (d.get("files") or {}).items():
                output.stdout.print(f"[bold]--- {output.escape(what)}[/]")
                output.write_host_text(text)
            sys.stdout.flush()
            continue
        if d["ok"]:
            output.stdout.print(f"[green]{output.escape(name)}[/]: {output.escape(d.get('summary') or '')}",
                                highlight=False)
            continue
        output.stdout.rule(f"[red]{output.escape(name)}[/]: {output.escape((d.get('summary') or '').splitlines()[0] if d.get('summary') else 'failed')}")
        output.stdout.print(output.escape(d.get("summary") or ""), highlight=False)
        for key, title in (("traceback", "smoke traceback"), ("server_log", "server log since its start")):
            if d.get(key):  # whole, never cut
                output.stdout.print(f"[bold]{title}:[/]")
                output.write_host_text(d[key] if d[key].endswith("\n") else d[key] + "\n")
                sys.stdout.flush()
        for fix in d.get("diagnosis") or []:
            output.stdout.print(f"[yellow]fix:[/] {output.escape(fix)}", highlight=False)
    ok = sum(d["ok"] for d in docs.values())
    output.stdout.print(f"{ok} ok, {len(docs) - ok} failed" + (f"; results in {directory}" if directory else ""),
                        highlight=False)


def _uptime(seconds: Optional[float]) -> str:
    if seconds is None:
        return "-"
    seconds = int(seconds)
    return f"{seconds // 3600}h{seconds % 3600 // 60:02d}m" if seconds >= 3600 else f"{seconds // 60}m{seconds % 60:02d}s"


def status(pattern: str = PatternArg,
           profile: Optional[str] = typer.Argument(None, help="Profile: compare what runs with what it renders to."),
           inventory_path: Optional[str] = InventoryOpt, forks: int = ForksOpt, as_json: bool = JsonOpt,
           host_key_policy_opt: Optional[str] = PolicyOpt) -> None:
    """One row per host and server, and per multi-node server (its ranks below it): desired vs
    running (release, argv hash, pid, uptime, health, accept len)."""
    inv = inventory(inventory_path)
    prof = load_profile(profile) if profile else None
    placed = placements(inv, inv.select(pattern), prof) if prof else {}

    def task(conn, note):
        value = stage.status_host(conn, prof, inv.path, placed.get(conn.host.name))
        ok = all(not row["drift"] for row in value["profiles"])
        return TaskOutcome(ok, value, None if ok else "; ".join(d for row in value["profiles"] for d in row["drift"]))

    results = _run(inv, pattern, task, "status", forks, host_key_policy_opt, quiet=as_json)
    server_groups = groups.group_status({name: r.value for name, r in results.items() if r.value is not None})
    code = 1 if results.exit_code == 0 and any(g["state"] == "down" for g in server_groups) else results.exit_code
    if as_json:
        doc = output.group_json("status", results, pattern=pattern, profile=profile, server_groups=server_groups)
        output.print_json(dict(doc, exit_code=code))
        raise typer.Exit(code)
    table = output.Table(title="status" + (f" {profile}" if profile else ""))
    for col in ("host", "profile", "state", "release", "argv hash", "pid", "uptime", "health", "accept len", "drift"):
        table.add_column(col)
    rank_rows: dict[tuple[str, str], dict[str, Any]] = {}  # (host, profile) -> its row, shown under its group
    for name, r in results.items():
        if r.value is None:
            table.add_row(output.escape(name), "-", "[red]unreachable[/]", *["-"] * 6,
                          output.escape((r.error or "").splitlines()[0] if r.error else ""))
            continue
        if not r.value["profiles"]:
            table.add_row(output.escape(name), "-", "nothing deployed", *["-"] * 7)
        for row in r.value["profiles"]:
            if row.get("placement"):
                rank_rows[(name, row["profile"])] = row
                continue
            table.add_row(*_status_cells(name, row))
    for group in server_groups:
        style = {"running": "green", "down": "red"}.get(group["state"], "")
        table.add_row(output.escape(f"{group['server_group']} ({len(group['hosts'])} nodes)"),
                      output.escape(group["profile"]), f"[{style}]{group['state']}[/]" if style else group["state"],
                      output.escape(str(group.get("release") or "-")), *["-"] * 5,
                      "[yellow]" + output.escape("; ".join(group["why"])) + "[/]" if group["why"] else "-")
        for host in group["hosts"]:
            row = rank_rows.get((host, group["profile"]))
            if row is not None:
                table.add_row(*_status_cells(f"  {host}/{row['placement']['rank']}", row))
    output.stdout.print(table)
    raise typer.Exit(code)


def _status_cells(label: str, row: dict[str, Any]) -> list[str]:
    state = "[green]running[/]" if row.get("alive") else ("stopped" if row.get("stopped") else "[red]down[/]")
    if row.get("mode") == "systemd":  # a unit (journald), not the detached supervisor
        state += " (unit)"
    desired = row.get("desired") or {}
    argv = row.get("argv_hash") or "-"
    if desired.get("argv_hash") and desired["argv_hash"] != row.get("argv_hash"):
        argv += f" (profile: {desired['argv_hash']})"
    return [output.escape(label), output.escape(row["profile"]), state, output.escape(str(row.get("release") or "-")),
            output.escape(argv), str(row.get("pid") or "-"), _uptime(row.get("uptime_s")), str(row.get("health") or "-"),
            f"{row['accept_length']:.2f}" if row.get("accept_length") is not None else "-",
            "[yellow]" + output.escape("; ".join(row["drift"])) + "[/]" if row["drift"] else "-"]


def stop(pattern: str = PatternArg,
         profile: Optional[str] = typer.Argument(None, help="Only this profile's server (default: every managed one)."),
         inventory_path: Optional[str] = InventoryOpt, forks: int = ForksOpt, as_json: bool = JsonOpt,
         grace: float = typer.Option(120.0, "--grace", callback=number(**SECONDS_OR_MORE),
                                     help="Seconds the server may drain before SIGKILL."),
         host_key_policy_opt: Optional[str] = PolicyOpt) -> None:
    """Stop the managed servers: SIGTERM, wait for SGLang's drain, SIGKILL after --grace."""
    inv, command = inventory(inventory_path), command_line()
    name = load_profile(profile).name if profile and profile.endswith((".yaml", ".yml")) else profile

    def task(conn, note):
        note("stopping")
        try:
            return dict(stage.stop_host(conn, name, grace, command), host=conn.host.name)
        except RemoteError as exc:
            return TaskOutcome(False, {"error": str(exc), **exc.detail}, str(exc))

    def unit_task(unit, conns, note, rank_note):
        if not unit.is_group:
            return task(conns[0], note)
        note(f"stopping rank 0 ({unit.leader.name}) first, then the others")
        try:
            return dict(groups.stop_group(conns, name, grace, command), host=unit.name)
        except RemoteError as exc:
            return TaskOutcome(False, {"error": str(exc), **exc.detail}, str(exc))

    started = time.monotonic()
    found = units(inv, inv.select(pattern), None)  # a multi-node server stops whole, rank 0 first
    if any(u.is_group for u in found):
        results = _run_units(inv, found, unit_task, "stop", forks, host_key_policy_opt, quiet=as_json)
    else:
        results = _run(inv, pattern, task, "stop", forks, host_key_policy_opt, quiet=as_json)
    if as_json:
        output.print_json(output.group_json("stop", results, pattern=pattern, profile=profile))
        raise typer.Exit(results.exit_code)

    def row(v: dict[str, Any]) -> list[str]:
        if v.get("ranks"):
            return ["; ".join(f"{host}/{rank}: {row(dict(r or {}, host=host))[0]}"
                              for rank, (host, r) in enumerate(v["ranks"].items()))]
        if v.get("unknown_profile"):
            runs = ", ".join(f"{p}{'' if alive else ' (stopped)'}" for p, alive in (v.get("here") or {}).items())
            return [f"no server of profile {v['unknown_profile']} on {v.get('host')} (this host runs: "
                    f"{runs or 'no sglfleet server'})"]
        cells = []
        for prof_name, s in (v.get("stopped") or {}).items():
            what = f"pid {s.get('pid')} exit {s.get('exit_code')}" + (" (SIGKILL)" if s.get("killed") else "") \
                if s.get("was_running") else "was not running"
            cells.append(f"{prof_name}: {what}, {s.get('seconds', 0):.1f}s")
        return ["; ".join(cells) or v.get("error") or "nothing managed here"]

    output.summary_table(f"stop ({time.monotonic() - started:.1f}s)", results, ["servers"], row,
                         refusals_have_rows=True)
    raise typer.Exit(results.exit_code)


def build_kernels(pattern: str = PatternArg, inventory_path: Optional[str] = InventoryOpt, forks: int = ForksOpt,
                  as_json: bool = JsonOpt,
                  rebuild: bool = typer.Option(False, "--rebuild", help="Build even what the cache already has."),
                  arch: str = typer.Option("9.0", "--arch", help="CUDA arch for CUDA builds (e.g. 9.0 for H100/H200)."),
                  host_key_policy_opt: Optional[str] = PolicyOpt) -> None:
    """Build the DDTree extension once per distinct ABI fingerprint of the hosts (here when this
    controller's torch matches, else on one host of that fingerprint) into the local cache deploy uses."""
    inv = inventory(inventory_path)
    results = _run(inv, pattern, lambda conn, note: kernels.fingerprint_of(conn), "fingerprint", forks,
                   host_key_policy_opt, quiet=as_json)
    groups = kernels.plan_builds({n: r.value for n, r in results.items() if r.ok})
    failed: dict[str, str] = {n: r.error or "failed" for n, r in results.items() if not r.ok}
    for key, group in groups.items():
        if group["cached"] and not rebuild:
            group["built"] = {"where": "cache", "seconds": 0.0, "dir": str(kernels.cache_dir() / key)}
            continue
        if group["where"] == "controller":
            try:
                group["built"] = kernels.build_here(group["fingerprint"], arch)
            except SglfleetError as exc:
                group["error"] = str(exc)
            continue
        builder = group["where"]
        answer = _run(inv, builder, lambda conn, note: kernels.build_on_host(conn, group["fingerprint"], arch),
                      f"build on {builder}", 1, host_key_policy_opt, quiet=as_json)[builder]
        if answer.ok:
            group["built"] = answer.value
        else:
            group["error"] = answer.error
    code = 1 if failed or any("error" in g for g in groups.values()) else 0
    if as_json:
        output.print_json({"command": "build-kernels", "pattern": pattern, "builds": groups, "unreachable": failed,
                           "cache": str(kernels.cache_dir()), "exit_code": code})
        raise typer.Exit(code)
    table = output.Table(title=f"build-kernels {pattern} -> {kernels.cache_dir()}")
    for col in ("fingerprint", "hosts", "built", "seconds", "result"):
        table.add_column(col)
    for key, group in groups.items():
        built = group.get("built") or {}
        table.add_row(output.escape(key), output.escape(", ".join(group["hosts"])), output.escape(built.get("where", "-")),
                      f"{built.get('seconds', 0):.1f}", "[red]failed[/]" if "error" in group else "[green]ok[/]")
    output.stdout.print(table)
    for key, group in groups.items():
        if "error" in group:
            output.stdout.print(f"[red]{output.escape(key)}[/]:\n{output.escape(group['error'])}", highlight=False)
    for name, error in failed.items():
        output.stdout.print(f"[red]{output.escape(name)}[/]: {output.escape(error)}", highlight=False)
    raise typer.Exit(code)
