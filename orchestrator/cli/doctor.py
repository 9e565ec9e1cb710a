"""`doctor`: whether each host can serve a profile, one round trip per host (stages.doctor)."""

from __future__ import annotations

import time
from typing import Any, Optional

import typer

from ..fleet.group import TaskOutcome
from ..spec.profile import Artifacts, load_profile
from ..stages import doctor as doctor_stage
from . import output
from .common import ForksOpt, InventoryOpt, JsonOpt, PatternArg, PolicyOpt, inventory, report, run_group

STYLE = {"ok": "green", "warn": "yellow", "fail": "red", "skip": "dim"}


def register(app: typer.Typer) -> None:
    app.command()(doctor)


def doctor(pattern: str = PatternArg,
           profile: Optional[str] = typer.Argument(None, help="Profile name or .yaml path (without: only what "
                                                   "the host alone says: GPUs, CUDA, disk, clock, versions)."),
           inventory_path: Optional[str] = InventoryOpt, forks: int = ForksOpt, as_json: bool = JsonOpt,
           host_key_policy: Optional[str] = PolicyOpt) -> None:
    """Check that each host can serve the profile: GPUs and their free memory, driver vs torch CUDA,
    model and draft, disk, port, clock, versions vs the patchset's pins, the extension's fingerprint,
    the patchset's worker. One round trip per host; exit 1 when a check fails, each failure with its fix."""
    inv = inventory(inventory_path)
    prof = load_profile(profile) if profile else None
    artifacts = prof.artifacts() if prof else Artifacts(None, None, [])
    started = time.monotonic()

    def task(conn):
        facts = doctor_stage.gather(conn, prof, artifacts, inv.path)
        checks = doctor_stage.evaluate(conn.host, prof, artifacts, facts, inv.path)
        value = {"checks": [c.to_json() for c in checks], "facts": facts}
        failed = doctor_stage.failing(checks)
        if failed:
            return TaskOutcome(False, value, doctor_stage.refusal_text(conn.host.name, checks))
        return value

    results = run_group(inv, pattern, task, "doctor", forks, host_key_policy, quiet=as_json)

    def table() -> None:
        names = [c["name"] for r in results.values() if r.value for c in r.value["checks"]]
        columns = list(dict.fromkeys(names))
        grid = output.Table(title=f"doctor {prof.name if prof else '(no profile)'}: {len(results)} host(s)")
        grid.add_column("host", style="bold")
        for name in columns:
            grid.add_column(name)
        for host, r in results.items():
            if not r.value:
                grid.add_row(output.escape(host), "[red]unreachable[/]", *[""] * (len(columns) - 1))
                continue
            by_name = {c["name"]: c["status"] for c in r.value["checks"]}
            grid.add_row(output.escape(host), *[_cell(by_name.get(n)) for n in columns])
        output.stdout.print(grid)
        for host, r in results.items():
            if not r.value:
                output.stdout.print(f"[red]{output.escape(host)}[/]: {output.escape(r.error or 'failed')}")
                continue
            for c in r.value["checks"]:
                if c["status"] in ("fail", "warn"):
                    output.stdout.print(f"[{STYLE[c['status']]}]{output.escape(host)} {c['name']}[/]: "
                                        f"{output.escape(c['detail'])}\n    fix: {output.escape(c['fix'])}",
                                        highlight=False)
        output.stdout.print(f"{len(results.succeeded)} ok, {len(results.failed)} failed",
                            style="red" if results.failed else "green", highlight=False)

    report("doctor", results, as_json, table, pattern=pattern, profile=prof.name if prof else None,
           wall_s=round(time.monotonic() - started, 3))


def _cell(status: Any) -> str:
    return f"[{STYLE.get(status, 'dim')}]{status or '-'}[/]"
