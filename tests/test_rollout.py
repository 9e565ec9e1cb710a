"""Rolling restart / deploy behind the real SGLang router (issue 19).

Unit tests (no lab): batch planning as Ansible's serial, max_fail_percentage boundaries,
max_unavailable slots, preflight refusal, the router client's loopback guard.

Lab tests (real sshd hosts, the real sglang-router from PyPI, the stand-in SGLang servers):
under a steady load through the router with its retries disabled, a rolling restart of 4 hosts
gives 0 failed requests and never fewer than hosts - max_unavailable workers; the same run with
the drain step skipped (test-only switch) shows failures; a host crashing on start halts the
rollout after its batch, is back on its previous deployment and in the router, later hosts
untouched, exit 1.
"""

from __future__ import annotations

import json
import os
import threading
import time
from pathlib import Path

import pytest
import yaml

from orchestrator.errors import ConfigError, LoopbackOnlyError
from orchestrator.fleet.inventory import Host
from orchestrator.lab.router import stand_in_profile
from orchestrator.stages import rollout

from .conftest import sglfleet, under_load


# ---------------------------------------------------------------- batches (Ansible's serial)


def hosts(n: int) -> list[str]:
    return [f"h{i}" for i in range(n)]


def sizes(batches: list[list[str]]) -> list[int]:
    return [len(b) for b in batches]


def test_serial_number_percentage_and_list():
    assert sizes(rollout.plan_batches(hosts(8), rollout.parse_serial("1"))) == [1] * 8
    assert sizes(rollout.plan_batches(hosts(8), rollout.parse_serial("3"))) == [3, 3, 2]
    assert sizes(rollout.plan_batches(hosts(8), rollout.parse_serial("25%"))) == [2, 2, 2, 2]
    # a canary, then a quarter of ALL hosts at a time; the last entry repeats
    assert sizes(rollout.plan_batches(hosts(8), rollout.parse_serial("1,25%"))) == [1, 2, 2, 2, 1]
    assert sizes(rollout.plan_batches(hosts(10), rollout.parse_serial("1,2,50%"))) == [1, 2, 5, 2]
    # a percentage rounds down but never to 0 (Ansible)
    assert sizes(rollout.plan_batches(hosts(3), rollout.parse_serial("10%"))) == [1, 1, 1]
    assert sizes(rollout.plan_batches(hosts(5), rollout.parse_serial("100%"))) == [5]
    # order kept, every host exactly once
    batches = rollout.plan_batches(hosts(7), rollout.parse_serial("2,30%"))
    assert [h for b in batches for h in b] == hosts(7)


def test_resumed_rollout_keeps_percentages_of_the_whole_fleet():
    assert sizes(rollout.plan_batches(hosts(3), ["50%"], total=8)) == [3]
    assert sizes(rollout.plan_batches(hosts(3), ["25%"], total=8)) == [2, 1]


@pytest.mark.parametrize("bad", ["0", "-1", "x", "0%", "101%", "abc%", "", "1,,2"])
def test_bad_serial_is_a_config_error(bad):
    with pytest.raises(ConfigError):
        rollout.parse_serial(bad)


def test_max_fail_percentage_must_be_exceeded_not_equalled():
    assert not rollout.batch_halts(0, 4, 0)
    assert rollout.batch_halts(1, 4, 0)            # default 0: any failure halts
    assert not rollout.batch_halts(1, 4, 25)       # 25% == 25%: goes on
    assert rollout.batch_halts(2, 4, 25)           # 50% > 25%
    assert rollout.batch_halts(1, 4, 24.9)         # 25% > 24.9%
    assert not rollout.batch_halts(2, 2, 100)      # everything failed, 100 allowed
    assert not rollout.batch_halts(1, 3, 100 / 3)  # 33.33..% == 33.33..%


def test_max_unavailable_count_or_percentage():
    assert rollout.parse_max_unavailable(None, 8) is None
    assert rollout.parse_max_unavailable("2", 8) == 2
    assert rollout.parse_max_unavailable("25%", 8) == 2
    assert rollout.parse_max_unavailable("10%", 4) == 1   # rounds down, at least 1
    for bad in ("0", "-2", "x", "0%", "150%"):
        with pytest.raises(ConfigError):
            rollout.parse_max_unavailable(bad, 8)


