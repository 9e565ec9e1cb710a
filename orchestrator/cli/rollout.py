"""`restart --rolling`: the running deployment restarted batch by batch behind the SGLang routers
(stages.rollout does the work). `deploy --rolling` is the same engine on the deploy command."""

from __future__ import annotations

import sys
from pathlib import Path
import threading
import time
from typing import Any, Optional

import typer
from rich.live import Live
from rich.table import Table

from ..errors import ConfigError
from ..fleet.group import Group
from ..spec.profile import load_profile
from ..stages import deploy as deploy_stage
from ..stages import rollout as stage
from . import output
from .option_paths import output_dir
from .option_checks import PERCENTAGE, POSITIVE_SECONDS, SECONDS_OR_MORE, number
from .common import (InventoryOpt, JsonOpt, PatternArg, PolicyOpt, command_line, health_timeouts, host_key_policy,
                     inventory, stop_on_signals)


def register(app: typer.Typer) -> None:
    app.command()(restart)


# The options `deploy --rolling` shares (see rollout_options); every number checked as click parses it.
BatchOpt = typer.Option("1", "--batch", "--serial", help="Hosts per batch, as Ansible's serial: a count, a "
                        "percentage (rounded down, at least 1), or a list (1,25%: one canary host, then a quarter "
                        "at a time).")
MaxUnavailableOpt = typer.Option(None, "--max-unavailable", help="Never more hosts out of routing than this "
                                 "(count or percentage), counting hosts already down. Default: the batch size.")
MaxFailOpt = typer.Option(0.0, "--max-fail-percentage", callback=number(**PERCENTAGE),
                          help="Halt when a batch's failed share EXCEEDS this (Ansible's rule; 0: any failure halts).")
DrainOpt = typer.Option(120.0, "--drain-timeout", callback=number(**SECONDS_OR_MORE),
                        help="Seconds to wait for a host's in-flight requests to reach 0 once it is out of routing.")
DEFAULT_MIN_READY_S = 10.0
MinReadyOpt = typer.Option(DEFAULT_MIN_READY_S, "--min-ready", callback=number(**SECONDS_OR_MORE),
                           help="Seconds a restarted server must stay healthy before it goes back in routing "
                           "(Kubernetes' minReadySeconds).")
GraceOpt = typer.Option(120.0, "--stop-grace", callback=number(**SECONDS_OR_MORE),
                        help="Seconds a stopping server may drain before SIGKILL.")
RouterTimeoutOpt = typer.Option(60.0, "--router-timeout", callback=number(**POSITIVE_SECONDS),
                                help="Seconds for a router to show a removal or a healthy worker.")
ContinueOpt = typer.Option(False, "--continue", help="Resume a halted rollout: hosts it finished are skipped.")
NoRouterOpt = typer.Option(False, "--no-router", help="Roll hosts that no router fronts (no sglfleet_router_url): "
                           "they are restarted in batches without routing; clients will see errors.")
FullOutageOpt = typer.Option(False, "--allow-full-outage", help="Allow a --batch or --max-unavailable that takes "
                             "every serving host of a router out at once (clients get no answer meanwhile).")
LoadTimeoutOpt = typer.Option(None, "--load-timeout", callback=number(**POSITIVE_SECONDS),
                              help="Seconds for the model load (until the port opens).")
HealthTimeoutOpt = typer.Option(None, "--health-timeout", callback=number(**POSITIVE_SECONDS),
                                help="Seconds for each health stage after the port opens.")
# Options that mean something only for a rolling operation (deploy refuses them without --rolling).
ROLLING_ONLY = ("batch", "max_unavailable", "max_fail_percentage", "drain_timeout", "router_timeout", "resume",
                "no_router", "allow_full_outage")
RunsOpt = typer.Option("runs", "--runs-dir", callback=output_dir(),
                       help="Where results and the resumable state are stored.")


def rollout_options(mode: str, batch: str, max_unavailable: Optional[str], max_fail_percentage: float,
                    drain_timeout: float, min_ready: float, stop_grace: float, router_timeout: float,
                    resume: bool, load_timeout: Optional[float], health_timeout: Optional[float],
                    runs: str, deploy_options: Optional[deploy_stage.DeployOptions] = None,
                    no_router: bool = False, allow_full_outage: bool = False) -> stage.RolloutOptions:
    """The rollout's options from the command line (their numbers checked as click parsed them);
    `deploy --rolling` passes its own DeployOptions (--force, --no-revert, --manager) as `deploy_options`."""
    timeouts = health_timeouts(load_timeout, health_timeout)
    if deploy_options is None:
        deploy_options = deploy_stage.DeployOptions(command=command_line(), stop_grace=stop_grace, timeouts=timeouts)
    return stage.RolloutOptions(mode=mode, serial=stage.parse_serial(batch), max_unavailable=max_unavailable,
                                max_fail_percentage=max_fail_percentage, drain_timeout=drain_timeout,
                                min_ready=min_ready, router_timeout=router_timeout, resume=resume,
                                deploy=deploy_options, state_dir=Path(runs), no_router=no_router,
                                allow_full_outage=allow_full_outage)


