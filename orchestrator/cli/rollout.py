"""`restart --rolling`: the running deployment restarted batch by batch behind the SGLang routers
(stages.rollout does the work). `deploy --rolling` is the same engine on the deploy command.
`rollout continue|abort`: the decision for a rollout paused after its canary analysis (sent to the
controller that waits for it, or acted on here from the state file when none does)."""

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
from .option_checks import PERCENTAGE, POSITIVE_SECONDS, SECONDS_OR_MORE, number, refuse_without
from .common import (InventoryOpt, JsonOpt, PatternArg, PolicyOpt, command_line, health_timeouts, host_key_policy,
                     inventory, stop_on_signals)


def register(app: typer.Typer) -> None:
    app.command()(restart)
    group = typer.Typer(no_args_is_help=True, help="Decide for a rollout paused after its canary analysis.")
    group.command("continue")(continue_command)
    group.command("abort")(abort_command)
    group.command("list")(list_command)
    app.add_typer(group, name="rollout")


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
CanaryOpt = typer.Option(None, "--canary", help="Canary analysis: the first batch is this many hosts (a count "
                         "or a percentage), then --batch as given; once it is back in routing, its accept length, "
                         "throughput and error rate are compared with the other hosts' (the baseline) over "
                         "--analysis-window, with the thresholds of the profile's analysis: section. A failing "
                         "canary is reverted and the rollout stops.")
AnalysisWindowOpt = typer.Option(None, "--analysis-window", callback=number(**POSITIVE_SECONDS),
                                 help="Seconds the canary and the baseline are observed (default: the profile's "
                                 "analysis.window, 60).")
AnalysisOpt = typer.Option("auto", "--analysis", help="auto: the verdict decides (pass goes on, fail reverts the "
                           "canary, inconclusive does what analysis.inconclusive says); pause: stop after the verdict "
                           "and wait for `sglfleet rollout continue` or `sglfleet rollout abort`.")
# Options that mean something only for a rolling operation (deploy refuses them without --rolling).
ROLLING_ONLY = ("batch", "max_unavailable", "max_fail_percentage", "drain_timeout", "router_timeout", "resume",
                "no_router", "allow_full_outage", "canary", "analysis_window", "analysis_mode")
RunsOpt = typer.Option("runs", "--runs-dir", callback=output_dir(),
                       help="Where results and the resumable state are stored.")


def rollout_options(mode: str, batch: str, max_unavailable: Optional[str], max_fail_percentage: float,
                    drain_timeout: float, min_ready: float, stop_grace: float, router_timeout: float,
                    resume: bool, load_timeout: Optional[float], health_timeout: Optional[float],
                    runs: str, deploy_options: Optional[deploy_stage.DeployOptions] = None,
                    no_router: bool = False, allow_full_outage: bool = False, canary: Optional[str] = None,
                    analysis_window: Optional[float] = None, analysis_mode: str = "auto") -> stage.RolloutOptions:
    """The rollout's options from the command line (their numbers checked as click parsed them);
    `deploy --rolling` passes its own DeployOptions (--force, --no-revert, --manager) as `deploy_options`."""
    timeouts = health_timeouts(load_timeout, health_timeout)
    if deploy_options is None:
        deploy_options = deploy_stage.DeployOptions(command=command_line(), stop_grace=stop_grace, timeouts=timeouts)
    return stage.RolloutOptions(mode=mode, serial=stage.parse_serial(batch), max_unavailable=max_unavailable,
                                max_fail_percentage=max_fail_percentage, drain_timeout=drain_timeout,
                                min_ready=min_ready, router_timeout=router_timeout, resume=resume,
                                deploy=deploy_options, state_dir=Path(runs), no_router=no_router,
                                allow_full_outage=allow_full_outage, canary=canary, analysis_window=analysis_window,
                                analysis_mode=analysis_mode)


class RolloutProgress:
    """One live line per batch and per host stage (a live table on a terminal; plain lines,
    one per change of stage, elsewhere), on stderr."""

    TICKING = ("health:", "drain:", "min_ready", "canary analysis ")
    SAID = ("batch", "halt", "host-done", "analysis", "pause")  # printed above the live table too

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
                if kind in self.SAID:
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
    finish(run, progress, mode, as_json)