def test_capacity_never_lets_more_hosts_out_than_the_limit():
    stop = threading.Event()
    cap = rollout.Capacity(2, {"down"}, stop)        # one host is down already: one slot left
    cap.acquire("a")
    got_b = threading.Event()

    def take_b():
        cap.acquire("b")
        got_b.set()

    t = threading.Thread(target=take_b)
    t.start()
    assert not got_b.wait(0.5), "a second host went out while the down host and 'a' filled max_unavailable 2"
    cap.acquire("down")                               # the down host itself needs no new slot
    cap.release("a")
    assert got_b.wait(2)
    t.join()
    assert cap.peak == 2
    stop.set()
    with pytest.raises(rollout.Aborted):
        cap.acquire("c")


class FakeRouterRollout(rollout.Rollout):
    """A Rollout whose preflight table is given (no router, no host) for check_capacity."""

    def __init__(self, max_unavailable):  # noqa: D107 - only what check_capacity reads
        self.max_unavailable = max_unavailable
        self.stop = threading.Event()


def rows(down: list[str], total: int = 4) -> list[dict]:
    return [{"host": f"h{i}", "up": f"h{i}" not in down, "why": "not in router" if f"h{i}" in down else "",
             "worker_url": f"http://127.0.0.{i + 1}:30000", "registered": []} for i in range(total)]


def test_a_host_already_down_is_refused_or_counted_as_the_flags_say():
    with pytest.raises(rollout.RolloutRefused, match="h2 .*max-unavailable is 1"):
        FakeRouterRollout(1).check_capacity(rows(["h2"]))
    run = FakeRouterRollout(2)
    run.check_capacity(rows(["h2"]))                  # counted: one slot left
    assert run.capacity.out == {"h2"} and run.capacity.limit == 2
    FakeRouterRollout(None).check_capacity(rows(["h2"]))   # no limit given: batch size rules
    FakeRouterRollout(1).check_capacity(rows([]))


def test_worker_url_from_bind_port_and_overrides(tmp_path):
    profile_path = tmp_path / "p.yaml"
    profile_path.write_text("name: p\nmodel: {path: /m}\nserver: {host: 0.0.0.0, port: 30770}\n")
    from orchestrator.spec.profile import load_profile

    prof = load_profile(str(profile_path))
    h = Host(name="a", address="10.0.0.5", vars={})
    assert rollout.worker_url(h, prof) == "http://10.0.0.5:30770"
    h = Host(name="a", address="10.0.0.5", vars={"sglfleet_server_bind": "127.0.7.1",
                                                  "sglfleet_profile_overrides": {"p": {"server": {"port": 31000}}}})
    assert rollout.worker_url(h, prof) == "http://127.0.7.1:31000"
    h = Host(name="a", address="10.0.0.5", vars={"sglfleet_router_worker_url": "http://gw-side:8000/"})
    assert rollout.worker_url(h, prof) == "http://gw-side:8000"
    assert rollout.host_routers(Host(name="a", address="x", vars={"sglfleet_router_url": ["http://r1:1", "r2:2"]})) == \
        ["http://r1:1", "http://r2:2"]


def test_a_restart_skips_the_smoke_only_when_the_record_vouches_for_what_starts():
    record = {"deploy_id": "d1", "release": "r1", "argv_hash": "a1", "env_hash": "e1",
              "expected": {"speculative_algorithm": None}}
    same = {"release": "r1", "argv_hash": "a1", "env_hash": "e1", "files_hash": "f2"}
    why = rollout.smoke_vouched(record, same)
    assert why and "d1" in why and "r1" in why
    # a changed release, argv or environment must pass SGLang's validation again
    for key, value in (("release", "r2"), ("release", None), ("argv_hash", "a2"), ("env_hash", "e2")):
        assert rollout.smoke_vouched(record, dict(same, **{key: value})) is None, key
    # a record that keeps no smoke result (older records), or none at all, vouches for nothing
    assert rollout.smoke_vouched({k: v for k, v in record.items() if k != "expected"}, same) is None
    assert rollout.smoke_vouched(None, same) is None
    assert rollout.smoke_vouched(dict(record, release=None), dict(same, release=None))  # pristine == pristine


