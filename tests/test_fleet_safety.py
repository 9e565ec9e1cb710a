"""Fleet-safe operations (issue 26), without a lab: the capacity guardrails of rolling operations,
Ansible's percentage rounding, the one numeric-option check of every command, rollout-only options
refused without --rolling, router URLs checked where the inventory writes them.

Every refusal here happens before any host is contacted: the inventories name 127.0.0.5, where
nothing listens, so a command that tried to connect would fail differently (exit 1)."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
from typer.testing import CliRunner

from orchestrator.cli import app
from orchestrator.errors import ConfigError
from orchestrator.fleet.inventory import load_inventory
from orchestrator.numbers import check_number
from orchestrator.spec.profile import load_profile
from orchestrator.stages import rollout

from .conftest import ROOT, sglfleet

PROFILE = str(ROOT / "playbooks" / "qwen36-ddtree.yaml")


def write_inventory(tmp_path: Path, hosts: int = 2, router: str | None = "http://127.0.0.1:30000",
                    extra: str = "") -> Path:
    lines = ["all:", "  vars:"]
    if router:
        lines.append(f"    sglfleet_router_url: {router}")
    lines.append("    ansible_user: root")
    lines.append("  hosts:")
    lines += [f"    h{i}: {{ansible_host: 127.0.0.5, ansible_port: {2200 + i}}}" for i in range(hosts)]
    path = tmp_path / "inv.yaml"
    path.write_text("\n".join(lines) + "\n" + extra)
    return path


# ---------------------------------------------------------------- percentages (Ansible's serial)


@pytest.mark.parametrize("percent, hosts, expected", [
    ("30%", 7, 2), ("30%", 8, 2), ("30%", 10, 3), ("10%", 3, 1), ("1%", 8, 1), ("100%", 7, 7), ("50%", 7, 3),
    # exact: in floats 0.35 * 2000 / 100 is 6.99999..., which rounded down to 6
    ("0.35%", 2000, 7), ("14.3%", 1000, 143),
])
def test_percentages_round_down_at_least_one_for_batch_and_max_unavailable(percent, hosts, expected):
    assert rollout.batch_size(percent, hosts) == expected
    assert rollout.parse_max_unavailable(percent, hosts) == expected
    names = [f"h{i}" for i in range(hosts)]
    batches = rollout.plan_batches(names, rollout.parse_serial(percent))
    assert len(batches[0]) == expected and sum(map(len, batches)) == hosts


@pytest.mark.parametrize("bad", ["nan%", "inf%", "-inf%", "1e9%"])
def test_non_finite_percentages_are_refused(bad):
    with pytest.raises(ConfigError):
        rollout.parse_serial(bad)
    with pytest.raises(ConfigError):
        rollout.parse_max_unavailable(bad, 8)


# ---------------------------------------------------------------- the one numeric check


def test_check_number_refuses_non_finite_and_out_of_range_naming_the_option():
    assert check_number("--grace", 0.0, low=0) == 0.0
    assert check_number("--x", None, above=0) is None
    for value in (math.nan, math.inf, -math.inf):
        with pytest.raises(ConfigError, match="--grace must be a finite number"):
            check_number("--grace", value, low=0, unit="seconds")
    with pytest.raises(ConfigError, match="--router-timeout must be a positive number of seconds, got 0"):
        check_number("--router-timeout", 0.0, above=0, unit="seconds")
    with pytest.raises(ConfigError, match="--max-fail-percentage must be between 0 and 100, got 101"):
        check_number("--max-fail-percentage", 101.0, low=0, high=100)
    with pytest.raises(ConfigError, match="--forks must be at least 1, got 0"):
        check_number("--forks", 0, low=1)


# Each command's numeric options, with a value the old code let through or refused only later.
BAD_NUMBERS = [
    (["deploy", "all", PROFILE, "--stop-grace", "nan"], "--stop-grace must be a finite number"),
    (["deploy", "all", PROFILE, "--stop-grace", "inf"], "--stop-grace must be a finite number"),
    (["deploy", "all", PROFILE, "--min-ready", "-1"], "--min-ready must be at least 0"),
    (["deploy", "all", PROFILE, "--load-timeout", "nan"], "--load-timeout must be a finite number"),
    (["deploy", "all", PROFILE, "--health-timeout", "0"], "--health-timeout must be a positive number"),
    (["deploy", "all", PROFILE, "--rolling", "--router-timeout", "0"], "--router-timeout must be a positive"),
    (["deploy", "all", PROFILE, "--rolling", "--drain-timeout", "nan"], "--drain-timeout must be a finite"),
    (["deploy", "all", PROFILE, "--rolling", "--max-fail-percentage", "nan"], "--max-fail-percentage must be a"),
    (["restart", "--rolling", "all", PROFILE, "--router-timeout", "-5"], "--router-timeout must be a positive"),
    (["restart", "--rolling", "all", PROFILE, "--drain-timeout", "-1"], "--drain-timeout must be at least 0"),
    (["restart", "--rolling", "all", PROFILE, "--min-ready", "inf"], "--min-ready must be a finite number"),
    (["restart", "--rolling", "all", PROFILE, "--max-fail-percentage", "150"], "between 0 and 100"),
    (["restart", "--rolling", "all", PROFILE, "--stop-grace", "nan"], "--stop-grace must be a finite"),
    (["stop", "all", "--grace", "nan"], "--grace must be a finite number"),
    (["stop", "all", "--grace", "-1"], "--grace must be at least 0"),
    (["run", "all", "true", "--timeout", "inf"], "--timeout must be a finite number"),
    (["push", "all", PROFILE, "--bwlimit", "nan"], "--bwlimit must be a finite number"),
    (["facts", "all", "--forks", "0"], "--forks must be at least 1"),
]


@pytest.mark.parametrize("argv, message", BAD_NUMBERS, ids=[" ".join(a[:1] + a[3:] if len(a) > 3 else a)
                                                             for a, _ in BAD_NUMBERS])
def test_every_numeric_option_is_checked_before_anything_runs(tmp_path, argv, message):
    inv = write_inventory(tmp_path)
    result = CliRunner().invoke(app, [*argv, "-i", str(inv)])
    assert isinstance(result.exception, ConfigError), (result.exception, result.output)
    assert message in str(result.exception), str(result.exception)


def test_a_bad_number_is_exit_2_one_paragraph_before_connecting(tmp_path):
    proc = sglfleet("stop", "all", "--grace", "nan", "-i", str(write_inventory(tmp_path)))
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert proc.stderr.startswith("error: --grace must be a finite number") and "Traceback" not in proc.stderr


# ---------------------------------------------------------------- rollout-only options


@pytest.mark.parametrize("extra", [["--batch", "2"], ["--continue"], ["--max-unavailable", "1"],
                                   ["--drain-timeout", "5"], ["--no-router"], ["--allow-full-outage"],
                                   ["--batch", "1"]])  # even the default, when typed, is a mistake here
def test_rollout_only_options_without_rolling_are_bad_input(tmp_path, extra):
    result = CliRunner().invoke(app, ["deploy", "all", PROFILE, *extra, "-i", str(write_inventory(tmp_path))])
    assert isinstance(result.exception, ConfigError), (result.exception, result.output)
    assert f"{extra[0]} is for --rolling only" in str(result.exception)


def test_rollout_only_options_without_rolling_exit_2(tmp_path):
    proc = sglfleet("deploy", "all", PROFILE, "--batch", "2", "--continue", "-i", str(write_inventory(tmp_path)))
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "--batch, --continue are for --rolling only" in proc.stderr


# ---------------------------------------------------------------- router URLs at load


@pytest.mark.parametrize("value, message", [
    ("127.0.0.1:30000", "the http:// is missing"), ("https://127.0.0.1:30000", "not https://"),
    ("http://127.0.0.1", "with the host and the port"), ("http://127.0.0.1:0", "not a number from 1 to 65535"),
    ("http://127.0.0.1:30000/v1", "nothing after the port"), ("[http://127.0.0.1:1, 'gw:2']", "http:// is missing"),
])
def test_a_router_url_that_is_not_http_host_port_is_a_config_error_with_file_line(tmp_path, value, message):
    path = tmp_path / "inv.yaml"
    path.write_text(f"all:\n  hosts:\n    a:\n      sglfleet_router_url: {value}\n")
    with pytest.raises(ConfigError) as info:
        load_inventory(str(path), ssh_config_path=str(tmp_path / "none"))
    assert f"{path}:4" in str(info.value) and message in str(info.value), str(info.value)
    if not value.startswith("["):
        path.write_text(f"all:\n  hosts:\n    a:\n      sglfleet_router_worker_url: {value}\n")
        with pytest.raises(ConfigError) as info:
            load_inventory(str(path), ssh_config_path=str(tmp_path / "none"))
        assert f"{path}:4" in str(info.value) and "'sglfleet_router_worker_url'" in str(info.value)


def test_router_urls_of_the_documented_form_load(tmp_path):
    path = tmp_path / "inv.yaml"
    path.write_text("all:\n  vars:\n    sglfleet_router_url: [http://127.0.0.1:30000, 'http://[::1]:30001/']\n"
                    "  hosts:\n    a: {sglfleet_router_worker_url: 'http://127.0.0.9:8000'}\n")
    inv = load_inventory(str(path), ssh_config_path=str(tmp_path / "none"))
    assert rollout.host_routers(inv.hosts["a"]) == ["http://127.0.0.1:30000", "http://[::1]:30001"]


# ---------------------------------------------------------------- capacity guardrails


def plan(tmp_path, hosts=2, router="http://127.0.0.1:30000", extra="", pattern="all", **options):
    inv = load_inventory(str(write_inventory(tmp_path, hosts, router, extra)), ssh_config_path=str(tmp_path / "x"))
    return rollout.Rollout(inv, pattern, load_profile(PROFILE), None, rollout.RolloutOptions(mode="restart", **options))


def test_hosts_no_router_fronts_are_refused_unless_no_router(tmp_path):
    with pytest.raises(ConfigError) as info:
        plan(tmp_path, router=None)
    said = str(info.value)
    assert "h0, h1: no router fronts them" in said and "sglfleet_router_url" in said and "--no-router" in said
    # opted out: allowed, batch by batch (a batch of all of them is still a full outage)
    plan(tmp_path, router=None, no_router=True)
    with pytest.raises(ConfigError, match="the hosts no router fronts out at once"):
        plan(tmp_path, router=None, no_router=True, serial=[2])


@pytest.mark.parametrize("serial, max_unavailable, said", [
    ([2], None, "batch 1 of 2 host(s) would take 2 of the 2 serving host(s) of router http://127.0.0.1:30000 out"),
    (["100%"], None, "batch 1 of 2 host(s) would take 2 of the 2"),
    ([5], None, "batch 1 of 2 host(s)"),
    ([1], "100%", "--max-unavailable 100% (2 host(s)) would let all 2 serving host(s) of router"),
    ([1], "2", "--max-unavailable 2 (2 host(s))"),
])
def test_a_plan_that_takes_all_of_a_routers_hosts_out_is_refused_with_the_numbers(tmp_path, serial,
                                                                                    max_unavailable, said):
    with pytest.raises(ConfigError) as info:
        plan(tmp_path, serial=serial, max_unavailable=max_unavailable)
    assert said in str(info.value) and "--allow-full-outage" in str(info.value), str(info.value)
    plan(tmp_path, serial=serial, max_unavailable=max_unavailable, allow_full_outage=True)


def test_a_plan_that_keeps_a_worker_serving_passes(tmp_path):
    plan(tmp_path, serial=[1])
    plan(tmp_path, hosts=4, serial=["50%"], max_unavailable="50%")
    plan(tmp_path, hosts=7, serial=["30%"], max_unavailable="30%")
    # the pattern leaves hosts of the same router serving: a batch of all selected hosts is fine
    plan(tmp_path, hosts=3, serial=[2], pattern="h0,h1")


def test_two_routers_each_keep_a_serving_worker(tmp_path):
    extra = "  children:\n    east:\n      vars: {sglfleet_router_url: 'http://127.0.0.2:30000'}\n      hosts: {h2: , h3: }\n"
    path = tmp_path / "inv.yaml"
    path.write_text("all:\n  hosts:\n    h0: {sglfleet_router_url: 'http://127.0.0.1:30000'}\n"
                    "    h1: {sglfleet_router_url: 'http://127.0.0.1:30000'}\n" + extra)
    inv = load_inventory(str(path), ssh_config_path=str(tmp_path / "x"))
    prof = load_profile(PROFILE)
    rollout.Rollout(inv, "all", prof, None, rollout.RolloutOptions(mode="restart", serial=[1, 2]))  # h0 | h1,h2 | h3
    with pytest.raises(ConfigError) as info:  # h0 | h1,h2,h3: router 2's both hosts in one batch
        rollout.Rollout(inv, "all", prof, None, rollout.RolloutOptions(mode="restart", serial=[1, 3]))
    assert "2 of the 2 serving host(s) of router http://127.0.0.2:30000" in str(info.value)
    assert "127.0.0.1:30000" not in str(info.value)


def test_hosts_already_down_count_against_the_last_serving_worker():
    fronted = {"http://r:1": {"h0", "h1", "h2"}}
    # h0 is down: a batch of the two others would leave the router nothing
    assert rollout.outage_refusals([["h1", "h2"]], {"http://r:1": {"h1", "h2"}}, {"http://r:1": 2}, None)
    assert not rollout.outage_refusals([["h1"], ["h2"]], {"http://r:1": {"h1", "h2"}}, {"http://r:1": 2}, None)
    assert not rollout.outage_refusals([["h0", "h1"], ["h2"]], fronted, {"http://r:1": 3}, None)
    # max_unavailable caps how many of a batch are out at once
    assert not rollout.outage_refusals([["h0", "h1", "h2"]], fronted, {"http://r:1": 3}, 2)


def test_the_cli_refuses_a_full_outage_with_exit_2(tmp_path):
    proc = sglfleet("restart", "--rolling", "all", PROFILE, "--batch", "100%", "-i", str(write_inventory(tmp_path)))
    assert proc.returncode == 2, proc.stdout + proc.stderr
    said = " ".join(proc.stderr.split())
    assert "batch 1 of 2 host(s) would take 2 of the 2 serving host(s)" in said and "--allow-full-outage" in said
    proc = sglfleet("restart", "--rolling", "all", PROFILE, "-i", str(write_inventory(tmp_path, router=None)))
    assert proc.returncode == 2 and "no router fronts them" in proc.stderr, proc.stderr


# ---------------------------------------------------------------- the deploy lease


def test_the_lease_lives_as_long_as_the_deploys_own_timeouts_say_step_by_step():
    from orchestrator.stages import deploy

    quick = deploy.DeployOptions(command="t", stop_grace=10, timeouts={"port": 60, "health": 30, "health_generate": 30,
                                                                        "generate": 30, "server_info": 30},
                                 min_ready=3)
    host = object.__new__(deploy.HostDeploy)
    host.options = quick
    host.stop_grace = quick.stop_grace  # what __init__ gives a single host (rank 0)
    health = 15 + 60 + 4 * 30
    # plan -> launch: the push and the smoke; launch renews it for the stop, start, health and min_ready
    assert host.lease_ttl("plan") == deploy.PUSH_AND_SMOKE_S + deploy.LEASE_MARGIN_S < 30 * 60
    assert host.lease_ttl("launch") == 10 + deploy.LAUNCH_CALL_S + health + 3 + deploy.LEASE_MARGIN_S < 15 * 60
    assert host.lease_ttl("revert") == 10 + deploy.LAUNCH_CALL_S + health + deploy.LEASE_MARGIN_S
    # the old single figure held every host for 2 x the timeouts + 2 x the grace + 20 min, whatever the step
    assert host.lease_ttl("plan") < 2 * health + 2 * 10 + 1200


def test_a_lease_records_its_step_and_an_expired_one_is_taken_over_and_said(tmp_path):
    """remote/server.py's own functions on a state dir here: the lease names the profile and the
    step it reached, each leased step renews it, and the next deploy that finds it expired takes
    it over and says whose it was and why (before, the takeover was only a log line on the host)."""
    import json
    import time

    from orchestrator.remote import server

    holder = {"user": "dana", "controller": "ops1", "command": "sglfleet deploy all p", "controller_pid": 4242}
    state = str(tmp_path)
    assert server.take_lease({"state_dir": state, "profile": "p", "lease": {"id": "d1", "holder": holder,
                                                                             "ttl": 0.2}}) is None
    server.lease_step({"state_dir": state, "deploy_id": "d1", "lease_ttl": 0.2}, "health", release="r1")
    held = json.loads((tmp_path / server.LEASE_FILE).read_text())
    assert (held["profile"], held["step"], held["release"], held["ttl"]) == ("p", "health", "r1", 0.2)
    time.sleep(0.3)
    took = server.take_lease({"state_dir": state, "profile": "p", "lease": {"id": "d2", "holder": holder, "ttl": 60}})
    assert took["id"] == "d1" and took["step"] == "health" and took["why"].startswith("its lease expired"), took
    assert json.loads((tmp_path / server.LEASE_FILE).read_text())["id"] == "d2"
