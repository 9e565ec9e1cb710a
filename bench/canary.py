"""Canary analysis benchmark: what the analysis adds to a rolling restart, in wall time and in the
controller's CPU.

A lab of --hosts hosts behind the real sglang-router (retries off), the stand-in servers with
simulated speculative decoding (DFLASH, --enable-metrics), a steady load through the router. Then
--rounds pairs of `restart --rolling all PROFILE --batch 1 --min-ready 1`, one without and one with
`--canary 1 --analysis-window W`, in alternating order (interleaved A/B on a shared machine), each
the whole CLI process: its wall time, and its CPU (user + sys of that process, from wait4).
Printed: medians of both and of the paired differences, the analysis' own time and CPU as the
rollout measured them (observe, judge, write analysis.json and the charts), and the CPU one read of
one server's /metrics costs the controller (prometheus_client's parser), on the stand-in's text and
on a synthetic text of SGLang's size (its gauges, counters and histograms with two label sets), so
the cost can be scaled to a fleet: hosts x (window / interval) reads.

    python -m orchestrator.lab.router install        # once, needs PyPI (make setup does it)
    unshare --net -- sh -c 'ip link set lo up && exec "$@"' jail \\
        timeout 1800 .venv/bin/python bench/canary.py [--hosts 3] [--rounds 3] [--window 10] --down

Results also go to runs/bench-canary-<time>.json.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
os.environ["SGLFLEET_LOOPBACK_ONLY"] = "1"

from orchestrator.fleet.router import RouterClient, request  # noqa: E402
from orchestrator.lab.loadgen import LoadGenerator  # noqa: E402
from orchestrator.lab.manager import Lab  # noqa: E402
from orchestrator.lab.router import LabRouter, missing_reason  # noqa: E402
from orchestrator.stages import canary  # noqa: E402
from rolling import bench_lab  # noqa: E402  (bench/, sys.path[0] when this file runs)

PROFILE = """name: bench-canary
description: canary analysis benchmark (lab stand-in servers, DFLASH)
model: {{path: /root/models/Qwen3-8B}}
speculative: {{algorithm: DFLASH, draft_model: /root/models/Qwen3.6-27B-DFlash, block_size: 16}}
hybrid: auto
server: {{host: 0.0.0.0, port: {port}, tp: 1, extra_args: [--enable-metrics]}}
env:
  SGLFLEET_SIM_LOAD_DELAY: "{load_delay}"
  SGLFLEET_SIM_SLOW_MS: "20"
  SGLFLEET_SIM_DRAIN_LOG_S: "1"
analysis: {{window: 60, interval: {interval}, min_samples: 5}}
"""


def run_cli(argv: list[str]) -> dict[str, Any]:
    """One CLI run: its wall time and its CPU (user + sys of the reaped process: os.times' children)."""
    before, began = os.times(), time.monotonic()
    proc = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True)
    wall, after = time.monotonic() - began, os.times()
    cpu = (after.children_user - before.children_user) + (after.children_system - before.children_system)
    try:
        doc = json.loads(proc.stdout)
    except ValueError:
        doc = {}
    return {"wall_s": round(wall, 3), "cpu_s": round(cpu, 3), "exit": proc.returncode, "doc": doc,
            "stderr": proc.stderr[-3000:]}


def sglang_sized_metrics() -> str:
    """A /metrics text of SGLang's size and shape: ~60 gauges, ~20 counters, 8 histograms of 20
    buckets, each family with two label sets (tp ranks), as prometheus_client writes it."""
    from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

    registry = CollectorRegistry()
    labels = ["model_name", "tp_rank"]
    gauges = [Gauge(f"sglang:gauge_{i}", "g", labels, registry=registry) for i in range(57)]
    gauges += [Gauge(f"sglang:{n}", "g", labels, registry=registry)
               for n in ("spec_accept_length", "spec_accept_rate", "gen_throughput")]
    counters = [Counter(f"sglang:counter_{i}", "c", labels, registry=registry) for i in range(19)]
    counters.append(Counter("sglang:generation_tokens", "c", labels, registry=registry))
    buckets = [0.001 * 2 ** i for i in range(20)]
    hists = [Histogram(f"sglang:histogram_{i}_seconds", "h", labels, buckets=buckets, registry=registry)
             for i in range(8)]
    for rank in ("0", "1"):
        for g in gauges:
            g.labels("qwen", rank).set(3.5)
        for c in counters:
            c.labels("qwen", rank).inc(1234)
        for h in hists:
            for v in (0.003, 0.02, 0.4):
                h.labels("qwen", rank).observe(v)
    return generate_latest(registry).decode()


