"""The `sglfleet` command line: wiring only. Each command family lives in its own module
(fleet, releases, serve, lab) and is thin: parse, call a stage, report (common.report).

`main()` registers only the family of the command it is given (`sglfleet run ...` never imports
the deploy stage, the profile schema, jinja2 or pydantic): start-up is most of what a small
command costs, and a fleet-wide `run` pays it once per invocation. Help, a mistyped command and
the `app` tests import get every family.

Exit codes: 0 every host ok, 1 some host failed, 2 usage or configuration error.
"""

from __future__ import annotations

import importlib
import sys
from typing import Any, Optional, Sequence

import typer

from ..errors import SglfleetError
from . import output
from .common import GLOBALS, InventoryOpt

# Each family module's commands (its register() adds exactly these; a test checks they agree).
FAMILIES: dict[str, tuple[str, ...]] = {
    "fleet": ("hosts", "facts", "run"),
    "releases": ("plan", "push", "releases", "rollback", "patchset"),
    "serve": ("render", "smoke"),
    "deploy": ("deploy", "status", "stop", "build-kernels"),
    "doctor": ("doctor",),
    "logs": ("logs", "metrics"),
    "lab": ("lab",),
    "rollout": ("restart", "rollout"),  # `restart --rolling`, `rollout continue|abort|list` (stages.rollout)
}
_FAMILY_OF = {command: family for family, commands in FAMILIES.items() for command in commands}


def options(inventory_path: Optional[str] = InventoryOpt) -> None:
    """Deploy and operate SGLang + DDTree on your own GPU hosts over SSH."""
    GLOBALS.inventory = inventory_path  # `sglfleet -i FILE COMMAND ...`; a subcommand's own -i wins


def build_app(families: Sequence[str] = tuple(FAMILIES)) -> typer.Typer:
    """The CLI with these command families registered (each imported only here)."""
    built = typer.Typer(no_args_is_help=True, add_completion=False, pretty_exceptions_enable=False,
                        help="Deploy and operate SGLang + DDTree on your own GPU hosts over SSH.")
    built.callback()(options)
    for family in families:
        importlib.import_module(f"{__name__}.{family}").register(built)
    return built


def command_family(argv: Sequence[str]) -> str | None:
    """The family of the command in argv (after the global -i FILE), None when there is none or it
    is no command (help, a typo): then every family is registered."""
    words = iter(argv)
    for word in words:
        if word in ("-i", "--inventory"):
            next(words, None)
        elif not (word.startswith("--inventory=") or (word.startswith("-i") and len(word) > 2)):
            return _FAMILY_OF.get(word)
    return None


def __getattr__(name: str) -> Any:
    if name == "app":  # every command, built on first use (tests, typer.main.get_command)
        globals()["app"] = build_app()
        return globals()["app"]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def main() -> None:
    family = command_family(sys.argv[1:])
    try:
        build_app((family,) if family else tuple(FAMILIES))()
    except SglfleetError as exc:
        output.stderr.print(f"[red]error:[/] {output.escape(str(exc))}", highlight=False)
        sys.exit(exc.exit_code)
    except KeyboardInterrupt:
        output.stderr.print("interrupted")
        sys.exit(130)