class RolloutProgress:
    """One live line per batch and per host stage (a live table on a terminal; plain lines,
    one per change of stage, elsewhere), on stderr."""

    TICKING = ("health:", "drain:", "min_ready")

    def __init__(self, enabled: bool):
        self.enabled = enabled
        self.live_mode = enabled and output.stderr.is_terminal
        self.batch = ""
        self.hosts: dict[str, str] = {}
        self.last: dict[str, str] = {}
        self.lock = threading.Lock()
        self.live: Live | None = None
        self.started = time.monotonic()

    def __call__(self, kind: str, host: Optional[str], text: str) -> None:
        if not self.enabled:
            return
        with self.lock:
            stamp = f"{time.monotonic() - self.started:7.1f}s"
            if kind == "batch":
                self.batch = text
                self.hosts = {}
            elif host:
                self.hosts[host] = text
            if self.live is not None:
                self.live.update(self._table())
                if kind in ("batch", "halt", "host-done"):
                    self.live.console.print(f"{stamp} " + output.escape(f"{host + ': ' if host else ''}{text}"),
                                            highlight=False)
                return
            key = text.split(" ", 1)[0] if text.startswith(self.TICKING) else text
            if host and kind == "stage" and self.last.get(host) == key:
                return
            if host:
                self.last[host] = key
            output.stderr.print(f"{stamp} " + output.escape(f"{host + ': ' if host else ''}{text}"), highlight=False)

    def _table(self) -> Table:
        table = Table(title=self.batch, show_header=False, box=None)
        for host, text in self.hosts.items():
            table.add_row(output.escape(host), output.escape(text[:110]))
        return table

    def __enter__(self) -> "RolloutProgress":
        if self.live_mode:
            self.live = Live(self._table(), console=output.stderr, refresh_per_second=4, transient=True)
            self.live.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        if self.live is not None:
            self.live.__exit__(*exc)
            self.live = None


def deployed_profile(inv: Any, pattern: str, policy: Optional[str]) -> str:
    """The one profile the pattern's hosts have deployed (for `restart --rolling PATTERN`)."""
    group = Group.from_inventory(inv, pattern, host_key_policy=host_key_policy(policy))
    with group:
        results = group.run(lambda conn: [row["profile"] for row in deploy_stage.status_host(conn, None, inv.path)
                                          ["profiles"] if not row.get("stopped")], "status")
    names = {name for r in results.values() if r.ok for name in r.value}
    if len(names) != 1:
        raise ConfigError(f"restart --rolling {pattern}: give the PROFILE: the hosts run "
                          f"{', '.join(sorted(names)) or 'no deployed profile'}")
    return names.pop()


def run_rollout(mode: str, inv: Any, pattern: str, profile_name: str, options: stage.RolloutOptions,
                as_json: bool, policy: Optional[str]) -> None:
    """Shared by `restart --rolling` and `deploy --rolling`: run, report, exit 0/1/2."""
    prof = load_profile(profile_name)
    progress = RolloutProgress(enabled=not as_json)
    run = stage.Rollout(inv, pattern, prof, prof.artifacts() if mode == "deploy" else None, options, progress,
                        host_key_policy(policy))
    try:
        with progress, stop_on_signals(run):  # stop_on_signals only needs `.stop`
            doc = run.run()
    except stage.RolloutRefused as exc:
        if as_json:
            output.print_json({"command": f"{mode} --rolling", "pattern": pattern, "profile": prof.name,
                               "refused": str(exc), "preflight": exc.table, "exit_code": 1})
        else:
            _preflight_table(exc.table)
            output.stderr.print(f"[red]refused:[/] {output.escape(str(exc))}", highlight=False)
        raise typer.Exit(1)
    if as_json:
        output.print_json(doc)
        raise typer.Exit(doc["exit_code"])
    report(doc)
    raise typer.Exit(doc["exit_code"])


def _preflight_table(rows: list[dict[str, Any]]) -> None:
    if not rows:
        return
    table = output.Table(title="fleet before the rollout")
    for col in ("host", "state", "worker", "why"):
        table.add_column(col)
    for r in rows:
        table.add_row(output.escape(r["host"]), "[green]serving[/]" if r["up"] else "[red]down[/]",
                      output.escape(r["worker_url"]), output.escape(r["why"] or "-"))
    output.stdout.print(table)


