"""Fan-out benchmark: `sglfleet facts` on 1, 8 and 32 lab hosts.

Prints the wall seconds of the whole CLI run (process start included) per host count,
the median of several runs, and the 32/1 ratio. Goal: 32 hosts within 2x of 1 host.

    make bench            # or: SGLFLEET_LOOPBACK_ONLY=1 .venv/bin/python bench/fanout.py
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

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from orchestrator.lab.manager import Lab, host_name  # noqa: E402

os.environ["SGLFLEET_LOOPBACK_ONLY"] = "1"


def facts_run(inventory: Path, count: int) -> tuple[float, float]:
    pattern = ",".join(host_name(i) for i in range(count))
    started = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "orchestrator.cli", "facts", pattern, "-i", str(inventory),
                           "--json"], capture_output=True, text=True, cwd=ROOT)
    wall = time.monotonic() - started
    doc = json.loads(proc.stdout)
    if proc.returncode != 0 or doc["summary"]["ok"] != count:
        raise SystemExit(f"facts on {count} hosts failed:\n{proc.stdout}\n{proc.stderr}")
    return wall, doc["wall_s"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--counts", default="1,8,32")
    args = parser.parse_args()
    counts = [int(c) for c in args.counts.split(",")]
    inventory = ROOT / "inventory" / "lab.yaml"
    lab = Lab(inventory_path=inventory)
    lab.up(max(counts))
    print(f"lab: {len(lab.hosts())} hosts; {os.cpu_count()} CPU cores on this machine (controller and all "
          f"simulated hosts share them)")
    facts_run(inventory, 1)  # warm the page cache and the remote interpreters
    rows = {}
    for count in counts:
        runs = [facts_run(inventory, count) for _ in range(args.repeat)]
        rows[count] = (statistics.median(r[0] for r in runs), statistics.median(r[1] for r in runs))
    print(f"\n{'hosts':>5}  {'CLI wall s':>10}  {'fan-out s':>9}   (median of {args.repeat})")
    for count, (wall, fanout) in rows.items():
        print(f"{count:>5}  {wall:>10.3f}  {fanout:>9.3f}")
    first, last = counts[0], counts[-1]
    ratio = rows[last][0] / rows[first][0]
    print(f"\n{last}/{first} ratio (CLI wall): {ratio:.2f}x  goal <= 2.0x: {'MET' if ratio <= 2.0 else 'MISSED'}")


if __name__ == "__main__":
    main()
