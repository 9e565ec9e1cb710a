"""Server groups without a host (issue 29): ranks from the inventory, the mismatches refused with
file:line (group size vs the profile's nodes, two groups sharing a host, a rank missing or twice),
the profile's multi-node schema, and each rank's rendered flags with their sources."""

from __future__ import annotations

import re
import textwrap

import pytest

from orchestrator.errors import ConfigError
from orchestrator.fleet.inventory import load_inventory
from orchestrator.fleet.server_groups import server_groups
from orchestrator.spec.profile import load_profile
from orchestrator.stages.render import RenderError, render
from orchestrator.stages.units import placements, units

from .test_render import DENSE_MODEL, OPTIONS_0523, facts

OPTIONS = OPTIONS_0523 + ["--nnodes", "--node-rank", "--dist-init-addr", "--pp-size"]


def inventory(tmp_path, text):
    path = tmp_path / "inv.yaml"
    path.write_text(textwrap.dedent(text))
    return load_inventory(str(path))


def profile(tmp_path, server="nodes: 2\n  tp: 16\n  dist_init_port: 20000", name="big"):
    path = tmp_path / f"{name}.yaml"
    path.write_text(f"name: {name}\nmodel: {{path: /root/models/Qwen3-8B}}\nserver:\n  port: 30000\n  {server}\n")
    return load_profile(str(path))


TWO_GROUPS = """\
all:
  children:
    llama-a:
      vars: {sglfleet_server_group: llama-a}
      hosts:
        a1: {ansible_host: 127.0.0.11}
        a0: {ansible_host: 127.0.0.10, sglfleet_node_rank: 0}
    llama-b:
      vars: {sglfleet_server_group: llama-b}
      hosts:
        b0: {ansible_host: 127.0.0.20}
        b1: {ansible_host: 127.0.0.21}
    solo:
      hosts:
        s0: {ansible_host: 127.0.0.30}
"""


def test_ranks_follow_the_inventory_order_and_an_explicit_rank_wins(tmp_path):
    groups = server_groups(inventory(tmp_path, TWO_GROUPS))
    assert set(groups) == {"llama-a", "llama-b"}
    # a1 is named first, but a0 says rank 0: a1 takes the lowest free rank
    assert [(r.host.name, r.rank) for r in groups["llama-a"].ranks] == [("a0", 0), ("a1", 1)]
    assert [(r.host.name, r.rank) for r in groups["llama-b"].ranks] == [("b0", 0), ("b1", 1)]
    a = groups["llama-a"]
    assert re.search(r"inv\.yaml:7 \(sglfleet_node_rank\)$", a.rank_of("a0").source), a.rank_of("a0").source
    assert "inventory order: the 1st host of server group llama-a" in a.rank_of("a1").source
    assert re.search(r"inv\.yaml:4\)$", a.rank_of("a1").source)  # where sglfleet_server_group is written


def test_adding_a_host_at_the_end_never_renumbers_the_others(tmp_path):
    before = server_groups(inventory(tmp_path, TWO_GROUPS))["llama-b"]
    after = server_groups(inventory(tmp_path, TWO_GROUPS.replace(
        "        b1: {ansible_host: 127.0.0.21}\n", "        b1: {ansible_host: 127.0.0.21}\n        b2: {}\n")))["llama-b"]
    assert [(r.host.name, r.rank) for r in after.ranks][:2] == [(r.host.name, r.rank) for r in before.ranks]


@pytest.mark.parametrize("change, expected", [
    # the same rank twice: both places named
    (("a1: {ansible_host: 127.0.0.11}", "a1: {ansible_host: 127.0.0.11, sglfleet_node_rank: 0}"),
     r"server group llama-a: a1 \(.*inv\.yaml:6\) and a0 \(.*inv\.yaml:7\) both have sglfleet_node_rank 0"),
    # a rank past the group's size leaves another missing
    (("b1: {ansible_host: 127.0.0.21}", "b1: {ansible_host: 127.0.0.21, sglfleet_node_rank: 2}"),
     r"server group llama-b has 2 host\(s\) \(b0, b1\), so its ranks are 0\.\.1, but b1 has sglfleet_node_rank 2 "
     r"\(.*inv\.yaml:12\), which leaves one of them missing"),
    # a host that two groups put in different server groups
    (("        s0: {ansible_host: 127.0.0.30}", "        s0: {ansible_host: 127.0.0.30}\n        a1:"),
     r"host a1 is in two server groups: llama-a sets it to 'llama-a' \(.*inv\.yaml:4\); "
     r"solo sets it to 'llama-b' \(.*inv\.yaml:\d+\)"),
    # a rank without a group
    (("s0: {ansible_host: 127.0.0.30}", "s0: {ansible_host: 127.0.0.30, sglfleet_node_rank: 1}"),
     r"host s0 has sglfleet_node_rank \(.*inv\.yaml:15\) but no sglfleet_server_group"),
])
def test_rank_mismatches_are_config_errors_with_file_and_line(tmp_path, change, expected):
    text = TWO_GROUPS.replace(*change)
    if "two server groups" in expected:
        text = text.replace("    solo:\n", "    solo:\n      vars: {sglfleet_server_group: llama-b}\n")
    with pytest.raises(ConfigError) as error:
        server_groups(inventory(tmp_path, text))
    assert re.search(expected, str(error.value)), str(error.value)


