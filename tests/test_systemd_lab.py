"""The systemd lab host: real systemd as PID 1 in a root of its own, and the deploy, logs and
stop paths that only a systemd host takes (a unit, journald, `systemctl stop` draining).

systemd's boot runs systemd-tmpfiles, which empties /tmp (and rewrites parts of /run and /var)
of the root it sees; the first test is the proof that the machine's own /tmp, /run and /var
survive a systemd host's boot and shutdown."""

from __future__ import annotations

import json
import os
import tempfile
import time
import uuid
from pathlib import Path

import pytest

from .private_lab import deploy_profile, private_lab



def systemd_missing() -> str | None:
    """Why this machine cannot run a systemd lab host (no systemd binary, no cgroup2), or None."""
    from orchestrator.errors import SglfleetError
    from orchestrator.lab.manager import Lab

    try:
        Lab(state_dir=Path("/var/cache/sglfleet/lab-probe")).check_systemd_prerequisites()
    except SglfleetError as exc:
        return str(exc)
    return None


pytestmark = [pytest.mark.lab, pytest.mark.skipif(systemd_missing() is not None, reason=str(systemd_missing()))]

UNIT = "sglfleet-qwen36-ddtree.service"


def ssh(lab, host: str, command: str, timeout: float = 120) -> tuple[int, str, str]:
    from orchestrator.fleet.hostkeys import KnownHosts
    from orchestrator.fleet.inventory import load_inventory
    from orchestrator.fleet.transport import Connection

    inventory = load_inventory(str(lab.inventory_path))
    with Connection(inventory.hosts[host], KnownHosts(inventory.known_hosts_path)) as conn:
        result = conn.run(command, timeout=timeout)
    return result.exit_code, result.stdout_text, result.stderr_text


def cli(lab, *args: str, runs: Path | None = None):
    from .conftest import sglfleet

    extra = ["--runs-dir", str(runs)] if runs else []
    return sglfleet(*args, "-i", str(lab.inventory_path), *extra)


def test_a_systemd_host_boots_in_a_root_of_its_own_and_the_machines_tmp_survives():
    marker = f"sglfleet-systemd-marker-{uuid.uuid4().hex}"
    tmp_fd, tmp_marker = tempfile.mkstemp(prefix=marker, dir="/tmp")
    os.close(tmp_fd)
    run_marker, var_marker = Path("/run") / marker, Path("/var/tmp") / marker
    run_marker.write_text("x")
    var_marker.write_text("x")
    try:
        with private_lab("systemd-boot", 10, 1, systemd=1) as lab:
            code, out, err = ssh(lab, "ct129", "cat /proc/1/comm; systemctl is-system-running; "
                                 "systemctl show -p ActiveState --value systemd-tmpfiles-setup.service; "
                                 "systemctl --failed --no-legend --plain; "
                                 f"ls -a /tmp /run /var/tmp | grep -c {marker} || true; hostname; "
                                 f"touch /var/lib/{marker} /etc/{marker} && echo wrote")
            assert code == 0, err
            lines = out.splitlines()
            # PID 1 is systemd, fully booted, nothing failed, and its /tmp cleaner ran...
            assert lines[0] == "systemd" and lines[1] == "running", out
            assert lines[2] == "active", out
            # ...on this host's own /tmp, /run and /var: the machine's files are not even visible
            assert lines[3:] == ["0", "ct129", "wrote"], out
            # and what it writes to /var or /etc stays in its own layer
            assert not Path("/var/lib", marker).exists() and not Path("/etc", marker).exists()
            assert lab.hosts()[0].kind == "systemd"
    finally:
        survived = [Path(tmp_marker).exists(), run_marker.exists(), var_marker.exists()]
        for path in (Path(tmp_marker), run_marker, var_marker):
            path.unlink(missing_ok=True)
    assert survived == [True, True, True], "the machine's /tmp, /run, /var markers after boot and poweroff"


@pytest.fixture(scope="module")
def systemd_lab():
    with private_lab("systemd", 11, 1, systemd=1) as lab:
        yield lab


