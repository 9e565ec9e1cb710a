"""Multi-node servers (issue 29) in the lab: what deploying a 2-node server group costs next to a
single host, and a rolling restart of two groups under load behind the real router.

Lab: 5 hosts; the first serves alone, the others are two server groups of 2 (grp-a, grp-b). The
stand-in runs SGLang's real validation, then its rendezvous and a load delay of --load-delay.

1. Deploy, single host vs group, --rounds times interleaved (one, then the other): each round
   changes the profile's environment, so every deploy restarts its server (smoke, launch, staged
   health, min_ready); the same profile text but `nodes: 2` for the group. Printed: median wall
   of the CLI, the step times of the slowest host, exec round trips per host, and a no-op rerun.
2. Rolling restart of grp-a and grp-b (batch 1, max-unavailable 1) under a steady load through the
   router (retries off): failed requests, and the wall against its floor, groups x (drain + D +
   min_ready): drain = one request (--slow-ms) + rank 0's own exit after SIGTERM, D = the group's
   own start to healthy, both measured without sglfleet (the deployed argv of both ranks started
   at once on other ports, timed to rank 0's /health 200; bench/rolling.py's probe), median of
   --start-rounds.

    python -m orchestrator.lab.router install        # once, needs PyPI (make setup does it)
    unshare --net -- sh -c 'ip link set lo up && exec "$@"' jail \\
        timeout 1800 .venv/bin/python bench/groups.py --down

Results also go to runs/bench-groups-<time>.json.
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
sys.path.insert(0, str(ROOT / "bench"))
os.environ["SGLFLEET_LOOPBACK_ONLY"] = "1"

import yaml  # noqa: E402

from orchestrator.fleet.router import RouterClient  # noqa: E402
from orchestrator.lab.loadgen import LoadGenerator, LoadReport  # noqa: E402
from orchestrator.lab.manager import Lab  # noqa: E402
from orchestrator.lab.router import LabRouter, missing_reason  # noqa: E402
from rolling import bench_lab, median, measure_start  # noqa: E402

PROFILE = """name: {name}
description: bench/groups.py ({name})
model: {{path: /root/models/Qwen3-8B}}
server:
  host: 0.0.0.0
  port: {port}
  tp: {tp}
  nodes: {nodes}
{dist}  extra_args: [--enable-metrics]
env:
  SGLFLEET_SIM_LOAD_DELAY: "{delay}"
  SGLFLEET_SIM_SLOW_MS: "{slow_ms}"
  SGLFLEET_SIM_DRAIN_LOG_S: "1"
  BENCH_ROUND: "{round}"