def test_the_host_s_own_server_group_settles_two_groups(tmp_path):
    text = TWO_GROUPS.replace("        s0: {ansible_host: 127.0.0.30}",
                              "        s0: {ansible_host: 127.0.0.30}\n        a1: {sglfleet_server_group: llama-a}")
    text = text.replace("    solo:\n", "    solo:\n      vars: {sglfleet_server_group: llama-b}\n")
    groups = server_groups(inventory(tmp_path, text))
    assert "a1" in groups["llama-a"].names and "a1" not in groups["llama-b"].names


@pytest.mark.parametrize("value", ["bad name", "", "x/y", True])
def test_a_bad_server_group_name_is_refused_where_it_is_written(tmp_path, value):
    with pytest.raises(ConfigError, match=r"inv\.yaml:4.*sglfleet_server_group"):
        inventory(tmp_path, TWO_GROUPS.replace("{sglfleet_server_group: llama-a}",
                                               f"{{sglfleet_server_group: {value!r}}}".replace("True", "true")))


@pytest.mark.parametrize("value", ["-1", "x", "1.5", "true"])
def test_a_bad_rank_is_refused_where_it_is_written(tmp_path, value):
    with pytest.raises(ConfigError, match=r"inv\.yaml:7.*sglfleet_node_rank"):
        inventory(tmp_path, TWO_GROUPS.replace("sglfleet_node_rank: 0", f"sglfleet_node_rank: {value}"))


# ---------------------------------------------------------------- against a profile


def test_a_group_of_three_for_nodes_2_names_both_files(tmp_path):
    inv = inventory(tmp_path, TWO_GROUPS.replace("        b1: {ansible_host: 127.0.0.21}\n",
                                                 "        b1: {ansible_host: 127.0.0.21}\n        b2: {}\n"))
    with pytest.raises(ConfigError) as error:
        units(inv, inv.select("llama-b"), profile(tmp_path))
    text = str(error.value)
    assert "server group llama-b has 3 host(s) (b0, b1, b2; sglfleet_server_group at" in text
    assert re.search(r"inv\.yaml:9\) but profile big runs on 2 node\(s\) \(server\.nodes at .*big\.yaml:5\): "
                     r"1 host\(s\) too many", text), text


def test_a_group_short_of_a_rank_says_which_is_missing(tmp_path):
    inv = inventory(tmp_path, TWO_GROUPS)
    with pytest.raises(ConfigError, match=r"rank\(s\) 2 missing"):
        units(inv, inv.select("llama-b"), profile(tmp_path, "nodes: 3\n  tp: 3\n  dist_init_port: 20000"))


def test_multi_node_profile_on_a_lone_host_and_single_node_profile_on_a_group_are_refused(tmp_path):
    inv = inventory(tmp_path, TWO_GROUPS)
    with pytest.raises(ConfigError, match=r"profile big runs on 2 nodes \(server\.nodes at .*big\.yaml:5\) but s0 is "
                                          r"in no server group"):
        units(inv, inv.select("s0"), profile(tmp_path))
    with pytest.raises(ConfigError, match=r"b0 is a node of server group llama-b \(sglfleet_server_group at "
                                          r".*inv\.yaml:9\), but profile one runs on one node"):
        units(inv, inv.select("b0"), profile(tmp_path, "tp: 1", name="one"))


def test_a_pattern_that_selects_part_of_a_group_is_refused_where_the_group_is_acted_on_whole(tmp_path):
    inv = inventory(tmp_path, TWO_GROUPS)
    prof = profile(tmp_path)
    with pytest.raises(ConfigError, match="the pattern selects b1 but not b0 of server group llama-b"):
        units(inv, inv.select("b1"), prof)
    # read-only commands place the ranks they were given
    only = units(inv, inv.select("b1"), prof, whole=False)
    assert [u.names for u in only] == [["b1"]] and only[0].placements["b1"].rank == 1
    both = units(inv, inv.select("llama-b,llama-a"), prof)
    assert [(u.name, u.names) for u in both] == [("llama-b", ["b0", "b1"]), ("llama-a", ["a0", "a1"])]


