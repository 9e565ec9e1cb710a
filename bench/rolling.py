"""Rolling-restart benchmark: 8 lab hosts behind the real sglang-router (retries off), batch 25%,
under a steady client load through the router.

Prints (and writes to runs/bench-rolling-<time>.json): requests ok / failed and p50 / p99 latency
before, during and after the rollout; the fewest healthy workers the router had; the wall time
of the rollout against the floor batches x (drain + D + min_ready), where D is the stand-in's
model-load delay (SGLFLEET_SIM_LOAD_DELAY) and drain the longest request (SGLFLEET_SIM_SLOW_MS);
and where each host's time went (prepare, drain, the server's start up to its port, health,
min_ready, back in the router). Goal: 0 failed, total <= 1.15x the floor.

    python -m orchestrator.lab.router install        # once, needs PyPI (make setup does it)
    SGLFLEET_LOOPBACK_ONLY=1 .venv/bin/python bench/rolling.py [--hosts 8] [--load-delay 10]

The lab (state in --lab-dir, addresses --subnet.N) and its router stay up for a rerun; --down
stops them at the end.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
os.environ["SGLFLEET_LOOPBACK_ONLY"] = "1"

from orchestrator.fleet.inventory import load_inventory  # noqa: E402
from orchestrator.fleet.router import RouterClient  # noqa: E402
from orchestrator.lab.loadgen import LoadGenerator, LoadReport  # noqa: E402
from orchestrator.lab.manager import Lab  # noqa: E402
from orchestrator.lab.router import LabRouter, missing_reason, stand_in_profile  # noqa: E402
from orchestrator.spec.profile import load_profile  # noqa: E402
from orchestrator.stages import rollout  # noqa: E402
from orchestrator.stages.deploy import DeployOptions  # noqa: E402



def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--hosts", type=int, default=8)
    ap.add_argument("--batch", default="25%")
    ap.add_argument("--load-delay", type=float, default=10.0, help="D: the stand-in's model-load seconds")
    ap.add_argument("--slow-ms", type=int, default=200, help="each request's duration on a server")
    ap.add_argument("--min-ready", type=float, default=5.0)
    ap.add_argument("--rate", type=float, default=10.0, help="requests per second through the router")
    ap.add_argument("--clients", type=int, default=16)
    ap.add_argument("--window", type=float, default=20.0, help="seconds of load before and after the rollout")
    ap.add_argument("--port", type=int, default=30772)
    ap.add_argument("--lab-dir", default="/var/cache/sglfleet/lab-roll-bench")
    ap.add_argument("--subnet", default="127.0.7")
    ap.add_argument("--no-pipeline", action="store_true", help="do not prepare the next batch ahead")
    ap.add_argument("--down", action="store_true", help="stop the lab and router at the end")
    args = ap.parse_args()
    reason = missing_reason()
    if reason:
        print(reason, file=sys.stderr)
        return 2

    work = Path(args.lab_dir + "-work")
    work.mkdir(parents=True, exist_ok=True)
    lab = Lab(state_dir=Path(args.lab_dir), inventory_path=work / "lab.yaml", subnet=args.subnet)
    router = LabRouter(lab.state_dir, lab.subnet)
    url = router.start()
    lab.up(args.hosts, extra_vars={"router_url": url})
    profile_path = work / "bench-rolling.yaml"
    profile_path.write_text(stand_in_profile("bench-rolling", "rolling-restart benchmark (lab stand-in servers)",
                                             args.port, args.load_delay, args.slow_ms))
    t = time.monotonic()
    deployed = subprocess.run([sys.executable, "-m", "orchestrator.cli", "deploy", "all", str(profile_path), "-i",
                               str(lab.inventory_path), "--json", "--runs-dir", str(work / "runs")],
                              capture_output=True, text=True, cwd=ROOT)
    if deployed.returncode != 0:
        print(deployed.stdout[-4000:], deployed.stderr[-4000:], file=sys.stderr)
        return 1
    print(f"deployed {args.hosts} servers in {time.monotonic() - t:.1f}s", file=sys.stderr)
    client = RouterClient(url)
    hosts = lab.hosts()
    for h in hosts:
        client.ensure(f"http://{h.address}:{args.port}", 120)

    inv = load_inventory(str(lab.inventory_path))
    options = rollout.RolloutOptions(mode="restart", serial=rollout.parse_serial(args.batch),
                                     max_unavailable=args.batch, min_ready=args.min_ready, drain_timeout=60,
                                     pipeline=not args.no_pipeline, state_dir=work / "runs",
                                     deploy=DeployOptions(command="bench/rolling.py", stop_grace=60))
    run = rollout.Rollout(inv, "all", load_profile(str(profile_path)), None, options,
                          lambda kind, host, text: kind in ("batch", "host-done", "halt") and
                          print(f"  {host + ': ' if host else ''}{text}", file=sys.stderr))
    load = LoadGenerator(url, rate=args.rate, clients=args.clients, duration=3600, max_new_tokens=8).start()
    time.sleep(args.window)
    began = time.monotonic()
    doc = run.run()
    ended = time.monotonic()
    time.sleep(args.window)
    load.stop()
    report = load.wait()

    batches = len(doc["planned_batches"])
    floor = batches * (args.slow_ms / 1000.0 + args.load_delay + args.min_ready)
    phases = {"before": LoadReport.stats(report.window(None, began)),
              "during": LoadReport.stats(report.window(began, ended)),
              "after": LoadReport.stats(report.window(ended, None))}
    per_host = {}
    for name, h in doc["hosts"].items():
        d = h.get("detail") or {}
        health = d.get("health") or {}
        times = h.get("times") or {}
        per_host[name] = {"outcome": h["outcome"], "seconds": h.get("seconds"),
                          "smoke_s": ((d.get("smoke") or {}).get("timings") or {}).get("total_s"),
                          "waited_for_slot_s": times.get("waited_for_slot_s"), "remove_s": times.get("remove_s"),
                          "drain_s": times.get("drain_s"), "stop_s": (d.get("stopped") or {}).get("seconds"),
                          "start_to_port_s": health.get("port"),
                          "health_after_port_s": round(sum(v for k, v in health.items() if k != "port"), 3),
                          "min_ready_s": times.get("min_ready_s"), "add_s": times.get("add_s")}
    # The stand-in's start is longer than D: it first validates the argv with the real SGLang
    # (an import of SGLang and torch, ~20 s on this shared 2-core box). The floor with the
    # start as measured says what the rollout itself adds.
    measured_floor = 0.0
    for b in doc["batches"]:
        measured_floor += max((per_host[n]["drain_s"] or 0) + (per_host[n]["stop_s"] or 0)
                              + (per_host[n]["start_to_port_s"] or 0) + per_host[n]["health_after_port_s"]
                              + (per_host[n]["min_ready_s"] or 0) for n in b["hosts"])
    result = {"bench": "rolling", "hosts": args.hosts, "batch": args.batch, "batches": batches,
              "load_delay_s": args.load_delay, "slow_ms": args.slow_ms, "min_ready_s": args.min_ready,
              "rate": args.rate, "clients": args.clients, "pipeline": not args.no_pipeline,
              "exit_code": doc["exit_code"], "rollout_s": round(ended - began, 1),
              "floor_s": round(floor, 1), "ratio": round((ended - began) / floor, 2),
              "floor_measured_start_s": round(measured_floor, 1),
              "ratio_measured_start": round((ended - began) / measured_floor, 2) if measured_floor else None,
              "min_healthy_workers": doc["min_healthy_workers"], "max_unavailable": doc["max_unavailable"],
              "requests": phases, "total": report.summary(), "per_host": per_host,
              "batch_seconds": [b["seconds"] for b in doc["batches"]]}
    out = ROOT / "runs" / time.strftime("bench-rolling-%Y%m%dT%H%M%S.json")
    out.parent.mkdir(exist_ok=True)
    out.write_text(json.dumps(result, indent=2))
    print(json.dumps({k: v for k, v in result.items() if k != "per_host"}, indent=2))
    print(f"\nper host (s):", file=sys.stderr)
    for name, p in per_host.items():
        print(f"  {name}: " + ", ".join(f"{k}={v}" for k, v in p.items()), file=sys.stderr)
    print(f"\nrollout {ended - began:.1f}s vs floor {floor:.1f}s ({(ended - began) / floor:.2f}x), vs the floor with "
          f"the servers' measured start {measured_floor:.1f}s ({result['ratio_measured_start']}x); "
          f"failed requests: {phases['during']['failed']} during, {report.summary()['failed']} in all; "
          f"results in {out}", file=sys.stderr)
    if args.down:
        router.stop()
        lab.down()
    return 0 if doc["exit_code"] == 0 and report.summary()["failed"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
