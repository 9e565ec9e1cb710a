"""Canary analysis (issue 28 §1): the verdict, canary vs baseline, as pure functions (no host);
readings of SGLang's /metrics and samples from decode lines; the profile's `analysis:` section."""

from __future__ import annotations

import pytest

from orchestrator.errors import ConfigError
from orchestrator.spec.profile import Analysis, load_profile
from orchestrator.stages import canary, metrics
from orchestrator.stages.canary import FAIL, INCONCLUSIVE, NA, PASS, SHOWN, Sample, Side

RULES = Analysis()  # accept length >= 0.9x, throughput >= 0.85x, error rate <= baseline + 1 pp, 5 samples


def side(hosts: list[str], accept: float | None, throughput: float | None, n: int = 10,
         requests: float | None = 100, errors: float | None = 0, jitter: float = 0.02) -> Side:
    """n samples per host around the given figures (a little spread, as real ones have)."""
    samples = []
    for h in hosts:
        for i in range(n):
            wobble = 1 + jitter * ((i % 5) - 2) / 2
            samples.append(Sample(h, 1000.0 + i, {
                "accept_len": None if accept is None else accept * wobble,
                "accept_rate": None if accept is None else (accept * wobble - 1) / 15,
                "gen_throughput": None if throughput is None else throughput * wobble}))
    return Side(hosts, samples, requests, errors)


def rows(verdict: canary.Verdict) -> dict[str, dict]:
    return {r["metric"]: r for r in verdict.rows}


def test_a_canary_like_its_baseline_passes_and_the_table_says_why():
    v = canary.judge(side(["c1"], 4.2, 400.0), side(["b1", "b2"], 4.25, 404.0), RULES)
    assert v.verdict == PASS and v.reasons == []
    r = rows(v)
    assert r["accept length"]["result"] == PASS and r["accept length"]["ratio"] == pytest.approx(4.2 / 4.25)
    assert r["accept length"]["threshold"] == ">= 0.9x baseline median"
    assert r["accept length"]["samples"] == {"canary": 10, "baseline": 20}
    assert r["throughput (tok/s)"]["result"] == PASS and r["error rate"]["result"] == PASS
    assert r["accept rate"]["result"] == SHOWN and r["accept rate"]["threshold"] is None  # shown, not judged


def test_accept_length_30_percent_lower_fails_although_healthy():
    v = canary.judge(side(["c1"], 4.25 * 0.7, 404.0), side(["b1", "b2"], 4.25, 404.0), RULES)
    assert v.verdict == FAIL
    r = rows(v)["accept length"]
    assert r["result"] == FAIL and r["ratio"] == pytest.approx(0.7, abs=0.01)
    assert "0.70x the baseline's" in r["why"] and "at least 0.9x" in r["why"]
    assert v.reasons == [f"accept length: {r['why']}"]


def test_the_ratio_is_against_the_baseline_not_a_constant():
    # the same canary figure passes against a baseline of similar workload and fails against a faster one
    assert canary.judge(side(["c"], 2.0, 100.0), side(["b"], 2.1, 100.0), RULES).verdict == PASS
    assert canary.judge(side(["c"], 2.0, 100.0), side(["b"], 3.0, 100.0), RULES).verdict == FAIL


def test_thresholds_at_their_boundary_and_from_the_profile():
    exact = Analysis(accept_length={"min_ratio": 0.5}, throughput={"min_ratio": 0.5})
    # exactly 0.5x: passes (at least min_ratio)
    assert canary.judge(side(["c"], 2.0, 50.0, jitter=0), side(["b"], 4.0, 100.0, jitter=0), exact).verdict == PASS
    slow = side(["c"], 4.0, 80.0, jitter=0)
    assert rows(canary.judge(slow, side(["b"], 4.0, 100.0, jitter=0), RULES))["throughput (tok/s)"]["result"] == FAIL
    loose = Analysis(throughput={"min_ratio": 0.75})
    assert canary.judge(slow, side(["b"], 4.0, 100.0, jitter=0), loose).verdict == PASS


def test_error_rate_is_the_canarys_share_against_the_baselines_plus_the_margin():
    base = side(["b1", "b2"], 4.0, 100.0, requests=1000, errors=10)          # 1%
    ok = side(["c"], 4.0, 100.0, requests=500, errors=10)                    # 2% <= 1% + 1 pp
    bad = side(["c"], 4.0, 100.0, requests=500, errors=11)                   # 2.2%
    assert rows(canary.judge(ok, base, RULES))["error rate"]["result"] == PASS
    v = canary.judge(bad, base, RULES)
    assert v.verdict == FAIL and rows(v)["error rate"]["result"] == FAIL
    assert "2.20% of 500" in rows(v)["error rate"]["why"]