@pytest.mark.slow
def test_deploy_on_a_systemd_host_runs_a_unit_logs_to_journald_and_stop_drains(systemd_lab, tmp_path):
    lab = systemd_lab
    runs = tmp_path / "runs"
    profile = deploy_profile(tmp_path, "qwen36-ddtree")
    proc = cli(lab, "deploy", "ct129", profile, "--json", runs=runs)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]

    # the unit as systemd sees it: installed, active, KillMode=mixed, the drain's exit accepted
    code, out, err = ssh(lab, "ct129", f"systemctl is-active {UNIT}; systemctl show -p KillMode -p "
                         f"SuccessExitStatus -p FragmentPath -p MainPID {UNIT}")
    assert code == 0, err
    state, *props = out.splitlines()
    props = dict(p.split("=", 1) for p in props)
    assert state == "active" and props["KillMode"] == "mixed", out
    assert "137" in props["SuccessExitStatus"] and props["FragmentPath"] == f"/etc/systemd/system/{UNIT}", out
    main_pid = int(props["MainPID"])
    assert main_pid > 1

    # journald has the server's log, and `sglfleet logs` reads it from there
    code, journal, err = ssh(lab, "ct129", f"journalctl -u {UNIT} -o cat --no-pager")
    assert code == 0 and "The server is fired up and ready to roll!" in journal, journal[-2000:] + err
    proc = cli(lab, "logs", "ct129", "--json")
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    doc = json.loads(proc.stdout)
    assert doc["hosts"]["ct129"]["source"] == "journald", doc["hosts"]
    texts = [line["line"] for line in doc["lines"] if line["host"] == "ct129"]
    earlier = journal.splitlines()  # the server keeps logging: what journalctl said then is the start
    assert len(texts) >= len(earlier) > 3 and texts[:len(earlier)] == earlier, (texts[-5:], earlier[-5:])

    proc = cli(lab, "status", "ct129", profile, "--json")
    row = json.loads(proc.stdout)["hosts"]["ct129"]["value"]["profiles"][0]
    assert proc.returncode == 0 and row["mode"] == "systemd" and row["pid"] == main_pid, row

    # a rerun changes nothing: same unit, same main pid
    proc = cli(lab, "deploy", "ct129", profile, "--json", runs=runs)
    assert proc.returncode == 0, proc.stdout[-3000:]
    code, out, _ = ssh(lab, "ct129", f"systemctl show -p MainPID --value {UNIT}")
    assert int(out.strip()) == main_pid

    # stop: systemctl stop, SGLang's drain in the journal, the unit inactive and the process gone
    proc = cli(lab, "stop", "ct129", "--json")
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    code, out, err = ssh(lab, "ct129", f"systemctl is-active {UNIT}; kill -0 {main_pid} 2>/dev/null && echo alive; "
                         f"journalctl -u {UNIT} -o cat --no-pager | grep -c 'Gracefully exiting'")
    lines = out.splitlines()
    assert lines[0] in ("inactive", "failed") and "alive" not in lines, out
    assert int(lines[-1]) >= 1, out


@pytest.mark.slow
def test_lab_down_powers_a_systemd_host_off_and_the_server_drains(tmp_path):
    """`lab down` shuts a systemd host down as `poweroff` does: systemd stops its units (the
    server drains), rather than everything being SIGKILLed with the pid namespace."""
    import subprocess

    with private_lab("systemd-off", 12, 1, systemd=1) as lab:
        proc = cli(lab, "deploy", "ct129", deploy_profile(tmp_path, "qwen36-ddtree"), "--json", runs=tmp_path / "r")
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
        # a persistent journal (in the host's upper layer), so it can be read after the poweroff
        code, out, err = ssh(lab, "ct129", "mkdir -p /var/log/journal && journalctl --flush && echo ok")
        assert code == 0 and "ok" in out, err
        host = lab.hosts()[0]
        started = time.monotonic()
        lab._power_off([host])
        took = time.monotonic() - started
        assert lab.init_pid(host) is None, "still running after the poweroff"
        journal = lab.host_dir("ct129") / "upper" / "rootfs" / "var" / "log" / "journal"
        read = subprocess.run(["journalctl", "--directory", str(next(journal.iterdir())), "-o", "cat",
                               "--no-pager"], capture_output=True, text=True, timeout=60)
    assert "Gracefully exiting" in read.stdout, read.stdout[-3000:] + read.stderr
    assert took < 30, took
