"""`sglfleet metrics` without hosts: decode lines in every format SGLang writes, the per-host
summary, the outlier flag, CSV, PNG charts, and /metrics parsing (prometheus_client)."""

from __future__ import annotations

import csv
import random
import statistics
import time
from pathlib import Path

import pytest

from orchestrator.stages import metrics

FIXTURES = Path(__file__).parent / "fixtures" / "logs"


def local_epoch(text: str) -> float:
    return time.mktime(time.strptime(text, "%Y-%m-%d %H:%M:%S"))


def fixture_lines(name: str) -> list[tuple[None, str]]:
    return [(None, line) for line in (FIXTURES / name).read_text().splitlines()]


def test_current_format_with_rank_prefixes_iteration_and_milliseconds():
    found = metrics.parse_lines("ct129", fixture_lines("decode-0.5.23.log"))
    assert len(found) == 3  # the prefill, load and HTTP lines are not decode lines
    first, second, third = found
    assert first.format == "comma" and first.ranks == "TP0"
    assert first.epoch == local_epoch("2026-12-03 09:30:10")
    assert first.values == {"running_req": 4, "tokens": 1280, "token_usage": 0.01, "accept_len": 3.41,
                            "accept_rate": 0.81, "cuda_graph": True, "gen_throughput": 312.55, "queue_req": 0}
    assert second.values["queue_req"] == 2 and second.values["gen_throughput"] == 540.10
    assert third.ranks == "DP0 TP1" and third.epoch == pytest.approx(local_epoch("2026-12-03 09:30:30") + 0.25)
    assert third.values["cap_len"] == 4.10 and third.values["cuda_graph"] is False
    assert third.values["accept_len"] == 3.60 and third.values["running_req"] == 6


def test_hybrid_model_fields():
    found = metrics.parse_lines("ct130", fixture_lines("decode-hybrid.log"))
    assert [r.values["mamba_num"] for r in found] == [2, 3]
    assert found[0].values["full_tokens"] == 1088 and found[0].values["mamba_usage"] == 0.04
    assert "tokens" not in found[0].values  # hybrid lines have #full token, not #token
    assert found[1].values["swa_tokens"] == 96 and found[1].values["swa_token_usage"] == 0.01
    assert [r.values["accept_len"] for r in found] == [4.11, 4.35]


def test_older_period_format_without_accept_rate():
    found = metrics.parse_lines("ct131", fixture_lines("decode-older.log"))
    assert [r.format for r in found] == ["period", "period"]
    assert found[0].values["accept_len"] == 2.31 and "accept_rate" not in found[0].values
    assert found[0].values["largest_len"] == 0  # a field we do not know is kept under a safe name
    assert "accept_len" not in found[1].values and found[1].values["gen_throughput"] == 88.20
    assert found[1].values["queue_req"] == 1


def test_a_line_without_its_own_stamp_takes_the_readers_time():
    line = "Decode batch, #running-req: 1, #token: 10, token usage: 0.00, accept len: 2.00, accept rate: 0.50, " \
           "cuda graph: True, gen throughput (token/s): 10.00, #queue-req: 0"
    assert metrics.parse_decode("h", line, 1234.5).epoch == 1234.5
    assert metrics.parse_decode("h", "Decode batch of something else", 1.0) is None


def synthetic(hosts: dict[str, float], n: int = 40, seed: int = 7) -> dict[str, list[metrics.Decode]]:
    rng = random.Random(seed)
    records = {}
    for host, accept in hosts.items():
        lines = []
        for i in range(n):
            stamp = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(1796290200 + 10 * i))
            a = round(accept + rng.uniform(-0.3, 0.3), 2)
            lines.append((None, f"[{stamp}] Decode batch, #running-req: {1 + i % 8}, #token: {100 * i}, token usage: "
                                f"0.01, accept len: {a:.2f}, accept rate: {(a - 1) / 15:.2f}, cuda graph: True, "
                                f"gen throughput (token/s): {95 * a:.2f}, #queue-req: 0"))
        records[host] = metrics.parse_lines(host, lines)
    return records


