"""Where a command keeps what it found: `runs/<time>-<kind>/` on the controller (smoke results,
deploy logs, log bundles), one new directory per run, never overwritten."""

from __future__ import annotations

import time
from pathlib import Path


def run_dir(base: str | Path, kind: str) -> Path:
    """A new, empty runs/<YYYYmmddTHHMMSS>-<kind>[-N] directory. Made with an atomic mkdir, so
    two runs started in the same second (two processes) each get their own."""
    Path(base).mkdir(parents=True, exist_ok=True)
    stem = Path(base) / (time.strftime("%Y%m%dT%H%M%S") + f"-{kind}")
    path, suffix = stem, 0
    while True:
        try:
            path.mkdir()
            return path
        except FileExistsError:
            suffix += 1
            path = Path(f"{stem}-{suffix}")