def parse_cost(text: str, rounds: int = 300) -> dict[str, Any]:
    began = time.process_time()
    for _ in range(rounds):
        canary.reading(text, 0.0)
    per = (time.process_time() - began) / rounds
    return {"bytes": len(text), "lines": text.count("\n"), "cpu_ms_per_read": round(per * 1000, 3)}


def gap(doc: dict[str, Any]) -> float | None:
    """Seconds from the first batch back in routing to the second batch's first host out, on the
    rollout's own clock: where the analysis sits, apart from the servers' starts (which a loaded
    machine stretches by tens of seconds from run to run)."""
    batches, hosts = doc.get("batches") or [], doc.get("hosts") or {}
    if len(batches) < 2:
        return None
    back = max(hosts[h]["times"]["back_at_s"] for h in batches[0]["hosts"])
    out = min(hosts[h]["times"]["out_at_s"] for h in batches[1]["hosts"])
    return round(out - back, 3)


def med(values: list[float]) -> float:
    return round(statistics.median(values), 3) if values else float("nan")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--hosts", type=int, default=3)
    ap.add_argument("--rounds", type=int, default=3, help="pairs of rollouts, without and with the canary")
    ap.add_argument("--window", type=float, default=10.0, help="--analysis-window, seconds")
    ap.add_argument("--interval", type=float, default=1.0, help="the profile's analysis.interval, seconds")
    ap.add_argument("--load-delay", type=float, default=1.0)
    ap.add_argument("--rate", type=float, default=12.0, help="requests per second through the router")
    ap.add_argument("--port", type=int, default=30791)
    ap.add_argument("--lab-dir", default="/var/cache/sglfleet/lab-canary-bench")
    ap.add_argument("--subnet", default="127.0.9")
    ap.add_argument("--down", action="store_true", help="stop the lab and router at the end")
    args = ap.parse_args()
    reason = missing_reason()
    if reason:
        print(reason, file=sys.stderr)
        return 2
    lab, router, work = bench_lab(args.lab_dir, args.subnet)
    try:
        return run(args, lab, router, work)
    finally:
        if args.down:
            router.stop()
            lab.down()