def test_summary_quantiles_and_the_outlier_host_flagged():
    records = synthetic({"ct129": 5.9, "ct130": 6.0, "ct131": 6.1, "ct132": 2.4})
    summary = metrics.summarize(records)
    for host, found in records.items():
        values = [r.values["accept_len"] for r in found]
        mine = summary["hosts"][host]["accept_len"]
        assert mine["median"] == statistics.median(values)
        ordered = sorted(values)
        # inclusive quantiles of 40 values: p10 at rank 3.9, p90 at rank 35.1 (0-based), interpolated
        assert mine["p10"] == pytest.approx(ordered[3] + 0.9 * (ordered[4] - ordered[3]))
        assert mine["p90"] == pytest.approx(ordered[35] + 0.1 * (ordered[36] - ordered[35]))
        assert summary["hosts"][host]["lines"] == 40
    assert summary["flagged"] == ["ct132"]
    assert "below the fleet's" in summary["hosts"]["ct132"]["why"]
    assert summary["fleet_accept_len_median"] == statistics.median(
        [summary["hosts"][h]["accept_len"]["median"] for h in records])


def test_no_outlier_in_a_healthy_fleet_nor_with_one_host():
    assert metrics.summarize(synthetic({"a": 6.0, "b": 5.6, "c": 6.2}))["flagged"] == []
    assert metrics.summarize(synthetic({"a": 1.5}))["flagged"] == []


def test_csv_has_one_row_per_decode_line(tmp_path):
    records = synthetic({"ct129": 6.0, "ct130": 2.0}, n=5)
    rows = metrics.write_csv(records, tmp_path / "m.csv")
    with open(tmp_path / "m.csv") as fh:
        read = list(csv.DictReader(fh))
    assert rows == len(read) == 10
    assert [float(r["epoch"]) for r in read] == sorted(float(r["epoch"]) for r in read)
    by_host = {h: [float(r["accept_len"]) for r in read if r["host"] == h] for h in records}
    assert by_host == {h: [r.values["accept_len"] for r in found] for h, found in records.items()}


def test_plots_are_real_pngs_holding_the_parsed_points(tmp_path):
    pytest.importorskip("matplotlib")
    import matplotlib.image

    records = synthetic({"ct129": 6.0, "ct130": 5.8, "ct131": 2.2}, n=30)
    charts = metrics.plot(records, tmp_path / "plots")
    assert set(charts) == {"accept_len", "gen_throughput"}
    for column, chart in charts.items():
        path = Path(chart["file"])
        assert path.stat().st_size > 20_000  # lines, markers, axes, legend: not an empty canvas
        image = matplotlib.image.imread(path)
        assert image.shape[:2] == (450, 1000)
        assert len({tuple(px) for px in image.reshape(-1, image.shape[2])[::7]}) > 20  # several colors drawn
        assert set(chart["series"]) == set(records)
        for host, found in records.items():
            plotted = chart["series"][host]
            assert [round(x, 3) for x, _ in plotted] == [round(r.epoch, 3) for r in found]
            assert [y for _, y in plotted] == [r.values[column] for r in found]


def test_prometheus_text_parsed_by_prometheus_client():
    pytest.importorskip("prometheus_client")
    text = "\n".join([
        "# HELP sglang:spec_accept_length The average acceptance length of speculative decoding.",
        "# TYPE sglang:spec_accept_length gauge",
        'sglang:spec_accept_length{model_name="qwen",tp_rank="0"} 3.5',
        'sglang:spec_accept_length{model_name="qwen",tp_rank="1"} 3.7',
        "# TYPE sglang:gen_throughput gauge",
        'sglang:gen_throughput{model_name="qwen"} 410.5',
        "# TYPE sglang:num_running_reqs gauge",
        "sglang:num_running_reqs 3",
        "# TYPE sglang:prompt_tokens counter",
        'sglang:prompt_tokens_total{model_name="qwen"} 1200',
    ]) + "\n"
    values = metrics.parse_prometheus(text)
    assert values['sglang:prompt_tokens_total{model_name="qwen"}'] == 1200
    figures = metrics.live_figures(values)
    assert figures["accept_len"] == pytest.approx(3.6) and figures["gen_throughput"] == 410.5
    assert figures["running_req"] == 3 and figures["accept_rate"] is None
