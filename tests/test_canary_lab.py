"""Canary analysis on the lab (issue 28 §1): real sshd hosts, the real sglang-router in front, real
load through it (orchestrator/lab/loadgen.py), the stand-in servers' simulated accept length
following what is deployed (a DDTree budget of 14 accepts ~28% less than 64: sim_server.py's model).

One private lab of 3 hosts for the module: the canary (ct129) and a baseline of two. Short windows
(6 s, a read every 0.5 s). Each test starts from the fleet on one deployment and leaves it so.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from .conftest import ROOT, fenced_env, sglfleet
from .test_rollout import router_or_skip

pytestmark = [pytest.mark.lab, pytest.mark.slow]

PORT = 30781
HOSTS = ["ct129", "ct130", "ct131"]
PROFILE = """name: canary
description: canary analysis test (DDTree budget {budget})
model: {{path: /root/models/Qwen3.6-27B}}
speculative:
  algorithm: DDTREE
  draft_model: /root/models/Qwen3.6-27B-DFlash
  block_size: 16
  ddtree: {{budget: {budget}, topk_cap: {cap}, shadow_linear: true}}
hybrid: auto
server: {{host: 0.0.0.0, port: {port}, tp: 1, extra_args: [--enable-metrics]}}
env:
  SGLFLEET_SIM_LOAD_DELAY: "0.5"
  SGLFLEET_SIM_SLOW_MS: "20"
  SGLFLEET_SIM_DRAIN_LOG_S: "1"
  CANARY_RELEASE: "{release}"
artifacts: {{patchset: {patchset}}}
analysis: {{window: 6, interval: 0.5, min_samples: 5, inconclusive: pause}}
"""


class CanaryLab:
    def __init__(self, lab, tmp: Path):
        from orchestrator.lab.router import LabRouter

        self.lab, self.tmp = lab, tmp
        self.router = LabRouter(lab.state_dir, lab.subnet, port=30000, prometheus_port=29000)
        self.router.stop()
        self.url = self.router.start()
        doc = yaml.safe_load(lab.inventory_path.read_text())
        doc["all"]["vars"]["sglfleet_router_url"] = self.url
        self.inventory = tmp / "canary.yaml"
        self.inventory.write_text(yaml.safe_dump(doc, sort_keys=False))
        (tmp / "canary.known_hosts").write_text(lab.known_hosts_path.read_text())
        self.runs = tmp / "runs"

    def profile(self, release: str, budget: int = 64) -> str:
        path = self.tmp / f"canary-{release}.yaml"
        path.write_text(PROFILE.format(budget=budget, cap=min(budget, 64), port=PORT, release=release,
                                       patchset=ROOT / "patches" / "sglang-0.5.23-ddtree"))
        return str(path)

    def args(self, *args: str) -> list[str]:
        if args[0] == "rollout":  # rollout continue|abort|list read the state files only
            return [*args, "--json", "--runs-dir", str(self.runs)]
        return [*args, "-i", str(self.inventory), "--json", "--runs-dir", str(self.runs)]

    def cli(self, *args: str) -> tuple[int, dict]:
        result = sglfleet(*self.args(*args))
        try:
            return result.returncode, json.loads(result.stdout)
        except ValueError:
            raise AssertionError(f"no JSON (exit {result.returncode}):\n{result.stdout}\n{result.stderr[-4000:]}") \
                from None

    def spawn(self, *args: str) -> subprocess.Popen:
        return subprocess.Popen([sys.executable, "-m", "orchestrator.cli", *self.args(*args)], cwd=ROOT,
                                env=fenced_env({"SGLFLEET_LOOPBACK_ONLY": "1"}), stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True)

    def servers(self) -> dict[str, tuple]:
        """host -> (pid, release of the record, argv hash): what serves now."""
        result = sglfleet("status", "all", "-i", str(self.inventory), "--json")
        out = {}
        for host, r in json.loads(result.stdout)["hosts"].items():
            row, = [p for p in r["value"]["profiles"] if p["profile"] == "canary"]
            out[host] = (row.get("pid"), row.get("release"), row.get("argv_hash"), row.get("alive"))
        return out

    def worker(self, host: str):
        from orchestrator.fleet.router import RouterClient

        return RouterClient(self.url).find(f"http://{self.lab._host(host).address}:{PORT}")

    def close(self) -> None:
        self.router.stop()


@pytest.fixture(scope="module")
def cl(tmp_path_factory):
    router_or_skip()
    from orchestrator.fleet.router import RouterClient

    from .private_lab import private_lab

    with private_lab("canary", 51, len(HOSTS)) as lab:
        c = CanaryLab(lab, tmp_path_factory.mktemp("canary"))
        try:
            result = sglfleet(*c.args("deploy", "all", c.profile("a")))
            assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
            for h in lab.hosts():
                RouterClient(c.url).ensure(f"http://{h.address}:{PORT}", 60)
            yield c
        finally:
            c.close()


def load(c: CanaryLab):
    from orchestrator.lab.loadgen import LoadGenerator

    return LoadGenerator(c.url, rate=12, clients=6, duration=600, max_new_tokens=16).start()


def rows(analysis: dict) -> dict:
    return {r["metric"]: r for r in analysis["rows"]}


def wait_paused(c: CanaryLab, proc: subprocess.Popen, timeout: float = 420) -> dict:
    """The controller's state file once it says paused."""
    from orchestrator.stages.rollout import saved_rollouts

    deadline = time.monotonic() + timeout
    while True:
        paused = [doc for _, doc in saved_rollouts(c.runs) if doc.get("paused")]
        if paused:
            return paused[0]
        assert proc.poll() is None, proc.communicate()[1][-4000:]
        assert time.monotonic() < deadline, "the rollout never paused"
        time.sleep(0.5)


