"""One check for every number a user gives (command-line options, stage options): finite, in
range, or a ConfigError (exit 2) that names the option. nan and inf are refused: `nan < 0` is
False, so a range test alone lets nan through, and an infinite timeout never ends."""

from __future__ import annotations

import math
from typing import Any, Optional

from .errors import ConfigError


def check_number(name: str, value: Any, low: Optional[float] = None, high: Optional[float] = None,
                 above: Optional[float] = None, unit: str = "") -> Any:
    """`value` when it is finite and low <= value <= high (above < value); else ConfigError
    naming the option. None (an option left out) passes."""
    if value is None:
        return value
    units = f" {unit}" if unit else ""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ConfigError(f"{name} must be a finite number{units}, got {value}")
    shown = f"{value:g}" if isinstance(value, float) else str(value)
    if above is not None and not value > above:
        what = "a positive number" if above == 0 else f"more than {above:g}"
        raise ConfigError(f"{name} must be {what}{' of ' + unit if unit else ''}, got {shown}")
    if low is not None and high is not None and not low <= value <= high:
        raise ConfigError(f"{name} must be between {low:g} and {high:g}{units}, got {shown}")
    if low is not None and value < low:
        raise ConfigError(f"{name} must be at least {low:g}{units}, got {shown}")
    if high is not None and value > high:
        raise ConfigError(f"{name} must be at most {high:g}{units}, got {shown}")
    return value