@pytest.mark.parametrize("min_ready", [0.3, 0.6])
def test_min_ready_checks_health_at_its_end_and_stops_there(monkeypatch, min_ready):
    """The last /health of min_ready is at its end (not up to a poll before it: the server's last
    moments unchecked) and nothing waits after it (not up to a poll more on every host)."""
    checks: list[float] = []
    monkeypatch.setattr(rollout, "worker_healthy", lambda url, timeout=5: checks.append(time.monotonic()) or True)

    class Run:
        options = rollout.RolloutOptions(mode="restart", min_ready=min_ready)
        event = staticmethod(lambda kind, host, text: None)

    host = object.__new__(rollout.HostRoll)
    host.run, host.name, host.url, host.times = Run(), "h0", "http://127.0.0.1:1", {}
    began = time.monotonic()
    assert host.stays_ready() is None
    took = time.monotonic() - began
    assert checks[-1] - began >= min_ready, [round(c - began, 3) for c in checks]
    assert took < min_ready + 0.1, took
    assert host.times["min_ready_s"] >= min_ready
    assert len(checks) >= min_ready / rollout.HostRoll.MIN_READY_POLL_S  # polled all along


def test_router_client_refuses_non_loopback_before_connecting(monkeypatch):
    from orchestrator.fleet.router import RouterClient, worker_in_flight

    monkeypatch.setenv("SGLFLEET_LOOPBACK_ONLY", "1")
    with pytest.raises(LoopbackOnlyError):
        RouterClient("http://10.1.2.3:30000").workers()
    with pytest.raises(LoopbackOnlyError):
        worker_in_flight("http://192.0.2.7:30000")


def test_restart_without_rolling_is_bad_input():
    result = sglfleet("restart", "all", "x")
    assert result.returncode == 2, result.stdout + result.stderr
    assert "--rolling" in result.stderr


# ---------------------------------------------------------------- the lab


def router_or_skip():
    from orchestrator.lab import router

    reason = router.missing_reason()
    if reason:
        if os.environ.get("CI") not in (None, "", "0", "false"):
            pytest.fail(f"CI: {reason}")
        pytest.skip(reason)




class RollLab:
    """A private lab with a real router in front, servers deployed, an inventory with sglfleet_router_url."""

    def __init__(self, lab, tmp: Path, port: int):
        from orchestrator.lab.router import LabRouter

        self.lab, self.tmp, self.port = lab, tmp, port
        self.router = LabRouter(lab.state_dir, lab.subnet, port=30000, prometheus_port=29000)
        self.router.stop()
        self.url = self.router.start()
        doc = yaml.safe_load(lab.inventory_path.read_text())
        doc["all"]["vars"]["sglfleet_router_url"] = self.url
        self.inventory = tmp / "roll.yaml"
        self.write_inventory(doc)
        (tmp / "roll.known_hosts").write_text(lab.known_hosts_path.read_text())

    def write_inventory(self, doc):
        self.inventory.write_text(yaml.safe_dump(doc, sort_keys=False))

    def profile(self, name: str, load_delay: float = 1, slow_ms: int = 300, release: str = "") -> Path:
        """The profile `name` (a server of its own on the host); `release` makes a new deployment
        of the same server (another env), written to NAME-RELEASE.yaml."""
        path = self.tmp / (f"{name}-{release}.yaml" if release else f"{name}.yaml")
        path.write_text(stand_in_profile(name, f"rolling test ({name})", self.port, load_delay, slow_ms,
                                         env={"ROLL_RELEASE": release or "1"}))
        return path

    def cli(self, *args: str) -> tuple[int, dict]:
        result = sglfleet(*args, "-i", str(self.inventory), "--json", "--runs-dir", str(self.tmp / "runs"))
        try:
            doc = json.loads(result.stdout)
        except ValueError:
            raise AssertionError(f"no JSON (exit {result.returncode}):\n{result.stdout}\n{result.stderr}") from None
        return result.returncode, doc

    def deploy_all(self, profile: Path) -> None:
        result = sglfleet("deploy", "all", str(profile), "-i", str(self.inventory), "--json", "--runs-dir",
                          str(self.tmp / "runs"))
        assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]

    def register_all(self) -> None:
        from orchestrator.fleet.router import RouterClient

        client = RouterClient(self.url)
        for h in self.lab.hosts():
            client.ensure(f"http://{h.address}:{self.port}", 60)

    def close(self):
        self.router.stop()


@pytest.fixture(scope="module")
def roll_lab(tmp_path_factory):
    router_or_skip()
    from .private_lab import private_lab

    with private_lab("roll", 1, 4) as lab:
        rl = RollLab(lab, tmp_path_factory.mktemp("roll"), port=30771)
        try:
            rl.deploy_all(rl.profile("roll-a"))
            rl.register_all()
            yield rl
        finally:
            rl.close()