def test_a_good_canary_goes_on_to_the_whole_fleet(cl):
    """restart --rolling --canary 1 under load: the restarted canary is judged against the two
    hosts not yet restarted, passes, and the rollout restarts them."""
    before = cl.servers()
    gen = load(cl)
    time.sleep(1)
    try:
        code, doc = cl.cli("restart", "--rolling", "all", cl.profile("a"), "--canary", "1", "--min-ready", "1")
    finally:
        gen.stop()
    served = gen.wait().summary()
    assert code == 0, json.dumps({k: doc.get(k) for k in ("halted", "analysis", "failed")}, indent=1)[-4000:]
    analysis = doc["analysis"]
    assert analysis["verdict"] == "pass" and analysis["canary"] == ["ct129"] and analysis["baseline"] == ["ct130", "ct131"]
    accept = rows(analysis)["accept length"]
    assert accept["result"] == "pass" and accept["canary"] == pytest.approx(4.25) and accept["ratio"] == pytest.approx(1)
    assert accept["samples"]["canary"] >= 5 and accept["samples"]["baseline"] >= 10, accept
    assert rows(analysis)["error rate"]["result"] == "pass"
    assert [h["outcome"] for h in doc["hosts"].values()] == ["restarted"] * 3
    assert [b["hosts"] for b in doc["batches"]] == [["ct129"], ["ct130"], ["ct131"]]
    after = cl.servers()
    assert all(after[h][0] != before[h][0] and after[h][3] for h in HOSTS)  # every host restarted, serving
    # the run directory: the analysis with every sample, and a chart per figure
    kept = json.loads((Path(analysis["run_dir"]) / "analysis.json").read_text())
    assert kept["verdict"] == "pass" and len(kept["every_sample"]["ct129"]) == accept["samples"]["canary"]
    assert set(analysis["charts"]) == {"accept_len", "gen_throughput"}
    assert all(Path(f).read_bytes()[:4] == b"\x89PNG" for f in analysis["charts"].values())
    assert served["failed"] == 0, served
    print(f"\ngood canary: analysis {analysis['seconds']:.1f}s wall, {analysis['cpu_s']:.2f}s CPU; rollout "
          f"{doc['seconds']:.1f}s; load {served}")


def test_a_canary_whose_accept_length_drops_is_reverted_and_the_rest_never_restart(cl):
    """deploy --rolling of a DDTree budget of 14 (the stand-in accepts ~28% less than at 64):
    healthy, but the analysis fails it, the canary goes back to what it served, and the other
    hosts keep their very server processes."""
    before = cl.servers()
    gen = load(cl)
    time.sleep(1)
    try:
        code, doc = cl.cli("deploy", "--rolling", "all", cl.profile("small", budget=14), "--canary", "1",
                           "--min-ready", "1")
    finally:
        gen.stop()
    served = gen.wait().summary()
    assert code == 1, json.dumps({k: doc.get(k) for k in ("halted", "analysis")}, indent=1)[-4000:]
    analysis = doc["analysis"]
    assert analysis["verdict"] == "fail"
    accept = rows(analysis)["accept length"]
    assert accept["result"] == "fail" and accept["ratio"] == pytest.approx(3.04 / 4.25, abs=0.01), accept
    assert rows(analysis)["throughput (tok/s)"]["result"] == "fail"  # fewer tokens per forward: slower
    assert doc["hosts"]["ct129"]["outcome"] == "reverted (canary)" and doc["hosts"]["ct129"]["detail"]["reverted"]["healthy"]
    assert doc["halted"]["why"].startswith("canary reverted: the canary analysis said fail: accept length:")
    assert doc["untouched"] == ["ct130", "ct131"] and doc["hosts"]["ct130"]["outcome"] == "untouched"
    after = cl.servers()
    assert after["ct130"] == before["ct130"] and after["ct131"] == before["ct131"]  # the same processes
    pid, release, argv_hash, alive = after["ct129"]
    assert alive and pid != before["ct129"][0] and (release, argv_hash) == before["ct129"][1:3]  # what it served
    assert cl.worker("ct129").healthy  # back in routing
    assert served["failed"] == 0, served