def test_without_a_profile_groups_are_units_and_lone_hosts_their_own(tmp_path):
    inv = inventory(tmp_path, TWO_GROUPS)
    found = units(inv, inv.select("all"), None)
    assert [(u.name, u.names, u.is_group) for u in found] == [("llama-a", ["a0", "a1"], True),
                                                              ("llama-b", ["b0", "b1"], True), ("s0", ["s0"], False)]


# ---------------------------------------------------------------- the profile's schema


@pytest.mark.parametrize("server, expected", [
    ("nodes: 3\n  tp: 16\n  dist_init_port: 20000", r"big\.yaml:5: server\.nodes: tp x pp \(16 x 1 = 16 GPUs\) "
                                                    r"must divide evenly over nodes \(3\)"),
    ("nodes: 2\n  tp: 16", r"big\.yaml:3: server\.dist_init_port: a server over 2 nodes needs dist_init_port"),
    ("nodes: 2\n  tp: 16\n  dist_init_port: 30000", r"big\.yaml:7: server\.dist_init_port: dist_init_port 30000 is "
                                                    r"server\.port too"),
    ("nodes: 0", r"big\.yaml:5: server\.nodes"),
])
def test_profile_multi_node_mistakes_are_errors_with_file_and_line(tmp_path, server, expected):
    with pytest.raises(ConfigError) as error:
        profile(tmp_path, server)
    assert re.search(expected, str(error.value)), str(error.value)


# ---------------------------------------------------------------- render


def test_each_rank_renders_its_own_flags_with_their_sources(tmp_path):
    inv = inventory(tmp_path, TWO_GROUPS)
    prof = profile(tmp_path, "nodes: 2\n  tp: 8\n  pp: 2\n  dist_init_port: 20000")
    placed = placements(inv, inv.select("llama-a"), prof)
    argvs = {}
    for name in ("a0", "a1"):
        rendered = render(inv.hosts[name], prof, facts(OPTIONS, DENSE_MODEL), inv.path, placement=placed[name])
        argvs[name] = rendered.argv
        sources = {f.name: f.source for f in rendered.flags}
        argv = rendered.argv
        assert argv[argv.index("--tp-size") + 1] == "8" and argv[argv.index("--pp-size") + 1] == "2"
        assert argv[argv.index("--nnodes") + 1] == "2"
        assert argv[argv.index("--dist-init-addr") + 1] == "127.0.0.10:20000"  # rank 0's address, both ranks
        assert re.search(r"big\.yaml:5 \(server\.nodes\)$", sources["--nnodes"])
        assert re.search(r"rank 0 a0's address \(.*inv\.yaml:7 \(ansible_host\)\) : .*big\.yaml:8 "
                         r"\(server\.dist_init_port\)$", sources["--dist-init-addr"]), sources["--dist-init-addr"]
        assert rendered.placement.hosts == ("a0", "a1")
    assert argvs["a0"][argvs["a0"].index("--node-rank") + 1] == "0"
    assert argvs["a1"][argvs["a1"].index("--node-rank") + 1] == "1"
    # the two argvs differ only in the rank
    assert [a for a in argvs["a0"] if a != "0"] == [a for a in argvs["a1"] if a != "1"]


def test_a_multi_node_profile_without_a_placement_does_not_render(tmp_path):
    inv = inventory(tmp_path, TWO_GROUPS)
    with pytest.raises(RenderError, match="runs on 2 nodes"):
        render(inv.hosts["a0"], profile(tmp_path), facts(OPTIONS, DENSE_MODEL), inv.path)


# ---------------------------------------------------------------- the ranks' meeting points


def _rank(name, rank):
    from types import SimpleNamespace

    return SimpleNamespace(host=SimpleNamespace(name=name), rank=rank)


def _in_threads(*calls):
    import threading

    out = {}
    threads = [threading.Thread(target=lambda k=k, f=f: out.__setitem__(k, f())) for k, f in calls]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    assert not any(t.is_alive() for t in threads), "a rank is still waiting"
    return out


def test_the_group_restarts_whole_when_one_rank_must_and_not_at_all_when_one_failed():
    from orchestrator.stages.groups import GroupSync

    sync = GroupSync(["a0", "a1"], "d1")
    got = _in_threads(("a0", lambda: sync.agree(_rank("a0", 0), [])),
                      ("a1", lambda: sync.agree(_rank("a1", 1), ["launch command changed"])))
    assert got == {"a0": ["the server group restarts whole: a1 (rank 1): launch command changed"],
                   "a1": ["launch command changed"]}
    sync = GroupSync(["a0", "a1"], "d2")
    sync.ended("a1", {"ok": False, "summary": "a1: refused: drifted files\nmore"})
    assert sync.agree(_rank("a0", 0), []) == "a1 (rank 1) failed: a1: refused: drifted files"
    assert GroupSync(["a0"], "d3").agree(_rank("a0", 0), []) == []  # all unchanged: nothing restarts


