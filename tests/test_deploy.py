"""`sglfleet deploy/status/stop` on lab hosts: real sshd, the real SGLang validating, the lab's
server stand-in (sglfleet-sim-server, labeled as such in the launch script) serving.

Each test owns one lab host, so they do not depend on each other's order.
"""

from __future__ import annotations

import atexit
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from orchestrator.fleet.hostkeys import KnownHosts
from orchestrator.fleet.transport import Connection

from .conftest import ROOT, fenced_env, sglfleet
from .private_lab import lab_fixture

pytestmark = [pytest.mark.lab, pytest.mark.slow]

# Servers and releases of these tests stay on a lab of their own (the shared lab's tests expect
# pristine hosts).
lab = lab_fixture("deploy", 5)
STATE = "/var/lib/sglfleet"
FAST = {"SGLANG_HEALTH_CHECK_TIMEOUT: \"20\"": "SGLANG_HEALTH_CHECK_TIMEOUT: \"20\"\n  SGLFLEET_SIM_LOAD_DELAY: \"0.5\""}


_SNAPSHOT: list[Path] = []


def artifacts_snapshot() -> Path:
    """The patchset and the kernel sources it ships, copied once per session: others edit the
    shared checkout while these tests run, and a changed source is a changed release (a rerun
    would rightly restart)."""
    if not _SNAPSHOT:
        snap = Path(tempfile.mkdtemp(prefix="sglfleet-deploy-artifacts-"))
        atexit.register(shutil.rmtree, snap, True)
        shutil.copytree(ROOT / "patches", snap / "patches")
        shutil.copytree(ROOT / "kernels" / "ddtree", snap / "kernels" / "ddtree",
                        ignore=shutil.ignore_patterns("results", "__pycache__", "*.cu"))
        (snap / "build").mkdir()
        _SNAPSHOT.append(snap)
    return _SNAPSHOT[0]


def profile_variant(tmp_path, name, replace=None, env=None):
    """The seed profile with a snapshot of the checkout's artifacts, a fast stand-in load, and changes."""
    text = (ROOT / "playbooks" / "qwen36-ddtree.yaml").read_text().replace("../", f"{artifacts_snapshot()}/")
    for old, new in {**FAST, **(replace or {})}.items():
        assert old in text, old
        text = text.replace(old, new)
    for key, value in (env or {}).items():
        text = text.replace("env:\n", f"env:\n  {key}: \"{value}\"\n")
    path = tmp_path / f"{name}.yaml"
    path.write_text(text)
    return str(path)


def deploy_json(lab, tmp_path, host, profile, *extra):
    proc = sglfleet("deploy", host, profile, "-i", str(lab.inventory_path), "--json", "--runs-dir",
                    str(tmp_path / "runs"), *extra)
    assert proc.stdout, proc.stderr
    doc = json.loads(proc.stdout)
    return proc.returncode, doc["hosts"][host], doc


def connect(inventory, name):
    return Connection(inventory.hosts[name], KnownHosts(inventory.known_hosts_path))


def on_host(inventory, name, command):
    with connect(inventory, name) as conn:
        result = conn.run(command, timeout=120)
    return result.stdout_text


def record(inventory, name, profile="qwen36-ddtree"):
    text = on_host(inventory, name, f"cat {STATE}/servers/{profile}/deployment.json 2>/dev/null")
    return json.loads(text) if text.strip() else None


def pid_alive(inventory, name, pid):
    return on_host(inventory, name, f"kill -0 {pid} 2>/dev/null && echo yes || echo no").strip() == "yes"


def status_json(lab, host, profile=None):
    proc = sglfleet("status", host, *([profile] if profile else []), "-i", str(lab.inventory_path), "--json")
    assert proc.stdout, proc.stderr
    return json.loads(proc.stdout)["hosts"][host]["value"]["profiles"][0]


