"""Inputs that must never run as code or reach outside where they belong, and stopping cleanly.

Patchsets ship only the files they hold or declare, import checks import modules by name, and
`patchset init` writes only inside --out (no SSH: each refusal happens before a connection).
Ctrl-C / SIGTERM during a push, on labs of their own (they leave releases on the hosts).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from orchestrator.errors import ConfigError
from orchestrator.fleet.hostkeys import KnownHosts
from orchestrator.fleet.inventory import load_inventory
from orchestrator.fleet.transport import Connection
from orchestrator.remote import hostlib, release
from orchestrator.spec.patchset import load_patchset

from .conftest import ROOT, fenced_env, sglfleet
from .private_lab import private_lab

MANIFEST = "name: t\npackage: sglang\nversions: '>=0'\n"


def patchset(tmp_path: Path, body: str) -> Path:
    directory = tmp_path / "ps"
    (directory / "files").mkdir(parents=True, exist_ok=True)
    (directory / "files" / "mine.py").write_text("X = 1\n")
    (directory / "patchset.yaml").write_text(MANIFEST + body)
    return directory


@pytest.mark.parametrize("name", ["os; os.system('touch /tmp/pwned')", "__import__('os')", "a..b", "sglang.",
                                  "1abc", "a b", "x\nimport os"])
def test_import_check_names_must_be_dotted_module_names(tmp_path, name):
    directory = patchset(tmp_path, "import_check:\n  - " + json.dumps(name) + "\n")
    with pytest.raises(ConfigError) as info:
        load_patchset(directory)
    assert f"{directory}/patchset.yaml:4: import_check.0:" in str(info.value)
    assert "is not a dotted module name" in str(info.value)


def test_the_host_imports_check_modules_by_name_never_as_source(tmp_path):
    host = release.Host.__new__(release.Host)
    (tmp_path / "site" / "pkg").mkdir(parents=True)
    host.state, host.package = str(tmp_path / "state"), {"root": str(tmp_path / "site" / "pkg"),
                                                         "site": str(tmp_path / "site")}
    marker = tmp_path / "ran"
    release.check_python(host, [], ["json", "os.path"])  # plain names import fine
    with pytest.raises(hostlib.Failure, match="not module names"):
        release.check_python(host, [], [f"os; open({str(marker)!r}, 'w')"])
    assert not marker.exists()
    with pytest.raises(hostlib.Failure, match="import check failed"):
        release.check_python(host, [], ["no_such_module_here"])


def test_a_source_that_is_a_symlink_is_refused_at_load(tmp_path):
    directory = patchset(tmp_path, "files:\n  - path: srt/x.py\n    source: files/link.py\n    replaces: new\n")
    (directory / "files" / "link.py").symlink_to("/etc/hostname")
    with pytest.raises(ConfigError) as info:
        load_patchset(directory)
    assert f"{directory}/patchset.yaml:6: files.0.source: files/link.py is (or passes through) a symlink" \
        in str(info.value)


def test_a_source_outside_the_patchset_is_refused_unless_its_directory_is_declared(tmp_path):
    shared = tmp_path / "shared"
    shared.mkdir()
    (shared / "ops.py").write_text("Y = 2\n")
    body = "files:\n  - path: srt/ops.py\n    source: ../shared/ops.py\n    replaces: new\n"
    directory = patchset(tmp_path, body)
    with pytest.raises(ConfigError) as info:
        load_patchset(directory)
    assert "patchset.yaml:6: files.0.source: ../shared/ops.py resolves to" in str(info.value)
    assert "outside the patchset directory" in str(info.value)
    (directory / "patchset.yaml").write_text(MANIFEST + "source_dirs: [../shared]\n" + body)
    assert load_patchset(directory).sources == {"srt/ops.py": b"Y = 2\n"}


def test_a_symlinked_directory_on_the_way_to_a_source_is_refused(tmp_path):
    real = tmp_path / "elsewhere"
    real.mkdir()
    (real / "f.py").write_text("Z = 3\n")
    directory = patchset(tmp_path, "files:\n  - path: srt/f.py\n    source: files/sub/f.py\n    replaces: new\n")
    (directory / "files" / "sub").symlink_to(real)
    with pytest.raises(ConfigError, match="passes through"):
        load_patchset(directory)


@pytest.mark.parametrize("new_under", ["../../..", "/etc", "srt/../../x"])
def test_patchset_init_refuses_a_new_under_that_leaves_the_package(tmp_path, new_under):
    edited = tmp_path / "edits"
    edited.mkdir()
    (edited / "new_module.py").write_text("A = 1\n")
    inventory = tmp_path / "inv.yaml"
    inventory.write_text("all:\n  hosts:\n    h1: {ansible_host: 127.0.0.5}\n")
    out = tmp_path / "out"
    proc = sglfleet("patchset", "init", "--from", str(edited), "--against", "h1", "--out", str(out),
                    "--new-under", new_under, "-i", str(inventory))
    assert proc.returncode == 2, proc.stderr
    assert f"--new-under {new_under}:" in proc.stderr and "relative path inside the package" in proc.stderr
    assert not out.exists()


def test_patchset_init_refuses_symlinks_among_the_edited_files(tmp_path):
    edited = tmp_path / "edits"
    edited.mkdir()
    os.symlink("/etc/hostname", edited / "server_args.py")
    from orchestrator.stages.release import init_patchset

    with pytest.raises(ConfigError, match="holds symlinks"):
        init_patchset(None, edited, "sglang", None)  # refused before any connection is used


# ---------------------------------------------------------------- Ctrl-C and SIGTERM


def _start_push(lab, hosts: str, pace_s: float, forks: int = 1) -> subprocess.Popen:
    env = fenced_env({"SGLFLEET_SWAP_PACE_S": str(pace_s), "SGLFLEET_LOOPBACK_ONLY": "1"})
    return subprocess.Popen([sys.executable, "-m", "orchestrator.cli", "push", hosts, "qwen36-ddtree", "--json",
                             "--forks", str(forks), "-i", str(lab.inventory_path)], cwd=ROOT, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _wait_for_swap(conn, deadline_s: float = 120) -> None:
    """Until the host is mid-swap (its journal exists)."""
    deadline = time.monotonic() + deadline_s
    while conn.run("test -e /var/lib/sglfleet/journal.json").exit_code != 0:
        assert time.monotonic() < deadline, "the push never started swapping"
        time.sleep(0.05)


def _release_state(lab, host: str) -> dict:
    proc = sglfleet("releases", host, "--json", "-i", str(lab.inventory_path))
    return json.loads(proc.stdout)["hosts"][host]["value"]


@pytest.mark.lab
@pytest.mark.slow
@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_one_interrupt_mid_swap_finishes_that_host_and_starts_no_other(tmp_path, sig):
    """The first Ctrl-C (or SIGTERM) lets the host being swapped finish its atomic step, starts no
    other host, prints every host's state and exits 130."""
    with private_lab("stop", 2 + (sig == signal.SIGTERM), 3) as lab:
        inv = load_inventory(lab.inventory_path)
        with Connection(inv.hosts["ct129"], KnownHosts(inv.known_hosts_path)) as conn:
            proc = _start_push(lab, "all", pace_s=0.4)
            _wait_for_swap(conn)
            proc.send_signal(sig)
            out, err = proc.communicate(timeout=300)
            assert proc.returncode == 130, err
            doc = json.loads(out)
            assert doc["interrupted"] is True and doc["not_started"] == ["ct130", "ct131"]
            first = doc["hosts"]["ct129"]
            assert first["ok"] and first["value"]["release"], first  # the step it was in completed
            assert conn.run("test -e /var/lib/sglfleet/journal.json").exit_code == 1  # nothing half-done
        for host in ("ct130", "ct131"):
            assert doc["hosts"][host]["error"] == "not started: the run was interrupted"
            assert _release_state(lab, host)["releases"] == []
        assert "no new host or step will start" in " ".join(err.split())


