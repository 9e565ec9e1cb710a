"""The lab itself: isolation between hosts, idempotent up, fault knobs, a clean down."""

from __future__ import annotations

import glob
import os
import subprocess

import pytest

from orchestrator.fleet.hostkeys import KnownHosts
from orchestrator.fleet.transport import Connection

from .conftest import TEST_LAB_DIR, spare_subnet
from .polling import wait_for

pytestmark = pytest.mark.lab


def connect(inventory, name):
    return Connection(inventory.hosts[name], KnownHosts(inventory.known_hosts_path))


def test_hosts_are_isolated(inventory):
    with connect(inventory, "ct129") as a, connect(inventory, "ct130") as b:
        for path in ("/root/only-on-ct129", "/var/lib/sglfleet/only-on-ct129", "/tmp/only-on-ct129",
                     "/var/tmp/only-on-ct129",
                     "/etc/systemd/system/only-on-ct129.service", "/root/ml-env/only-on-ct129"):
            assert a.run(f"echo x > {path}").ok
            assert a.run(f"test -f {path}").ok
            assert b.run(f"test -e {path}").exit_code == 1, f"{path} leaked to ct130"
            assert not os.path.exists(path), f"{path} leaked to the real machine"
        assert a.run("hostname").stdout == b"ct129\n" and b.run("hostname").stdout == b"ct130\n"
        # own pid namespace: PID 1 is the host's init, and ct130's processes are not visible
        assert b"hostinit.py" in a.run("cat /proc/1/cmdline").stdout
        assert b"ct130" not in a.run("ps -eo args").stdout


def test_lab_up_again_is_a_noop(lab):
    before = {h.name: h.unshare_pid for h in lab.hosts()}
    known = lab.known_hosts_path.read_text()
    lab.up(len(before))
    assert {h.name: h.unshare_pid for h in lab.hosts()} == before
    assert lab.known_hosts_path.read_text() == known


@pytest.mark.slow
def test_kill_host_and_lab_down_leave_nothing(tmp_path):
    from orchestrator.lab.manager import Lab

    lab = Lab(state_dir=TEST_LAB_DIR.with_name(f"{TEST_LAB_DIR.name}-down-test"), inventory_path=tmp_path / "lab.yaml",
              subnet=spare_subnet())
    lab.down()
    lab.up(2)
    namespaces = {ns for h in ("ct129", "ct130") for ns in lab.namespaces(h).values()}
    pids = [lab.init_pid(h) for h in lab.hosts()]
    assert len(namespaces) == 6 and all(pids)

    lab.kill_host("ct130")
    status = {s.name: s for s in lab.status()}
    assert status["ct129"].running and status["ct129"].sshd
    assert not status["ct130"].running

    lab.down()

    def still_in_use() -> set[str]:
        left = set()
        for link in glob.glob("/proc/[0-9]*/ns/*"):
            try:
                if os.readlink(link) in namespaces:
                    left.add(f"{link} ({open(link.rsplit('/ns/', 1)[0] + '/cmdline', 'rb').read()[:80]!r})")
            except OSError:
                pass
        return left

    # a helper outside the host's PID namespace (an nsenter waiting for its child) may take a
    # moment to see its child gone on a loaded machine (a fixed 0.2 s fell short in CI)
    assert wait_for(lambda: not still_in_use(), timeout=30), f"namespaces still in use: {sorted(still_in_use())[:5]}"
    assert not any(os.path.exists(f"/proc/{pid}") for pid in pids)
    with open("/proc/self/mountinfo") as fh:
        assert str(lab.state_dir) not in fh.read()
    assert not lab.inventory_path.exists() and not lab.known_hosts_path.exists()
    assert not (lab.state_dir / "hosts").exists()


def test_state_dir_under_a_per_host_path_is_refused(tmp_path):
    from orchestrator.errors import SglfleetError
    from orchestrator.lab.manager import Lab

    with pytest.raises(SglfleetError, match="every lab host replaces with its own copy"):
        Lab(state_dir=tmp_path / "lab")


