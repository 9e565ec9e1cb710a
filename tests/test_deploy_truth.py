"""`deploy` tells the truth about the server it started (issue 26, section 2), on lab hosts: a
server that dies right after its staged health is a failed deploy (the stay-healthy window,
--min-ready), a /generate that answers 200 with nothing generated fails the generate stage at
once, a /health that answers 503 fails the health stage; each is reverted to what served before.

Each test owns one host of a private lab, deployed once with the good profile by the fixture."""

from __future__ import annotations

import pytest

from .conftest import sglfleet
from .private_lab import lab_fixture
from .test_deploy import deploy_json, pid_alive, profile_variant, record

pytestmark = [pytest.mark.lab, pytest.mark.slow]

lab = lab_fixture("deploy-truth", 46, hosts=3)


@pytest.fixture(scope="module")
def good(lab, tmp_path_factory):
    """Every host serves the good profile before a test breaks its own host's next deploy."""
    tmp = tmp_path_factory.mktemp("truth")
    profile = profile_variant(tmp, "good")
    proc = sglfleet("deploy", "all", profile, "-i", str(lab.inventory_path), "--json", "--runs-dir", str(tmp / "runs"))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return profile


def assert_reverted(lab, inventory, host, doc, stage):
    assert doc["failed_stage"] == stage, (doc.get("failed_stage"), doc["summary"])
    assert doc["reverted"]["restored"] and doc["reverted"]["healthy"], doc["summary"]
    assert "reverted: the previous deployment" in doc["summary"]
    rec = record(inventory, host)
    assert rec["pid"] == doc["reverted"]["pid"] and rec["reverted_from"] == doc["deploy_id"]
    assert pid_alive(inventory, host, doc["reverted"]["pid"])


def test_a_server_that_dies_right_after_its_health_passed_is_a_failed_deploy(lab, inventory, good, tmp_path):
    """It passes every staged health stage, then crashes within the stay-healthy window: without
    that window the deploy was reported a success (exit 0) for a server that was gone seconds later."""
    host = "ct129"
    crash = profile_variant(tmp_path, "late-crash", env={"SGLFLEET_SIM_CRASH_AFTER": "8"})
    code, doc, _ = deploy_json(lab, tmp_path, host, crash, "--min-ready", "20")
    assert code == 1, doc["summary"]
    assert [s for s in ("alive", "port", "health", "generate", "server_info") if s not in doc["health"]] == []
    assert "server exited with code 1 during min_ready" in doc["summary"], doc["summary"]
    assert "Scheduler hit an exception" in doc["server_log"]
    assert_reverted(lab, inventory, host, doc, "min_ready")


def test_the_stay_healthy_window_is_part_of_a_good_deploy(lab, inventory, good, tmp_path):
    host = "ct129"
    other = profile_variant(tmp_path, "window", env={"TRUTH_RUN": "2"})
    code, doc, _ = deploy_json(lab, tmp_path, host, other, "--min-ready", "2")
    assert code == 0, doc["summary"]
    assert doc["health"]["min_ready"] >= 2
    code, doc, _ = deploy_json(lab, tmp_path, host, good, "--min-ready", "0")  # 0: no window
    assert code == 0 and "min_ready" not in doc["health"], doc


@pytest.mark.parametrize("host, knob, timeout, said, stage, passed", [
    # a definite answer fails at once: not "timed out" after polling the stage's 90 s
    ("ct130", "SGLFLEET_SIM_EMPTY_GENERATE", "90", "health stage generate failed: HTTP 200 without generated text "
     "or tokens", "generate", ["alive", "port", "health", "health_generate"]),
    # 503 is what SGLang answers while it warms up: polled to the stage's timeout, and it is this stage that fails
    ("ct131", "SGLFLEET_SIM_HEALTH_FAIL", "4", "timed out after 4", "health", ["alive", "port"]),
], ids=["generate-200-empty", "health-503"])
def test_a_wrong_health_answer_fails_its_own_stage_and_reverts(lab, inventory, good, tmp_path, host, knob, timeout,
                                                               said, stage, passed):
    broken = profile_variant(tmp_path, knob.lower(), env={knob: "1"})
    code, doc, _ = deploy_json(lab, tmp_path, host, broken, "--health-timeout", timeout)
    assert code == 1 and said in doc["summary"], doc["summary"]
    assert list(doc["health"]) == passed, doc["health"]
    assert_reverted(lab, inventory, host, doc, stage)