@pytest.mark.lab
@pytest.mark.slow
def test_a_second_interrupt_stops_waiting_and_the_host_is_never_left_half_swapped(tmp_path):
    with private_lab("abort", 4, 2) as lab:
        inv = load_inventory(lab.inventory_path)
        with Connection(inv.hosts["ct129"], KnownHosts(inv.known_hosts_path)) as conn:
            proc = _start_push(lab, "all", pace_s=0.6)
            _wait_for_swap(conn)
            proc.send_signal(signal.SIGINT)
            time.sleep(0.3)
            proc.send_signal(signal.SIGINT)
            out, err = proc.communicate(timeout=60)
            assert proc.returncode == 130
            said = " ".join(err.split())
            assert "stopped waiting" in said and "no host is ever left half-swapped" in said, said
            # Whatever the host side did with the controller gone, the next run sees all-old or
            # all-new files: a committed release, or a journal the next push undoes first.
            deadline = time.monotonic() + 60
            while conn.run("pgrep -f 'release[.]py apply' >/dev/null").exit_code == 0:
                assert time.monotonic() < deadline
                time.sleep(0.2)
        state = _release_state(lab, "ct129")
        again = sglfleet("push", "ct129", "qwen36-ddtree", "--json", "-i", str(lab.inventory_path))
        assert again.returncode == 0, again.stderr
        value = json.loads(again.stdout)["hosts"]["ct129"]["value"]
        assert {f["status"] for f in value["files"]} <= {"current", "add", "change"}  # never "drifted"
        if state["interrupted"]:
            assert value["recovered"]["undone"] is True
        assert _release_state(lab, "ct129")["interrupted"] is None


