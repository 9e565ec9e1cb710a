"""Fan-out benchmark: `sglfleet facts` on 1, 8 and 32 lab hosts (`--counts 1,32,128` for more).

Prints, per host count, the median over several runs of: the wall seconds of the whole CLI run
(process start included), the controller's CPU seconds (user + sys of the CLI process: what
sglfleet itself spends, apart from the simulated hosts that share this machine's cores), and the
controller CPU per host beyond the first ((cpu(N) - cpu(1)) / (N - 1)). Goals: the largest count
within 2x the wall time of 1 host; controller CPU per host at or below pyinfra's (~11 ms at 128).

    make bench            # or: SGLFLEET_LOOPBACK_ONLY=1 .venv/bin/python bench/fanout.py
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from orchestrator.lab.manager import Lab, host_name  # noqa: E402

os.environ["SGLFLEET_LOOPBACK_ONLY"] = "1"


def facts_run(inventory: Path, count: int) -> tuple[float, float, float]:
    """(CLI wall s, fan-out wall s, controller CPU s) of one `sglfleet facts` run."""
    pattern = ",".join(host_name(i) for i in range(count))
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    started = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "orchestrator.cli", "facts", pattern, "-i", str(inventory),
                           "--json", "--forks", str(max(count, 1))], capture_output=True, text=True, cwd=ROOT)
    wall = time.monotonic() - started
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    doc = json.loads(proc.stdout)
    if proc.returncode != 0 or doc["summary"]["ok"] != count:
        raise SystemExit(f"facts on {count} hosts failed:\n{proc.stdout}\n{proc.stderr}")
    return wall, doc["wall_s"], cpu


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
        rows[count] = tuple(statistics.median(r[i] for r in runs) for i in range(3))
    first, last = counts[0], counts[-1]
    print(f"\n{'hosts':>5}  {'CLI wall s':>10}  {'fan-out s':>9}  {'ctrl CPU s':>10}  {'CPU/host ms':>11}"
          f"   (median of {args.repeat})")
    for count, (wall, fanout, cpu) in rows.items():
        per_host = (cpu - rows[first][2]) / (count - first) * 1000 if count > first else float("nan")
        print(f"{count:>5}  {wall:>10.3f}  {fanout:>9.3f}  {cpu:>10.3f}  {per_host:>11.1f}")
    ratio = rows[last][0] / rows[first][0]
    print(f"\n{last}/{first} ratio (CLI wall): {ratio:.2f}x  goal <= 2.0x: {'MET' if ratio <= 2.0 else 'MISSED'}")


if __name__ == "__main__":
    main()
