"""A log with one huge line: what `logs --tail N` and a whole read cost on the host.

Writes a log of --lines ordinary SGLang-like lines with ONE line of --line-mib MiB last but one
(a client's prompt echoed), and the same log without it; then reads each through the host-side
reader (remote/logs.py, run as the host runs it: a separate process through the call convention
on a LocalConnection) with `--tail 2` and whole, --rounds times, and prints the median wall time
and the reader process's peak RSS (wait4), next to `tail -n 2` of the same file.

    .venv/bin/python bench/log_long_line.py [--line-mib 60] [--lines 20000] [--rounds 3]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

READ = """
import json, sys, time
sys.path.insert(0, {root!r})
from orchestrator.fleet.inventory import Host
from orchestrator.fleet.local import LocalConnection
from orchestrator.stages import logs as stage
conn = LocalConnection(Host(name="local", address="127.0.0.1", python=sys.executable))
query = stage.Query(profile="p", tail={tail}, extra={{"log_dir": {log_dir!r}, "state_dir": {log_dir!r}, "source": "file"}})
started = time.monotonic()
merged, states = stage.read_merged([conn], query, {{"local": None}})
lines = list(merged)
print(json.dumps({{"s": time.monotonic() - started, "lines": len(lines), "answer": states["local"].answer_bytes,
                  "longest": max(len(x.text) for x in lines)}}))
"""


def write_log(path: Path, lines: int, line_mib: float) -> None:
    with open(path, "w") as fh:
        for i in range(lines):
            if line_mib and i == lines - 1:  # the last line but one: what --tail 2 shows
                fh.write("[2026-12-03 09:30:00] prompt: " + "x" * int(line_mib * (1 << 20)) + "\n")
            fh.write(f"[2026-12-03 09:30:{i % 60:02d}] Decode batch, #running-req: 4, accept len: 3.41, "
                     f"gen throughput (token/s): 312.55, request {i}\n")


def measure(argv: list[str]) -> tuple[float, float, str]:
    """(wall s, peak RSS MiB of the biggest process of the run: the reader or its host side,
    stdout). Each run gets a wrapper process of its own, so the peaks do not accumulate."""
    wrapper = ("import resource, subprocess, sys; subprocess.run(sys.argv[1:]); "
               "print(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss, file=sys.stderr)")
    started = time.monotonic()
    proc = subprocess.run([sys.executable, "-c", wrapper, *argv], capture_output=True, text=True, check=True)
    return time.monotonic() - started, int(proc.stderr.split()[-1]) / 1024, proc.stdout


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--line-mib", type=float, default=60)
    parser.add_argument("--lines", type=int, default=20000)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        for label, mib in (("plain", 0), (f"one {args.line_mib:g} MiB line", args.line_mib)):
            directory = Path(tmp) / label.replace(" ", "_")
            directory.mkdir()
            write_log(directory / "p.log", args.lines, mib)
            size = (directory / "p.log").stat().st_size
            for tail in (2, "None"):
                runs = [measure([sys.executable, "-c", READ.format(root=str(ROOT), tail=tail,
                                                                    log_dir=str(directory))])
                        for _ in range(args.rounds)]
                result = json.loads(runs[-1][2])
                print(f"{label:>18} ({size / (1 << 20):.1f} MiB)  {'--tail 2' if tail == 2 else 'whole':>8}: "
                      f"{statistics.median(r[0] for r in runs):.3f} s, peak RSS {max(r[1] for r in runs):.0f} MiB, "
                      f"{result['lines']} lines, answer {result['answer'] / 1024:.0f} KiB, "
                      f"longest line shown {result['longest']} chars", flush=True)
            runs = [measure(["tail", "-n", "2", str(directory / "p.log")]) for _ in range(args.rounds)]
            print(f"{label:>18}  tail -n 2 (coreutils): {statistics.median(r[0] for r in runs):.3f} s")


if __name__ == "__main__":
    main()
