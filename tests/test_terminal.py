"""What reaches the operator's terminal from a host: escaped (cli/output.terminal_text, the one
function every output path uses), never U+FFFD, and a huge log line cut on the host with a marker.
No SSH: the host side runs through the real call convention on a LocalConnection."""

from __future__ import annotations

import json
import sys
import time
import tracemalloc
import unicodedata
from pathlib import Path

from hypothesis import given, settings
from hypothesis import strategies as st

from orchestrator.cli import output
from orchestrator.cli.logs import Printer
from orchestrator.fleet.inventory import Host
from orchestrator.fleet.local import LocalConnection
from orchestrator.remote import logs as remote_logs
from orchestrator.stages import logs as stage

BASE = 1796290200
SAFE_CONTROLS = {"\t", "\n"}


def local() -> LocalConnection:
    return LocalConnection(Host(name="local", address="127.0.0.1", python=sys.executable))


def stamp(epoch: float) -> bytes:
    return time.strftime("[%Y-%m-%d %H:%M:%S]", time.localtime(epoch)).encode()


def query(tmp_path: Path, **kw) -> stage.Query:
    return stage.Query(profile="p", extra={"log_dir": str(tmp_path), "state_dir": str(tmp_path / "state"),
                                           "source": "file"}, **kw)


def unsafe(text: str) -> list[str]:
    """Characters a terminal would act on, or that cannot be written to one."""
    return [c for c in text if c not in SAFE_CONTROLS and (unicodedata.category(c) in ("Cc", "Cs")
                                                          or "\u202a" <= c <= "\u202e" or "\u2066" <= c <= "\u2069")]


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=200))
def test_arbitrary_host_bytes_are_shown_without_a_control_character_or_a_replacement(data):
    shown = output.terminal_text(data)
    assert unsafe(shown) == []
    assert shown.count("\ufffd") == data.count("\ufffd".encode())  # only a real U+FFFD shows as one
    text = data.decode("utf-8", "surrogateescape")
    assert output.terminal_text(text) == shown  # bytes, or text decoded with surrogateescape: the same
    assert unsafe(output.json_safe({"line": text})["line"]) == []
    if not unsafe(text):
        assert shown == text  # ordinary text (tabs, newlines, any language) is left as it is


@given(st.text(max_size=100))
def test_text_with_no_control_character_is_left_alone(text):
    if not unsafe(text):
        assert output.terminal_text(text) == text


def test_each_control_and_undecodable_byte_is_shown_as_its_escape():
    assert output.terminal_text(b"\x1b]0;owned\x07\x1b[2Jok\tcaf\xe9 caf\xc3\xa9\r\x7f\xc2\x9b\n") == \
        "\\x1b]0;owned\\x07\\x1b[2Jok\tcaf\\xe9 caf\u00e9\\x0d\\x7f\\x9b\n"
    assert output.terminal_text("\u202eevil") == "\\u202eevil"
    assert output.escape("[red]x\x1b") == "\\[red]x\\x1b"  # Rich markup escaped too


def test_logs_printed_and_as_json_carry_no_control_sequence_and_no_replacement(tmp_path, capsys):
    hostile = stamp(BASE) + b" GET /\x1b]0;pwned\x07\x1b[2J caf\xe9 \xff\xfe done\n"
    (tmp_path / "p.log").write_bytes(hostile)
    merged, states = stage.read_merged([local()], query(tmp_path), {"local": None})
    assert states["local"].error is None
    lines = list(merged)
    assert "\ufffd" not in lines[0].text  # the host kept the bytes (surrogateescape), not U+FFFD
    printer = Printer(["local"], as_json=False, color=False)
    printer.line(lines[0])
    printer.flush()
    out = capsys.readouterr().out
    assert "\x1b" not in out and "\x07" not in out and "\ufffd" not in out
    assert "\\x1b]0;pwned\\x07\\x1b[2J caf\\xe9 \\xff\\xfe done" in out
    printer = Printer(["local"], as_json=True, color=False)
    printer.line(lines[0])
    printer.finish(states, 0)
    document = json.loads(capsys.readouterr().out)
    assert document["lines"][0]["line"].endswith("GET /\\x1b]0;pwned\\x07\\x1b[2J caf\\xe9 \\xff\\xfe done")


def test_run_and_tracebacks_go_through_the_same_function(capsys):
    output.write_host_text(b"\x1b[31mred\x1b[0m \xe9\n")
    output.print_json({"stdout": "\x1b[2J\udce9"})
    out = capsys.readouterr().out
    assert "\x1b" not in out and "\\x1b[31mred\\x1b[0m \\xe9\n" in out
    assert json.loads(out[out.index("{"):])["stdout"] == "\\x1b[2J\\xe9"