def test_seed_story_gate_serve_rerun(lab, inventory, tmp_path):
    host = "ct129"
    off = profile_variant(tmp_path, "seed-off", {"hybrid: auto": "hybrid: off"})
    # Draft tokens the DFlash draft's block size contradicts: only SGLang's validation (the patchset's) sees it.
    clash = profile_variant(tmp_path, "seed-clash", {'"40"]': '"40", "--speculative-num-draft-tokens", "8"]'})
    good = profile_variant(tmp_path, "seed")
    # hybrid: off on the hybrid model: doctor's model check, run on deploy's plan round trip, refuses it
    # with doctor's own text and fix before anything is pushed or started.
    code, doc, _ = deploy_json(lab, tmp_path, host, off)
    assert code == 1 and doc["phase"] == "plan" and doc["refused"], doc["summary"]
    assert doc["summary"].startswith(f"{host}: model: ") and "fix: set hybrid: auto" in doc["summary"], doc["summary"]
    assert [c["name"] for c in doc["doctor"] if c["status"] == "fail"] == ["model"]
    assert "smoke" not in doc["steps"] and "pushed" not in doc
    assert on_host(inventory, host, f"cat {STATE}/current 2>/dev/null").strip() == ""
    # The clash fails at the smoke gate, with SGLang's traceback and the fix; nothing starts.
    code, doc, whole = deploy_json(lab, tmp_path, host, clash)
    assert code == 1 and doc["action"] == "failed" and doc["phase"] == "smoke", doc["summary"]
    assert doc["traceback"].startswith("Traceback (most recent call last):")
    assert "they differ (8 vs 16)" in doc["traceback"]
    assert any("block size" in fix for fix in doc["diagnosis"]), doc["diagnosis"]
    stored = Path(whole["run_dir"]) / f"{host}.traceback.txt"
    assert stored.read_text() == doc["traceback"]
    # the smoke ran inside the push's transaction: the swap undone there, no release committed
    assert "restored in the push's own transaction" in doc["summary"] and record(inventory, host) is None
    assert doc["steps"] and "smoke" not in doc["steps"] and "pushed" not in doc
    assert on_host(inventory, host, f"cat {STATE}/current 2>/dev/null").strip() == ""
    assert on_host(inventory, host, f"ls {STATE}/releases 2>/dev/null").strip() == ""

    # hybrid: auto serves; the running config is the deployed one.
    code, doc, _ = deploy_json(lab, tmp_path, host, good)
    assert code == 0, doc["summary"]
    assert doc["action"] == "deployed" and doc["restart_reasons"] == ["nothing deployed by sglfleet yet"]
    info = doc["server_info"]
    assert [info[k] for k in ("speculative_algorithm", "speculative_num_draft_tokens", "speculative_ddtree_budget",
                              "speculative_ddtree_topk_cap")] == ["DDTREE", 16, 64, 64]
    assert info["lab_simulation"] is True and info["host"] == inventory.hosts[host].address  # its own address
    assert list(doc["health"]) == ["alive", "port", "health", "health_generate", "generate", "server_info", "min_ready"]
    assert doc["generated"]["completion_tokens"] == 8
    assert doc["round_trips"]["exec"] <= 6, doc["round_trips"]
    rec = record(inventory, host)
    assert rec["pid"] == doc["pid"] and rec["release"] == doc["release"] and rec["argv"] == doc["command"]
    assert rec["argv"][0] == "/usr/local/bin/sglfleet-sim-server"
    script = on_host(inventory, host, f"cat {STATE}/servers/qwen36-ddtree/launch.sh")
    assert "LAB SIMULATION" in script  # the stand-in is labeled where it is used
    # The controller exited; the server it started (detached) still serves.
    assert pid_alive(inventory, host, doc["pid"])

    # Rerun with nothing changed: no restart, no bytes, two round trips.
    code, again, _ = deploy_json(lab, tmp_path, host, good)
    assert code == 0 and again["action"] == "unchanged", again
    assert again["pid"] == doc["pid"] and "pushed" not in again
    assert again["summary"].startswith(f"unchanged: running release {doc['release']} since ")
    assert again["round_trips"] == {"exec": 2, "health_polls": 0}

    # --dry-run says what would happen and why, and changes nothing.
    changed = profile_variant(tmp_path, "changed", env={"EXTRA_SETTING": "1"})
    code, dry, _ = deploy_json(lab, tmp_path, host, changed, "--dry-run")
    assert code == 0 and dry["action"] == "dry-run" and dry["restart_reasons"] == ["environment changed"]
    assert dry["summary"] == "would restart: environment changed" and "EXTRA_SETTING='1'" not in dry["files"]["env"]
    assert "EXTRA_SETTING=1" in dry["files"]["env"] and dry["round_trips"]["exec"] == 1
    assert record(inventory, host)["pid"] == doc["pid"]

    # A bad change is stopped by the gate while the server keeps serving.
    code, bad, _ = deploy_json(lab, tmp_path, host, clash)
    assert code == 1 and bad["phase"] == "smoke"
    assert pid_alive(inventory, host, doc["pid"]) and record(inventory, host)["pid"] == doc["pid"]
    row = status_json(lab, host, good)
    assert row["alive"] and row["pid"] == doc["pid"] and row["health"] == 200 and row["drift"] == []
    assert row["accept_length"] == pytest.approx(4.25)

    # stop: SIGTERM, the drain, the exit; status says stopped.
    proc = sglfleet("stop", host, "-i", str(lab.inventory_path), "--json", "--grace", "20")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    stopped = json.loads(proc.stdout)["hosts"][host]["value"]["stopped"]["qwen36-ddtree"]
    assert stopped["was_running"] and stopped["pid"] == doc["pid"] and not stopped["killed"]
    assert "Gracefully exiting... Remaining number of requests 0" in stopped["drain"]
    assert not pid_alive(inventory, host, doc["pid"])
    log = on_host(inventory, host, "cat /var/log/sglfleet/qwen36-ddtree.log")
    assert "The server is fired up and ready to roll!" in log and "exited with code 0" in log


