"""Every option naming a place this machine writes to (`--runs-dir`, `--plot`, `--csv`, `--out`)
checked by one function, `writable`, before any host is contacted.

As the numeric options' checks (option_checks.number), `output_dir()` and `output_file()` make typer callbacks: typer runs them
while it parses the command line (defaults included), so a path that cannot be written is refused
(exit 2, the option, the path and why, one paragraph) before the command's body runs. Nothing is
left behind: a directory that does not exist yet is not created here, but its nearest existing
ancestor must be a directory this process can create entries in (tried, with a probe that is
removed at once: permission bits say nothing for root, nor for /proc, /sys or a read-only mount).
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import Any, Callable, Optional

import typer

from ..errors import ConfigError


def _refuse(option: str, value: Any, why: str) -> ConfigError:
    return ConfigError(f"{option} {value!s}: {why}; nothing was done")


def _creatable_in(directory: Path) -> Optional[str]:
    """None when an entry can be made in `directory` (tried), else why not."""
    try:
        probe = tempfile.mkdtemp(prefix=".sglfleet-write-check-", dir=directory)
    except OSError as exc:
        return f"cannot create anything in {directory} ({exc.strerror or exc})"
    os.rmdir(probe)
    return None


def writable(option: str, value: Any, kind: str) -> Optional[str]:
    """`value` as a path this process can write, as a directory (kind "dir") or a file (kind
    "file"), or ConfigError naming the option, the path and why. None stays None."""
    if value is None:
        return None
    text = str(value)
    if not text or "\0" in text:
        raise _refuse(option, repr(text), "not a path")
    try:
        path = Path(text)
        if path.exists() or path.is_symlink():
            if kind == "dir" and not path.is_dir():
                raise _refuse(option, text, "exists and is not a directory")
            if kind == "file" and path.is_dir():
                raise _refuse(option, text, "is a directory; give a file name")
            if kind == "file":
                with open(path, "ab"):  # opened for appending: its content stays as it is
                    pass
                return text
            why = _creatable_in(path)
            if why:
                raise _refuse(option, text, why)
            return text
        ancestor = path.parent if kind == "file" else path
        while not ancestor.exists():
            if ancestor.is_symlink():
                raise _refuse(option, text, f"{ancestor} is a dangling symbolic link")
            ancestor = ancestor.parent
        if not ancestor.is_dir():
            raise _refuse(option, text, f"{ancestor} is not a directory")
        why = _creatable_in(ancestor)
        if why:
            raise _refuse(option, text, why)
    except ConfigError:
        raise
    except (OSError, ValueError) as exc:
        raise _refuse(option, text, getattr(exc, "strerror", None) or str(exc)) from None
    return text


def output_dir() -> Callable[[typer.Context, typer.CallbackParam, Any], Any]:
    """A typer callback: the option names a directory this machine writes into."""

    def callback(ctx: typer.Context, param: typer.CallbackParam, value: Any) -> Any:
        writable(max(param.opts, key=len), value, "dir")  # the long form: --runs-dir
        return value

    return callback


def output_file() -> Callable[[typer.Context, typer.CallbackParam, Any], Any]:
    """A typer callback: the option names a file this machine writes."""

    def callback(ctx: typer.Context, param: typer.CallbackParam, value: Any) -> Any:
        writable(max(param.opts, key=len), value, "file")
        return value

    return callback
