"""`logs`, `metrics`: the servers' logs (read, follow, bundle) and DDTree accept-length figures.

Exit codes: 0 every host answered, 1 some host failed (the others are still shown), 2 bad input.
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time
from typing import Any, Optional

import typer

from ..errors import ConfigError
from ..fleet.group import DEFAULT_FORKS, Group
from ..stages import logs as stage
from ..stages import metrics as metrics_stage
from ..stages.runs import run_dir
from . import output
from .option_paths import output_dir, output_file
from ..stages.units import rank_labels, serving_hosts
from .common import InventoryOpt, JsonOpt, PatternArg, PolicyOpt, host_key_policy, inventory, run_group

ProfileOpt = typer.Argument(None, help="Profile name (or .yaml); default: the only server on each host.")
SinceOpt = typer.Option(None, "--since", help="From this time: 10m, 2h, 1d ago, an ISO time, or `last` "
                        "(only what is new since the previous `logs` run read each host to its end).")
UntilOpt = typer.Option(None, "--until", help="Up to this time (same forms as --since, not `last`).")
# -f is --follow here (as in docker compose logs and journalctl), so --forks has no short form.
ForksOpt = typer.Option(DEFAULT_FORKS, "--forks", help="How many hosts to work on at once.")
RunsOpt = typer.Option("runs", "--runs-dir", callback=output_dir(), help="Where bundles, results and kept "
                       "cursors live.")
# docker compose's palette order: one color per host, in pattern order.
COLORS = ["36", "33", "32", "35", "34", "91", "96", "93", "92", "95", "94", "31"]


def register(app: typer.Typer) -> None:
    app.command("logs")(logs_command)
    app.command("metrics")(metrics_command)


def _query(profile: Optional[str], since: Optional[str], until: Optional[str], tail: Optional[int],
           grep: Optional[str]) -> tuple[stage.Query, bool]:
    if until == "last":
        raise ConfigError("--until last has no meaning; give a duration ago or an ISO time")
    since_last = since == "last"
    query = stage.Query(profile=stage.profile_name(profile),
                        since=None if since_last else stage.parse_time(since, "--since"),
                        until=stage.parse_time(until, "--until"), tail=tail, grep=grep)
    return query, since_last


class Printer:
    """`host | line`, the host colored on a terminal (as `docker compose logs`), or one JSON
    document written as it goes (--json): {"command", "lines": [...], "hosts", "exit_code"}."""

    def __init__(self, hosts: list[str], as_json: bool, color: bool, labels: dict[str, str] | None = None):
        self.labels = labels or {}  # host -> `host/rank` for the ranks of a multi-node server
        self.width = max((len(self.labels.get(h, h)) for h in hosts), default=0)
        self.color = {h: COLORS[i % len(COLORS)] for i, h in enumerate(hosts)} if color else {}
        self.as_json = as_json
        self.count = 0
        self.lock = threading.Lock()
        if as_json:
            sys.stdout.write('{"command": "logs", "lines": [')

    def line(self, line: stage.Line) -> None:
        with self.lock:
            if self.as_json:
                # the line is the one field a host wrote: redacted and escaped as on a terminal
                rank = self.labels.get(line.host)
                sys.stdout.write((",\n" if self.count else "\n") + json.dumps(
                    {"host": output.terminal_text(line.host), **({"rank": int(rank.rsplit("/", 1)[1])} if rank else {}),
                     "ts": line.ts, "line": output.shown(line.text)}))
            else:
                prefix = f"{self.labels.get(line.host, line.host):<{self.width}} |"
                code = self.color.get(line.host)
                if code:
                    prefix = f"\x1b[{code}m{prefix}\x1b[0m"
                sys.stdout.write(f"{prefix} {output.shown(line.text)}\n")
            self.count += 1
            if self.count % 256 == 0:
                sys.stdout.flush()

    def flush(self) -> None:
        sys.stdout.flush()

    def finish(self, states: dict[str, stage.HostRead], exit_code: int, **extra: Any) -> None:
        if self.as_json:
            hosts = {name: s.to_json() for name, s in states.items()}
            sys.stdout.write("\n], " + output.json_text({"hosts": hosts, **extra, "exit_code": exit_code})[1:] + "\n")
        sys.stdout.flush()


def _event(host: str, kind: str, detail: str) -> None:
    style = {"lost": "yellow", "reconnected": "green", "gap": "yellow", "failed": "red"}.get(kind, "")
    output.stderr.print(f"[{style}]{output.escape(host)}: {kind}[/]" + (f" {output.escape(detail)}" if detail else ""),
                        highlight=False)


def logs_command(pattern: str = PatternArg, profile: Optional[str] = ProfileOpt,
                 follow: bool = typer.Option(False, "-f", "--follow", help="Stream new lines from every host "
                                             "until Ctrl-C (reconnects a host that drops)."),
                 since: Optional[str] = SinceOpt, until: Optional[str] = UntilOpt,
                 tail: Optional[int] = typer.Option(None, "--tail", "-n", help="Only the last N lines per host "
                                                    "(with -f: default 10)."),
                 grep: Optional[str] = typer.Option(None, "--grep", help="Only lines matching this regex "
                                                    "(filtered on the host)."),
                 bundle: bool = typer.Option(False, "--bundle", help="Collect a diagnostics tar.gz per host into "
                                             "RUNS/<time>-logs/ (sos collect style) instead of printing."),
                 color: Optional[bool] = typer.Option(None, "--color/--no-color", help="Color host prefixes "
                                                      "(default: on a terminal)."),
                 inventory_path: Optional[str] = InventoryOpt, forks: int = ForksOpt, as_json: bool = JsonOpt,
                 runs: str = RunsOpt, policy: Optional[str] = PolicyOpt) -> None:
    """Print each host's server log, lines prefixed with the host and merged by time (journald on
    systemd hosts, the supervisor's log files elsewhere); -f follows; --bundle collects."""
    query, since_last = _query(profile, since, until, tail, grep)
    inv = inventory(inventory_path)
    if bundle:
        if follow or since or until or tail is not None or grep:
            raise ConfigError("--bundle collects whole logs; it takes none of -f, --since, --until, --tail, --grep")
        _bundle(inv, pattern, query, runs, forks, as_json, policy)
    if follow and until:
        raise ConfigError("-f follows new lines; --until cannot be combined with it")
    group = Group.from_inventory(inv, pattern, forks=forks, host_key_policy=host_key_policy(policy))
    store = stage.CursorStore(runs, query.profile)
    cursors = store.cursors(group.hosts) if since_last else {}
    if since_last:
        for host in group.hosts:
            if cursors.get(host.name) is None:
                output.stderr.print(f"{host.name}: no earlier read of its log kept here; reading it whole",
                                    highlight=False)
    if follow and query.tail is None and query.since is None and not since_last:
        query.tail = 10  # journalctl -f's default
    printer = Printer([h.name for h in group.hosts], as_json,
                      sys.stdout.isatty() and not as_json if color is None else color and not as_json,
                      rank_labels(inv))
    conns = [group.connection(h) for h in group.hosts]
    with group:
        if follow:
            follower = stage.Follower(conns, query, lambda line: (printer.line(line), printer.flush()), _event,
                                      cursors)
            try:
                states = follower.run()
            except KeyboardInterrupt:
                states = follower.shut()
            store.save(group.hosts, {n: s for n, s in states.items() if s.error is None})
            failed = [n for n, s in states.items() if s.error is not None]
            printer.finish(states, 1 if failed else 0, command_line="logs -f")
            raise typer.Exit(1 if failed else 0)
        merged, states = stage.read_merged(conns, query, cursors)
        try:
            for line in merged:
                printer.line(line)
            printer.flush()
        except BrokenPipeError:  # `sglfleet logs ... | head`: the reader has what it wanted
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
            raise typer.Exit(0) from None
    store.save(group.hosts, states)
    failed = {n: s for n, s in states.items() if s.error is not None}
    code = 1 if failed else 0
    printer.finish(states, code)
    for name, state in states.items():
        for gap in state.gaps:
            _event(name, "gap", gap)
    for name, state in failed.items():
        _event(name, "failed", str(state.error))
    raise typer.Exit(code)