def test_dry_run_names_what_the_real_run_would_refuse_and_stop_names_an_unknown_profile(lab, inventory, good,
                                                                                          tmp_path):
    import json
    import time

    from .test_deploy import on_host

    host = "ct131"
    other = profile_variant(tmp_path, "other", replace={"name: qwen36-ddtree": "name: other-prof"})
    # a first deploy of another profile, on a free port: "would deploy"
    elsewhere = profile_variant(tmp_path, "other-port", replace={"name: qwen36-ddtree": "name: other-prof",
                                                                "port: 30000": "port: 30500"})
    code, dry, _ = deploy_json(lab, tmp_path, host, elsewhere, "--dry-run")
    assert code == 0 and dry["summary"] == "would deploy: nothing deployed by sglfleet yet", dry["summary"]

    # the port is served by the good profile, which sglfleet deployed: named as such, dry run and real run
    serving = record(inventory, host)["pid"]
    served = f"port 30000 is taken: profile qwen36-ddtree's server (pid {serving}, " \
             "deployed by sglfleet on "
    code, dry, _ = deploy_json(lab, tmp_path, host, other, "--dry-run")
    assert code == 0 and dry["summary"].startswith("would be refused: " + f"{host}: " + served), dry["summary"]
    code, doc, _ = deploy_json(lab, tmp_path, host, other)
    assert code == 1 and doc["phase"] == "plan" and doc["refused"], doc["summary"]
    assert doc["summary"].startswith(f"{host}: " + served), doc["summary"]
    assert f"stop it (`sglfleet stop {host} qwen36-ddtree`) or give this profile another port" in doc["summary"]
    assert "sglfleet did not start it" not in doc["summary"]

    # a lease another machine's deploy holds: the dry run says the real run would be refused
    lease = {"id": "20261204T000000Z-dabcdef", "since": time.time(), "ttl": 600,
             "holder": {"user": "ops", "controller": "other-machine", "command": "sglfleet deploy all x",
                        "controller_pid": 4242}}
    on_host(inventory, host, f"echo '{json.dumps(lease)}' > /var/lib/sglfleet/deploy-lease.json")
    try:
        code, dry, _ = deploy_json(lab, tmp_path, host, good, "--dry-run")
    finally:
        on_host(inventory, host, "rm -f /var/lib/sglfleet/deploy-lease.json")
    assert code == 0 and dry["summary"].startswith("would be refused: host is being deployed by another sglfleet "
                                                   "run: ops@other-machine running `sglfleet deploy all x`"), dry
    code, dry, _ = deploy_json(lab, tmp_path, host, good, "--dry-run")
    assert code == 0 and dry["summary"].startswith("unchanged: running release"), dry["summary"]

    # stop of a profile neither deployed here nor running: said so, with what the host runs; exit 0
    proc = sglfleet("stop", host, "no-such-profile", "-i", str(lab.inventory_path), "--json")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    value = json.loads(proc.stdout)["hosts"][host]["value"]
    assert value["unknown_profile"] == "no-such-profile" and value["here"] == {"qwen36-ddtree": True}, value
    proc = sglfleet("stop", host, "no-such-profile", "-i", str(lab.inventory_path), env={"COLUMNS": "250"})
    said = " ".join(proc.stdout.split())
    assert proc.returncode == 0 and f"no server of profile no-such-profile on {host} (this host runs: qwen36-ddtree)" \
        in said and "was not running" not in said, said
    assert pid_alive(inventory, host, serving)  # nothing of the above touched the server that serves


def _deploy_until(lab, tmp_path, host, profile, marker, *extra):
    """A plain (not --json) deploy, its stderr read until a progress line containing `marker`."""
    import subprocess
    import sys

    from .conftest import ROOT, fenced_env

    proc = subprocess.Popen([sys.executable, "-m", "orchestrator.cli", "deploy", host, profile, "-i",
                             str(lab.inventory_path), "--runs-dir", str(tmp_path / "runs"), *extra],
                            cwd=ROOT, env=fenced_env({"COLUMNS": "250"}), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    seen = []
    for line in proc.stderr:  # off a terminal: one line per step per host (cli/deploy.StepLines)
        seen.append(line)
        if f"{host}: {marker}" in line:
            return proc, seen
    out, _ = proc.communicate()
    raise AssertionError(f"no progress line '{host}: {marker}' (exit {proc.returncode}):\n{''.join(seen)}\n{out}")


def test_ctrl_c_between_plan_and_launch_leaves_the_running_server_untouched(lab, inventory, good, tmp_path):
    import signal

    host = "ct129"
    before = record(inventory, host)
    changed = profile_variant(tmp_path, "between", env={"TRUTH_RUN": "3"})
    proc, seen = _deploy_until(lab, tmp_path, host, changed, "smoke")
    proc.send_signal(signal.SIGINT)  # while SGLang validates the new argv: before the launch step
    out, err = proc.communicate(timeout=300)
    said = " ".join(out.split())
    assert proc.returncode == 130, out + err
    assert "stopped before touching the running server: the run was interrupted" in said, said
    assert any(f"{host}: plan" in line for line in seen), seen
    after = record(inventory, host)
    assert after["pid"] == before["pid"] and after["deploy_id"] == before["deploy_id"]
    assert pid_alive(inventory, host, before["pid"])


def test_ctrl_c_during_the_health_wait_stops_promptly_and_reverts(lab, inventory, good, tmp_path):
    """The new server loads for 90 s; one Ctrl-C while the deploy waits for it: the wait ends
    within seconds (it waited the whole load before), the previous deployment serves again, 130."""
    import signal
    import time

    host = "ct130"
    before = record(inventory, host)
    slow = profile_variant(tmp_path, "slow-load", replace={'SGLFLEET_SIM_LOAD_DELAY: "0.5"': 'SGLFLEET_SIM_LOAD_DELAY: "90"'})
    proc, seen = _deploy_until(lab, tmp_path, host, slow, "health: health")
    time.sleep(1)
    began = time.monotonic()
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=300)
    took = time.monotonic() - began
    said = " ".join(out.split())
    assert proc.returncode == 130, out + err
    assert took < 45, f"{took:.1f}s after Ctrl-C (the load alone takes 90 s)"
    assert "health stage health interrupted (Ctrl-C)" in said and "reverted: the previous deployment" in said, said
    rec = record(inventory, host)
    assert rec.get("reverted_from") and pid_alive(inventory, host, rec["pid"]), rec
    assert rec["env_hash"] == before["env_hash"]  # what served before, not the slow one
    print(f"\nCtrl-C to exit: {took:.1f}s")
