"""The suite's CLI runs (tests/cli_zygote.py): a fork of the zygote answers as a fresh start does,
and a call the zygote could answer differently gets a fresh start."""

from __future__ import annotations

import subprocess
import sys

import pytest

from .cli_zygote import zygote_for
from .conftest import ROOT, fenced_env, sglfleet


@pytest.fixture
def zygote():
    zygote = zygote_for(fenced_env(), ROOT)
    if zygote is None:
        pytest.skip("no CLI zygote here (SGLFLEET_TEST_FRESH_CLI=1, or its import printed something)")
    # made by this worker's first CLI call, perhaps many tests ago: it must still serve ordinary calls
    assert zygote.serves(fenced_env()), zygote.why_not(fenced_env())
    return zygote


def fresh(*args: str, env=None, cwd=ROOT) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "orchestrator.cli", *args], capture_output=True, text=True,
                          env=fenced_env(env), cwd=cwd, timeout=120)


def local_inventory(directory):
    (directory / "local.yaml").write_text("all:\n  hosts:\n    here:\n      ansible_connection: local\n"
                                          "    there:\n      ansible_host: 127.0.0.9\n")


@pytest.mark.parametrize(("args", "code"), [(["--help"], 0), (["hosts", "all", "-i", "local.yaml", "--json"], 0),
                                            (["hosts", "nowhere", "-i", "local.yaml"], 2),
                                            (["hosts", "all", "-i", "missing.yaml"], 2), (["no-such-command"], 2)])
def test_a_fork_answers_as_a_fresh_start_does_in_the_calls_directory(zygote, tmp_path, args, code):
    local_inventory(tmp_path)
    before = zygote.calls
    forked = sglfleet(*args, cwd=tmp_path)  # the relative -i is found only in the call's own directory
    assert zygote.calls == before + 1  # ordinary calls are served: PYTEST_CURRENT_TEST differs in each
    started = fresh(*args, cwd=tmp_path)
    assert (forked.returncode, forked.stdout, forked.stderr) == (started.returncode, started.stdout, started.stderr)
    assert forked.returncode == code, forked.stdout + forked.stderr


def test_a_fork_takes_the_calls_environment(zygote, tmp_path):
    local_inventory(tmp_path)
    forked = sglfleet("hosts", "all", "--json", env={"SGLFLEET_INVENTORY": str(tmp_path / "local.yaml")})
    assert forked.returncode == 0, forked.stderr
    assert '"here"' in forked.stdout and '"there"' in forked.stdout


def test_a_name_read_at_import_gets_a_fresh_start(zygote):
    before = zygote.calls
    wide = sglfleet("--help", env={"COLUMNS": "200"})  # cli/output.py sizes its consoles at import
    assert zygote.calls == before and wide.returncode == 0
    assert wide.stdout == fresh("--help", env={"COLUMNS": "200"}).stdout
    assert zygote.serves(fenced_env({"SGLFLEET_SWAP_PACE_S": "1", "XDG_CACHE_HOME": "/nowhere"}))
    assert not zygote.serves(fenced_env({"PYTHONHASHSEED": "1"}))


def test_a_call_past_its_timeout_is_killed(zygote):
    with pytest.raises(subprocess.TimeoutExpired):
        zygote.run(["lab", "proxy", "ct129", "--listen", "127.0.0.1:0"], fenced_env(), ROOT, timeout=0.05)
    assert zygote.run(["--help"], fenced_env(), ROOT, timeout=60).returncode == 0  # and the zygote serves on


def test_a_zygote_is_started_anew_when_this_process_s_environment_changed(zygote, monkeypatch):
    monkeypatch.setenv("PLAT", "linux-x86_64")  # what distutils sets here when the kernel tests build
    assert not zygote.serves(fenced_env())
    assert sglfleet("--help").returncode == 0
    now = zygote_for(fenced_env(), ROOT)
    assert now is not zygote and now.calls == 1 and zygote.proc.poll() is not None
