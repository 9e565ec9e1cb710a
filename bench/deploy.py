"""Deploy benchmark on the lab: exec round trips per host, orchestrator overhead, no-op fan-out.

    SGLFLEET_LOOPBACK_ONLY=1 .venv/bin/python bench/deploy.py [--hosts 8] [--load-delay 5]

1. One host, first deploy: exec round trips (health polls apart; goal <= 6), wall time, and the
   orchestrator's overhead = wall - the server's own start (launch -> /health 200: the stand-in's
   SGLang import + validation + SGLFLEET_SIM_LOAD_DELAY) - the smoke probe (SGLang's own
   validation on the host), with the per-step seconds. The stand-in is the lab's
   sglfleet-sim-server (no GPU; ~0.85 GB resident each, as it imports SGLang and torch).
2. One host, no-op rerun: round trips (goal <= 2) and wall time.
3. All N hosts: first deploy (wall), then the no-op rerun on 1 host vs N hosts, median of 3
   (goal: N within 2x of 1).

The lab is its own (SGLFLEET_BENCH_LAB_DIR, subnet SGLFLEET_BENCH_SUBNET, default 127.0.5) and
is taken down at the end. Every host runs a stand-in server (~0.85 GB each): mind the machine's
memory before asking for many hosts (32 need ~27 GB).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from orchestrator.lab.manager import Lab, host_name  # noqa: E402

os.environ["SGLFLEET_LOOPBACK_ONLY"] = "1"


def profile(tmp: Path, load_delay: float) -> Path:
    text = (ROOT / "playbooks" / "qwen36-ddtree.yaml").read_text().replace("../", f"{ROOT}/")
    text = text.replace("env:\n", f"env:\n  SGLFLEET_SIM_LOAD_DELAY: \"{load_delay}\"\n")
    path = tmp / "bench-ddtree.yaml"
    path.write_text(text)
    return path


def deploy(inventory: Path, prof: Path, pattern: str, runs: Path, forks: int) -> tuple[float, dict]:
    started = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "orchestrator.cli", "deploy", pattern, str(prof), "-i",
                           str(inventory), "--json", "--runs-dir", str(runs), "--forks", str(forks)],
                          capture_output=True, text=True, cwd=ROOT)
    wall = time.monotonic() - started
    if not proc.stdout:
        raise SystemExit(f"deploy gave no JSON:\n{proc.stderr}")
    doc = json.loads(proc.stdout)
    failed = {h: d.get("summary") for h, d in doc["hosts"].items() if not d["ok"]}
    if failed:
        raise SystemExit(f"deploy failed on {failed}")
    return wall, doc


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hosts", type=int, default=8)
    parser.add_argument("--load-delay", type=float, default=5.0)
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()
    lab = Lab(state_dir=Path(os.environ.get("SGLFLEET_BENCH_LAB_DIR", "/var/cache/sglfleet/lab-bench-deploy")),
              inventory_path=Path(tempfile.mkdtemp()) / "lab.yaml",
              subnet=os.environ.get("SGLFLEET_BENCH_SUBNET", "127.0.5"))
    lab.down()
    lab.up(args.hosts)
    result: dict = {"hosts": args.hosts, "load_delay_s": args.load_delay}
    try:
        with tempfile.TemporaryDirectory() as tmp_name:
            tmp = Path(tmp_name)
            prof, runs, one = profile(tmp, args.load_delay), tmp / "runs", host_name(0)
            wall, doc = deploy(lab.inventory_path, prof, one, runs, 1)
            host = doc["hosts"][one]
            # The stand-in listens first and loads after (503 meanwhile): its own start is the
            # stages up to /health 200 (SGLang's real order is load, then listen: the same sum).
            server_start = sum(host["health"][k] for k in ("alive", "port", "health"))
            probe = (host.get("smoke") or {}).get("timings", {}).get("total_s") or 0.0
            result["first_deploy_1_host"] = {
                "round_trips": host["round_trips"], "wall_s": round(wall, 2), "host_seconds": host["seconds"],
                "server_start_s": round(server_start, 2), "smoke_probe_s": probe,
                "overhead_s": round(wall - server_start - probe, 2), "health": host["health"],
                "steps": host.get("steps")}
            noop = []
            for _ in range(args.repeat):
                wall, doc = deploy(lab.inventory_path, prof, one, runs, 1)
                assert doc["hosts"][one]["action"] == "unchanged", doc["hosts"][one]
                noop.append(wall)
            result["noop_1_host"] = {"round_trips": doc["hosts"][one]["round_trips"],
                                     "wall_s_median": round(statistics.median(noop), 2)}
            everyone = ",".join(host_name(i) for i in range(args.hosts))
            wall, doc = deploy(lab.inventory_path, prof, everyone, runs, args.hosts)
            result[f"first_deploy_{args.hosts}_hosts"] = {
                "wall_s": round(wall, 2), "round_trips_max": max(d["round_trips"]["exec"] for d in doc["hosts"].values())}
            noop_n = []
            for _ in range(args.repeat):
                wall, doc = deploy(lab.inventory_path, prof, everyone, runs, args.hosts)
                assert all(d["action"] == "unchanged" for d in doc["hosts"].values())
                noop_n.append(wall)
            result[f"noop_{args.hosts}_hosts"] = {
                "wall_s_median": round(statistics.median(noop_n), 2),
                "ratio_to_1_host": round(statistics.median(noop_n) / statistics.median(noop), 2),
                "round_trips_max": max(d["round_trips"]["exec"] for d in doc["hosts"].values())}
    finally:
        lab.down()
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
