"""The `sglfleet` command line: wiring only. Each command family lives in its own module
(fleet, releases, serve, lab) and is thin: parse, call a stage, report (common.report).

Exit codes: 0 every host ok, 1 some host failed, 2 usage or configuration error.
"""

from __future__ import annotations

import sys
from typing import Optional

import typer

from ..errors import SglfleetError
from . import deploy, doctor, fleet, lab, logs, output, releases, serve
from . import rollout
from .common import GLOBALS, InventoryOpt

app = typer.Typer(no_args_is_help=True, add_completion=False, pretty_exceptions_enable=False,
                  help="Deploy and operate SGLang + DDTree on your own GPU hosts over SSH.")


@app.callback()
def options(inventory_path: Optional[str] = InventoryOpt) -> None:
    """Deploy and operate SGLang + DDTree on your own GPU hosts over SSH."""
    GLOBALS.inventory = inventory_path  # `sglfleet -i FILE COMMAND ...`; a subcommand's own -i wins


for family in (fleet, releases, serve, deploy, doctor, logs, lab):
    family.register(app)
rollout.register(app)  # `restart --rolling` (stages.rollout)


def main() -> None:
    try:
        app()
    except SglfleetError as exc:
        output.stderr.print(f"[red]error:[/] {output.escape(str(exc))}", highlight=False)
        sys.exit(exc.exit_code)
    except KeyboardInterrupt:
        output.stderr.print("interrupted")
        sys.exit(130)