def _bundle(inv: Any, pattern: str, query: stage.Query, runs: str, forks: int, as_json: bool,
            policy: Optional[str]) -> None:
    directory = run_dir(runs, "logs")
    slots = threading.Semaphore(stage.FETCH_SLOTS)
    started = time.monotonic()
    results = run_group(inv, pattern, lambda conn: stage.bundle_host(conn, query, directory, runs, slots),
                        "bundle", forks, policy, quiet=as_json)
    index = {"command": "logs --bundle", "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "pattern": pattern,
             "profile": query.profile, "inventory": inv.path, "wall_s": round(time.monotonic() - started, 3),
             "hosts": {name: ({"ok": True, **r.value} if r.ok else {"ok": False, "error": r.error})
                       for name, r in results.items()}}
    stage.write_index(directory, index)
    if as_json:
        output.print_json({**index, "run_dir": str(directory), "exit_code": results.exit_code})
        raise typer.Exit(results.exit_code)
    output.summary_table(f"bundle -> {directory}", results, ["file", "size", "items", "not collected", "seconds"],
                         lambda v: [os.path.basename(v["file"]), output.human_bytes(v["bytes"]),
                                    str(len(v["items"])), ", ".join(v["not_collected"]) or "-", f"{v['seconds']:.1f}"])
    raise typer.Exit(results.exit_code)


