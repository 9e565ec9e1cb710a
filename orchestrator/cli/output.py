"""Terminal and JSON output: live per-host progress, summary tables, one JSON document.

Progress goes to stderr (a live table on a terminal, one line per finished host
otherwise), so stdout carries only the summary or, with --json, the JSON document.

Host text is untrusted (a server log holds what clients sent): `terminal_text` is the one
function every path that shows it goes through (`escape` for Rich markup, `print_json` for
every string of a JSON document, and the raw writes of logs, `run`, tracebacks). Control
characters are shown as `\\x1b`, `\\x07`, ... (tab and newline kept: they are the text's layout),
bytes that are not UTF-8 as `\\xe9`, never replaced with U+FFFD, so nothing a host sends can
retitle, clear, recolour or overwrite the operator's terminal.

Rich is imported when a console is first used (`stdout`, `stderr`: module attributes made on
first access). Where Rich would write no styles anyway (the stream is no terminal and neither
FORCE_COLOR nor TTY_COMPATIBLE=1 asks for them), the lines a command prints once per host
(progress, `say`, `host_rule`) are written as they are: `sglfleet run` on 128 hosts, piped, spent
~60 ms of its CPU rendering them through Rich and ~30 ms importing it (bench/peers.py). Written
plainly, host text keeps its tabs and `:name:` shortcodes (Rich turns them into spaces and emoji).
"""

from __future__ import annotations

import json
import os
import re
import sys
import threading
import time
from typing import TYPE_CHECKING, Any, Callable, Iterable

from ..fleet.group import GroupResult, Stopped
from ..remote import redact

if TYPE_CHECKING:
    from rich.console import Console
    from rich.live import Live
    from rich.table import Table

# Off a terminal (CI logs, pipes) Rich would assume 80 columns and wrap the tables; COLUMNS wins.
_WIDTH = None if sys.stdout.isatty() or "COLUMNS" in os.environ else 160


def _console(name: str) -> "Console":
    """The Rich console of sys.stdout or sys.stderr, made (and Rich imported) on first use."""
    console = globals().get(name)
    if console is None:
        from rich.console import Console

        # emoji off: Rich would turn a `:name:` shortcode in host text into an emoji (its markup
        # escape does not cover them), and sglfleet's own text has none
        console = (Console(soft_wrap=True, width=_WIDTH, emoji=False) if name == "stdout"
                   else Console(stderr=True, soft_wrap=True, emoji=False))
        globals()[name] = console
    return console


def __getattr__(name: str) -> Any:  # output.stdout, output.stderr, output.Table: Rich, on first use
    if name in ("stdout", "stderr"):
        return _console(name)
    if name == "Table":
        from rich.table import Table

        globals()[name] = Table
        return Table
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def _unstyled(stream: Any) -> bool:
    """Whether Rich would write this stream without styles: no terminal, and no FORCE_COLOR or
    TTY_COMPATIBLE=1 (Rich styles a pipe for those). Unsure is False: Rich then decides."""
    if os.environ.get("FORCE_COLOR") or os.environ.get("TTY_COMPATIBLE") == "1":
        return False
    try:
        return not stream.isatty()
    except ValueError:  # closed
        return False


def say(text: str, style: str | None = None, end: str = "\n", err: bool = False) -> None:
    """Text that is already shown() (or the tool's own), whole, in `style` on a terminal."""
    stream = sys.stderr if err else sys.stdout
    if _unstyled(stream):
        stream.write(text + end)
    else:
        from rich.text import Text  # not markup: Rich's escape doubles a lone trailing backslash

        _console("stderr" if err else "stdout").print(Text(text, style=style or ""), end=end)


def host_rule(name: str, status: str, style: str) -> None:
    """A rule across stdout titled with a host's name (in `style`) and its status, as Rich draws it."""
    title = f"{shown(name)} {shown(status)}"
    columns = os.environ.get("COLUMNS", "")
    width = _WIDTH or (int(columns) if columns.isdigit() else 0)  # as Rich sizes the console
    encoding = (getattr(sys.stdout, "encoding", None) or "").lower()
    if (_unstyled(sys.stdout) and encoding.startswith("utf") and title.isascii() and title.isprintable()
            and len(title) <= width - 4):
        # Rich's centred rule: (side - 1) rule characters, the title between spaces, the rest
        # of the width; its own arithmetic gives one or two characters more, cut to the width
        side = (width - len(title)) // 2
        sys.stdout.write(("\u2500" * (side - 1) + f" {title} " + "\u2500" * (side + 1))[:width] + "\n")
    else:
        from rich.text import Text

        _console("stdout").rule(Text.assemble((shown(name), style), " ", shown(status)))

