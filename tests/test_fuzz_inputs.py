"""Fuzzing the files users write: inventories and profiles.

Every case must end as a loaded inventory/profile or as a ConfigError (exit 2, one paragraph,
with the file named): never another exception, which the CLI would show as a traceback. Cases
are random YAML structures mutated from real ones, random scalars in every position, and random
bytes. A handful also go through the real CLI, which must print no traceback.
"""

from __future__ import annotations

import copy
import os
import tempfile
from pathlib import Path
from typing import Any

import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from orchestrator.errors import SglfleetError
from orchestrator.fleet.inventory import load_inventory
from orchestrator.spec.profile import load_profile

from .conftest import ROOT, sglfleet

INVENTORY = {
    "all": {
        "vars": {"ansible_user": "root", "ansible_python_interpreter": "/root/ml-env/bin/python3",
                 "sglfleet_profile_overrides": {"qwen36-ddtree": {"server": {"port": 30001}}}},
        "children": {
            "gpu-fleet": {"hosts": {"ct129": {"ansible_host": "127.0.1.1", "ansible_port": 22},
                                    "ct130": {"ansible_host": "127.0.1.2", "sglfleet_proxy_jump": "ct129"}},
                          "vars": {"sglfleet_models_dir": "/root/models"}},
            "lab": {"children": {"gpu-fleet": {}}, "hosts": {"ct131": None}},
        },
    }
}
PROFILE = yaml.safe_load((ROOT / "playbooks" / "qwen36-ddtree.yaml").read_text())
PROFILE["artifacts"] = {}  # artifacts point at files relative to the profile; fuzz the rest

scalars = st.one_of(st.none(), st.booleans(), st.integers(min_value=-2**40, max_value=2**40),
                    st.floats(allow_nan=True), st.text(max_size=30),
                    st.sampled_from(["", ":", ",", "!", "&", "~(", "[1:", "h[01:99]", "0.0.0.0", "10.0.0.1",
                                     "host:abc", "../..", "\n", "a\x00b", "-5", "0"]))
values = st.recursive(scalars, lambda inner: st.one_of(st.lists(inner, max_size=4),
                                                       st.dictionaries(st.text(max_size=12), inner, max_size=4)),
                      max_leaves=12)


def _paths(node: Any, prefix: tuple = ()) -> list[tuple]:
    out = [prefix]
    if isinstance(node, dict):
        for key, value in node.items():
            out += _paths(value, prefix + (key,))
    elif isinstance(node, list):
        for index, value in enumerate(node):
            out += _paths(value, prefix + (index,))
    return out


@st.composite
def mutated(draw: Any, base: dict) -> Any:
    """`base` with a few random nodes replaced, deleted or given extra keys."""
    document = copy.deepcopy(base)
    for _ in range(draw(st.integers(min_value=1, max_value=4))):
        paths = [p for p in _paths(document) if p]
        if not paths or not isinstance(document, dict):
            break
        path = draw(st.sampled_from(paths))
        parent = document
        for key in path[:-1]:
            parent = parent[key]
        action = draw(st.sampled_from(["replace", "delete", "add"]))
        if action == "replace":
            parent[path[-1]] = draw(values)
        elif action == "delete" and isinstance(parent, dict):
            del parent[path[-1]]
        elif isinstance(parent, dict):
            parent[draw(st.text(max_size=12))] = draw(values)
    return document


def _dump(document: Any) -> bytes:
    return yaml.safe_dump(document, allow_unicode=True).encode("utf-8")


def _check(loader: Any, data: bytes, name: str) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / name
        path.write_bytes(data)
        try:
            loader(path)
        except SglfleetError as exc:
            assert exc.exit_code == 2, (type(exc).__name__, str(exc))
            message = str(exc)
            assert message and "Traceback" not in message
            assert str(path) in message or "inventory" in message or "profile" in message, message


def _load_inventory(path: Path) -> None:
    inventory = load_inventory(path)
    for pattern in ("all", "gpu-fleet", "ct1*", "gpu-fleet:!ct130"):
        try:
            inventory.select(pattern)
        except SglfleetError as exc:  # a term matching nothing in a mutated inventory: bad input, exit 2
            assert exc.exit_code == 2


def _load_profile(path: Path) -> None:
    load_profile(str(path)).artifacts()