def finish(run: stage.Rollout, progress: RolloutProgress, mode: str, as_json: bool) -> None:
    """Run the rollout with progress and Ctrl-C handling, report it, exit with its code."""
    prof, pattern = run.profile, run.pattern
    if not as_json:  # the verdict's table as soon as it is known (a paused rollout waits after it)
        run.on_verdict = lambda analysis: output.stderr.print(analysis_table(analysis))
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


def _figure(metric: str, value: Optional[float]) -> str:
    if value is None:
        return "-"
    if metric == "error rate":
        return f"{100 * value:.2f}%"
    return f"{value:.1f}" if metric.startswith("throughput") else f"{value:.2f}"


def analysis_table(analysis: dict[str, Any]) -> Table:
    """metric, canary, baseline, ratio, threshold, result (and samples, why) of a canary analysis."""
    colour = {"pass": "green", "fail": "red", "inconclusive": "yellow"}
    verdict = analysis["verdict"]
    table = output.Table(title=f"canary analysis: [{colour.get(verdict, 'white')}]{verdict}[/] "
                         f"({', '.join(analysis['canary'])} vs {', '.join(analysis['baseline'])}, "
                         f"{analysis['observed_s']:.0f}s window)")
    for col in ("metric", "canary", "baseline", "ratio", "threshold", "result", "samples (c/b)", "why"):
        table.add_column(col)
    for r in analysis["rows"]:
        result = r["result"]
        table.add_row(output.escape(r["metric"]), _figure(r["metric"], r["canary"]), _figure(r["metric"], r["baseline"]),
                      f"{r['ratio']:.2f}x" if r.get("ratio") is not None else "-", output.escape(r["threshold"] or "-"),
                      f"[{colour.get(result, 'dim')}]{result}[/]",
                      f"{r['samples']['canary']}/{r['samples']['baseline']}", output.escape(r.get("why") or ""))
    return table


def report_analysis(analysis: dict[str, Any]) -> None:
    output.stdout.print(analysis_table(analysis))
    off = sorted(h for h, src in (analysis.get("source") or {}).items() if src != "/metrics")
    if off:
        output.stdout.print(f"/metrics off on {output.escape(', '.join(off))}: judged from their decode log lines "
                            "(no error rate from those)", highlight=False)
    for host, error in (analysis.get("read_errors") or {}).items():
        output.stdout.print(f"[yellow]{output.escape(host)}[/]: {output.escape(error)}", highlight=False)
    charts = ", ".join((analysis.get("charts") or {}).values()) or f"none ({analysis.get('chart_error')})"
    output.stdout.print(f"analysis: {output.escape(analysis['run_dir'])}/analysis.json; charts: {output.escape(charts)}",
                        highlight=False)


def report(doc: dict[str, Any]) -> None:
    if doc.get("analysis"):
        report_analysis(doc["analysis"])
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
    if (doc.get("halted") or {}).get("paused"):
        output.stdout.print(f"[yellow]paused[/] after the canary analysis, then interrupted; decide with `sglfleet "
                            f"rollout continue` or `sglfleet rollout abort` (state {output.escape(doc['state_file'])})"
                            + (f"; untouched: {', '.join(doc['untouched'])}" if doc.get("untouched") else ""),
                            highlight=False)
    elif doc.get("halted"):
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


def restart(ctx: typer.Context, pattern: str = PatternArg,
            profile: Optional[str] = typer.Argument(None, help="Profile (default: the one the hosts have deployed)."),
            rolling: bool = typer.Option(False, "--rolling", help="One batch at a time behind the routers "
                                         "(sglfleet_router_url) while clients keep getting answers."),
            batch: str = BatchOpt, max_unavailable: Optional[str] = MaxUnavailableOpt,
            max_fail_percentage: float = MaxFailOpt, drain_timeout: float = DrainOpt, min_ready: float = MinReadyOpt,
            stop_grace: float = GraceOpt, router_timeout: float = RouterTimeoutOpt, resume: bool = ContinueOpt,
            no_router: bool = NoRouterOpt, allow_full_outage: bool = FullOutageOpt,
            canary: Optional[str] = CanaryOpt, analysis_window: Optional[float] = AnalysisWindowOpt,
            analysis_mode: str = AnalysisOpt,
            load_timeout: Optional[float] = LoadTimeoutOpt, health_timeout: Optional[float] = HealthTimeoutOpt,
            runs: str = RunsOpt, inventory_path: Optional[str] = InventoryOpt, as_json: bool = JsonOpt,
            host_key_policy_opt: Optional[str] = PolicyOpt) -> None:
    """Restart the deployment that runs, batch by batch: out of the routers, drained, restarted,
    health-checked, back in; a host that fails is reverted and the rollout halts."""
    if not rolling:
        raise ConfigError("restart needs --rolling (one batch at a time behind the routers); to stop and start "
                          "everything at once use `sglfleet stop` then `sglfleet deploy`")
    if not canary:
        refuse_without(ctx, ("analysis_window", "analysis_mode"), "--canary")
    inv = inventory(inventory_path)
    options = rollout_options("restart", batch, max_unavailable, max_fail_percentage, drain_timeout, min_ready,
                              stop_grace, router_timeout, resume, load_timeout, health_timeout, runs,
                              no_router=no_router, allow_full_outage=allow_full_outage, canary=canary,
                              analysis_window=analysis_window, analysis_mode=analysis_mode)
    name = profile or deployed_profile(inv, pattern, host_key_policy_opt)
    run_rollout("restart", inv, pattern, name, options, as_json, host_key_policy_opt)