# C0 controls but tab and newline, DEL, C1, the bidirectional overrides and isolates (they reorder
# what is shown, hiding text), and surrogates: U+DC80-U+DCFF are the undecodable bytes 0x80-0xff
# of a surrogateescape decode; any other lone surrogate cannot be written to a terminal at all.
_UNSAFE = re.compile("[\x00-\x08\x0b-\x1f\x7f-\x9f\u202a-\u202e\u2066-\u2069\ud800-\udfff]")


def _shown(match: "re.Match[str]") -> str:
    code = ord(match.group())
    if 0xDC80 <= code <= 0xDCFF:
        return f"\\x{code - 0xDC00:02x}"
    return f"\\x{code:02x}" if code <= 0xFF else f"\\u{code:04x}"


def terminal_text(value: str | bytes) -> str:
    """Host bytes or text as it may reach a terminal: bytes are decoded as UTF-8 with what is
    not UTF-8 shown as `\\xNN` (as is text decoded with surrogateescape), control characters
    as `\\xNN` (bidi controls `\\uNNNN`); tab and newline are kept."""
    if isinstance(value, (bytes, bytearray, memoryview)):
        value = bytes(value).decode("utf-8", "surrogateescape")
    elif not isinstance(value, str):
        value = str(value)
    if value.isprintable():  # every character _UNSAFE names is unprintable: the common case, fast
        return value
    return _UNSAFE.sub(_shown, value)


def shown(value: str | bytes) -> str:
    """What is printed of any text: secrets redacted (remote/redact.py: every secret value this
    process has rendered or read, and token-shaped text), then terminal_text."""
    if isinstance(value, (bytes, bytearray, memoryview)):
        value = bytes(value).decode("utf-8", "surrogateescape")
    return terminal_text(redact.text(value if isinstance(value, str) else str(value), redact.KNOWN))


def escape(value: str | bytes) -> str:
    """Host text for Rich: redacted and terminal-safe (shown), then Rich's markup escaped."""
    from rich.markup import escape as markup_escape  # Rich is imported on first use

    return markup_escape(shown(value))


def json_safe(document: Any) -> Any:
    """Every string of a JSON document (keys too) through terminal_text: --json carries host
    text in the same form the terminal shows it, so `jq -r` cannot write a control sequence."""
    if isinstance(document, str):
        return terminal_text(document)
    if isinstance(document, dict):
        return {json_safe(k) if isinstance(k, str) else k: json_safe(v) for k, v in document.items()}
    if isinstance(document, (list, tuple)):
        return [json_safe(v) for v in document]
    return document


def json_text(document: Any, **kwargs: Any) -> str:
    """json.dumps of the document, secrets redacted (redact.scrub) and every string
    terminal-safe (json_safe); other objects as their (escaped) str."""
    document = json.loads(json.dumps(document, default=str))  # plain types, for the scrub
    return json.dumps(json_safe(redact.scrub(document)), **kwargs)


def write_host_text(value: str | bytes, stream: Any = None) -> None:
    """Raw host output (a command's stdout, a traceback, a log tail), whole, redacted and
    terminal-safe (shown)."""
    (stream or sys.stdout).write(shown(value))


_STYLE = {"waiting": "dim", "connecting": "cyan", "running": "yellow", "ok": "green", "failed": "red"}


class Progress:
    """Per-host progress; a callback for Group(progress=...)."""

    def __init__(self, hosts: Iterable[str], title: str, enabled: bool = True):
        self.state = {h: ("waiting", "") for h in hosts}
        self.started = {h: 0.0 for h in self.state}
        self.title = title
        self.enabled = enabled
        self.live_mode = enabled and not _unstyled(sys.stderr) and _console("stderr").is_terminal
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
                if _unstyled(sys.stderr):
                    sys.stderr.write(f"{shown(host)}: {event} ({took:.2f}s)"
                                     + (f" {shown(first_line)}" if first_line else "") + "\n")
                else:
                    _console("stderr").print(f"[{_STYLE[event]}]{escape(host)}: {event}[/] ({took:.2f}s)"
                                             + (f" {escape(first_line)}" if first_line else ""), highlight=False)

    def _table(self) -> Table:
        from rich.table import Table

        table = Table(title=self.title, show_header=False, box=None)
        for host, (event, detail) in self.state.items():
            first_line = detail.splitlines()[0] if detail else ""
            table.add_row(escape(host), f"[{_STYLE.get(event, '')}]{event}[/]", escape(first_line[:100]))
        return table

    def __enter__(self) -> "Progress":
        if self.live_mode:
            from rich.live import Live

            self._live = Live(self._table(), console=_console("stderr"), refresh_per_second=8, transient=True)
            self._live.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        if self._live is not None:
            self._live.__exit__(*exc)
            self._live = None


def print_json(document: dict[str, Any]) -> None:
    sys.stdout.write(json_text(document, indent=2) + "\n")


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
    from rich.table import Table

    stdout = _console("stdout")
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
