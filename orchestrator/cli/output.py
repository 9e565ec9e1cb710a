"""Terminal and JSON output: live per-host progress, summary tables, one JSON document.

Progress goes to stderr (a live table on a terminal, one line per finished host
otherwise), so stdout carries only the summary or, with --json, the JSON document.
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time
from typing import Any, Callable, Iterable

from rich.console import Console
from rich.live import Live
from rich.markup import escape
from rich.table import Table

from ..fleet.group import GroupResult, Stopped

# Off a terminal (CI logs, pipes) Rich would assume 80 columns and wrap the tables; COLUMNS wins.
_WIDTH = None if sys.stdout.isatty() or "COLUMNS" in os.environ else 160
stdout = Console(soft_wrap=True, width=_WIDTH)
stderr = Console(stderr=True, soft_wrap=True)

_STYLE = {"waiting": "dim", "connecting": "cyan", "running": "yellow", "ok": "green", "failed": "red"}


class Progress:
    """Per-host progress; a callback for Group(progress=...)."""

    def __init__(self, hosts: Iterable[str], title: str, enabled: bool = True):
        self.state = {h: ("waiting", "") for h in hosts}
        self.started = {h: 0.0 for h in self.state}
        self.title = title
        self.enabled = enabled
        self.live_mode = enabled and stderr.is_terminal
        self._lock = threading.Lock()
        self._live: Live | None = None

    def __call__(self, host: str, event: str, detail: str = "") -> None:
        with self._lock:
            if event == "connecting":
                self.started[host] = time.monotonic()
            self.state[host] = (event, detail)
            if self._live is not None:
                self._live.update(self._table())
            elif self.enabled and event in ("ok", "failed"):
                took = time.monotonic() - self.started[host]
                first_line = detail.splitlines()[0] if detail else ""
                stderr.print(f"[{_STYLE[event]}]{escape(host)}: {event}[/] ({took:.2f}s)"
                             + (f" {escape(first_line)}" if first_line else ""), highlight=False)

    def _table(self) -> Table:
        table = Table(title=self.title, show_header=False, box=None)
        for host, (event, detail) in self.state.items():
            first_line = detail.splitlines()[0] if detail else ""
            table.add_row(escape(host), f"[{_STYLE.get(event, '')}]{event}[/]", escape(first_line[:100]))
        return table

    def __enter__(self) -> "Progress":
        if self.live_mode:
            self._live = Live(self._table(), console=stderr, refresh_per_second=8, transient=True)
            self._live.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        if self._live is not None:
            self._live.__exit__(*exc)
            self._live = None


def print_json(document: dict[str, Any]) -> None:
    sys.stdout.write(json.dumps(document, indent=2, default=str) + "\n")


def group_json(command: str, results: GroupResult, **extra: Any) -> dict[str, Any]:
    return {
        "command": command,
        **extra,
        "hosts": {name: r.to_json() for name, r in results.items()},
        "summary": {"ok": len(results.succeeded), "failed": len(results.failed),
                    "total": len(results)},
        "interrupted": results.interrupted,
        "not_started": sorted(results.not_started),
        "exit_code": results.exit_code,
    }


def summary_table(title: str, results: GroupResult, columns: list[str],
                  row: Callable[[Any], list[str]], refusals_have_rows: bool = False) -> None:
    """One row per host. With refusals_have_rows, a host that answered but refused (a failed
    result with a value, e.g. a drifted file) keeps its row, marked refused."""
    table = Table(title=title)
    table.add_column("host", style="bold")
    table.add_column("status")
    for col in columns:
        table.add_column(col)
    for name, result in results.items():
        if result.ok:
            table.add_row(escape(name), "[green]ok[/]", *[escape(c) for c in row(result.value)])
        elif refusals_have_rows and result.value:
            table.add_row(escape(name), "[red]refused[/]", *[escape(c) for c in row(result.value)])
        elif isinstance(result.exception, Stopped):
            table.add_row(escape(name), "[yellow]not started[/]", escape(str(result.exception)),
                          *[""] * (len(columns) - 1))
        else:
            first = (result.error or "failed").splitlines()[0]
            table.add_row(escape(name), "[red]failed[/]", escape(first), *[""] * (len(columns) - 1))
    stdout.print(table)
    ok, skipped = len(results.succeeded), len(results.not_started)
    failed = len(results.failed) - skipped
    stdout.print(f"{ok} ok, {failed} failed" + (f", {skipped} not started" if skipped else "")
                 + (" (interrupted)" if results.interrupted else ""), style="red" if failed + skipped else "green",
                 highlight=False)
    for name, result in results.failed.items():
        shown_as_row = refusals_have_rows and result.value
        if result.error and "\n" in result.error and not shown_as_row:
            stdout.print(f"\n[red]{escape(name)}[/]:\n{escape(result.error)}", highlight=False)


def human_bytes(n: int | None) -> str:
    if n is None:
        return "?"
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if value < 1024 or unit == "TiB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    return f"{n} B"
