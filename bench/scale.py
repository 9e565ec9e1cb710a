"""Scale: what a lab host costs this machine, and `facts` on N lab hosts (wall, CPU, peak RSS).

    jailed SGLFLEET_LOOPBACK_ONLY=1 .venv/bin/python bench/scale.py [--hosts 254] [--repeat 3]

Brings up its own lab (SGLFLEET_BENCH_LAB_DIR, subnet SGLFLEET_BENCH_SUBNET, default 127.0.8; one
subnet holds at most 254 hosts; taken down at the end), measures each idle host's memory (PSS and
RSS of its process tree: unshare, its init, sshd), then runs `sglfleet facts` on 1 host and on
all N (forks = N), median of --repeat: wall seconds, the CLI's CPU seconds and its peak RSS
(ru_maxrss of the CLI process). Printed beside them: the figures extrapolated linearly to
--target hosts from the 1- and N-host ones, marked as extrapolated (issue 31's goals for 1,000
hosts: <= 15 s wall, <= 500 MB RSS). The lab refuses to start when N hosts would need more than
--max-lab-gb of memory (measured on the first 8 hosts): other work shares this machine.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from orchestrator.lab.manager import Lab  # noqa: E402

os.environ["SGLFLEET_LOOPBACK_ONLY"] = "1"


def tree(pid: int) -> list[int]:
    """pid and every descendant (from /proc/*/stat)."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                ppid = int(Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(entry))
    found, todo = [], [pid]
    while todo:
        current = todo.pop()
        found.append(current)
        todo += children.get(current, [])
    return found


def memory_mib(pids: list[int]) -> tuple[float, float]:
    """(PSS, RSS) MiB summed over pids."""
    pss = rss = 0
    for pid in pids:
        try:
            pss += next(int(line.split()[1]) for line in open(f"/proc/{pid}/smaps_rollup") if line.startswith("Pss:"))
            rss += next(int(line.split()[1]) for line in open(f"/proc/{pid}/status") if line.startswith("VmRSS:"))
        except (OSError, StopIteration):
            continue
    return pss / 1024, rss / 1024


def host_memory(lab: Lab, count: int) -> tuple[float, float]:
    """Median (PSS, RSS) MiB of the first `count` lab hosts' process trees."""
    sizes = [memory_mib(tree(h.unshare_pid)) for h in lab.hosts()[:count]]
    return statistics.median(s[0] for s in sizes), statistics.median(s[1] for s in sizes)


def facts(inventory: Path, pattern: str, forks: int, cache: Path) -> tuple[float, float, float]:
    """(wall s, CPU s, peak RSS MB) of one `sglfleet facts` CLI run."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}
    env["SGLFLEET_SSH_CACHE"] = str(cache)  # these hosts' ssh -G answers only, as a user's cache holds
    # ru_maxrss of RUSAGE_CHILDREN is the largest child so far: a wrapper reports the CLI's own
    probe = ("import resource,subprocess,sys;p=subprocess.run(sys.argv[1:]);"
             "print(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss,file=sys.stderr);sys.exit(p.returncode)")
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    started = time.monotonic()
    proc = subprocess.run([sys.executable, "-c", probe, sys.executable, "-m", "orchestrator.cli", "facts", pattern,
                           "-i", str(inventory), "--json", "--forks", str(forks)],
                          capture_output=True, text=True, cwd=ROOT, env=env)
    wall = time.monotonic() - started
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    doc = json.loads(proc.stdout)
    if proc.returncode != 0 or doc["summary"]["failed"]:
        raise SystemExit(f"facts {pattern} failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-2000:]}")
    return wall, cpu, int(proc.stderr.strip().splitlines()[-1]) / 1024


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hosts", type=int, default=254)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--target", type=int, default=1000, help="the host count to extrapolate to")
    parser.add_argument("--max-lab-gb", type=float, default=6.0)
    args = parser.parse_args()
    lab = Lab(state_dir=Path(os.environ.get("SGLFLEET_BENCH_LAB_DIR", "/var/cache/sglfleet/lab-bench-scale")),
              inventory_path=Path(tempfile.mkdtemp()) / "lab.yaml",
              subnet=os.environ.get("SGLFLEET_BENCH_SUBNET", "127.0.8"))
    lab.down()
    try:
        lab.up(8)
        pss, rss = host_memory(lab, 8)
        if pss * args.hosts / 1024 > args.max_lab_gb:
            raise SystemExit(f"{args.hosts} lab hosts need ~{pss * args.hosts / 1024:.1f} GB (PSS {pss:.1f} MiB "
                             f"each), over --max-lab-gb {args.max_lab_gb}")
        began = time.monotonic()
        lab.up(args.hosts)
        up_s = time.monotonic() - began
        pss, rss = host_memory(lab, args.hosts)
        print(f"lab: {args.hosts} hosts up in {up_s:.0f} s; each idle host {pss:.1f} MiB PSS ({rss:.1f} MiB RSS): "
              f"{pss * args.hosts / 1024:.2f} GB for the lab, {pss * args.target / 1024:.1f} GB for {args.target}; "
              f"{os.cpu_count()} cores shared with the lab and other work", flush=True)
        with tempfile.TemporaryDirectory() as tmp_name:
            cache = Path(tmp_name) / "ssh-g.json"
            everyone = "all"
            facts(lab.inventory_path, everyone, args.hosts, cache)  # warm: byte-code, the ssh -G answers
            one = [facts(lab.inventory_path, lab.hosts()[0].name, 1, cache) for _ in range(args.repeat)]
            many = [facts(lab.inventory_path, everyone, args.hosts, cache) for _ in range(args.repeat)]
    finally:
        lab.down()
    rows = {1: [statistics.median(r[i] for r in one) for i in range(3)],
            args.hosts: [statistics.median(r[i] for r in many) for i in range(3)]}
    print(f"\n{'hosts':>6}  {'wall s':>7}  {'CPU s':>6}  {'peak RSS MB':>11}   (median of {args.repeat})")
    for count, (wall, cpu, peak) in rows.items():
        print(f"{count:>6}  {wall:>7.2f}  {cpu:>6.2f}  {peak:>11.1f}")
    per = [(rows[args.hosts][i] - rows[1][i]) / (args.hosts - 1) for i in range(3)]
    guess = [rows[1][i] + per[i] * (args.target - 1) for i in range(3)]
    print(f"per extra host: {per[0] * 1000:.1f} ms wall, {per[1] * 1000:.1f} ms CPU, {per[2] * 1024:.0f} KiB RSS")
    print(f"EXTRAPOLATED (not measured) to {args.target} hosts: RSS {guess[2]:.0f} MB (goal <= 500), controller CPU "
          f"{guess[1]:.1f} s (one core: a lower bound on the wall where the hosts run elsewhere; goal <= 15 s wall); "
          f"this lab's wall would be {guess[0]:.1f} s, its hosts sharing these cores")


if __name__ == "__main__":
    main()