def metrics_command(pattern: str = PatternArg, profile: Optional[str] = ProfileOpt,
                    since: Optional[str] = SinceOpt, until: Optional[str] = UntilOpt,
                    csv_path: Optional[str] = typer.Option(None, "--csv", callback=output_file(),
                                                           help="Write every decode line as a CSV row."),
                    plot_dir: Optional[str] = typer.Option(None, "--plot", callback=output_dir(), help="Write PNG charts (accept length, "
                                                           "throughput over time per host) into this directory."),
                    ratio: float = typer.Option(metrics_stage.OUTLIER_RATIO, "--outlier-ratio",
                                                help="Flag hosts whose median accept length is below this x the "
                                                     "fleet's median."),
                    fail_on_outlier: bool = typer.Option(False, "--fail-on-outlier", help="Exit 1 when a host is "
                                                         "flagged."),
                    live: bool = typer.Option(False, "--live", help="Scrape /metrics of each running server instead "
                                              "of reading logs (needs --enable-metrics)."),
                    inventory_path: Optional[str] = InventoryOpt, forks: int = ForksOpt, as_json: bool = JsonOpt,
                    policy: Optional[str] = PolicyOpt) -> None:
    """Accept length, accept rate and throughput per host from SGLang's decode log lines: a
    summary (median, p10, p90), outlier hosts flagged, optional CSV and PNG charts."""
    if not 0 < ratio <= 1:
        raise ConfigError(f"--outlier-ratio must be in (0, 1], got {ratio}")
    query, since_last = _query(profile, since, until, None, None)
    if since_last:
        raise ConfigError("metrics reads the whole window it is given; --since last is for `logs`")
    inv = inventory(inventory_path)
    # A multi-node server's figures are rank 0's: its ranks are read there, once.
    names, notes = serving_hosts(inv, inv.select(pattern))
    for note in notes:
        if not as_json:
            output.stderr.print(output.escape(note), highlight=False)
    serving = ",".join(names)
    if live:
        if csv_path or plot_dir:
            raise ConfigError("--live prints the current figures; --csv and --plot read logs (leave out --live)")
        results = run_group(inv, serving, lambda conn: metrics_stage.scrape(conn, query), "scrape", forks, policy,
                            quiet=as_json)
        if as_json:
            output.print_json(output.group_json("metrics --live", results))
            raise typer.Exit(results.exit_code)
        columns = list(metrics_stage.LIVE.values())
        output.summary_table("metrics (live /metrics)", results, columns,
                             lambda v: [_num(v["figures"].get(c)) for c in columns])
        raise typer.Exit(results.exit_code)

    results = run_group(inv, serving, lambda conn: metrics_stage.collect(conn, query)[0], "metrics", forks, policy,
                        quiet=as_json)
    records = {name: r.value for name, r in results.items() if r.ok}
    summary = metrics_stage.summarize(records, ratio)
    extra: dict[str, Any] = {}
    try:  # the paths were checked before any host was contacted; a write can still fail (a full disk)
        if csv_path:
            extra["csv"] = {"file": csv_path, "rows": metrics_stage.write_csv(records, csv_path)}
        if plot_dir:
            charts = metrics_stage.plot(records, plot_dir)
            extra["plots"] = {k: v["file"] for k, v in charts.items()}
    except OSError as exc:
        option, path = ("--csv", csv_path) if "csv" not in extra and csv_path else ("--plot", plot_dir)
        raise ConfigError(f"{option} {path}: could not write it: {exc.strerror or exc}") from None
    code = results.exit_code or (1 if fail_on_outlier and summary["flagged"] else 0)
    if as_json:
        output.print_json({"command": "metrics", "pattern": pattern, "summary": summary, **extra,
                           "hosts_failed": {n: r.error for n, r in results.failed.items()}, "exit_code": code})
        raise typer.Exit(code)
    table = output.Table(title=f"accept length and throughput per host (fleet median accept len "
                               f"{_num(summary['fleet_accept_len_median'])})")
    for col in ("host", "lines", "accept len median", "p10", "p90", "accept rate", "tok/s median", "p10", "p90",
                "flag"):
        table.add_column(col)
    for name, h in summary["hosts"].items():
        a, t = h["accept_len"], h["gen_throughput"]
        table.add_row(name, str(h["lines"]), _num(a["median"]), _num(a["p10"]), _num(a["p90"]),
                      _num(h["accept_rate_median"]), _num(t["median"], 1), _num(t["p10"], 1), _num(t["p90"], 1),
                      "[red]LOW[/]" if h["flagged"] else "")
    output.stdout.print(table)
    for name in summary["flagged"]:
        output.stdout.print(f"[red]{output.escape(name)}[/]: {output.escape(summary['hosts'][name]['why'])}", highlight=False)
    for name, r in results.failed.items():
        output.stdout.print(f"[red]{output.escape(name)}[/]: {output.escape(r.error or 'failed')}", highlight=False)
    for what, value in extra.items():
        output.stdout.print(f"{what}: {value}", highlight=False)
    raise typer.Exit(code)


def _num(value: Any, digits: int = 2) -> str:
    return "-" if value is None else f"{value:.{digits}f}"