def test_a_canary_failing_every_request_fails_even_with_nothing_decoded():
    """It generates nothing, so no accept-length sample: the error rate still fails it
    (a fail wins over an inconclusive)."""
    broken = Side(["c"], [], requests=40, errors=40)
    v = canary.judge(broken, side(["b"], 4.0, 100.0), RULES)
    assert v.verdict == FAIL
    assert rows(v)["accept length"]["result"] == INCONCLUSIVE and rows(v)["error rate"]["result"] == FAIL


def test_too_few_samples_is_inconclusive_never_a_pass():
    idle = Side(["c"], [], requests=0, errors=0)  # no traffic reached the canary
    v = canary.judge(idle, side(["b"], 4.0, 100.0), RULES)
    assert v.verdict == INCONCLUSIVE
    assert "the canary decoded in 0 interval(s), the baseline in 10" in rows(v)["accept length"]["why"]
    four = side(["c"], 4.0, 100.0, n=4)
    assert canary.judge(four, side(["b"], 4.0, 100.0), RULES).verdict == INCONCLUSIVE
    assert canary.judge(four, side(["b"], 4.0, 100.0), Analysis(min_samples=4)).verdict == PASS


def test_figures_nobody_reports_are_not_judged_and_a_lost_one_fails():
    # no speculative decoding on either side: accept length is n/a, throughput and errors decide
    plain = canary.judge(side(["c"], None, 100.0), side(["b"], None, 101.0), RULES)
    assert plain.verdict == PASS and rows(plain)["accept length"]["result"] == NA
    # the canary decodes but reports no accept length where the baseline does: speculation is off there
    lost = canary.judge(side(["c"], None, 100.0), side(["b"], 4.0, 100.0), RULES)
    assert lost.verdict == FAIL and "reports no accept length" in rows(lost)["accept length"]["why"]
    # metrics off (decode lines only): no request counters, the error rate is not judged
    logs = canary.judge(side(["c"], 4.0, 100.0, requests=None, errors=None),
                        side(["b"], 4.0, 100.0, requests=None, errors=None), RULES)
    assert logs.verdict == PASS and rows(logs)["error rate"]["result"] == NA
    # nothing judged at all is no evidence: inconclusive
    nothing = Analysis(accept_length={"min_ratio": None}, throughput={"min_ratio": None},
                       error_rate={"max_increase": None})
    assert canary.judge(side(["c"], 4.0, 100.0), side(["b"], 4.0, 100.0), nothing).verdict == INCONCLUSIVE


@pytest.mark.parametrize("verdict,mode,inconclusive,action", [
    (PASS, "auto", "pause", "continue"), (FAIL, "auto", "pause", "revert"),
    (INCONCLUSIVE, "auto", "pause", "pause"), (INCONCLUSIVE, "auto", "fail", "revert"),
    (PASS, "pause", "fail", "pause"), (FAIL, "pause", "pause", "pause")])
def test_what_the_rollout_does_with_a_verdict(verdict, mode, inconclusive, action):
    assert canary.decide(verdict, mode, inconclusive) == action


# ---------------------------------------------------------------- readings and samples

SGLANG_METRICS = """# HELP sglang:spec_accept_length The average acceptance length of speculative decoding.
# TYPE sglang:spec_accept_length gauge
sglang:spec_accept_length{{model_name="qwen",tp_rank="0"}} {accept}
sglang:spec_accept_length{{model_name="qwen",tp_rank="1"}} {accept}
# TYPE sglang:gen_throughput gauge
sglang:gen_throughput{{model_name="qwen",tp_rank="0"}} 410.5
# TYPE sglang:num_running_reqs gauge
sglang:num_running_reqs{{model_name="qwen",tp_rank="0"}} 3
# TYPE sglang:generation_tokens_total counter
sglang:generation_tokens_total{{model_name="qwen"}} {tokens}
# TYPE sglang:num_requests_total counter
sglang:num_requests_total{{model_name="qwen",is_streaming="false"}} {requests}
# TYPE sglang:http_responses_total counter
sglang:http_responses_total{{endpoint="/generate",method="POST",status_code="200"}} {ok}
sglang:http_responses_total{{endpoint="/generate",method="POST",status_code="500"}} {bad}
sglang:http_responses_total{{endpoint="/health",method="GET",status_code="503"}} {health}
"""