@pytest.mark.lab
@pytest.mark.slow
def test_rolling_restart_under_load_fails_no_request_and_control_does(roll_lab):
    rl = roll_lab
    profile = str(rl.tmp / "roll-a.yaml")
    (code, doc), load = under_load(rl.url, lambda: rl.cli("restart", "--rolling", "all", profile, "--batch", "2",
                                                          "--max-unavailable", "2", "--min-ready", "1"))
    print(f"\nrolling restart under load: {load}; fewest healthy workers {doc['min_healthy_workers']}; "
          f"{doc['seconds']}s")
    assert code == 0, json.dumps(doc, indent=1)[-4000:]
    assert [h["outcome"] for h in doc["hosts"].values()] == ["restarted"] * 4
    assert load["failed"] == 0, load
    # the load kept its rate through the whole rollout (a starved load would hide failures)
    assert load["during_call"] >= max(40, 0.8 * load["offered_during"]), load
    # the router never had fewer than hosts - max_unavailable healthy workers
    assert doc["router_samples"] > 50
    assert min(doc["min_healthy_workers"].values()) >= 4 - 2, doc["min_healthy_workers"]
    assert doc["max_unavailable_peak"] <= 2
    for h in doc["hosts"].values():
        assert h["detail"]["stopped"]["was_running"] and h["detail"]["launched"]["pid"]
        # The deployment is unchanged and passed its smoke when it was deployed: no smoke again.
        assert "passed its smoke" in (h["detail"]["smoke"].get("skipped") or ""), h["detail"]["smoke"]
        assert "smoke" not in h["detail"]["steps"] and h["detail"]["round_trips"]["exec"] == 3, h["detail"]["steps"]
        times = h["times"]
        assert times["prepare_at_s"] <= times["out_at_s"] < times["back_at_s"] <= doc["seconds"], times
    # one timeline: no host of a batch left routing before the previous batch was back in it
    for earlier, later in zip(doc["batches"], doc["batches"][1:]):
        assert max(doc["hosts"][n]["times"]["back_at_s"] for n in earlier["hosts"]) <= \
            min(doc["hosts"][n]["times"]["out_at_s"] for n in later["hosts"])

    # Control: the same run with the drain step skipped must show failed requests.
    code, doc, load = _control(rl, profile)
    print(f"control (no drain): {load}; fewest healthy workers {doc['min_healthy_workers']}")
    assert load["failed"] > 0, f"the control run (no drain) failed no request: the test cannot fail: {load}"


def _control(rl: RollLab, profile: str) -> tuple[int, dict, dict]:
    """The rollout with unsafe_skip_drain, in-process (the switch is not on the CLI)."""
    from orchestrator.fleet.inventory import load_inventory
    from orchestrator.spec.profile import load_profile
    from orchestrator.stages.deploy import DeployOptions

    options = rollout.RolloutOptions(mode="restart", serial=[2], max_unavailable="2", min_ready=1,
                                     state_dir=rl.tmp / "runs-control", unsafe_skip_drain=True,
                                     deploy=DeployOptions(command="test control"))
    run = rollout.Rollout(load_inventory(str(rl.inventory)), "all", load_profile(profile), None, options)
    doc, load = under_load(rl.url, run.run)
    return doc["exit_code"], doc, load


def _server_pid(rl: RollLab, host: str, profile: str) -> tuple[object, list]:
    result = sglfleet("status", host, profile, "-i", str(rl.inventory), "--json")
    doc = json.loads(result.stdout)
    row = doc["hosts"][host]["value"]["profiles"][0]
    return row.get("pid"), row.get("drift")