# ---------------------------------------------------------------- rollout continue | abort | list

StateArg = typer.Argument(None, help="The rollout: its state file, or that file's name under RUNS/rollouts/ "
                          "(default: the only paused one there; `sglfleet rollout list` shows them).")
DECISION_WAIT_S = 30.0


def _chosen(state: Optional[str], runs: str, paused_only: bool) -> tuple[Path, dict[str, Any]]:
    """The state file named, or the one paused rollout under RUNS (else the one halted one)."""
    if state:
        path = Path(state)
        if not _is_file(path):
            path = Path(runs) / "rollouts" / (state if state.endswith(".json") else state + ".json")
        saved = dict(stage.saved_rollouts(path.parent.parent)).get(path) if _is_file(path) else None
        if saved is None:
            raise ConfigError(f"no rollout state {state!r} (looked for {state} and {path}); `sglfleet rollout list "
                              f"--runs-dir {runs}` shows them")
        return path, saved
    every = stage.saved_rollouts(Path(runs))
    found = [(p, d) for p, d in every if d.get("paused")] or ([] if paused_only else every)
    if len(found) != 1:
        what = "paused rollout" if paused_only or any(d.get("paused") for _, d in every) else "rollout to continue"
        raise ConfigError(f"{'no' if not found else len(found)} {what}{'s' if found else ''} under {runs}/rollouts"
                          + (f": name one ({', '.join(p.stem for p, _ in found)})" if found else "")
                          + "; `sglfleet rollout list` shows them")
    return found[0]


def _is_file(path: Path) -> bool:
    try:  # a name too long for the file system, or one with a NUL, is no file
        return path.is_file()
    except (OSError, ValueError):
        return False


def _rebuilt(path: Path, doc: dict[str, Any], progress: Any, policy: Optional[str]) -> stage.Rollout:
    """The rollout a state file describes, resumable (its inventory, profile and options)."""
    missing = [k for k in ("inventory", "profile_path", "options", "pattern", "mode") if not doc.get(k)]
    if missing or not isinstance(doc.get("options"), dict):
        raise ConfigError(f"{path} does not say {', '.join(missing) or 'its options'} (written by an older sglfleet, "
                          "or edited): resume it with the command that started it and --continue")
    inv = inventory(doc["inventory"])
    prof = load_profile(doc["profile_path"])
    options = stage.options_from(doc["options"], path.parent.parent, command_line())
    run = stage.Rollout(inv, doc["pattern"], prof, prof.artifacts() if doc["mode"] == "deploy" else None, options,
                        progress, host_key_policy(policy))
    run.state_file = path
    return run


def _tell_controller(path: Path, action: str, as_json: bool) -> None:
    """Hand the decision to the controller that waits (it holds the lock) and exit 0 once it took it."""
    holder = stage.ControllerLock(path).holder()
    stage.send_decision(path, action, command_line())
    deadline = time.monotonic() + DECISION_WAIT_S
    while stage.decision_path(path).exists():
        if time.monotonic() > deadline:
            raise ConfigError(f"the controller ({holder}) did not take the decision within {DECISION_WAIT_S:.0f} s; "
                              f"it is in {stage.decision_path(path)} for it")
        time.sleep(0.1)
    what = "goes on with the other hosts" if action == "continue" else "reverts the canary and stops"
    if as_json:
        output.print_json({"command": f"rollout {action}", "state_file": str(path), "sent_to": holder,
                           "exit_code": 0})
    else:
        output.stdout.print(f"{action}: the controller ({output.escape(holder)}) took it and {what}", highlight=False)
    raise typer.Exit(0)