def test_crash_during_load_is_shown_stored_and_reverted(lab, inventory, tmp_path):
    host = "ct130"
    good = profile_variant(tmp_path, "good")
    code, first, _ = deploy_json(lab, tmp_path, host, good)
    assert code == 0, first["summary"]
    crash = profile_variant(tmp_path, "crash", env={"SGLFLEET_SIM_CRASH_AFTER": "1"},
                            replace={"SGLFLEET_SIM_LOAD_DELAY: \"0.5\"": "SGLFLEET_SIM_LOAD_DELAY: \"30\""})
    code, doc, whole = deploy_json(lab, tmp_path, host, crash)
    assert code == 1 and doc["phase"] == "health", doc["summary"]
    assert doc["restart_reasons"] == ["environment changed"]
    assert doc["exit_code"] == 1 and "server exited with code 1" in doc["summary"]
    log = doc["server_log"]
    assert "Scheduler hit an exception: Traceback (most recent call last):" in log
    assert "RuntimeError: CUDA error: an illegal memory access was encountered" in log
    assert log.startswith("==== sglfleet supervisor: start ")  # whole, from the start of this run
    assert "The server is fired up" not in log  # only this run, not the previous server's
    assert (Path(whole["run_dir"]) / f"{host}.server.log").read_text() == log
    # The previous deployment serves again, health-checked, and the record says so.
    reverted = doc["reverted"]
    assert reverted["restored"] and reverted["healthy"] and reverted["pid"] != first["pid"]
    assert "reverted: the previous deployment" in doc["summary"]
    rec = record(inventory, host)
    assert rec["pid"] == reverted["pid"] and rec["env_hash"] == first["env_hash"]
    assert rec["reverted_from"] == doc["deploy_id"]
    assert pid_alive(inventory, host, reverted["pid"])
    env = on_host(inventory, host, f"cat {STATE}/servers/qwen36-ddtree/sglang.env")
    assert "SGLFLEET_SIM_CRASH_AFTER" not in env
    # ... and a rerun of the good profile finds it as it should be.
    code, again, _ = deploy_json(lab, tmp_path, host, good)
    assert code == 0 and again["action"] == "unchanged" and again["pid"] == reverted["pid"], \
        (again.get("restart_reasons"), again.get("running_before"), again.get("summary"))