def test_an_idle_canary_is_inconclusive_pauses_and_abort_reverts_it(cl):
    """No traffic: nothing decoded, nothing to judge: inconclusive, and the profile says pause.
    `sglfleet rollout abort` from another process tells the waiting controller, which reverts the
    canary and exits 1; the other hosts are untouched."""
    before = cl.servers()
    proc = cl.spawn("deploy", "--rolling", "all", cl.profile("idle"), "--canary", "1", "--min-ready", "1")
    try:
        paused = wait_paused(cl, proc)
        assert paused["paused"]["verdict"] == "inconclusive" and paused["paused"]["canary"] == ["ct129"]
        code, told = cl.cli("rollout", "list")
        listed = [r for r in told["rollouts"] if r["status"].startswith("paused")]
        assert code == 0 and len(listed) == 1, told
        assert listed[0]["status"] == "paused after the canary analysis (inconclusive)"
        assert listed[0]["controller"].startswith(f"pid {proc.pid} "), listed  # it waits
        code, told = cl.cli("rollout", "abort")
        assert code == 0 and told["sent_to"].startswith(f"pid {proc.pid} "), told
        out, err = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 1, err[-4000:]
    doc = json.loads(out)
    analysis = doc["analysis"]
    assert analysis["verdict"] == "inconclusive" and analysis["samples"]["ct129"] == 0
    assert "too few samples: the canary decoded in 0 interval(s)" in rows(analysis)["accept length"]["why"]
    assert doc["canary"]["decision"]["action"] == "abort"
    assert doc["hosts"]["ct129"]["outcome"] == "reverted (canary)" and doc["untouched"] == ["ct130", "ct131"]
    after = cl.servers()
    assert after["ct130"] == before["ct130"] and after["ct131"] == before["ct131"]
    assert after["ct129"][1:3] == before["ct129"][1:3] and cl.worker("ct129").healthy


def test_pause_then_continue_after_the_controller_exited(cl):
    """--analysis pause: the controller stops after a passing verdict; interrupted there, it leaves
    the state paused, and `sglfleet rollout continue` rolls out the rest from the state file (a
    restart: no smoke to pay for on three hosts)."""
    from orchestrator.stages.rollout import saved_rollouts

    before = cl.servers()
    gen = load(cl)
    time.sleep(1)
    proc = cl.spawn("restart", "--rolling", "all", cl.profile("a"), "--canary", "1", "--analysis", "pause",
                    "--min-ready", "1")
    try:
        paused = wait_paused(cl, proc)
        assert paused["paused"]["verdict"] == "pass"
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=120)
        assert proc.returncode == 130, err[-4000:]
        doc = json.loads(out)
        assert doc["halted"]["paused"] and doc["untouched"] == ["ct130", "ct131"]
        state, = [path for path, d in saved_rollouts(cl.runs) if d.get("paused")]  # still paused, for `rollout continue`
        assert cl.servers()["ct130"] == before["ct130"]
        code, doc = cl.cli("rollout", "continue")
    finally:
        gen.stop()
        if proc.poll() is None:
            proc.kill()
    served = gen.wait().summary()
    assert code == 0, json.dumps({k: doc.get(k) for k in ("halted", "hosts")}, indent=1, default=str)[-4000:]
    assert doc["analysis"] is None and doc["canary"]["decision"]["action"] == "continue"
    assert {h: d["outcome"] for h, d in doc["hosts"].items()} == {
        "ct129": "done earlier (--continue)", "ct130": "restarted", "ct131": "restarted"}
    assert doc["state_file"] is None and state not in dict(saved_rollouts(cl.runs))  # finished: no state left
    after = cl.servers()
    assert all(after[h][0] != before[h][0] and after[h][3] for h in HOSTS), (before, after)
    assert served["failed"] == 0, served