@pytest.mark.lab
@pytest.mark.slow
def test_crash_on_start_halts_reverts_and_continue_resumes(roll_lab):
    from orchestrator.fleet.inventory import load_inventory
    from orchestrator.fleet.router import RouterClient
    from orchestrator.spec.profile import load_profile
    from orchestrator.stages.deploy import DeployOptions

    rl = roll_lab
    new = rl.profile("roll-a", release="b")
    before = {h: _server_pid(rl, h, str(rl.tmp / "roll-a.yaml")) for h in ("ct131", "ct132")}
    doc = yaml.safe_load(rl.inventory.read_text())
    # ct130's server crashes on start (a stand-in knob through sglfleet_profile_overrides)
    doc["all"]["hosts"]["ct130"]["sglfleet_profile_overrides"] = {"roll-a": {"env": {"SGLFLEET_SIM_CRASH_AFTER": "0.3"}}}
    rl.write_inventory(doc)

    def deploy(resume: bool) -> dict:
        options = rollout.RolloutOptions(mode="deploy", serial=[1], min_ready=1, resume=resume,
                                         state_dir=rl.tmp / "runs-crash", deploy=DeployOptions(command="test"))
        return rollout.rolling_deploy(load_inventory(str(rl.inventory)), "all", load_profile(str(new)), options)

    out = deploy(False)
    assert out["exit_code"] == 1, json.dumps(out, indent=1, default=str)[-4000:]
    outcomes = {h: d["outcome"] for h, d in out["hosts"].items()}
    assert outcomes == {"ct129": "deployed", "ct130": "failed, reverted", "ct131": "untouched",
                        "ct132": "untouched"}, {h: (d["outcome"], d.get("summary")) for h, d in out["hosts"].items()}
    # a new deployment (another environment) passes SGLang's validation before it replaces the old one
    smoke = out["hosts"]["ct129"]["detail"]["smoke"]
    assert smoke["ok"] and "skipped" not in smoke and smoke["timings"], smoke
    assert "smoke" in out["hosts"]["ct129"]["detail"]["steps"]
    assert out["halted"]["batch"] == 2 and out["untouched"] == ["ct131", "ct132"]
    assert out["hosts"]["ct130"]["detail"]["reverted"]["healthy"] is True
    assert "exited" in out["hosts"]["ct130"]["summary"] or "exit" in out["hosts"]["ct130"]["summary"]
    # ct130 serves its previous deployment (release 1: no drift against it) and is back in the router
    del doc["all"]["hosts"]["ct130"]["sglfleet_profile_overrides"]
    rl.write_inventory(doc)
    pid, drift = _server_pid(rl, "ct130", str(rl.tmp / "roll-a.yaml"))
    assert pid and drift == [], drift
    worker = RouterClient(rl.url).find(f"http://{rl.lab._host('ct130').address}:{rl.port}")
    assert worker is not None and worker.healthy
    # hosts after the halt were not touched: same server process as before
    assert {h: _server_pid(rl, h, str(rl.tmp / "roll-a.yaml")) for h in ("ct131", "ct132")} == before
    assert out["state_file"]

    # --continue after the fix (the knob is gone): ct129 is not redone; the rest get release b
    out = deploy(True)
    assert out["exit_code"] == 0, json.dumps(out, indent=1, default=str)[-4000:]
    outcomes = {h: d["outcome"] for h, d in out["hosts"].items()}
    assert outcomes == {"ct129": "done earlier (--continue)", "ct130": "deployed", "ct131": "deployed",
                        "ct132": "deployed"}, {h: (d["outcome"], d.get("summary")) for h, d in out["hosts"].items()}
    assert out["state_file"] is None


@pytest.mark.lab
@pytest.mark.slow
def test_a_server_that_does_not_stay_healthy_for_min_ready_is_reverted(roll_lab):
    from orchestrator.fleet.inventory import load_inventory
    from orchestrator.fleet.router import RouterClient
    from orchestrator.spec.profile import load_profile
    from orchestrator.stages.deploy import DeployOptions

    rl = roll_lab
    new = rl.profile("roll-a", release="c")
    doc = yaml.safe_load(rl.inventory.read_text())
    # passes the staged health (about 2 s after it listens), then crashes: only min_ready sees it
    doc["all"]["hosts"]["ct129"]["sglfleet_profile_overrides"] = {"roll-a": {"env": {"SGLFLEET_SIM_CRASH_AFTER": "6"}}}
    rl.write_inventory(doc)
    try:
        options = rollout.RolloutOptions(mode="deploy", serial=[1], min_ready=12, state_dir=rl.tmp / "runs-minready",
                                         deploy=DeployOptions(command="test"))
        out = rollout.rolling_deploy(load_inventory(str(rl.inventory)), "all", load_profile(str(new)), options)
    finally:
        del doc["all"]["hosts"]["ct129"]["sglfleet_profile_overrides"]
        rl.write_inventory(doc)
    assert out["exit_code"] == 1, json.dumps(out, indent=1, default=str)[-4000:]
    host = out["hosts"]["ct129"]
    assert host["outcome"] == "failed, reverted" and host["detail"]["phase"] == "min_ready", host["summary"]
    assert out["untouched"] == ["ct130", "ct131", "ct132"]
    worker = RouterClient(rl.url).find(f"http://{rl.lab._host('ct129').address}:{rl.port}")
    assert worker is not None and worker.healthy
    pid, drift = _server_pid(rl, "ct129", str(rl.tmp / "roll-a-b.yaml"))  # the previous deployment again
    assert pid and drift == [], drift