"""


def profile(work: Path, name: str, nodes: int, args: argparse.Namespace, round_: int) -> str:
    path = work / f"{name}-{round_}.yaml"
    path.write_text(PROFILE.format(name=name, port=args.port, tp=nodes, nodes=nodes, delay=args.load_delay,
                                   slow_ms=args.slow_ms, round=round_,
                                   dist=f"  dist_init_port: {args.port + 100}\n" if nodes > 1 else ""))
    return str(path)


def cli(inventory: Path, work: Path, *args: str) -> tuple[int, dict, float]:
    began = time.monotonic()
    result = subprocess.run([sys.executable, "-m", "orchestrator.cli", *args, "-i", str(inventory), "--json",
                             "--runs-dir", str(work / "runs")], capture_output=True, text=True, cwd=ROOT)
    wall = time.monotonic() - began
    try:
        return result.returncode, json.loads(result.stdout), wall
    except ValueError:
        raise RuntimeError(f"no JSON (exit {result.returncode}): {result.stdout[-2000:]} {result.stderr[-2000:]}") \
            from None


def host_docs(doc: dict) -> dict[str, dict]:
    """host -> its deploy document (a group's ranks, or the host's own)."""
    out = {}
    for name, d in doc["hosts"].items():
        out.update(d["ranks"] if d.get("ranks") else {name: d})
    return out


def slowest_steps(doc: dict) -> dict[str, float]:
    docs = list(host_docs(doc).values())
    worst = max(docs, key=lambda d: d.get("seconds") or 0)
    return worst.get("steps") or {}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--load-delay", type=float, default=5.0)
    ap.add_argument("--slow-ms", type=int, default=200)
    ap.add_argument("--min-ready", type=float, default=3.0)
    ap.add_argument("--rate", type=float, default=8.0)
    ap.add_argument("--clients", type=int, default=8)
    ap.add_argument("--start-rounds", type=int, default=3)
    ap.add_argument("--port", type=int, default=30880)
    ap.add_argument("--lab-dir", default="/var/cache/sglfleet/lab-groups-bench")
    ap.add_argument("--subnet", default="127.0.8")
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
    lab.up(5, extra_vars={"sglfleet_router_url": url})
    doc = yaml.safe_load(lab.inventory_path.read_text())
    names = [h.name for h in lab.hosts()]
    single, groups = names[0], {"grp-a": names[1:3], "grp-b": names[3:5]}
    for group, hosts in groups.items():
        doc["all"]["children"][group] = {"vars": {"sglfleet_server_group": group}, "hosts": {h: None for h in hosts}}
    inventory = work / "groups.yaml"
    inventory.write_text(yaml.safe_dump(doc, sort_keys=False))
    (work / "groups.known_hosts").write_text(lab.known_hosts_path.read_text())
    err = sys.stderr

    # 1. deploy: a single host vs a 2-node group, interleaved rounds; round 0 warms the caches
    rows: dict[str, list[dict]] = {"single": [], "group": []}
    for round_ in range(args.rounds + 1):
        for kind, pattern, nodes in (("single", single, 1), ("group", "grp-a", 2)):
            code, out, wall = cli(inventory, work, "deploy", pattern, profile(work, f"bench-{kind}", nodes, args,
                                                                                round_))
            if code != 0:
                print(json.dumps(out, indent=1)[-4000:], file=err)
                return 1
            trips = sorted({d["round_trips"]["exec"] for d in host_docs(out).values()})
            row = {"round": round_, "wall_s": round(wall, 2), "steps": slowest_steps(out), "exec_per_host": trips}
            print(f"  deploy {kind} round {round_}: {wall:.1f}s, round trips per host {trips}, steps {row['steps']}",
                  file=err)
            if round_:
                rows[kind].append(row)
    noop = {}
    for kind, pattern, nodes in (("single", single, 1), ("group", "grp-a", 2)):
        code, out, wall = cli(inventory, work, "deploy", pattern, profile(work, f"bench-{kind}", nodes, args,
                                                                            args.rounds))
        noop[kind] = {"wall_s": round(wall, 2), "action": sorted({d["action"] for d in host_docs(out).values()}),
                      "exec_per_host": sorted({d["round_trips"]["exec"] for d in host_docs(out).values()})}
    deploy = {kind: {"wall_median_s": median([r["wall_s"] for r in rs]),
                     "step_median_s": {step: median([r["steps"].get(step) for r in rs])
                                       for step in ("plan", "smoke", "launch", "health", "record")},
                     "rounds": rs, "noop": noop[kind]} for kind, rs in rows.items()}

    # 2. a rolling restart of both groups under load
    code, out, _ = cli(inventory, work, "deploy", "grp-b", profile(work, "bench-group", 2, args, args.rounds))
    if code != 0:
        print(json.dumps(out, indent=1)[-4000:], file=err)
        return 1
    client = RouterClient(url)
    address = {h.name: h.address for h in lab.hosts()}
    for hosts in groups.values():
        client.ensure(f"http://{address[hosts[0]]}:{args.port}", 120)
    load = LoadGenerator(url, rate=args.rate, clients=args.clients, duration=3600, max_new_tokens=8).start()
    starts, exits = [], []
    for _ in range(args.start_rounds):  # the group's own start, both ranks at once, on other ports
        measured = measure_start(inventory, groups["grp-b"], "bench-group", args.port + 1,
                                 dist_port=args.port + 101)
        starts.append(measured[groups["grp-b"][0]]["healthy_s"])
        exits.append(measured[groups["grp-b"][0]].get("stop_s"))
    d_group, exit_s = median(starts), median(exits) or 0.0
    began = time.monotonic()
    code, doc, wall = cli(inventory, work, "restart", "--rolling", "grp-a,grp-b",
                          profile(work, "bench-group", 2, args, args.rounds), "--batch", "1", "--max-unavailable", "1",
                          "--min-ready", str(args.min_ready))
    ended = time.monotonic()
    time.sleep(5)
    load.stop()
    report = load.wait()
    during = LoadReport.stats(report.window(began, ended))
    drain = args.slow_ms / 1000.0 + exit_s
    floor = 2 * (drain + d_group + args.min_ready)
    rollout = {"exit_code": code, "outcomes": {n: h["outcome"] for n, h in doc["hosts"].items()},
               "rollout_s": doc.get("seconds"), "cli_wall_s": round(wall, 1),
               "floor_s": round(floor, 1), "ratio": round(doc["seconds"] / floor, 2) if doc.get("seconds") else None,
               "group_start_s": d_group, "group_start_samples": starts, "rank0_exit_s": exit_s, "drain_s": round(drain, 3),
               "during": during, "total": report.summary(), "min_healthy_workers": doc.get("min_healthy_workers")}
    result = {"bench": "groups", "load_delay_s": args.load_delay, "min_ready_s": args.min_ready,
              "slow_ms": args.slow_ms, "rate": args.rate, "deploy": deploy, "rolling_restart": rollout,
              "load_average": os.getloadavg()}
    path = ROOT / "runs" / time.strftime("bench-groups-%Y%m%dT%H%M%S.json")
    path.parent.mkdir(exist_ok=True)
    path.write_text(json.dumps(result, indent=2))
    s, g = deploy["single"], deploy["group"]
    print(f"\ndeploy (a changed environment: smoke, launch, health, min_ready), median of {args.rounds}: "
          f"single host {s['wall_median_s']}s {s['step_median_s']}; 2-node group {g['wall_median_s']}s "
          f"{g['step_median_s']}; no-op: single {s['noop']}, group {g['noop']}", file=err)
    print(f"rolling restart of 2 groups under load: {rollout['rollout_s']}s vs floor {rollout['floor_s']}s "
          f"(2 x (drain {drain:.2f}s + the group's own start {d_group}s + min_ready {args.min_ready:g}s)) = "
          f"{rollout['ratio']}x; requests during: {during['ok']} ok, {during['failed']} failed; whole load "
          f"{report.summary()['ok']} ok, {report.summary()['failed']} failed; load average {os.getloadavg()}; "
          f"results in {path}", file=err)
    return 0 if code == 0 and report.summary()["failed"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