def test_the_other_ranks_launch_once_rank_0_s_launch_answered_and_not_if_it_was_refused():
    import time

    from orchestrator.stages.groups import GroupSync

    for outcome, expected in (("ok", None), ("failed", None), ("refused", "a0 (rank 0) was refused before it "
                                                                         "stopped anything; the group serves on")):
        sync = GroupSync(["a0", "a1"], "d")
        order = []

        def rank0():
            assert sync.launch_turn(_rank("a0", 0)) is None
            time.sleep(0.3)  # rank 0's launch call
            order.append("a0")
            sync.launched(_rank("a0", 0), outcome)

        def rank1():
            why = sync.launch_turn(_rank("a1", 1))
            order.append("a1")
            return why

        got = _in_threads(("a0", rank0), ("a1", rank1))
        assert got["a1"] == expected and order == ["a0", "a1"], (outcome, got, order)


def test_one_rank_failing_its_health_fails_the_others_and_ends_their_waits():
    from orchestrator.stages.groups import GroupSync
    from orchestrator.stages.health import HealthResult

    sync = GroupSync(["a0", "a1"], "d")
    got = _in_threads(("a0", lambda: sync.healthy(_rank("a0", 0), HealthResult(ok=True))),
                      ("a1", lambda: sync.failing(_rank("a1", 1), "server exited with code 1 during port")))
    assert not got["a0"].ok and got["a0"].failed["stage"] == "group"
    assert "another rank failed: a1 (rank 1): server exited with code 1 during port" in got["a0"].summary()
    assert sync.abort.is_set()  # a rank still polling its health stops at its next slice


def test_a_rank_whose_launch_was_refused_reverts_to_what_it_records_not_to_the_generation_before(tmp_path):
    """remote/server.py's revert (no lab, temp dirs): a rank whose own launch was refused before it
    moved anything still records what ran (its old server ended with rank 0's); that starts
    again, not previous/ (the generation before it). Without the flag, previous/ as always."""
    from orchestrator.remote import server

    from .test_deploy_host import base_args, lease, wait

    def deploy(deploy_id, script):
        args = base_args(tmp_path, deploy_id)
        lease(args, deploy_id)
        launched = server.cmd_launch(dict(args, files={"launch_script": "#!/bin/sh\n" + script, "env": "",
                                                       "unit": ""}))
        server.cmd_finish(dict(args, record={"profile": "p", "deploy_id": deploy_id, "pid": launched["pid"],
                                             "mode": "supervisor", "argv": [script]}))
        return args

    deploy("gen-a", "exec sleep 300 # a\n")
    args = deploy("gen-b", "exec sleep 300 # b\n")
    paths = server.paths_for(args)
    try:
        for flag, expected in ((True, "gen-b"), (False, "gen-a")):
            revert = base_args(tmp_path, f"d-{flag}")
            lease(revert, f"d-{flag}")
            answer = server.cmd_revert(dict(revert, relaunch_current=flag))
            assert answer["restored"]["deploy_id"] == expected, (flag, answer["restored"])
            assert wait(lambda: server.alive(answer["pid"]))
            server.cmd_finish(dict(revert, record=dict(answer["restored"], pid=answer["pid"])))
    finally:
        server.cmd_stop(dict(args, stop_grace=1))


def test_ctrl_c_before_the_launch_is_decided_once_for_every_rank():
    """A Ctrl-C stops all ranks before their launch or none: a rank 0 that launched with a rank 1
    that did not would take the running group down."""
    import threading
    from types import SimpleNamespace

    from orchestrator.fleet import group as group_module
    from orchestrator.stages.groups import INTERRUPTED, GroupSync

    run = SimpleNamespace(stop=threading.Event())
    group_module._current.group = run
    try:
        run.stop.set()  # before the ranks met: none launches
        sync = GroupSync(["a0", "a1"], "d")
        got = _in_threads(("a0", group_module.in_this_run(lambda: sync.launch_turn(_rank("a0", 0)))),
                          ("a1", group_module.in_this_run(lambda: sync.launch_turn(_rank("a1", 1)))))
        assert got == {"a0": INTERRUPTED, "a1": INTERRUPTED}

        run.stop.clear()  # once they met: every rank goes, the Ctrl-C notwithstanding
        sync = GroupSync(["a0", "a1"], "d")

        def rank0():
            why = sync.launch_turn(_rank("a0", 0))
            run.stop.set()
            sync.launched(_rank("a0", 0), "ok")
            return why

        got = _in_threads(("a0", group_module.in_this_run(rank0)),
                          ("a1", group_module.in_this_run(lambda: sync.launch_turn(_rank("a1", 1)))))
        assert got == {"a0": None, "a1": None}
    finally:
        group_module._current.group = None
