"""Rolling-restart benchmark: 8 lab hosts behind the real sglang-router (retries off), batch 25%,
under a steady client load through the router.

What it does, in order: starts a lab and its router (state in --lab-dir, addresses --subnet.N),
deploys the stand-in servers, starts the client load, then MEASURES the servers' own start: on the
lab hosts themselves, without sglfleet, it starts the deployed server command (argv and
environment from the host's deployment record, on another port) and times it to its first
/health 200 and, after SIGTERM, to its exit: one server alone, and a batch's worth at once (as
the rollout starts them on this machine's shared cores), --start-rounds times each, medians
kept. Then, still under load, it runs `restart --rolling` and prints:

- requests ok / failed, p50 / p99 latency before, during and after the rollout, the fewest
  healthy workers the router had;
- the floor batches x (drain + D + min_ready), where drain is what a server out of routing
  takes to stop by itself: its last request (--slow-ms) and its own exit after SIGTERM (measured
  as above), and D the server's own load time. The stand-in's start is
  SGLang's real validation of the argv (import sglang, prepare_server_args) and then the
  configured delay --load-delay; a real SGLang server also validates before it loads weights, so
  D is the MEASURED start to healthy. The configured delay and both measured starts are printed;
  the goal (total <= 1.15x the floor, 0 failed) is judged on the floor with the batch-at-once D;
- where the time went: the median per phase over the hosts (prepare, smoke, waiting for the
  previous batch, router removal, drain, stop, start, each health stage, record, min_ready,
  router add), and per batch the critical path (from the previous batch back in routing to this
  one back) against that batch's floor, with the batch's server start as the rollout saw it and
  what remains beyond drain + that start + min_ready ("ours": the orchestrator's own time, a
  figure that does not move with how busy the shared machine was), and the ratio against the
  floor made of those starts (it counts the health polls' 0.25 s granularity as the server's).

    python -m orchestrator.lab.router install        # once, needs PyPI (make setup does it)
    # in a network jail (only lo), bounded in time:
    unshare --net -- sh -c 'ip link set lo up && exec "$@"' jail \\
        timeout 1200 .venv/bin/python bench/rolling.py [--hosts 8] [--load-delay 10] --down

Results also go to runs/bench-rolling-<time>.json. The lab and router stay up for a rerun in the
same network namespace unless --down; a lab left by another namespace (unreachable) is restarted.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
os.environ["SGLFLEET_LOOPBACK_ONLY"] = "1"

from orchestrator.fleet.group import Group  # noqa: E402
from orchestrator.fleet.inventory import load_inventory  # noqa: E402
from orchestrator.fleet.router import RouterClient  # noqa: E402
from orchestrator.lab.loadgen import LoadGenerator, LoadReport  # noqa: E402
from orchestrator.lab.manager import Lab  # noqa: E402
from orchestrator.lab.router import LabRouter, missing_reason, stand_in_profile  # noqa: E402
from orchestrator.remote.hostlib import server_paths  # noqa: E402
from orchestrator.spec.profile import load_profile  # noqa: E402
from orchestrator.stages import rollout  # noqa: E402
from orchestrator.stages.deploy import DeployOptions  # noqa: E402

# Runs ON a lab host (python3 -, argument: JSON): the deployed server command, as its record and
# env file say, on another port; seconds to the port, to /health 200, and from SIGTERM to exit.
START_PROBE = r'''
import json, os, signal, socket, subprocess, sys, time, urllib.request
a = json.loads(sys.argv[1])
record = json.load(open(a["record"]))
argv = list(record["argv"])
argv[argv.index("--port") + 1] = str(a["port"])
if a.get("dist_port"):  # a rank of a multi-node server: its group meets on another port too
    i = argv.index("--dist-init-addr") + 1
    argv[i] = argv[i].rsplit(":", 1)[0] + ":" + str(a["dist_port"])
host = record.get("bind") or "127.0.0.1"
null = open(os.devnull, "wb")
began = time.monotonic()
proc = subprocess.Popen(["sh", "-c", 'set -a; . "$0"; set +a; exec "$@"', a["env_file"]] + argv,
                        stdin=subprocess.DEVNULL, stdout=null, stderr=null, start_new_session=True)
out = {"port_s": None, "healthy_s": None}
try:
    while time.monotonic() - began < a["timeout"]:
        if proc.poll() is not None:
            out["exited"] = proc.returncode
            break
        if out["port_s"] is None:
            try:
                socket.create_connection((host, a["port"]), timeout=1).close()
                out["port_s"] = round(time.monotonic() - began, 3)
            except OSError:
                pass
        if out["port_s"] is not None:
            try:
                if urllib.request.urlopen("http://%s:%d/health" % (host, a["port"]), timeout=2).status == 200:
                    out["healthy_s"] = round(time.monotonic() - began, 3)
                    break
            except OSError:
                pass
        time.sleep(0.02)
finally:
    stopping = time.monotonic()
    if proc.poll() is None:
        os.kill(proc.pid, signal.SIGTERM)
        try:
            proc.wait(60)
            out["stop_s"] = round(time.monotonic() - stopping, 3)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
print(json.dumps(out))
'''


def measure_start(inventory_path: Path, hosts: list[str], profile: str, port: int, timeout: float = 300,
                  dist_port: int | None = None) -> dict:
    """The stand-in started on each of `hosts` at once, outside sglfleet: host -> seconds. The
    ranks of a multi-node server (`dist_port`: where they meet instead) start together, as one,
    and only rank 0 (hosts[0]) must answer: the others end when its probe stops it."""
    inv = load_inventory(str(inventory_path))
    paths = server_paths(profile)
    arg = json.dumps({"record": paths["record"], "env_file": paths["env_file"], "port": port, "timeout": timeout,
                      "dist_port": dist_port})
    group = Group.from_inventory(inv, ",".join(hosts), forks=len(hosts))

    def probe(conn: Any) -> dict:
        python = _quote(conn.host.python or "python3")
        result = conn.run(f"{python} - {_quote(arg)}", stdin=START_PROBE.encode(), timeout=timeout + 90)
        if not result.ok:
            raise RuntimeError(f"start probe failed on {conn.host.name}: {result.stderr_text[-2000:]}")
        return json.loads(result.stdout_text.strip().splitlines()[-1])

    with group:
        results = group.run(probe, "measure start")
    out = {}
    for name, r in results.items():
        if dist_port is not None and name != hosts[0]:
            out[name] = r.value if r.ok else {"error": r.error}
            continue
        if not r.ok or r.value.get("healthy_s") is None:
            raise RuntimeError(f"{name}: the stand-in did not get healthy when started alone: {r.error or r.value}")
        out[name] = r.value
    return out


def _quote(text: str) -> str:
    import shlex

    return shlex.quote(text)


def _reachable(address: str, port: int = 22) -> bool:
    try:
        socket.create_connection((address, port), timeout=1).close()
        return True
    except OSError:
        return False


def median(values: list[float | None]) -> float | None:
    values = [v for v in values if v is not None]
    return round(statistics.median(values), 3) if values else None


# The phases of one host's turn, in order, as the rollout document records them.
PHASES = ("prepare", "smoke", "wait_previous_batch", "remove", "drain", "stop", "start", "health_alive",
          "health_port", "health_health", "health_health_generate", "health_generate", "health_server_info",
          "record", "min_ready", "add", "other")


def host_phases(h: dict) -> dict[str, float | None]:
    """Seconds per phase of one host (None: it did not happen). `start` is the launch round trip
    after the stop (writing the files, starting the supervisor and the server); `other` is what
    the out-to-back span holds beyond the named phases (stage hand-offs, progress)."""
    d = h.get("detail") or {}
    times = h.get("times") or {}
    steps = d.get("steps") or {}
    health = d.get("health") or {}
    stop = (d.get("stopped") or {}).get("seconds")
    waited = times.get("waited_for_slot_s") or 0.0
    out = {"prepare": steps.get("plan"), "smoke": steps.get("smoke"), "wait_previous_batch": waited,
           "remove": times.get("remove_s"), "drain": times.get("drain_s"), "stop": stop}
    if steps.get("launch") is not None:
        out["start"] = round(steps["launch"] - waited - (out["remove"] or 0) - (out["drain"] or 0) - (stop or 0), 3)
    for stage in ("alive", "port", "health", "health_generate", "generate", "server_info"):
        out[f"health_{stage}"] = health.get(stage)
    out.update(record=steps.get("record"), min_ready=times.get("min_ready_s"), add=times.get("add_s"))
    if times.get("back_at_s") is not None and times.get("out_at_s") is not None:
        named = sum(v or 0 for k, v in out.items() if k not in ("prepare", "smoke", "wait_previous_batch"))
        out["other"] = round(times["back_at_s"] - times["out_at_s"] - named, 3)
    return out


def critical_path(doc: dict, per_host: dict, floor_per_batch: float, drain: float, min_ready: float) -> list[dict]:
    """Per batch: from the previous batch's last host back in routing (the rollout's start for the
    first) to this batch's last host back, split at this batch's first host out of routing.
    `start_seen_s`: the batch's slowest server start as the rollout saw it (on the host: launch to
    /health 200, polled every 0.25 s), under whatever else the machine ran at that moment; `ours_s`:
    the rest of the batch's wall time beyond drain + that start + min_ready, i.e. what the
    orchestrator added (a check that does not depend on how busy the machine was)."""
    rows, previous_back = [], 0.0
    for b in doc["batches"]:
        times = [doc["hosts"][n].get("times") or {} for n in b["hosts"]]
        outs = [t["out_at_s"] for t in times if t.get("out_at_s") is not None]
        backs = [t["back_at_s"] for t in times if t.get("back_at_s") is not None]
        if not outs or not backs:
            continue
        back = max(backs)
        seen = max(sum(per_host[n].get(f"health_{k}") or 0.0 for k in ("alive", "port", "health")) for n in b["hosts"])
        wall = back - previous_back
        rows.append({"batch": b["batch"], "hosts": b["hosts"], "until_first_out_s": round(min(outs) - previous_back, 3),
                     "out_to_back_s": round(back - min(outs), 3), "wall_s": round(wall, 3),
                     "floor_s": round(floor_per_batch, 3), "start_seen_s": round(seen, 3),
                     "ours_s": round(wall - drain - seen - min_ready, 3)})
        previous_back = back
    return rows


def measure_starts(inventory_path: Path, batch: list[str], profile: str, port: int, rounds: int) -> dict:
    """`rounds` x (the stand-in alone on the batch's first host, then on each of its hosts at once),
    interleaved; the medians say D (the machine is shared: one sample is one moment's load)."""
    alone, together, exits = [], [], []
    for _ in range(rounds):
        one = measure_start(inventory_path, batch[:1], profile, port)[batch[0]]
        both = measure_start(inventory_path, batch, profile, port)
        alone.append(one["healthy_s"])
        together.append(max(v["healthy_s"] for v in both.values()))
        exits += [v.get("stop_s") for v in [one, *both.values()] if v.get("stop_s") is not None]
    return {"alone_s": median(alone), "batch_s": median(together), "exit_s": median(exits) or 0.0,
            "samples": {"alone_s": alone, "batch_s": together, "exit_s": exits}}


def bench_lab(lab_dir: str, subnet: str) -> tuple[Lab, LabRouter, Path]:
    """A benchmark's lab and router (state in `lab_dir`, its work files beside it in `-work`); a
    lab left there by another network namespace (unreachable from here) is taken down first."""
    work = Path(lab_dir + "-work")
    work.mkdir(parents=True, exist_ok=True)
    lab = Lab(state_dir=Path(lab_dir), inventory_path=work / "lab.yaml", subnet=subnet)
    router = LabRouter(lab.state_dir, lab.subnet)
    if any(not _reachable(h.address) for h in lab.hosts() if lab.init_pid(h) is not None):
        print("the lab in this state dir runs in another network namespace: restarting it", file=sys.stderr)
        router.stop()
        lab.down()
    return lab, router, work


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--hosts", type=int, default=8)
    ap.add_argument("--batch", default="25%")
    ap.add_argument("--load-delay", type=float, default=10.0, help="D as configured: the stand-in's model-load "
                    "seconds after its SGLang validation")
    ap.add_argument("--slow-ms", type=int, default=200, help="each request's duration on a server")
    ap.add_argument("--min-ready", type=float, default=5.0)
    ap.add_argument("--rate", type=float, default=10.0, help="requests per second through the router")
    ap.add_argument("--clients", type=int, default=16)
    ap.add_argument("--window", type=float, default=20.0, help="seconds of load before and after the rollout")
    ap.add_argument("--port", type=int, default=30772)
    ap.add_argument("--lab-dir", default="/var/cache/sglfleet/lab-roll-bench")
    ap.add_argument("--subnet", default="127.0.7")
    ap.add_argument("--start-rounds", type=int, default=3, help="measurements of the servers' own start (median)")
    ap.add_argument("--no-pipeline", action="store_true", help="do not prepare the next batch ahead")
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

    batch = rollout.plan_batches([h.name for h in hosts], rollout.parse_serial(args.batch))[0]
    # The load runs from here on, so the servers' own start is measured as the rollout will see it.
    load = LoadGenerator(url, rate=args.rate, clients=args.clients, duration=3600, max_new_tokens=8).start()
    starts = measure_starts(lab.inventory_path, batch, "bench-rolling", args.port + 1, args.start_rounds)
    d_alone, d_batch, exit_s = starts["alone_s"], starts["batch_s"], starts["exit_s"]
    print(f"the stand-in's own start to healthy (no sglfleet; SGLang's validation, then the load delay), median of "
          f"{args.start_rounds}: alone {d_alone:.1f}s {starts['samples']['alone_s']}, {len(batch)} at once "
          f"{d_batch:.1f}s {starts['samples']['batch_s']}; its exit after SIGTERM {exit_s:.2f}s", file=sys.stderr)

    inv = load_inventory(str(lab.inventory_path))
    options = rollout.RolloutOptions(mode="restart", serial=rollout.parse_serial(args.batch),
                                     max_unavailable=args.batch, min_ready=args.min_ready, drain_timeout=60,
                                     pipeline=not args.no_pipeline, state_dir=work / "runs",
                                     deploy=DeployOptions(command="bench/rolling.py", stop_grace=60))
    run = rollout.Rollout(inv, "all", load_profile(str(profile_path)), None, options,
                          lambda kind, host, text: kind in ("batch", "host-done", "halt") and
                          print(f"  {host + ': ' if host else ''}{text}", file=sys.stderr))
    window_began = time.monotonic()
    time.sleep(args.window)
    began = time.monotonic()
    doc = run.run()
    ended = time.monotonic()
    time.sleep(args.window)
    load.stop()
    report = load.wait()

    batches = len(doc["planned_batches"])
    # drain: what stopping a server out of routing takes by itself: its last request (one
    # request's length) and its own exit after SIGTERM (SGLang's drain with nothing left; measured)
    drain = args.slow_ms / 1000.0 + exit_s
    per_batch = {"configured": drain + args.load_delay + args.min_ready, "alone": drain + d_alone + args.min_ready,
                 "batch": drain + d_batch + args.min_ready}
    floors = {k: round(batches * v, 1) for k, v in per_batch.items()}
    wall = ended - began
    phases = {"before": LoadReport.stats(report.window(window_began, began)),
              "during": LoadReport.stats(report.window(began, ended)),
              "after": LoadReport.stats(report.window(ended, None))}
    per_host = {name: host_phases(h) for name, h in doc["hosts"].items()}
    breakdown = {p: median([ph.get(p) for ph in per_host.values()]) for p in PHASES}
    path = critical_path(doc, per_host, per_batch["batch"], drain, args.min_ready)
    # The same floor with each batch's start as the rollout saw it: what the orchestrator adds,
    # whatever else the shared machine ran during the rollout or during the measurements.
    floor_seen = sum(drain + r["start_seen_s"] + args.min_ready for r in path)
    result = {"bench": "rolling", "hosts": args.hosts, "batch": args.batch, "batches": batches,
              "load_delay_configured_s": args.load_delay, "start_measured_alone_s": d_alone,
              "start_measured_batch_s": d_batch, "start_samples": starts["samples"],
              "slow_ms": args.slow_ms, "min_ready_s": args.min_ready, "rate": args.rate, "clients": args.clients,
              "pipeline": not args.no_pipeline, "exit_code": doc["exit_code"], "rollout_s": round(wall, 1),
              "server_exit_measured_s": exit_s,
              "floor": {"contains": "batches x (drain: one request's length + the server's own exit after "
                                    "SIGTERM, measured + D: the server's own start to healthy + min_ready)",
                        "drain_s": round(drain, 3),
                        "with_configured_delay_s": floors["configured"], "with_start_alone_s": floors["alone"],
                        "with_start_batch_s": floors["batch"], "with_start_as_the_rollout_saw_it_s": round(floor_seen, 1)},
              "ratio": {"vs_configured_delay": round(wall / floors["configured"], 2),
                        "vs_start_alone": round(wall / floors["alone"], 2),
                        "vs_start_batch": round(wall / floors["batch"], 2),
                        "vs_start_as_the_rollout_saw_it": round(wall / floor_seen, 2) if floor_seen else None},
              "min_healthy_workers": doc["min_healthy_workers"], "max_unavailable": doc["max_unavailable"],
              "requests": phases, "total": report.summary(), "phase_median_s": breakdown, "critical_path": path,
              "per_host": per_host, "smoke_skipped": {n: bool(((h.get("detail") or {}).get("smoke") or {})
                                                              .get("skipped")) for n, h in doc["hosts"].items()}}
    out = ROOT / "runs" / time.strftime("bench-rolling-%Y%m%dT%H%M%S.json")
    out.parent.mkdir(exist_ok=True)
    out.write_text(json.dumps(result, indent=2))
    print(json.dumps({k: v for k, v in result.items() if k not in ("per_host", "start_samples")}, indent=2))
    err = sys.stderr
    print("\nmedian seconds per phase over the hosts (prepare, smoke and the wait overlap the previous batch):",
          file=err)
    print("  " + "  ".join(f"{p}={v}" for p, v in breakdown.items() if v is not None), file=err)
    print("critical path per batch (s): " + "; ".join(
        f"{r['batch']}: {r['wall_s']:.1f} (to first out {r['until_first_out_s']:.1f}, out->back "
        f"{r['out_to_back_s']:.1f}; floor {r['floor_s']:.1f}; start as the rollout saw it {r['start_seen_s']:.1f}, "
        f"ours {r['ours_s']:.1f})" for r in path), file=err)
    during = phases["during"]
    windows = [phases[k] for k in ("before", "during", "after")]
    print(f"\nrequests before/during/after: {sum(w['ok'] for w in windows)} ok, {sum(w['failed'] for w in windows)} "
          f"failed (since the load began, start measurements included: {report.summary()['ok']} ok, "
          f"{report.summary()['failed']} failed); p50/p99 ms before "
          f"{phases['before']['p50_ms']}/{phases['before']['p99_ms']}, during {during['p50_ms']}/{during['p99_ms']}, "
          f"after {phases['after']['p50_ms']}/{phases['after']['p99_ms']}; fewest healthy workers "
          f"{doc['min_healthy_workers']}", file=err)
    print(f"floor = {batches} batches x (drain {drain:.2f}s [a request {args.slow_ms / 1000.0:.1f}s + the server's "
          f"exit {exit_s:.2f}s] + D + min_ready {args.min_ready:.1f}s), D the server's own start to healthy (SGLang "
          f"validation + load): configured delay {args.load_delay:.1f}s -> {floors['configured']:.1f}s; measured "
          f"alone {d_alone:.1f}s -> {floors['alone']:.1f}s; measured {len(batch)} at once {d_batch:.1f}s -> "
          f"{floors['batch']:.1f}s", file=err)
    print(f"rollout {wall:.1f}s = {result['ratio']['vs_start_batch']}x the floor ({result['ratio']['vs_start_alone']}x "
          f"with D alone, {result['ratio']['vs_configured_delay']}x with the configured delay only; "
          f"{result['ratio']['vs_start_as_the_rollout_saw_it']}x against {floor_seen:.1f}s, the floor with each "
          f"batch's start as the rollout saw it); goal <= 1.15x and 0 failed; results in {out}", file=err)
    return 0 if doc["exit_code"] == 0 and report.summary()["failed"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
