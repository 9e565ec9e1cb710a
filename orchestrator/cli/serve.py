"""`render`, `smoke`: the launch flags for a host, and SGLang's own validation of them."""

from __future__ import annotations

import shlex
import shutil
import sys
from typing import Optional

import typer

from ..errors import ConfigError
from ..fleet.group import TaskOutcome
from ..fleet.inventory import Host
from ..fleet.local import LocalConnection
from ..remote import redact
from ..remote.hostlib import server_paths
from ..spec.profile import load_profile
from ..stages.render import render, server_facts
from ..stages.runs import run_dir
from ..stages.smoke import simulate_for, smoke_host, store
from ..stages.units import placements
from . import output
from .option_paths import output_dir
from .common import ForksOpt, InventoryOpt, JsonOpt, PolicyOpt, inventory, on_one_host, run_group

WHAT = ("command", "env", "unit", "launch-script")


def register(app: typer.Typer) -> None:
    app.command("render")(render_command)
    app.command()(smoke)


def render_command(host: str = typer.Argument(..., help="One host name."),
                   profile: str = typer.Argument(..., help="Profile name or .yaml path."),
                   inventory_path: Optional[str] = InventoryOpt, as_json: bool = JsonOpt,
                   what: str = typer.Option("command", "--what", help=" | ".join(WHAT)),
                   host_key_policy: Optional[str] = PolicyOpt) -> None:
    """Print the final launch command for HOST and, per flag, the rule or file line that put it there."""
    if what not in WHAT:
        raise ConfigError(f"--what must be one of {', '.join(WHAT)}, got '{what}'")
    inv, prof = inventory(inventory_path), load_profile(profile)
    placed = placements(inv, inv.select(host), prof)  # a rank of a multi-node server: its own flags
    rendered = on_one_host(inv, host, "render", lambda conn: render(conn.host, prof, server_facts(conn, prof),
                                                                    inv.path, placement=placed.get(conn.host.name)),
                           "render", host_key_policy)
    if as_json:
        output.print_json(rendered.to_json())
        return
    paths = server_paths(rendered.profile)
    if what == "env":
        output.write_host_text(rendered.template("sglang.env.j2"))  # secrets redacted, as everywhere
    elif what == "unit":
        output.write_host_text(rendered.template("sglang-server.service.j2", launch_script=paths["launch_script"],
                                                 stop_timeout_s=120))
    elif what == "launch-script":
        output.write_host_text(rendered.template("launch.sh.j2", env_file=paths["env_file"]))
    else:
        output.stdout.print(output.escape(shlex.join(redact.argv(rendered.command))), highlight=False, soft_wrap=True)
        place = rendered.placement
        rank = (f" (rank {place.rank} of {place.nodes} of server group {place.group}: "
                f"{', '.join(place.hosts)})" if place else "")
        table = output.Table(title=output.escape(f"{rendered.host}{rank}: {len(rendered.flags)} flags for SGLang "
                                                 f"{rendered.facts['sglang'].get('version')}"))
        table.add_column("flag")
        table.add_column("value")
        table.add_column("from")
        for flag in rendered.flags:
            values = redact.argv(flag.argv)[1:]
            table.add_row(output.escape(flag.name), output.escape(" ".join(values)), output.escape(flag.source))
        output.stdout.print(table)


