"""Every numeric command-line option checked by one function (orchestrator/numbers.check_number,
which the stages use too), and which options a command was given.

`number(...)` makes a typer callback: typer runs it while it parses the command line, so a bad
value is refused (exit 2, the option named, one paragraph) before the command's body runs and
before any host is contacted. nan and inf are refused everywhere: a FLOAT option accepts them, and
`nan < 0` is False, so a range test alone lets them through (`--grace nan`, `--min-ready inf`).

`given(ctx, ...)` names the options typed on the command line (not defaults), for options that
mean something only with another one (`deploy --batch` without `--rolling`).
"""

from __future__ import annotations

from typing import Any, Callable, Iterable, Optional

import typer

from ..errors import ConfigError
from ..numbers import check_number


def option_name(param: typer.CallbackParam) -> str:
    """The long form of an option (`--tail` of `--tail/-n`)."""
    names = list(param.opts) + list(param.secondary_opts)
    return next((n for n in names if n.startswith("--")), names[0] if names else str(param.name))


def number(low: Optional[float] = None, high: Optional[float] = None, above: Optional[float] = None,
           unit: str = "") -> Callable[[typer.Context, typer.CallbackParam, Any], Any]:
    """A typer/click callback that checks the option's value with check_number."""

    def callback(ctx: typer.Context, param: typer.CallbackParam, value: Any) -> Any:
        return check_number(option_name(param), value, low=low, high=high, above=above, unit=unit)

    return callback


# The ranges the commands share.
SECONDS_OR_MORE = dict(low=0, unit="seconds")       # a grace, a drain, a min_ready: 0 allowed
POSITIVE_SECONDS = dict(above=0, unit="seconds")    # a timeout: 0 would fail at once
PERCENTAGE = dict(low=0, high=100)


def given(ctx: typer.Context, names: Iterable[str]) -> list[str]:
    """The options among `names` (parameter names) typed on the command line, as `--flag`s."""
    out = []
    for command_param in ctx.command.params:
        if command_param.name in names and \
                getattr(ctx.get_parameter_source(command_param.name), "name", None) == "COMMANDLINE":
            out.append(option_name(command_param))
    return out


def refuse_without(ctx: typer.Context, names: Iterable[str], needs: str) -> None:
    """Exit 2 when options that only mean something with `needs` were given without it."""
    extra = given(ctx, names)
    if extra:
        raise ConfigError(f"{', '.join(extra)} {'is' if len(extra) == 1 else 'are'} for {needs} only; "
                          f"add {needs} or leave {'it' if len(extra) == 1 else 'them'} out (nothing was done)")