def text(accept=3.5, tokens=1000, requests=10, ok=10, bad=0, health=0):
    return SGLANG_METRICS.format(accept=accept, tokens=tokens, requests=requests, ok=ok, bad=bad, health=health)


def test_a_reading_of_sglangs_metrics():
    r = canary.reading(text(bad=2, health=7), 5.0)
    assert r.gauges["accept_len"] == 3.5 and r.gauges["gen_throughput"] == 410.5
    assert (r.tokens, r.requests, r.responses, r.errors) == (1000, 10, 12, 2)  # /health's 503s are not requests


def test_an_interval_is_a_sample_only_when_the_server_decoded():
    a = canary.reading(text(tokens=1000), 1.0)
    b = canary.reading(text(accept=3.0, tokens=1400, requests=14, ok=14), 2.0)
    s = canary.sample_between("h", a, b)
    assert s is not None and s.values == {"accept_len": 3.0, "accept_rate": None, "gen_throughput": 410.5}
    assert canary.sample_between("h", b, canary.reading(text(accept=3.0, tokens=1400), 3.0)) is None  # idle
    # a restarted server's counters went back: nothing measured in that interval
    assert canary.sample_between("h", b, canary.reading(text(tokens=5), 3.0)) is None
    tally = canary.Tally()
    tally.add(a, b)
    tally.add(b, canary.reading(text(tokens=1500, requests=20, ok=18, bad=2, health=50), 3.0))
    assert (tally.requests, tally.errors) == (10, 2)


def test_without_the_http_counter_aborted_requests_are_the_errors():
    before = canary.reading("sglang:num_requests_total 10\nsglang:num_aborted_requests_total 1\n", 1.0)
    after = canary.reading("sglang:num_requests_total 30\nsglang:num_aborted_requests_total 3\n", 2.0)
    tally = canary.Tally()
    tally.add(before, after)
    assert (tally.requests, tally.errors) == (20, 2)
    assert canary.decoded(before, after)  # no token counter: the request counter moved


def test_decode_lines_of_the_window_with_a_running_request_are_samples():
    line = "[2026-12-03 09:30:{s:02d}] Decode batch, #running-req: {n}, #token: 10, token usage: 0.00, accept len: " \
           "{a}, accept rate: 0.20, cuda graph: True, gen throughput (token/s): 300.00, #queue-req: 0, "
    found = metrics.parse_lines("h", [(None, line.format(s=i, n=i % 3, a=3.0 + i / 10)) for i in range(10)])
    since, until = found[2].epoch, found[8].epoch
    samples = canary.from_decode_lines("h", found, since, until)
    # seconds 2..8, without those with no running request (3, 6): 2, 4, 5, 7, 8
    assert [round(s.values["accept_len"], 1) for s in samples] == [3.2, 3.4, 3.5, 3.7, 3.8]
    assert all(s.source == "log" and s.values["gen_throughput"] == 300.0 for s in samples)


# ---------------------------------------------------------------- the profile's analysis: section


def write(tmp_path, body: str):
    path = tmp_path / "p.yaml"
    path.write_text("name: p\nmodel: {path: /m}\n" + body)
    return str(path)


def test_the_analysis_section_and_its_defaults(tmp_path):
    prof = load_profile(write(tmp_path, "analysis:\n  window: 30\n  interval: 2\n  min_samples: 3\n"
                                        "  inconclusive: fail\n  accept_length: {min_ratio: 0.95}\n"
                                        "  error_rate: {max_increase: 0.005}\n"))
    a = prof.model.analysis
    assert (a.window, a.interval, a.min_samples, a.inconclusive) == (30, 2, 3, "fail")
    assert (a.accept_length.min_ratio, a.throughput.min_ratio, a.error_rate.max_increase) == (0.95, 0.85, 0.005)
    assert load_profile(write(tmp_path, "")).model.analysis == Analysis()


@pytest.mark.parametrize("body,needle", [
    ("analysis:\n  window: 0\n", "window"),
    ("analysis:\n  window: .nan\n", "window"),
    ("analysis:\n  interval: 10\n  window: 5\n", "longer than the window"),
    ("analysis:\n  min_samples: 0\n", "min_samples"),
    ("analysis:\n  inconclusive: maybe\n", "inconclusive"),
    ("analysis:\n  accept_length: {min_ratio: -1}\n", "min_ratio"),
    ("analysis:\n  error_rate: {max_increase: 2}\n", "max_increase"),
    ("analysis:\n  accept_lenght: {min_ratio: 0.9}\n", "accept_lenght"),
])
def test_a_bad_analysis_section_is_refused_with_file_and_line(tmp_path, body, needle):
    with pytest.raises(ConfigError) as caught:
        load_profile(write(tmp_path, body))
    message = str(caught.value)
    assert needle in message and "p.yaml:" in message, message