# ---------------------------------------------------------------- bad input: exit 2, one paragraph


def _inventory(tmp_path: Path, host_vars: str = "") -> Path:
    path = tmp_path / "inv.yaml"
    path.write_text("all:\n  hosts:\n    h1: {ansible_host: 127.0.0.5" + host_vars + "}\n")
    return path


def _one_paragraph_error(proc, *needles: str) -> None:
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "Traceback" not in proc.stderr and proc.stderr.startswith("error: ")
    said = " ".join(proc.stderr.split())
    for needle in needles:
        assert needle in said, said


def test_smoke_local_with_a_missing_python_writes_nothing(tmp_path):
    runs = tmp_path / "runs"
    proc = sglfleet("smoke", "--local", "qwen36-ddtree", "--python", "/nonexistent/python3", "--runs-dir", str(runs))
    _one_paragraph_error(proc, "--python /nonexistent/python3: no such executable here")
    assert not runs.exists()


@pytest.mark.parametrize("command", [["releases", "h1"], ["rollback", "h1"]])
def test_a_package_that_is_not_a_module_name_is_refused_before_connecting(tmp_path, command):
    proc = sglfleet(*command, "--package", "..", "-i", str(_inventory(tmp_path)))
    _one_paragraph_error(proc, "--package '..' is not an importable package name")


@pytest.mark.parametrize("timeout", ["0", "-1"])
def test_run_refuses_a_timeout_that_is_not_positive(tmp_path, timeout):
    proc = sglfleet("run", "h1", "true", "--timeout", timeout, "-i", str(_inventory(tmp_path)))
    _one_paragraph_error(proc, "--timeout must be a positive number of seconds")


def test_forks_zero_is_bad_input(tmp_path):
    proc = sglfleet("facts", "h1", "--forks", "0", "-i", str(_inventory(tmp_path)))
    _one_paragraph_error(proc, "--forks must be at least 1, got 0")


def test_a_missing_identity_file_is_named(tmp_path):
    inventory = _inventory(tmp_path, ", ansible_ssh_private_key_file: /nonexistent/id_ed25519")
    proc = sglfleet("facts", "h1", "--json", "-i", str(inventory))
    assert proc.returncode == 1
    error = json.loads(proc.stdout)["hosts"]["h1"]["error"]
    # named as the inventory spells it (9c443be), with where to fix it
    assert error.startswith("h1: ansible_ssh_private_key_file /nonexistent/id_ed25519 does not exist on this "
                            "machine; fix it in the inventory"), error


