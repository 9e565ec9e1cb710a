"""Where a command keeps what it found: `runs/<time>-<kind>/` on the controller (smoke results,
deploy logs, log bundles), one new directory per run, never overwritten."""

from __future__ import annotations

import time
from pathlib import Path


def run_dir(base: str | Path, kind: str) -> Path:
    """A new, empty runs/<YYYYmmddTHHMMSS>-<kind>[-N] directory."""
    path = Path(base) / (time.strftime("%Y%m%dT%H%M%S") + f"-{kind}")
    suffix = 0
    while path.exists():
        suffix += 1
        path = Path(f"{path}-{suffix}")
    path.mkdir(parents=True)
    return path