# ---------------------------------------------------------------- the lab stand-in's simulated figures


def test_the_stand_ins_accept_length_follows_what_is_deployed():
    from types import SimpleNamespace

    from orchestrator.lab.sim_server import spec_figures

    def ddtree(budget, cap=None, scale=1.0):
        return spec_figures(SimpleNamespace(speculative_algorithm="DDTREE", speculative_num_draft_tokens=16,
                                            speculative_ddtree_budget=budget, speculative_ddtree_topk_cap=cap), scale)

    assert ddtree(64) == (4.25, 0.22) and ddtree(16)[0] == 3.15 and ddtree(4)[0] == 2.6
    assert ddtree(16)[0] / ddtree(64)[0] == pytest.approx(0.74, abs=0.01)   # a budget too small: ~26% lower
    assert ddtree(64, cap=2)[0] == pytest.approx(4.25 * 0.85, abs=0.01)     # a narrow tree
    assert ddtree(64, scale=0.7)[0] == pytest.approx(4.25 * 0.7, abs=0.01)  # SGLFLEET_SIM_ACCEPT_SCALE
    assert spec_figures(SimpleNamespace(speculative_algorithm=None)) is None


def test_the_stand_ins_metrics_move_only_with_requests_and_count_failures(monkeypatch):
    from orchestrator.lab.sim_server import SimServer

    monkeypatch.setenv("SGLFLEET_SIM_ERROR_RATE", "0.25")
    monkeypatch.setenv("SGLFLEET_SIM_FORWARDS_PER_S", "100000")  # no decode time in a unit test
    server = SimServer({"fields": {"enable_metrics": True, "model_path": "/m"}, "server_args": {},
                        "spec": [4.0, 0.2], "hybrid": False, "version": "lab"}, "h200", [])
    server.ready = True
    idle = canary.reading(server.metrics({})[1], 1.0)
    assert idle.tokens == 0 and idle.gauges["accept_len"] == 4.0 and idle.gauges["gen_throughput"] == 400000.0
    assert canary.reading(server.metrics({})[1], 2.0).tokens == 0  # nothing served: no counter moves
    statuses = [server.generate({"text": "a b", "sampling_params": {"max_new_tokens": 4}})[0] for _ in range(8)]
    assert statuses.count(500) == 2 and statuses.count(200) == 6
    busy = canary.reading(server.metrics({})[1], 3.0)
    assert (busy.tokens, busy.responses, busy.errors) == (24, 8, 2)
    assert canary.sample_between("h", idle, busy) is not None
    server.args.enable_metrics = False
    assert server.metrics({})[0] == 404


# ---------------------------------------------------------------- the rollout's part (no host)


def test_canary_option_and_the_first_batch():
    from orchestrator.stages import rollout

    assert rollout.parse_canary(None) is None and rollout.parse_canary("") is None
    assert rollout.parse_canary("1") == 1 and rollout.parse_canary("10%") == "10%"
    for bad in ("0", "1,2", "x", "150%"):
        with pytest.raises(ConfigError, match="--canary"):
            rollout.parse_canary(bad)
    # the canary is the first batch, then --batch as given
    hosts = [f"h{i}" for i in range(8)]
    assert [len(b) for b in rollout.plan_batches(hosts, [1] + rollout.parse_serial("25%"))] == [1, 2, 2, 2, 1]
    assert [len(b) for b in rollout.plan_batches(hosts, ["10%"] + [3])] == [1, 3, 3, 1]


def test_the_state_keeps_the_options_a_resume_needs(tmp_path):
    from orchestrator.stages import rollout
    from orchestrator.stages.deploy import DeployOptions

    options = rollout.RolloutOptions(mode="deploy", serial=[1, "25%"], max_unavailable="2", min_ready=3,
                                     canary="1", analysis_window=30, analysis_mode="pause",
                                     deploy=DeployOptions(command="sglfleet deploy", stop_grace=7,
                                                          timeouts={"port": 9.0}, revert=False))
    again = rollout.options_from(rollout.options_doc(options), tmp_path, "sglfleet rollout continue")
    assert again.resume and again.state_dir == tmp_path
    for key in rollout.KEPT_OPTIONS:
        assert getattr(again, key) == getattr(options, key), key
    assert (again.deploy.stop_grace, again.deploy.timeouts, again.deploy.revert) == (7, {"port": 9.0}, False)
    assert again.deploy.command == "sglfleet rollout continue"


