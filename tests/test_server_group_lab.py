"""Multi-node servers in the lab (issue 29): two server groups of two hosts each (real sshd, the
stand-in's rendezvous, the real sglang-router in front of each group's rank 0).

One private lab for the module; the tests run in order on what the earlier ones left:
deploy both groups (rank 0 launched first, SGLang's validation of each rank's own flags, every
rank recorded with the group and the release) and a no-op rerun (2 round trips per host); smoke
on every rank (SGLang refusing multi-node data parallelism); status, logs and metrics of a
group; a non-zero rank killed (the group is down, the NCCL error shown) and redeployed; a rank
that fails reverts the whole group; a rolling restart of both groups under load fails no
request; a group that is the canary of a rolling deploy and fails its analysis is reverted
whole; stop takes rank 0 first and the other ranks end on its shutdown.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
import yaml

from .conftest import sglfleet, under_load
from .polling import wait_for

pytestmark = [pytest.mark.lab, pytest.mark.slow]

PORT, DIST_PORT = 30790, 20790
PROFILE = """name: big
description: one server over two lab hosts (the stand-in's rendezvous)
model: {{path: /root/models/Qwen3-8B}}
server:
  host: 0.0.0.0
  port: %d
  tp: 2
  nodes: 2
  dist_init_port: %d
  extra_args: [--enable-metrics]
env:
  SGLFLEET_SIM_LOAD_DELAY: "1"
  SGLFLEET_SIM_SLOW_MS: "200"
  SGLFLEET_SIM_DRAIN_LOG_S: "1"
  SGLFLEET_SIM_DECODE_LOG_S: "1"
  SGLFLEET_SIM_DIST_TIMEOUT: "60"
  ROLL_RELEASE: "{release}"
""" % (PORT, DIST_PORT)


class GroupLab:
    """The lab, its router (workers: each group's rank 0) and an inventory of two server groups."""

    def __init__(self, lab, tmp: Path):
        from orchestrator.lab.router import LabRouter

        self.lab, self.tmp = lab, tmp
        self.router = LabRouter(lab.state_dir, lab.subnet, port=30000, prometheus_port=29000)
        self.router.stop()
        self.url = self.router.start()
        self.doc = yaml.safe_load(lab.inventory_path.read_text())
        names = list(self.doc["all"]["children"]["lab"]["hosts"])
        self.groups = {"grp-a": names[:2], "grp-b": names[2:4]}
        self.doc["all"]["vars"]["sglfleet_router_url"] = self.url
        for group, hosts in self.groups.items():
            self.doc["all"]["children"][group] = {"vars": {"sglfleet_server_group": group},
                                                  "hosts": {h: None for h in hosts}}
        self.inventory = tmp / "groups.yaml"
        self.write_inventory()
        (tmp / "groups.known_hosts").write_text(lab.known_hosts_path.read_text())
        self.address = {h.name: h.address for h in lab.hosts()}

    def write_inventory(self, overrides: dict | None = None) -> None:
        doc = json.loads(json.dumps(self.doc))
        for host, value in (overrides or {}).items():
            for group in doc["all"]["children"].values():
                if host in (group.get("hosts") or {}):
                    group["hosts"][host] = {"sglfleet_profile_overrides": {"big": value}}
        self.inventory.write_text(yaml.safe_dump(doc, sort_keys=False))

    def profile(self, release: str = "1") -> str:
        path = self.tmp / f"big-{release}.yaml"
        path.write_text(PROFILE.format(release=release))
        return str(path)

    def cli(self, *args: str, timeout: float = 300) -> tuple[int, dict]:
        """The CLI's --json document; its progress lines (stderr) are kept in progress.log."""
        runs = ["--runs-dir", str(self.tmp / "runs")] if args[0] in ("deploy", "restart", "smoke") else []
        with open(self.tmp / "progress.log", "a") as progress:
            progress.write(f"\n$ {' '.join(args)}\n")
            progress.flush()
            try:
                result = sglfleet(*args, "-i", str(self.inventory), "--json", *runs, timeout=timeout)
                progress.write(result.stderr)
            except subprocess.TimeoutExpired as exc:  # what the hosts were at, for the failure's message
                said = exc.stderr or b""
                progress.write(said.decode("utf-8", "replace") if isinstance(said, bytes) else said)
                look = "cat /var/lib/sglfleet/deploy-lease.json; tail -5 /var/log/sglfleet/big.log"
                state = "\n".join(f"{h}: {self.run(h, look)}" for h in self.address)
                raise AssertionError(f"{' '.join(args)}: no answer in {timeout}s; the hosts:\n{state}") from None
        try:
            return result.returncode, json.loads(result.stdout)
        except ValueError:
            raise AssertionError(f"no JSON (exit {result.returncode}):\n{result.stdout}\n"
                                 f"{(self.tmp / 'progress.log').read_text()[-4000:]}") from None

    def text(self, *args: str) -> tuple[int, str]:
        result = sglfleet(*args, "-i", str(self.inventory))
        return result.returncode, result.stdout + result.stderr

    def run(self, host: str, command: str) -> str:
        from orchestrator.fleet.hostkeys import KnownHosts
        from orchestrator.fleet.inventory import load_inventory
        from orchestrator.fleet.transport import Connection

        inv = load_inventory(str(self.inventory))
        conn = Connection(inv.hosts[host], KnownHosts(inv.known_hosts_path))
        try:
            return conn.run(command).stdout_text
        finally:
            conn.close()

    def status(self, pattern: str = "all") -> tuple[int, dict]:
        return self.cli("status", pattern, self.profile())

    def worker(self, group: str) -> str:
        return f"http://{self.address[self.groups[group][0]]}:{PORT}"


@pytest.fixture(scope="module")
def glab(tmp_path_factory):
    from .private_lab import private_lab
    from .test_rollout import router_or_skip

    router_or_skip()
    with private_lab("groups", 29, 4) as lab:
        gl = GroupLab(lab, tmp_path_factory.mktemp("groups"))
        try:
            yield gl
        finally:
            gl.router.stop()


def group_row(doc: dict, name: str) -> dict:
    return next(g for g in doc["server_groups"] if g["server_group"] == name)


def test_both_groups_deploy_rank_0_first_and_a_rerun_is_unchanged_in_2_round_trips_per_host(glab):
    code, doc = glab.cli("deploy", "all", glab.profile(), timeout=600)
    assert code == 0, json.dumps(doc, indent=1)[-4000:]
    assert set(doc["hosts"]) == {"grp-a", "grp-b"}
    for group, hosts in glab.groups.items():
        g = doc["hosts"][group]
        assert g["action"] == "deployed" and list(g["ranks"]) == hosts
        first, second = (g["ranks"][h] for h in hosts)
        # 4 round trips on each rank, whether it pushed (the smoke rides in the push) or the host
        # already had the release's files (the smoke on its own); one more where its code cache
        # lacked this version's scripts (remote_call: once per host and command), which depends on
        # what the lab image carries, not on the group
        for rank in (first, second):
            assert rank["round_trips"]["exec"] in (4, 5), rank["round_trips"]
        # rank 0 started before rank 1 (it hosts the rendezvous)
        assert first["launched"]["started"] <= second["launched"]["started"]
        assert first["deploy_id"] == second["deploy_id"] == g["deploy_id"]
        # SGLang's own validation ran on each rank with that rank's flags
        for rank, host in enumerate(hosts):
            fields = g["ranks"][host]["smoke"]["fields"]
            assert (fields["nnodes"], fields["node_rank"]) == (2, rank), fields
        # each rank's record names the group, its rank, every rank and the release
        for rank, host in enumerate(hosts):
            record = json.loads(glab.run(host, "cat /var/lib/sglfleet/servers/big/deployment.json"))
            assert record["placement"] == {"server_group": group, "rank": rank, "nodes": 2, "ranks": hosts,
                                           "dist_init_addr": f"{glab.address[hosts[0]]}:{DIST_PORT}"}
            assert record["deploy_id"] == g["deploy_id"] and "release" in record
            argv = record["argv"]
            assert argv[argv.index("--node-rank") + 1] == str(rank)

    code, doc = glab.cli("deploy", "all", glab.profile())
    assert code == 0, json.dumps(doc, indent=1)[-3000:]
    for group in glab.groups:
        g = doc["hosts"][group]
        assert g["action"] == "unchanged", g["summary"]
        assert all(r["round_trips"]["exec"] == 2 for r in g["ranks"].values()), g["round_trips"]

    code, doc = glab.status()
    assert code == 0, json.dumps(doc, indent=1)[-3000:]
    assert sorted(g["server_group"] for g in doc["server_groups"]) == ["grp-a", "grp-b"]
    assert all(g["state"] == "running" and not g["why"] for g in doc["server_groups"])
    code, text = glab.text("status", "grp-a", glab.profile())
    assert code == 0 and "grp-a (2 nodes)" in text and f"{glab.groups['grp-a'][1]}/1" in text, text


def test_smoke_runs_sglang_s_own_validation_on_every_rank_which_refuses_multi_node_data_parallelism(glab):
    path = glab.tmp / "big-dp.yaml"
    path.write_text(PROFILE.format(release="dp").replace("[--enable-metrics]", "[--enable-metrics, --dp-size, '2']"))
    code, doc = glab.cli("smoke", "grp-b", str(path))
    assert code == 1, doc
    for rank, host in enumerate(glab.groups["grp-b"]):
        result = doc["hosts"][host]
        assert result["render"]["placement"]["rank"] == rank
        assert result["phase"] == "validate" and "multi-node data-parallel replicas are not supported" in \
            result["probe"]["traceback"], result["summary"]


def test_logs_merge_the_ranks_and_metrics_read_rank_0(glab):
    a0, a1 = glab.groups["grp-a"]
    code, text = glab.text("logs", "grp-a", "big", "--grep", "node rank", "--no-color")
    assert code == 0, text
    assert f"{a0}/0 | " in text and f"{a1}/1 | " in text, text
    lines = text.splitlines()
    assert any(line.startswith(f"{a0}/0 | ") and "node rank 1 joined" in line for line in lines), text
    assert any(line.startswith(f"{a1}/1 | ") and "node rank 1 of 2: connected to rank 0" in line for line in lines)
    code, doc = glab.cli("metrics", "grp-a", "big")
    assert code == 0, doc
    assert list(doc["summary"]["hosts"]) == [a0]


def test_a_killed_non_zero_rank_takes_its_group_down_and_status_shows_the_error(glab):
    b0, b1 = glab.groups["grp-b"]
    _, doc = glab.status("grp-b")
    pid = next(row["pid"] for row in doc["hosts"][b1]["value"]["profiles"])
    glab.run(b1, f"kill -9 {pid}")

    def down():
        code, doc = glab.status("grp-b")
        group = group_row(doc, "grp-b")
        return (code, group) if group["state"] == "down" and len(group["why"]) == 2 else None

    code, group = wait_for(down, timeout=60)
    assert code == 1
    why = "\n".join(group["why"])
    assert f"{b1} (rank 1) is down: exited with code 137 (killed by signal 9)" in why, why
    assert f"{b0} (rank 0) is down: exited with code 1: " in why and \
        "NCCL error: remote process exited or there was a network error: node rank 1 closed its connection" in why

    code, doc = glab.cli("deploy", "grp-b", glab.profile())  # back: the group restarts whole
    assert code == 0, json.dumps(doc, indent=1)[-3000:]
    reasons = doc["hosts"]["grp-b"]["ranks"][b0]["restart_reasons"]
    assert any("server not running" in r for r in reasons), reasons


def test_a_rank_that_fails_reverts_the_whole_group(glab):
    a0, a1 = glab.groups["grp-a"]
    records = {h: json.loads(glab.run(h, "cat /var/lib/sglfleet/servers/big/deployment.json")) for h in (a0, a1)}
    # release 2: rank 1's new server crashes right after it joined; the group goes back to release 1
    glab.write_inventory({a1: {"env": {"SGLFLEET_SIM_CRASH_AFTER": "2"}}})
    try:
        code, doc = glab.cli("deploy", "grp-a", glab.profile("2"), "--min-ready", "5", timeout=600)
    finally:
        glab.write_inventory()
    assert code == 1, json.dumps(doc, indent=1)[-3000:]
    g = doc["hosts"]["grp-a"]
    assert not g["ok"] and f"{a1} (rank 1): server exited with code 1" in g["summary"], g["summary"]
    assert "illegal memory access" in g["ranks"][a1]["server_log"]  # the crash, and what it did to rank 0:
    assert "node rank 1 closed its connection" in (g["ranks"][a0].get("server_log") or g["summary"])
    for host in (a0, a1):
        rank = g["ranks"][host]
        assert rank["reverted"]["restored"] and rank["reverted"]["healthy"], rank.get("summary")
    code, after = glab.status("grp-a")
    assert code == 0 and group_row(after, "grp-a")["state"] == "running", json.dumps(after, indent=1)[-3000:]
    for host in (a0, a1):  # release 1's argv and environment again, not release 2's
        record = json.loads(glab.run(host, "cat /var/lib/sglfleet/servers/big/deployment.json"))
        assert record["env_hash"] == records[host]["env_hash"] and record.get("reverted_from")


def test_a_rolling_restart_of_both_groups_under_load_fails_no_request(glab):
    from orchestrator.fleet.router import RouterClient

    client = RouterClient(glab.url)
    for group in glab.groups:  # each group's rank 0 is its only worker
        client.ensure(glab.worker(group), 60)
    (code, doc), stats = under_load(glab.url, lambda: glab.cli(
        "restart", "--rolling", "all", glab.profile(), "--batch", "1", "--max-unavailable", "1", "--min-ready", "1",
        timeout=600), warmup=0)
    print(f"\nrolling restart of 2 groups under load: {stats}; {doc.get('seconds')}s")
    assert code == 0, json.dumps(doc, indent=1)[-4000:]
    assert [h["outcome"] for h in doc["hosts"].values()] == ["restarted", "restarted"], doc["hosts"]
    assert stats["failed"] == 0, stats
    # the load kept its rate through the whole rollout (a count fixed in advance would follow the rollout's speed)
    assert stats["during_call"] >= max(40, 0.8 * stats["offered_during"]), stats
    assert doc["max_unavailable_peak"] <= 1 and min(doc["min_healthy_workers"].values()) >= 1
    assert sorted(w.url for w in client.workers()) == sorted(glab.worker(g) for g in glab.groups)
    for group, hosts in glab.groups.items():
        detail = doc["hosts"][group]["detail"]
        assert list(detail["ranks"]) == hosts
        for host in hosts:  # every rank restarted (its old server stopped, a new one started)
            rank = detail["ranks"][host]
            assert rank["stopped"]["was_running"] is not None and rank["launched"]["pid"], rank.get("summary")
        times = doc["hosts"][group]["times"]
        assert times["out_at_s"] < times["back_at_s"]
    # one group out of routing at a time: the second left only once the first was back
    first, second = (doc["hosts"][g]["times"] for g in glab.groups)
    assert first["back_at_s"] <= second["out_at_s"] or second["back_at_s"] <= first["out_at_s"]


def test_a_server_group_canary_that_fails_is_reverted_whole_and_the_other_group_never_restarts(glab):
    """deploy --rolling --canary 1 (issue 28 on server groups): the canary is the group grp-a,
    judged through its rank 0's /metrics against grp-b; with no traffic nothing is judged, and
    analysis.inconclusive: fail reverts it: every rank back on what it served (rank 0 first, as
    the group's own deploy reverts), back in routing; grp-b keeps its very server processes."""
    from orchestrator.fleet.router import RouterClient

    a0, a1 = glab.groups["grp-a"]
    records = {h: json.loads(glab.run(h, "cat /var/lib/sglfleet/servers/big/deployment.json")) for h in (a0, a1)}
    _, before = glab.status()
    path = Path(glab.profile("canary"))
    path.write_text(path.read_text() + "analysis: {window: 3, interval: 0.5, min_samples: 3, inconclusive: fail}\n")
    code, doc = glab.cli("deploy", "--rolling", "all", str(path), "--canary", "1", "--min-ready", "1", timeout=600)
    assert code == 1, json.dumps({k: doc.get(k) for k in ("halted", "analysis", "hosts")}, indent=1)[-4000:]
    analysis = doc["analysis"]
    assert (analysis["canary"], analysis["baseline"], analysis["verdict"]) == (["grp-a"], ["grp-b"], "inconclusive")
    g = doc["hosts"]["grp-a"]
    assert g["outcome"] == "reverted (canary)", g["summary"]
    assert set(g["detail"]["reverted"]["ranks"]) == {a0, a1}
    assert all(r["healthy"] for r in g["detail"]["reverted"]["ranks"].values()), g["summary"]
    assert doc["untouched"] == ["grp-b"] and doc["hosts"]["grp-b"]["outcome"] == "untouched"
    code, after = glab.status()
    assert code == 0 and group_row(after, "grp-a")["state"] == "running", json.dumps(after, indent=1)[-3000:]
    for host in (a0, a1):  # release 1's environment again, by a revert; a new process on every rank
        record = json.loads(glab.run(host, "cat /var/lib/sglfleet/servers/big/deployment.json"))
        assert record["env_hash"] == records[host]["env_hash"] and record.get("reverted_from")
        assert group_row(after, "grp-a")["ranks"][host]["pid"] != group_row(before, "grp-a")["ranks"][host]["pid"]
    for host in glab.groups["grp-b"]:  # the same processes
        assert group_row(after, "grp-b")["ranks"][host]["pid"] == group_row(before, "grp-b")["ranks"][host]["pid"]
    assert RouterClient(glab.url).find(glab.worker("grp-a")).healthy  # back in routing


def test_stop_takes_rank_0_first_and_the_others_end_on_its_shutdown(glab):
    b0, b1 = glab.groups["grp-b"]
    code, text = glab.text("stop", b1)  # a part of a group: refused, nothing stopped
    assert code == 2 and f"not {b0} of server group grp-b" in text, text
    code, doc = glab.cli("stop", "grp-b", "big", "--grace", "20")
    assert code == 0, doc
    ranks = doc["hosts"]["grp-b"]["value"]["ranks"]
    assert list(ranks) == [b0, b1]
    assert ranks[b0]["stopped"]["big"]["was_running"] and ranks[b0]["stopped"]["big"]["exit_code"] == 0
    assert not ranks[b1]["stopped"]["big"].get("killed")
    log = glab.run(b1, "cat /var/log/sglfleet/big.log")
    assert "Received ShutdownReq from node rank 0" in log, log[-2000:]
    code, doc = glab.status("grp-b")
    assert group_row(doc, "grp-b")["state"] == "stopped"