FUZZ = settings(max_examples=int(os.environ.get("SGLFLEET_FUZZ_EXAMPLES", "300")), deadline=None,
                suppress_health_check=[HealthCheck.too_slow])


@FUZZ
@given(mutated(INVENTORY))
def test_mutated_inventories_load_or_fail_with_a_config_error(document):
    _check(_load_inventory, _dump(document), "inventory.yaml")


@FUZZ
@given(mutated(PROFILE))
def test_mutated_profiles_load_or_fail_with_a_config_error(document):
    _check(_load_profile, _dump(document), "profile.yaml")


@FUZZ
@given(st.binary(max_size=300), st.integers(min_value=0, max_value=600))
def test_random_bytes_in_an_inventory_or_profile(noise, at):
    for base, loader, name in ((INVENTORY, _load_inventory, "inventory.yaml"), (PROFILE, _load_profile, "p.yaml")):
        text = _dump(base)
        at = min(at, len(text))
        _check(loader, text[:at] + noise + text[at:], name)


def test_the_cli_prints_no_traceback_for_broken_files(tmp_path):
    """The same classes through the real CLI (a few cases: each is a process start)."""
    cases = [b"\xff\xfe not utf-8", b"all: [1, 2", b"all:\n  hosts: ct129\n", b"all:\n  children: 7\n",
             b"all:\n  hosts:\n    ct129: {ansible_host: 127.0.0.5, sglfleet_proxy_jump: 'host:abc'}\n"]
    for index, data in enumerate(cases):
        inventory = tmp_path / f"inv{index}.yaml"
        inventory.write_bytes(data)
        proc = sglfleet("hosts", "all", "-i", str(inventory))
        assert proc.returncode == 2 and "Traceback" not in proc.stderr + proc.stdout, (data, proc.stderr)
        assert str(inventory) in " ".join(proc.stderr.split()), proc.stderr


# ---------------------------------------------------------------- every command's options

import sys  # noqa: E402

import click  # noqa: E402
import pytest  # noqa: E402
import typer  # noqa: E402

from orchestrator.cli import app, common, main  # noqa: E402
from orchestrator.cli.option_paths import writable  # noqa: E402
from orchestrator.errors import ConfigError  # noqa: E402

# Hosts the loopback guard refuses before a socket exists (192.0.2.0/24 is TEST-NET-1: routed
# nowhere; the suite runs with only `lo` and a fence on top): every command meets hosts that
# cannot be reached, at once.
UNREACHABLE = ("all:\n  children:\n    gpu-fleet:\n      hosts:\n"
               "        ct129: {ansible_host: 192.0.2.1}\n        ct130: {ansible_host: 192.0.2.2}\n")
HOSTILE = ["nan", "inf", "-inf", "-1", "0", "1e308", "99999999999999999999999", "", " ", "\u00fc\u00df",
           "\x1b[2J", "a\nb", "all", "ct129", ":", ",", "!ct129", "~(", "ct1[0:", "10m", "last",
           "2026-13-45", "qwen36-ddtree", "no-such-profile", "/proc/x/y", "/sys/kernel/x", "/dev/null",
           "/dev/full", "/etc/passwd/x", "rel-dir", "../up", "/proc/self/status", "9" * 400, "--json"]
WRITES = ("runs", "csv_path", "plot_dir", "out")  # options naming where this machine writes
VALID_ARGUMENTS = {"pattern": st.sampled_from(["all", "ct129", "gpu-fleet"]), "host": st.just("ct129"),
                   "profile": st.sampled_from(["qwen36-ddtree", "qwen3-8b-dflash"]), "command": st.just("true")}
SKIPPED = {"inventory_path", "follow", "local", "python"}  # -i is ours; -f never ends; --local runs SGLang here
COMMANDS = [(name, command) for name, command in typer.main.get_command(app).commands.items() if name != "lab"]
COMMANDS = [(f"{name} {sub}", c) for name, group in COMMANDS if isinstance(group, click.Group)
            for sub, c in group.commands.items()] + [(n, c) for n, c in COMMANDS if not isinstance(c, click.Group)]