def test_one_controller_per_rollout_and_its_decision_file(tmp_path):
    import subprocess
    import sys

    from orchestrator.stages import rollout

    state = tmp_path / "rollouts" / "deploy-p-abc.json"
    first = rollout.ControllerLock(state)
    with first:
        assert first.holder().startswith("pid ")
        with pytest.raises(ConfigError, match="another controller"):
            with rollout.ControllerLock(state):
                pass
        # another process sees it held too (flock is per open file, not per process: same answer)
        probe = ("import fcntl, os, sys; fd = os.open(sys.argv[1], os.O_RDWR)\n"
                 "try:\n    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB); print('free')\n"
                 "except BlockingIOError:\n    print('held')\n")
        assert subprocess.run([sys.executable, "-c", probe, str(first.path)], capture_output=True,
                              text=True).stdout.strip() == "held"
    with rollout.ControllerLock(state):
        pass  # released
    assert rollout.take_decision(state) is None
    rollout.send_decision(state, "continue", "sglfleet rollout continue")
    taken = rollout.take_decision(state)
    assert taken["action"] == "continue" and taken["by"]["command"] == "sglfleet rollout continue"
    assert rollout.take_decision(state) is None  # taken once
    with pytest.raises(ConfigError):
        rollout.send_decision(state, "promote", "x")


def test_a_window_too_short_for_the_samples_or_the_interval_is_refused(tmp_path):
    from types import SimpleNamespace

    from orchestrator.stages import rollout

    path = tmp_path / "p.yaml"
    path.write_text("name: p\nmodel: {path: /m}\nanalysis:\n  interval: 2\n  min_samples: 5\n")
    run = object.__new__(rollout.Rollout)
    run.profile = load_profile(str(path))
    run.options = SimpleNamespace(analysis_mode="auto", analysis_window=1.0)
    with pytest.raises(ConfigError, match=r"shorter than the profile's analysis.interval \(2 s, .*p.yaml:4\)"):
        run.check_analysis()
    run.options.analysis_window = 8.0
    run.window = run.check_analysis()
    with pytest.raises(ConfigError, match="at most 4 sample"):  # 8 s / 2 s = 4 intervals < 5
        run.samples_possible(1)
    run.samples_possible(2)  # two canary hosts: 8 samples
    run.options.analysis_mode = "maybe"
    with pytest.raises(ConfigError, match="--analysis must be auto or pause"):
        run.check_analysis()


def test_a_server_group_is_one_canary_and_the_state_keeps_each_ranks_revert(tmp_path):
    """A multi-node profile's units are all server groups: --canary 1 takes the first group whole,
    and the state file keeps what reverting each of its ranks needs (for `rollout abort` without
    the controller). tests/test_server_group_lab.py reverts such a canary on the lab."""
    from orchestrator.fleet.inventory import load_inventory
    from orchestrator.stages import rollout

    from .test_server_groups import TWO_GROUPS

    (tmp_path / "inv.yaml").write_text(TWO_GROUPS.split("    solo:")[0])
    (tmp_path / "big.yaml").write_text("name: big\nmodel: {path: /root/models/Qwen3-8B}\nserver:\n  port: 30000\n"
                                       "  nodes: 2\n  tp: 16\n  dist_init_port: 20000\n")
    run = rollout.Rollout(load_inventory(str(tmp_path / "inv.yaml")), "all", load_profile(str(tmp_path / "big.yaml")),
                          None, rollout.RolloutOptions(mode="restart", serial=[1], no_router=True, state_dir=tmp_path,
                                                       canary="1", analysis_window=60.0))
    assert rollout.plan_batches([h.name for h in run.hosts], run.serial) == [["llama-a"], ["llama-b"]]
    rank = {"pushed": {"release": "r2"}, "running_before": {"release": "r1", "pid": 7}, "mode": "supervisor"}
    kept = rollout._kept({"outcome": "deployed", "ranks": {"a0": dict(rank, summary="x"), "a1": rank}})
    assert kept["ranks"] == {"a0": rank, "a1": rank} and kept["outcome"] == "deployed"
    assert "ranks" not in rollout._kept({"outcome": "deployed", "pushed": None})