@pytest.mark.lab
@pytest.mark.slow
def test_an_interrupted_deploy_finishes_its_host_and_starts_no_other(tmp_path):
    """Ctrl-C during a deploy: the host it is on ends its current step (and either serves the new
    deployment or is left as it was), no other host starts, every host is reported, exit 130."""
    from .test_deploy import profile_variant

    profile = profile_variant(tmp_path, "slow", replace={'SGLFLEET_SIM_LOAD_DELAY: "0.5"': 'SGLFLEET_SIM_LOAD_DELAY: "3"'})
    with private_lab("stop-deploy", 9, 2) as lab:
        inv = load_inventory(lab.inventory_path)
        env = fenced_env({"SGLFLEET_LOOPBACK_ONLY": "1"})
        proc = subprocess.Popen([sys.executable, "-m", "orchestrator.cli", "deploy", "all", profile, "--json",
                                 "--forks", "1", "--runs-dir", str(tmp_path / "runs"), "-i", str(lab.inventory_path)],
                                cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        with Connection(inv.hosts["ct129"], KnownHosts(inv.known_hosts_path)) as conn:
            deadline = time.monotonic() + 300
            while conn.run(f"test -e /var/lib/sglfleet/{hostlib.DEPLOY_LEASE_FILE}").exit_code != 0:
                if proc.poll() is not None:
                    raise AssertionError(f"the deploy ended before it reached ct129: {proc.communicate()}")
                assert time.monotonic() < deadline, "the deploy never reached ct129"
                time.sleep(0.1)
            proc.send_signal(signal.SIGINT)
            out, err = proc.communicate(timeout=600)
            assert proc.returncode == 130, err[-3000:]
            doc = json.loads(out)
            first, second = doc["hosts"]["ct129"], doc["hosts"]["ct130"]
            assert first["ok"] or first.get("stopped"), first.get("summary")
            assert conn.run(f"test -e /var/lib/sglfleet/{hostlib.DEPLOY_LEASE_FILE}").exit_code == 1  # given back
            assert conn.run("test -e /var/lib/sglfleet/journal.json").exit_code == 1  # nothing half-swapped
        assert not second["ok"] and "not started" in second["summary"]
        with Connection(inv.hosts["ct130"], KnownHosts(inv.known_hosts_path)) as conn:
            assert conn.run("test -e /var/lib/sglfleet/servers || test -e /var/lib/sglfleet/releases").exit_code == 1
        assert "no new host or step will start" in " ".join(err.split())


# ---------------------------------------------------------------- profile fields at load


def _profile(tmp_path: Path, body: str) -> Path:
    path = tmp_path / "p.yaml"
    path.write_text("name: p\n" + body)
    return path


@pytest.mark.parametrize("body,line,what", [
    ("model:\n  path: models/Qwen3-8B\n", 3, "model.path 'models/Qwen3-8B' must be an absolute path on the host"),
    ("model:\n  path: ~/m\n", 3, "model.path '~/m' must be an absolute path"),
    ("model:\n  path: /m\nspeculative:\n  algorithm: DFLASH\n  draft_model: ./draft\n", 6,
     "speculative.draft_model './draft' must be an absolute path"),
    ('env:\n  "KEY\\n": x\n', 2, "env key 'KEY\\n' is not a variable name"),
])
def test_profile_host_paths_and_env_keys_are_refused_at_load_with_file_and_line(tmp_path, body, line, what):
    from orchestrator.spec.profile import load_profile

    path = _profile(tmp_path, body)
    with pytest.raises(ConfigError) as info:
        load_profile(str(path))
    assert f"{path}:{line}" in str(info.value) and what in str(info.value), str(info.value)


def test_a_profile_name_ending_in_a_newline_is_refused(tmp_path):
    from orchestrator.spec.profile import load_profile

    path = tmp_path / "p.yaml"
    path.write_text('name: "p\\n"\nmodel:\n  path: /m\n')
    with pytest.raises(ConfigError, match="must be a safe slug"):
        load_profile(str(path))


@pytest.mark.parametrize("var,value,why", [
    ("sglfleet_server_command", "python3 -m sglang.launch_server", "must start with an absolute executable path"),
    ("sglfleet_server_command", "/usr/bin/python3 -m sglang.launch_server; id", "holds shell syntax (';')"),
    ("sglfleet_server_command", "/usr/bin/x $(id)", "holds shell syntax"),
    ("sglfleet_server_command", ["/opt/my server/bin/x", "--a"], "holds shell metacharacters or spaces"),
    ("sglfleet_server_command", ["bin/x"], "must start with an absolute executable path"),
    ("sglfleet_server_bind", "127.0.1.2, 127.0.1.3", "must be one address"),
    ("sglfleet_server_bind", "127.0.1.2 127.0.1.3", "must be one address"),
    ("sglfleet_server_bind", "127.0.1.2:30000", "without a port"),
])
def test_server_command_and_bind_are_checked_at_load_with_file_and_line(tmp_path, var, value, why):
    path = tmp_path / "inventory.yaml"
    path.write_text(json.dumps({"all": {"hosts": {"ct129": {"ansible_host": "127.0.1.1"}}}}, indent=1))
    lines = path.read_text().splitlines()
    lines.insert(4, f'    {json.dumps(var)}: {json.dumps(value)},')
    path.write_text("\n".join(lines) + "\n")
    with pytest.raises(ConfigError) as info:
        load_inventory(str(path))
    assert f"{path}:5" in str(info.value) and why in str(info.value), (path.read_text(), str(info.value))


def test_a_plain_server_command_and_bind_still_load(tmp_path):
    path = tmp_path / "inventory.yaml"
    path.write_text("all:\n  hosts:\n    ct129:\n      ansible_host: 127.0.1.1\n      sglfleet_server_bind: '::'\n"
                    "      sglfleet_server_command: \"/usr/local/bin/sglfleet-sim-server --label 'a b'\"\n")
    host = load_inventory(str(path)).hosts["ct129"]
    assert host.vars["sglfleet_server_bind"] == "::"


# ---------------------------------------------------------------- a host-side helper killed


@pytest.mark.lab
@pytest.mark.slow
def test_a_push_whose_helper_is_killed_says_the_signal_and_that_nothing_was_swapped(tmp_path):
    """The helper dies mid-transfer (kill -9, as the OOM killer would): the push says so with the
    signal, and what the host holds; the next push removes the staging dir it left."""
    with private_lab("killed-helper", 13, 1) as lab:
        inv = load_inventory(lab.inventory_path)
        with Connection(inv.hosts["ct129"], KnownHosts(inv.known_hosts_path)) as conn:
            proc = subprocess.Popen([sys.executable, "-m", "orchestrator.cli", "push", "ct129", "qwen36-ddtree",
                                     "--bwlimit", "4", "-i", str(lab.inventory_path)], cwd=ROOT,
                                    env=fenced_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
            deadline = time.monotonic() + 120
            while conn.run("ls -d /var/lib/sglfleet/releases/*/files").exit_code != 0:
                assert time.monotonic() < deadline and proc.poll() is None, proc.communicate()
                time.sleep(0.05)
            staged = conn.run("ls /var/lib/sglfleet/releases").stdout_text.split()
            killed = conn.run("kill -9 $(python3 -c 'import json;print(json.load(open(\"/var/lib/sglfleet/lock\"))"
                              "[\"pid\"])')")
            assert killed.ok, killed.stderr_text
            out, err = proc.communicate(timeout=120)
            said = " ".join((out + err).split())
            assert proc.returncode == 1, said
            assert "killed by signal 9 (SIGKILL)" in said and "nothing was swapped" in said, said
            assert "Traceback" not in said
            assert conn.run("ls /var/lib/sglfleet/releases").stdout_text.split() == staged  # left behind...
            assert _release_state(lab, "ct129")["releases"] == []  # ...but never listed
            again = sglfleet("push", "ct129", "qwen36-ddtree", "--json", "-i", str(lab.inventory_path))
            assert again.returncode == 0, again.stderr
            release = json.loads(again.stdout)["hosts"]["ct129"]["value"]["release"]
            assert conn.run("ls /var/lib/sglfleet/releases").stdout_text.split() == [release]  # ...and removed