@pytest.mark.parametrize("args, message", [(["--hosts", "2", "--systemd", "3"], "--systemd must be between 0 and"),
                                           (["--hosts", "0"], "--hosts must be between 1 and"),
                                           (["--hosts", "300", "--router"], "holds at most 253 hosts")])
def test_bad_host_counts_are_bad_input(tmp_path, args, message):
    from .conftest import sglfleet

    state = TEST_LAB_DIR.with_name(f"{TEST_LAB_DIR.name}-bad-counts")
    result = sglfleet("lab", "up", *args, env={"SGLFLEET_LAB_DIR": str(state),
                                               "SGLFLEET_LAB_INVENTORY": str(tmp_path / "lab.yaml")})
    assert result.returncode == 2 and message in result.stderr, result.stderr
    assert not (tmp_path / "lab.yaml").exists()


def test_a_run_takes_down_only_the_labs_of_runs_that_are_gone(tmp_path):
    # Run labs are named by their pytest's pid: a live run's lab is never a leftover.
    from .conftest import RUN_LAB_PREFIX, stale_run_labs

    proc = subprocess.Popen(["true"])  # a pid that has exited
    proc.wait()
    alive = os.getppid()
    for name in (f"{RUN_LAB_PREFIX}{proc.pid}", f"{RUN_LAB_PREFIX}{proc.pid}-logs",
                 f"{RUN_LAB_PREFIX}{proc.pid}-logs-inventory", f"{RUN_LAB_PREFIX}{alive}",
                 f"{RUN_LAB_PREFIX}{alive}-deploy", f"{RUN_LAB_PREFIX}{os.getpid()}", "lab-test-other"):
        (tmp_path / name).mkdir()
    assert [p.name for p in stale_run_labs(tmp_path)] == sorted(
        [f"{RUN_LAB_PREFIX}{proc.pid}", f"{RUN_LAB_PREFIX}{proc.pid}-logs", f"{RUN_LAB_PREFIX}{proc.pid}-logs-inventory"])


def test_addresses_go_on_in_the_next_subnets_and_a_lab_past_the_last_is_refused(tmp_path):
    from orchestrator.errors import ConfigError
    from orchestrator.lab.manager import Lab, host_address

    assert [host_address(i, "127.0.8") for i in (0, 253, 254, 507, 508, 999)] == [
        "127.0.8.1", "127.0.8.254", "127.0.9.1", "127.0.9.254", "127.0.10.1", "127.0.11.238"]
    lab = Lab(state_dir=TEST_LAB_DIR.with_name(f"{TEST_LAB_DIR.name}-too-far"), inventory_path=tmp_path / "lab.yaml",
              subnet="127.0.254")
    with pytest.raises(ConfigError, match="would need subnets up to 127.0.256"):
        lab.up(600)
    assert not lab.state_file.exists() and not (tmp_path / "lab.yaml").exists()


def test_pid_1_is_the_perl_reaper_and_knobs_pulled_back_to_back_both_act(lab, inventory):
    name = lab.hosts()[-1].name
    pid = lab.init_pid(lab._host(name))
    assert os.readlink(f"/proc/{pid}/exe") == "/usr/bin/perl"
    assert open(f"/proc/{pid}/cmdline", "rb").read().startswith(b"hostinit.py (its Perl reaper)")
    for _ in range(3):  # a start sent while the stop still waited for sshd to exit was lost once
        lab.stop_sshd(name)
        lab.start_sshd(name)
    with connect(inventory, name) as conn:
        # an orphan (its parent, the shell, is gone at once) is reaped by PID 1 when it exits
        orphan = conn.run("sh -c 'sleep 0.2 & echo $!'").stdout.strip().decode()
        gone = wait_for(lambda: conn.run(f"test -e /proc/{orphan}").exit_code == 1, timeout=10)
    assert gone, f"orphan {orphan} is still there (a zombie PID 1 did not reap?)"