def run(args: argparse.Namespace, lab: Lab, router: LabRouter, work: Path) -> int:
    url = router.start()
    lab.up(args.hosts, extra_vars={"sglfleet_router_url": url})
    profile = work / "bench-canary.yaml"
    profile.write_text(PROFILE.format(port=args.port, load_delay=args.load_delay, interval=args.interval))
    cli = [sys.executable, "-m", "orchestrator.cli"]
    common = ["-i", str(lab.inventory_path), "--json", "--runs-dir", str(work / "runs")]
    deployed = run_cli(cli + ["deploy", "all", str(profile)] + common)
    if deployed["exit"] != 0:
        print(json.dumps(deployed["doc"])[-3000:], deployed["stderr"], file=sys.stderr)
        return 1
    client = RouterClient(url)
    for h in lab.hosts():
        client.ensure(f"http://{h.address}:{args.port}", 120)
    stand_in_text = request(f"http://{lab.hosts()[0].address}:{args.port}", "GET", "/metrics", what="worker")[1]

    restart = cli + ["restart", "--rolling", "all", str(profile), "--batch", "1", "--min-ready", "1"] + common
    with_canary = restart + ["--canary", "1", "--analysis-window", f"{args.window:g}"]
    load = LoadGenerator(url, rate=args.rate, clients=8, duration=7200, max_new_tokens=16).start()
    time.sleep(2)
    runs: dict[str, list[dict[str, Any]]] = {"plain": [], "canary": []}
    try:
        for i in range(args.rounds):
            order = ("plain", "canary") if i % 2 == 0 else ("canary", "plain")
            for kind in order:
                r = run_cli(with_canary if kind == "canary" else restart)
                analysis = (r["doc"] or {}).get("analysis") or {}
                print(f"round {i + 1} {kind}: exit {r['exit']}, wall {r['wall_s']:.1f}s, CPU {r['cpu_s']:.2f}s"
                      + (f"; analysis {analysis.get('verdict')} {analysis.get('seconds')}s wall, "
                         f"{analysis.get('cpu_s')}s CPU, {analysis.get('reads')} reads" if analysis else "")
                      + f"; load avg {os.getloadavg()[0]:.1f}", file=sys.stderr)
                if r["exit"] != 0:
                    print(json.dumps((r["doc"] or {}).get("halted")), r["stderr"], file=sys.stderr)
                    return 1
                runs[kind].append({k: r[k] for k in ("wall_s", "cpu_s")} | {
                    "gap_s": gap(r["doc"]), "analysis_s": analysis.get("seconds"),
                    "analysis_cpu_s": analysis.get("cpu_s"), "charts_s": analysis.get("charts_s"),
                    "charts_cpu_s": analysis.get("charts_cpu_s"), "reads": analysis.get("reads"),
                    "verdict": analysis.get("verdict"), "load": os.getloadavg()[0]})
    finally:
        load.stop()
    served = load.wait().summary()
    plain, withc = runs["plain"], runs["canary"]
    added_wall = [c["wall_s"] - p["wall_s"] for p, c in zip(plain, withc)]
    added_cpu = [c["cpu_s"] - p["cpu_s"] for p, c in zip(plain, withc)]
    costs = {"stand-in": parse_cost(stand_in_text), "sglang-sized": parse_cost(sglang_sized_metrics())}
    result = {
        "hosts": args.hosts, "rounds": args.rounds, "window_s": args.window, "interval_s": args.interval,
        "rollout_wall_s": {"plain": med([r["wall_s"] for r in plain]), "canary": med([r["wall_s"] for r in withc])},
        "rollout_cpu_s": {"plain": med([r["cpu_s"] for r in plain]), "canary": med([r["cpu_s"] for r in withc])},
        "added_wall_s": med(added_wall), "added_cpu_s": med(added_cpu),
        "gap_s": {"plain": med([r["gap_s"] for r in plain]), "canary": med([r["gap_s"] for r in withc])},
        "charts_s": med([r["charts_s"] for r in withc]), "charts_cpu_s": med([r["charts_cpu_s"] for r in withc]),
        "analysis_s": med([r["analysis_s"] for r in withc]), "analysis_cpu_s": med([r["analysis_cpu_s"] for r in withc]),
        "reads_per_analysis": med([r["reads"] for r in withc]), "per_read": costs, "load": served, "runs": runs}
    out = ROOT / "runs" / f"bench-canary-{time.strftime('%Y%m%dT%H%M%S')}.json"
    out.parent.mkdir(exist_ok=True)
    out.write_text(json.dumps(result, indent=2))
    print(f"\n{args.hosts} hosts, restart --rolling --batch 1, {args.rounds} interleaved pairs, window {args.window:g}s "
          f"read every {args.interval:g}s, {args.rate:g} req/s through the router ({served['failed']} of "
          f"{served['requests']} failed)")
    print(f"rollout wall  plain {result['rollout_wall_s']['plain']:.1f}s  canary {result['rollout_wall_s']['canary']:.1f}s"
          f"  added (median of pairs) {result['added_wall_s']:.1f}s (whole rollouts: the servers' starts on a shared "
          "machine move them by tens of seconds; the gap below is the analysis' own place)")
    print(f"between the first batch back in routing and the second out (the rollout's own clock): plain "
          f"{result['gap_s']['plain']:.2f}s, canary {result['gap_s']['canary']:.2f}s: the analysis adds "
          f"{result['gap_s']['canary'] - result['gap_s']['plain']:.2f}s for a {args.window:g}s window")
    print(f"controller CPU plain {result['rollout_cpu_s']['plain']:.2f}s  canary {result['rollout_cpu_s']['canary']:.2f}s"
          f"  added (median of pairs) {result['added_cpu_s']:.2f}s")
    print(f"the analysis as the rollout timed it: {result['analysis_s']:.1f}s wall, {result['analysis_cpu_s']:.2f}s CPU "
          f"(the whole process meanwhile, its router watch included), {result['reads_per_analysis']:.0f} reads; "
          f"of which the two charts {result['charts_s']:.2f}s wall, {result['charts_cpu_s']:.2f}s CPU")
    for name, c in costs.items():
        print(f"one /metrics read parsed, {name} text ({c['lines']} lines, {c['bytes']} bytes): "
              f"{c['cpu_ms_per_read']:.3f} ms CPU")
    print(f"results: {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
