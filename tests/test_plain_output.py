"""The per-host lines written without Rich where Rich would write no styles (cli/output.py): the
same text Rich writes, and Rich's styles kept where FORCE_COLOR asks for them (that `run`, piped,
imports no Rich: tests/test_cli_startup.py)."""

from __future__ import annotations

import io
import subprocess
import sys

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from rich.console import Console
from rich.text import Text

from orchestrator.cli import output

from .conftest import ROOT, fenced_env

ASCII_TITLE = st.text(alphabet=st.characters(min_codepoint=0x20, max_codepoint=0x7E), min_size=1, max_size=200)


def rich_console(width: int, **kwargs) -> Console:
    return Console(file=io.StringIO(), soft_wrap=True, width=width, **kwargs)


class Pipe(io.StringIO):
    encoding = "utf-8"  # a UTF-8 pipe (a StringIO has no encoding)


@pytest.fixture(autouse=True)
def no_forced_styles(monkeypatch):
    for name in ("FORCE_COLOR", "TTY_COMPATIBLE"):
        monkeypatch.delenv(name, raising=False)


@settings(max_examples=300, deadline=None)
@given(name=ASCII_TITLE, status=ASCII_TITLE, width=st.integers(min_value=1, max_value=300))
def test_a_host_rule_written_plainly_is_rich_s_rule(name, status, width):
    console = rich_console(width)
    # the title as a Text, not markup: Rich's markup escape doubles a lone trailing backslash
    # ('x \\' is drawn 'x \\\\'), which the plain path does not copy
    console.rule(Text.assemble((name, "green"), " ", status))
    plain = Pipe()
    saved = sys.stdout, output._WIDTH, output.__dict__.get("stdout")
    # a title Rich must cut (longer than the width less 4) goes to the module's console: one of this width
    sys.stdout, output._WIDTH, output.stdout = plain, width, Console(file=plain, soft_wrap=True, width=width)
    try:
        output.host_rule(name, status, "green")
    finally:
        sys.stdout, output._WIDTH, output.stdout = saved
    assert plain.getvalue() == console.file.getvalue()


def test_a_wide_or_unprintable_title_goes_to_rich(monkeypatch, capsys):
    monkeypatch.setattr(output, "_WIDTH", 40)
    # the module's console is made on first use, at the width of then: one made by an earlier
    # test in this process would draw at its own width, so this test's is made here, at 40
    monkeypatch.setitem(vars(output), "stdout", None)
    output.host_rule("\u4e2d\u6587-host", "ok", "green")  # two cells a character: Rich measures
    drawn = rich_console(40)
    drawn.rule("[green]\u4e2d\u6587-host[/] ok")
    assert capsys.readouterr().out == drawn.file.getvalue()


def test_progress_and_say_write_what_rich_writes(capsys):
    progress = output.Progress(["ct129", "ct[130]"], "run")
    for host, event, detail in (("ct129", "ok", ""), ("ct[130]", "failed", "exit code 2\nmore")):
        progress(host, "connecting")
        progress(host, event, detail)
    output.say("3 ok, 1 failed")
    output.say(output.shown("warning: [x] \x1b[2J"), style="yellow", end="")
    captured = capsys.readouterr()
    lines = captured.err.splitlines()
    assert [line.rsplit(" (", 1)[0] for line in lines] == ["ct129: ok", "ct[130]: failed"]
    assert lines[1].endswith("s) exit code 2")
    console = rich_console(160)
    console.print("3 ok, 1 failed")
    console.print(output.escape("warning: [x] \x1b[2J"), style="yellow", end="")
    assert captured.out == console.file.getvalue() == "3 ok, 1 failed\nwarning: [x] \\x1b[2J"


def test_host_text_keeps_its_tabs_and_shortcodes_written_plainly(capsys):
    output.say(output.shown("a\tb :thumbs_up:"))
    assert capsys.readouterr().out == "a\tb :thumbs_up:\n"  # Rich: 'a       b 👍'


def run_in_cli(code: str, env: dict | None = None) -> str:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT,
                          env=fenced_env(env), timeout=60, check=True).stdout


def test_force_color_keeps_rich_s_styles_on_a_pipe():
    code = ("from orchestrator.cli import output; output.say('3 ok', style='green'); "
            "output.host_rule('ct129', 'ok', 'green'); output.stdout.print(output.escape('x :thumbs_up:'))")
    plain, styled = run_in_cli(code, {"FORCE_COLOR": ""}), run_in_cli(code, {"FORCE_COLOR": "1"})
    assert "\x1b[" not in plain and plain.startswith("3 ok\n\u2500")
    assert "\x1b[32m3 ok" in styled and "\x1b[32mct129" in styled
    assert plain.endswith("x :thumbs_up:\n") and "x :thumbs_up:" in styled  # host text, never an emoji