def _argv(draw: Any, command: click.Command) -> list[str]:
    value = st.one_of(st.sampled_from(HOSTILE), st.text(max_size=12).filter(lambda t: "/" not in t and "\0" not in t),
                      st.integers(min_value=-10**12, max_value=10**12).map(str),
                      st.floats(allow_nan=True, allow_infinity=True).map(repr))
    paths = st.sampled_from(["/proc/x/y", "/sys/kernel/x", "/dev/null", "/dev/full", "/etc/passwd/x", "rel-dir",
                             "../up", "", "\u00fc", "runs"])
    argv: list[str] = []
    for param in command.params:
        if param.name in SKIPPED:
            continue
        if param.param_type_name == "argument":
            if param.required or draw(st.booleans()):  # mostly valid, so the options are reached
                argv.append(draw(st.one_of(VALID_ARGUMENTS.get(param.name, value), value)
                                 if draw(st.integers(0, 3)) else value))
        elif draw(st.integers(0, 3)) == 0 or param.name in WRITES and draw(st.booleans()):
            flag = max(param.opts, key=len)
            writes = param.name in WRITES
            argv += [flag] if getattr(param, "is_flag", False) else [flag, draw(paths if writes else value)]
    return argv


def _invoke(argv: list[str]) -> int:
    """The CLI in this process, as `sglfleet ARGV` runs it; an exception out of main() is what a
    user sees as a traceback."""
    saved = sys.argv
    sys.argv = ["sglfleet", *argv]
    common.GLOBALS.inventory = None
    try:
        main()
        return 0
    except SystemExit as exc:
        return exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    finally:
        sys.argv = saved


@pytest.mark.parametrize("name,command", COMMANDS, ids=[n for n, _ in COMMANDS])
def test_every_commands_options_against_unreachable_hosts_exit_0_1_or_2_and_never_a_traceback(
        name, command, tmp_path, monkeypatch, capsys):
    assert os.environ.get("SGLFLEET_LOOPBACK_ONLY") == "1"  # the guard refuses 192.0.2.x before a socket
    inventory = tmp_path / "inventory.yaml"
    inventory.write_text(UNREACHABLE)
    monkeypatch.chdir(tmp_path)  # --runs-dir, --out, --csv relative to here (default runs/ too)

    @settings(max_examples=40, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)
    @given(st.data())
    def check(data: Any) -> None:
        argv = [*name.split(), *_argv(data.draw, command), "-i", str(inventory)]
        code = _invoke(argv)
        out, err = capsys.readouterr()
        assert code in (0, 1, 2), (argv, code, err[-2000:])
        assert "Traceback (most recent call last)" not in err + out, (argv, err[-3000:])

    check()


def test_output_paths_are_checked_with_the_path_and_the_reason(tmp_path):
    (tmp_path / "file").write_text("x")
    cases = {("--runs-dir", "/proc/x/y", "dir"): "cannot create anything in /proc",
             ("--runs-dir", str(tmp_path / "file"), "dir"): "exists and is not a directory",
             ("--plot", str(tmp_path / "file" / "sub"), "dir"): f"{tmp_path / 'file'} is not a directory",
             ("--csv", str(tmp_path), "file"): "is a directory",
             ("--out", "", "dir"): "not a path"}
    for (option, path, kind), why in cases.items():
        with pytest.raises(ConfigError, match=".*") as info:
            writable(option, path, kind)
        assert str(info.value).startswith(f"{option} ") and why in str(info.value), str(info.value)
    writable("--runs-dir", str(tmp_path / "new" / "deeper"), "dir")
    assert not (tmp_path / "new").exists()  # checked, not created
    writable("--csv", str(tmp_path / "file"), "file")
    assert (tmp_path / "file").read_text() == "x"
    assert [p.name for p in tmp_path.iterdir()] == ["file"]  # the probe left nothing


def test_an_unwritable_runs_dir_is_refused_before_any_host_is_contacted(tmp_path, capsys):
    inventory = tmp_path / "inventory.yaml"
    inventory.write_text(UNREACHABLE)
    for argv in (["smoke", "all", "qwen36-ddtree", "--runs-dir", "/proc/nope"],
                 ["logs", "all", "--bundle", "--runs-dir", "/dev/null"],
                 ["metrics", "all", "--csv", str(tmp_path)], ["deploy", "all", "qwen36-ddtree", "--runs-dir", "/sys/x"]):
        code = _invoke([*argv, "-i", str(inventory)])
        err = capsys.readouterr().err
        assert code == 2 and argv[-1] in err and "192.0.2" not in err, (argv, err)