def continue_command(state: Optional[str] = StateArg, runs: str = RunsOpt, as_json: bool = JsonOpt,
                     host_key_policy_opt: Optional[str] = PolicyOpt) -> None:
    """Go on with a rollout paused after its canary analysis (or halted): the controller waiting
    for it goes on; when none waits (it exited), the rest is rolled out here, from the state file."""
    path, doc = _chosen(state, runs, paused_only=False)
    lock = stage.ControllerLock(path)
    if not lock.acquire():
        if not doc.get("paused"):
            raise ConfigError(f"a controller ({lock.holder()}) is running {path.stem} and it is not paused: "
                              "nothing to decide")
        _tell_controller(path, "continue", as_json)
    lock.release()
    progress = RolloutProgress(enabled=not as_json)
    finish(_rebuilt(path, doc, progress, host_key_policy_opt), progress, doc["mode"], as_json)


def abort_command(state: Optional[str] = StateArg, runs: str = RunsOpt, as_json: bool = JsonOpt,
                  host_key_policy_opt: Optional[str] = PolicyOpt) -> None:
    """Revert the canary of a rollout paused after its canary analysis (the controller waiting for
    it does; when none waits, it is done here from the state file); the other hosts stay untouched."""
    path, doc = _chosen(state, runs, paused_only=True)
    if not doc.get("paused"):
        raise ConfigError(f"{path.stem} is not paused after a canary analysis: nothing to abort (a halted "
                          "rollout leaves its hosts as they are; `rollout continue` or --continue resumes it)")
    lock = stage.ControllerLock(path)
    if not lock.acquire():
        _tell_controller(path, "abort", as_json)
    lock.release()
    progress = RolloutProgress(enabled=not as_json)
    run = _rebuilt(path, doc, progress, host_key_policy_opt)
    with progress, stop_on_signals(run):
        result = run.abort()
    if as_json:
        output.print_json(result)
        raise typer.Exit(result["exit_code"])
    table = output.Table(title=f"rollout abort: {path.stem}")
    for col in ("host", "outcome", "release now", "summary"):
        table.add_column(col)
    for name, h in result["hosts"].items():
        table.add_row(output.escape(name), output.escape(h["outcome"] or "-"), output.escape(str(h["release"] or "-")),
                      output.escape((h["summary"] or "").splitlines()[0] if h["summary"] else ""))
    output.stdout.print(table)
    output.stdout.print(f"{output.escape(result['why'])}; the other hosts were not touched", highlight=False)
    raise typer.Exit(result["exit_code"])


def list_command(runs: str = RunsOpt, as_json: bool = JsonOpt) -> None:
    """The rollouts under RUNS/rollouts that can be continued or aborted: paused, halted, or running."""
    rows = []
    for path, doc in stage.saved_rollouts(Path(runs)):
        lock = stage.ControllerLock(path)
        running = not lock.acquire()
        lock.release()
        paused = doc.get("paused") or {}
        if paused:
            status = f"paused after the canary analysis ({paused.get('verdict')})"
        elif doc.get("halted"):
            status = f"halted: {(doc['halted'] or {}).get('why')}"
        else:
            status = "running" if running else "interrupted"
        rows.append({"state": path.stem, "file": str(path), "mode": doc.get("mode"), "profile": doc.get("profile"),
                     "pattern": doc.get("pattern"), "done": doc.get("done") or [], "status": status,
                     "controller": lock.holder() if running else None, "analysis": paused.get("run_dir")})
    if as_json:
        output.print_json({"command": "rollout list", "runs_dir": runs, "rollouts": rows, "exit_code": 0})
        raise typer.Exit(0)
    if not rows:
        output.stdout.print(f"no rollout to continue or abort under {output.escape(runs)}/rollouts", highlight=False)
        raise typer.Exit(0)
    table = output.Table(title=f"rollouts under {runs}/rollouts")
    for col in ("state", "mode", "profile", "pattern", "done", "status", "controller"):
        table.add_column(col)
    for r in rows:
        table.add_row(*(output.escape(str(v)) for v in (r["state"], r["mode"], r["profile"], r["pattern"],
                                                        ", ".join(r["done"]) or "-", r["status"],
                                                        r["controller"] or "-")))
    output.stdout.print(table)
    raise typer.Exit(0)