def test_hang_during_load_times_out_kills_and_reverts(lab, inventory, tmp_path):
    host = "ct131"
    good = profile_variant(tmp_path, "good")
    code, first, _ = deploy_json(lab, tmp_path, host, good)
    assert code == 0, first["summary"]
    hang = profile_variant(tmp_path, "hang", env={"SGLFLEET_SIM_HANG_LOAD": "1"})
    code, doc, _ = deploy_json(lab, tmp_path, host, hang, "--health-timeout", "3", "--stop-grace", "5")
    assert code == 1 and doc["failed_stage"] == "health", doc["summary"]
    assert "timed out after" in doc["summary"] and "hanging during load" in doc["server_log"]
    hung_pid = doc["launched"]["pid"]
    assert doc["reverted"]["stopped_failed"]["pid"] == hung_pid
    assert not pid_alive(inventory, host, hung_pid)
    assert doc["reverted"]["healthy"] and pid_alive(inventory, host, doc["reverted"]["pid"])


def test_port_taken_by_a_foreign_process_is_refused(lab, inventory, tmp_path):
    host = "ct132"
    address = inventory.hosts[host].address
    on_host(inventory, host, f"setsid nohup python3 -m http.server --bind {address} 30000 >/dev/null 2>&1 "
                             "< /dev/null & sleep 1")
    try:
        pid = on_host(inventory, host, "pgrep -f '^python3 -m http.server'").split()[0]
        code, doc, _ = deploy_json(lab, tmp_path, host, profile_variant(tmp_path, "good"))
        assert code == 1 and doc["phase"] == "plan", doc
        assert f"pid {pid} (python3 -m http.server --bind {address} 30000)" in doc["summary"]
        assert "nothing was changed" in doc["summary"]
        assert record(inventory, host) is None and "pushed" not in doc
        assert on_host(inventory, host, f"ls {STATE}/releases 2>/dev/null").strip() == ""
        assert pid_alive(inventory, host, pid)
    finally:
        on_host(inventory, host, "pkill -f '^python3 -m http.server'; true")


def test_concurrent_deploys_one_refused_with_the_holder_named(lab, inventory, tmp_path):
    host = "ct133"
    profile = profile_variant(tmp_path, "good")
    argv = [sys.executable, "-m", "orchestrator.cli", "deploy", host, profile, "-i", str(lab.inventory_path),
            "--json", "--runs-dir", str(tmp_path / "runs")]
    procs = [subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT,
                              env=fenced_env()) for _ in range(2)]
    docs = []
    for proc in procs:
        out, err = proc.communicate(timeout=300)
        assert out, f"exit {proc.returncode}, no JSON: {err[-3000:]}"
        docs.append((proc.returncode, json.loads(out)["hosts"][host]))
    codes = sorted(code for code, _ in docs)
    assert codes == [0, 1], [(code, doc.get("phase"), doc.get("summary")) for code, doc in docs]
    refused = next(doc for code, doc in docs if code == 1)
    winner = next(doc for code, doc in docs if code == 0)
    # Refused by the deploy lease (the winner's deploy named) or, if it came while the winner held
    # the host lock for a step, by that lock (the holder's command named).
    assert refused["phase"] == "plan" and refused["refused"]
    assert f"running `sglfleet deploy {host} " in refused["summary"]
    assert ("being deployed by another sglfleet run" in refused["summary"] and winner["deploy_id"] in refused["summary"]) \
        or "host is locked by another sglfleet run" in refused["summary"]
    assert "pushed" not in refused and "launched" not in refused