def huge_log(tmp_path: Path, size: int) -> bytes:
    log = tmp_path / "p.log"
    with open(log, "wb") as fh:
        fh.write(stamp(BASE) + b" before\n")
        fh.write(stamp(BASE + 1) + b" prompt: " + "\u00e9".encode() * (size // 2) + b"\n")
        fh.write(stamp(BASE + 2) + b" after\n")
    return log.read_bytes()


def test_a_huge_line_is_cut_with_a_marker_forward_backward_and_in_pages(tmp_path):
    data = huge_log(tmp_path, 8 << 20)
    long_line = data.split(b"\n")[1]
    for kw in ({}, {"tail": 2}, {"tail": 3}, {"page_bytes": 10_000}):
        merged, states = stage.read_merged([local()], query(tmp_path, **kw), {"local": None})
        texts = [x.text for x in merged]
        assert states["local"].error is None, kw
        assert texts[-1].endswith(" after"), kw
        cut = texts[-2]
        kept = cut[:cut.index(" \u2026 [")].encode()
        assert len(kept) <= remote_logs.MAX_LINE_BYTES and long_line.startswith(kept), kw
        assert cut.endswith(f" \u2026 [{len(long_line) - len(kept)} bytes cut]"), kw
        assert "\udcc3" not in cut  # the cut never splits a character in two
        assert states["local"].answer_bytes < 200_000, kw
    merged, states = stage.read_merged([local()], query(tmp_path), {"local": None})
    list(merged)
    assert states["local"].bytes_read == len(data)  # cut in the answer, but read (and the cursor moved) whole


def test_reading_a_huge_line_backwards_holds_a_block_not_the_line(tmp_path):
    huge_log(tmp_path, 16 << 20)
    end = (tmp_path / "p.log").stat().st_size
    tracemalloc.start()
    try:
        lines = list(remote_logs.reverse_lines(str(tmp_path / "p.log"), end))
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert [length for _, length in lines][0] == len(stamp(BASE + 2) + b" after\n")
    assert sum(length for _, length in lines) == end
    assert peak < 4 * (remote_logs.BLOCK + remote_logs.MAX_LINE_BYTES), peak


def test_reverse_lines_agree_with_a_plain_split(tmp_path):
    for body in (b"", b"a\n", b"a\nb", b"\n\n", b"x" * 200_000 + b"\ny\n" + b"z" * 70_000, b"a\r\nb\n"):
        path = tmp_path / "f"
        path.write_bytes(body)
        got = list(remote_logs.reverse_lines(str(path), len(body)))
        expected = body.splitlines(keepends=True)[::-1]
        assert [n for _, n in got] == [len(x) for x in expected], body[:20]
        assert [h for h, _ in got] == [x[:remote_logs.MAX_LINE_BYTES] for x in expected]


def test_a_long_line_still_being_written_is_not_taken_half(tmp_path):
    log = tmp_path / "p.log"
    log.write_bytes(stamp(BASE) + b" done\n" + b"y" * (remote_logs.MAX_LINE_BYTES * 3))
    merged, states = stage.read_merged([local()], query(tmp_path), {"local": None})
    assert [x.text for x in merged] == [stamp(BASE).decode() + " done"]
    with open(log, "ab") as fh:
        fh.write(b"end\n")
    merged, _ = stage.read_merged([local()], query(tmp_path), {"local": states["local"].cursor})
    (text,) = [x.text for x in merged]
    assert text.startswith("yyy") and text.endswith(f" \u2026 [{3 * remote_logs.MAX_LINE_BYTES + 3 - remote_logs.MAX_LINE_BYTES} bytes cut]")


def test_journald_bytes_are_kept_not_replaced():
    assert remote_logs.journal_text({"MESSAGE": list(b"caf\xe9 \x1b[2J")}) == "caf\udce9 \x1b[2J"
    assert output.terminal_text(remote_logs.journal_text({"MESSAGE": list(b"caf\xe9")})) == "caf\\xe9"


def test_the_printer_stream_is_the_only_writer(capsys):
    # the colored prefix is ours; the host's part never brings its own escape
    printer = Printer(["h"], as_json=False, color=True)
    printer.line(stage.Line("h", None, "\x1b[0m"))
    printer.flush()
    out = capsys.readouterr().out
    assert out == "\x1b[36mh |\x1b[0m \\x1b[0m\n"