@pytest.mark.lab
def test_a_host_down_before_the_rollout_is_refused_with_the_table(roll_lab):
    from orchestrator.fleet.inventory import load_inventory
    from orchestrator.fleet.router import RouterClient
    from orchestrator.spec.profile import load_profile

    rl = roll_lab
    stopped = sglfleet("stop", "ct132", "-i", str(rl.inventory), "--json", "--grace", "5")
    assert stopped.returncode == 0, stopped.stdout + stopped.stderr
    try:
        code, doc = rl.cli("restart", "--rolling", "all", str(rl.tmp / "roll-a.yaml"), "--max-unavailable", "1")
        assert code == 1
        assert "refusing to start" in doc["refused"] and "ct132" in doc["refused"]
        assert [r["host"] for r in doc["preflight"] if not r["up"]] == ["ct132"]
        client = RouterClient(rl.url)
        url = f"http://{rl.lab._host('ct132').address}:{rl.port}"
        deadline = time.monotonic() + 60
        while client.find(url) is None or client.find(url).healthy:  # the router has seen it go
            assert time.monotonic() < deadline, client.find(url)
            time.sleep(0.2)
    finally:
        result = sglfleet("deploy", "ct132", str(rl.tmp / "roll-a.yaml"), "-i", str(rl.inventory), "--json",
                          "--runs-dir", str(rl.tmp / "runs"))
        assert result.returncode == 0, result.stdout[-2000:]
    # Serving again while the router still lists it unhealthy (its next health checks have not run):
    # the preflight waits for the router to catch up instead of counting it down (seen in CI as a
    # rollout refused 0.3 s after this test).
    options = rollout.RolloutOptions(mode="restart", serial=[1], max_unavailable="1", state_dir=rl.tmp / "runs-pre")
    run = rollout.Rollout(load_inventory(str(rl.inventory)), "all", load_profile(str(rl.tmp / "roll-a.yaml")), None,
                          options)
    table = run.preflight()
    assert all(r["up"] for r in table), table
    assert client.find(url).healthy


@pytest.mark.lab
@pytest.mark.slow
def test_an_interrupted_rolling_restart_touches_no_further_host_and_leaves_all_serving(roll_lab):
    """Ctrl-C once the first host has restarted: no further host is taken out, the one in progress
    finishes and goes back into the router, every server still serves, exit 130."""
    import signal
    import subprocess
    import sys

    from orchestrator.fleet.router import RouterClient

    from .conftest import ROOT, fenced_env

    rl = roll_lab
    # A restart restarts what runs: the fleet back on one deployment (the tests before left release
    # b on some hosts, and a restart of roll-a refuses those: "environment changed").
    rl.deploy_all(rl.tmp / "roll-a.yaml")
    profile = str(rl.tmp / "roll-a.yaml")
    hosts = ["ct129", "ct130", "ct131", "ct132"]
    before = {h: _server_pid(rl, h, profile)[0] for h in hosts}
    proc = subprocess.Popen([sys.executable, "-m", "orchestrator.cli", "restart", "--rolling", "all", profile,
                             "--batch", "1", "--min-ready", "1", "--json", "-i", str(rl.inventory),
                             "--runs-dir", str(rl.tmp / "runs-interrupt")], cwd=ROOT,
                            env=fenced_env({"SGLFLEET_LOOPBACK_ONLY": "1"}), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 600
    while _server_pid(rl, "ct129", profile)[0] == before["ct129"]:  # the first host restarted
        assert proc.poll() is None, proc.communicate()
        assert time.monotonic() < deadline, "the rollout never restarted ct129"
        time.sleep(0.5)
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=600)
    assert proc.returncode == 130, err[-3000:]
    assert json.loads(out)["exit_code"] == 130
    after = {h: _server_pid(rl, h, profile)[0] for h in hosts}
    untouched = [h for h in hosts if after[h] == before[h]]
    assert after["ct129"] != before["ct129"] and {"ct131", "ct132"} <= set(untouched), (before, after)
    assert all(after.values())  # every host serves
    client = RouterClient(rl.url)
    for h in rl.lab.hosts():
        client.wait_healthy(f"http://{h.address}:{rl.port}", 60)  # and is back in routing