def test_controller_killed_mid_deploy_then_rerun_converges(lab, inventory, tmp_path):
    """SSH dropped mid-deploy: the controller dies while the new server loads; the lease it
    left names a dead process of this machine, so the rerun takes over and converges."""
    host = "ct134"
    slow = profile_variant(tmp_path, "slow", replace={"SGLFLEET_SIM_LOAD_DELAY: \"0.5\"": "SGLFLEET_SIM_LOAD_DELAY: \"8\""})
    argv = [sys.executable, "-m", "orchestrator.cli", "deploy", host, slow, "-i", str(lab.inventory_path),
            "--json", "--runs-dir", str(tmp_path / "runs")]
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=ROOT, env=fenced_env())
    deadline = time.monotonic() + 240
    while time.monotonic() < deadline:  # until the new server runs (launch done, health polling)
        if on_host(inventory, host, f"cat {STATE}/servers/qwen36-ddtree/supervisor.json 2>/dev/null").strip():
            break
        time.sleep(0.5)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    lease = json.loads(on_host(inventory, host, f"cat {STATE}/deploy-lease.json"))  # left behind
    assert lease["step"] == "health" and lease["profile"] == "qwen36-ddtree", lease
    # its controller is gone: status names the interrupted deploy, never "not deployed"
    row = status_json(lab, host, slow)
    said = "; ".join(row["drift"])
    assert row["interrupted"]["id"] == lease["id"] and "not deployed" not in said, row
    assert f"deploy {lease['id']} of release " in said and "interrupted at health by " in said, said
    assert "started by that deploy and never recorded" in said and "rerun `sglfleet deploy`" in said, said
    # the rerun takes the lease over at once, and says so
    code, doc, _ = deploy_json(lab, tmp_path, host, slow)
    assert code == 0, doc["summary"]
    assert doc["action"] in ("deployed", "unchanged")
    assert doc["lease_taken_over"]["id"] == lease["id"], doc
    assert f"took over the lease of deploy {lease['id']} (interrupted at health: its controller process is gone)" \
        in doc["summary"], doc["summary"]
    row = status_json(lab, host, slow)
    assert row["alive"] and row["health"] == 200 and row["drift"] == []


def test_detached_server_survives_the_ssh_session(lab, inventory, tmp_path):
    host = "ct135"
    code, doc, _ = deploy_json(lab, tmp_path, host, profile_variant(tmp_path, "good"))
    assert code == 0, doc["summary"]
    lab.stop_sshd(host)  # every SSH session of the host ends with sshd
    try:
        time.sleep(1)
    finally:
        lab.start_sshd(host)
    assert pid_alive(inventory, host, doc["pid"])
    row = status_json(lab, host)
    assert row["alive"] and row["pid"] == doc["pid"] and row["health"] == 200


def test_lab_host_refuses_a_wildcard_bind(lab, inventory, tmp_path):
    """An inventory without the lab's sglfleet_server_bind (an older `lab up`) renders 0.0.0.0: refused."""
    text = Path(lab.inventory_path).read_text().replace("sglfleet_server_bind:", "old_server_bind:")
    old = tmp_path / "old-lab.yaml"
    old.write_text(text)
    (tmp_path / "old-lab.known_hosts").write_text(Path(lab.known_hosts_path).read_text())
    proc = sglfleet("deploy", "ct136", profile_variant(tmp_path, "good"), "-i", str(old), "--json",
                    "--runs-dir", str(tmp_path / "runs"))
    doc = json.loads(proc.stdout)["hosts"]["ct136"]
    assert proc.returncode == 2 and doc["phase"] == "render"  # bad input: nothing was tried
    assert "would bind 0.0.0.0" in doc["summary"] and "share one network namespace" in doc["summary"]
    assert os.path.basename(str(old)) in doc["summary"] or "sglfleet_server_bind" in doc["summary"]
