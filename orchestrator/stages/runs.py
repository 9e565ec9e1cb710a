"""Where a command keeps what it found: `runs/<time>-<kind>/` on the controller (smoke results,
deploy logs, log bundles), one new directory per run, never overwritten."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

from ..remote import redact


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


def write_text(path: Path, text: str, like: Any = None) -> Path:
    """Host text as the host wrote it (bytes that are not UTF-8, kept as surrogates, go back as
    those bytes), with the secrets of the document `like` and every one this process knows
    redacted (remote/redact.py)."""
    secrets = sorted(redact.values_in(like) | redact.KNOWN, key=len, reverse=True)
    path.write_bytes(redact.text(text, secrets).encode("utf-8", "surrogateescape"))
    return path


def write_json(path: Path, document: Any) -> Path:
    """One JSON document, secrets redacted (redact.scrub); host text in it with \\udcNN escapes
    for bytes that are not UTF-8."""
    plain = json.loads(json.dumps(document, default=str))
    path.write_text(json.dumps(redact.scrub(plain), indent=2) + "\n")
    return path