def report(doc: dict[str, Any]) -> None:
    registered = [(r["host"], r["registered"]) for r in doc.get("preflight") or [] if r.get("registered")]
    for host, routers in registered:
        output.stdout.print(f"{output.escape(host)}: was serving but not in {', '.join(routers)}: added",
                            highlight=False)
    table = output.Table(title=f"{doc['command']} {doc['pattern']} {doc['profile']} ({doc['seconds']:.1f}s)")
    for col in ("host", "outcome", "release now", "smoke", "drain", "health", "min_ready", "seconds"):
        table.add_column(col)
    for name, h in doc["hosts"].items():
        times = h.get("times") or {}
        health = h.get("health") or {}
        outcome = h.get("outcome") or "-"
        style = "green" if h.get("ok") and outcome not in ("untouched",) else ("dim" if outcome == "untouched"
                                                                                else "red")
        table.add_row(output.escape(name), f"[{style}]{output.escape(outcome)}[/]",
                      output.escape(str(h.get("release") or "-")), _smoke_cell(h),
                      f"{times['drain_s']:.1f}s" if "drain_s" in times else "-",
                      f"{sum(health.values()):.1f}s" if health else "-",
                      f"{times['min_ready_s']:.1f}s" if "min_ready_s" in times else "-",
                      f"{h['seconds']:.1f}" if h.get("seconds") is not None else "-")
    output.stdout.print(table)
    for name, h in doc["hosts"].items():
        if not h.get("ok") and h.get("summary"):
            summary = h["summary"][len(name) + 2:] if h["summary"].startswith(name + ": ") else h["summary"]
            output.stdout.print(f"[red]{output.escape(name)}[/]: {output.escape(summary)}", highlight=False)
            detail = h.get("detail") or {}
            for part in [detail, *(detail.get("ranks") or {}).values()]:  # a server group: each rank's
                if part.get("server_log"):
                    where = f" ({part.get('host')})" if part is not detail else ""
                    output.stdout.print(f"[bold]server log since its start{output.escape(where)}:[/]")
                    output.write_host_text(part["server_log"] if part["server_log"].endswith("\n")
                                           else part["server_log"] + "\n")
                    sys.stdout.flush()
    mins = doc.get("min_healthy_workers") or {}
    if mins:
        output.stdout.print("fewest healthy workers seen: " + ", ".join(f"{u}: {n}" for u, n in mins.items()),
                            highlight=False)
    if doc.get("halted"):
        output.stdout.print(f"[red]halted[/] after batch {doc['halted']['batch']}: {output.escape(doc['halted']['why'])}"
                            + (f"; untouched: {', '.join(doc['untouched'])}" if doc.get("untouched") else "")
                            + ("; resume with --continue" if doc.get("state_file") else ""), highlight=False)
    else:
        output.stdout.print(f"{len(doc['hosts']) - len(doc['failed'])} ok, {len(doc['failed'])} failed",
                            style="red" if doc["failed"] else "green", highlight=False)


def _smoke_cell(host: dict[str, Any]) -> str:
    """The smoke gate's time, or why a restart skipped it (its record vouched for it)."""
    detail = host.get("detail") or {}
    detail = next(iter((detail.get("ranks") or {}).values()), detail)  # a server group: as its rank 0
    smoke = detail.get("smoke") or {}
    if smoke.get("skipped"):
        return "skipped (passed at deploy)"
    seconds = (detail.get("steps") or {}).get("smoke")
    return f"{seconds:.1f}s" if seconds is not None else "-"


def restart(pattern: str = PatternArg,
            profile: Optional[str] = typer.Argument(None, help="Profile (default: the one the hosts have deployed)."),
            rolling: bool = typer.Option(False, "--rolling", help="One batch at a time behind the routers "
                                         "(sglfleet_router_url) while clients keep getting answers."),
            batch: str = BatchOpt, max_unavailable: Optional[str] = MaxUnavailableOpt,
            max_fail_percentage: float = MaxFailOpt, drain_timeout: float = DrainOpt, min_ready: float = MinReadyOpt,
            stop_grace: float = GraceOpt, router_timeout: float = RouterTimeoutOpt, resume: bool = ContinueOpt,
            no_router: bool = NoRouterOpt, allow_full_outage: bool = FullOutageOpt,
            load_timeout: Optional[float] = LoadTimeoutOpt, health_timeout: Optional[float] = HealthTimeoutOpt,
            runs: str = RunsOpt, inventory_path: Optional[str] = InventoryOpt, as_json: bool = JsonOpt,
            host_key_policy_opt: Optional[str] = PolicyOpt) -> None:
    """Restart the deployment that runs, batch by batch: out of the routers, drained, restarted,
    health-checked, back in; a host that fails is reverted and the rollout halts."""
    if not rolling:
        raise ConfigError("restart needs --rolling (one batch at a time behind the routers); to stop and start "
                          "everything at once use `sglfleet stop` then `sglfleet deploy`")
    inv = inventory(inventory_path)
    options = rollout_options("restart", batch, max_unavailable, max_fail_percentage, drain_timeout, min_ready,
                              stop_grace, router_timeout, resume, load_timeout, health_timeout, runs,
                              no_router=no_router, allow_full_outage=allow_full_outage)
    name = profile or deployed_profile(inv, pattern, host_key_policy_opt)
    run_rollout("restart", inv, pattern, name, options, as_json, host_key_policy_opt)