def smoke(pattern: Optional[str] = typer.Argument(None, help="Host pattern (not with --local)."),
          profile: Optional[str] = typer.Argument(None, help="Profile name or .yaml path."),
          inventory_path: Optional[str] = InventoryOpt, forks: int = ForksOpt, as_json: bool = JsonOpt,
          simulate: Optional[str] = typer.Option(None, "--simulate", help="Validate as if on this GPU (h200, "
                                                 "h100, a100, l40s) inside SGLang's platform override."),
          local: Optional[str] = typer.Option(None, "--local", help="PROFILE: run the probe against a local "
                                              "SGLang install instead of hosts (offline preflight)."),
          python: Optional[str] = typer.Option(None, "--python", help="Interpreter for --local (default: this one)."),
          runs: str = typer.Option("runs", "--runs-dir", callback=output_dir(), help="Where results are stored."),
          host_key_policy: Optional[str] = PolicyOpt) -> None:
    """Run SGLang's prepare_server_args AND its full validation with the rendered flags on each host."""
    if local:
        if pattern and not profile:
            raise ConfigError("with --local give only the profile: sglfleet smoke --local PROFILE")
        prof = load_profile(local)
        interpreter = python or sys.executable
        if shutil.which(interpreter) is None:
            raise ConfigError(f"--python {interpreter}: no such executable here (give the path of the Python "
                              "that has SGLang installed, e.g. /root/ml-env/bin/python3)")
        conn = LocalConnection(Host(name="local", address="127.0.0.1", python=interpreter))
        directory = run_dir(runs, "smoke")
        document = smoke_host(conn, prof, "local", simulate)
        store(directory, "local", document)
        results = {"local": document}
    else:
        if not pattern or not profile:
            raise ConfigError("usage: sglfleet smoke PATTERN PROFILE (or sglfleet smoke --local PROFILE)")
        inv, prof = inventory(inventory_path), load_profile(profile)
        placed = placements(inv, inv.select(pattern), prof)  # each rank of a multi-node server: its own flags
        directory = run_dir(runs, "smoke")

        def task(conn):
            document = smoke_host(conn, prof, inv.path, simulate_for(conn.host, simulate), placed.get(conn.host.name))
            store(directory, conn.host.name, document)
            return TaskOutcome(document["ok"], document, None if document["ok"] else document["summary"])

        group_results = run_group(inv, pattern, task, "smoke", forks, host_key_policy, quiet=as_json)
        results = {}
        for name, r in group_results.items():
            if r.value is None:  # never reached the probe (connection)
                r.value = {"ok": False, "summary": (r.error or "failed").splitlines()[0], "error": r.error}
                store(directory, name, r.value)
            results[name] = r.value
    failed = [n for n, d in results.items() if not d["ok"]]
    if as_json:
        output.print_json({"command": "smoke", "run_dir": str(directory), "hosts": results,
                           "summary": {"ok": len(results) - len(failed), "failed": len(failed)},
                           "exit_code": 1 if failed else 0})
        raise typer.Exit(1 if failed else 0)
    table = output.Table(title=f"smoke {profile or local} -> {directory}")
    for col in ("host", "result", "phase", "algorithm", "draft tokens", "budget", "topk cap", "shadow linear",
                "mamba", "seconds"):
        table.add_column(col)
    for name, d in results.items():
        f = (d.get("probe") or {}).get("fields") or {}
        total = ((d.get("probe") or {}).get("timings") or {}).get("total_s")
        place = (d.get("render") or {}).get("placement")
        label = f"{name} ({place['server_group']}/{place['rank']})" if place else name
        table.add_row(output.escape(label), "[green]ok[/]" if d["ok"] else "[red]failed[/]",
                      output.escape(d.get("phase") or "-"),
                      *[output.escape(str(f.get(k, "-"))) for k in ("speculative_algorithm", "speculative_num_draft_tokens",
                                                     "speculative_ddtree_budget", "speculative_ddtree_topk_cap",
                                                     "speculative_ddtree_shadow_linear",
                                                     "mamba_radix_cache_strategy")], str(total or "-"))
    output.stdout.print(table)
    for name in failed:
        d = results[name]
        output.stdout.rule(f"[red]{output.escape(name)}[/]: {output.escape(d['summary'])}")
        probe = d.get("probe") or {}
        if probe.get("traceback"):  # whole, never cut: this is what the seed story lost
            output.write_host_text(probe["traceback"])
            sys.stdout.flush()
        for fix in d.get("diagnosis", []):
            output.stdout.print(f"[yellow]fix:[/] {output.escape(fix)}", highlight=False)
    output.stdout.print(f"{len(results) - len(failed)} ok, {len(failed)} failed; results in {directory}",
                        highlight=False)
    raise typer.Exit(1 if failed else 0)
