"""Scale: a lab of 1,000 hosts, what each costs this machine, and `facts` on all of them.

    jailed SGLFLEET_LOOPBACK_ONLY=1 .venv/bin/python bench/scale.py [--hosts 1000] [--forks 200] [--repeat 3]

Brings up its own lab (SGLFLEET_BENCH_LAB_DIR, from subnet SGLFLEET_BENCH_SUBNET, default 127.0.8:
254 hosts a subnet, so 1,000 take 127.0.8-11; taken down at the end whatever happens), its plain
hosts in a cgroup of their own, and measures each idle host's memory (PSS and RSS of its process
tree: unshare, its PID 1, sshd). Then `sglfleet facts` on 1 host and on all N (--forks at a time),
median of --repeat: wall seconds, the CLI's CPU seconds and peak RSS (ru_maxrss of the CLI
process), and the CPU seconds the lab's hosts spent answering (their cgroup: sshd, the shell, the
host's Python). Issue 31's goals for 1,000 hosts are printed beside them: <= 15 s wall, <= 500 MB
RSS. The simulated hosts run on this machine's cores, so the wall cannot go below their CPU
spread over the cores (the floor, printed beside the wall; with the controller's CPU too, the
whole floor), which a real fleet spends on N machines. The lab refuses to start when N hosts
would need more than --max-lab-gb (PSS measured on the first 8 hosts): other work shares this
machine, so a large lab is brought up for the run only.
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
GOAL_WALL_S, GOAL_RSS_MB = 15.0, 500.0  # issue 31, facts on 1,000 hosts


def process_trees(roots: list[int]) -> dict[int, list[int]]:
    """Each root pid with every descendant, from one pass over /proc."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                ppid = int(Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(entry))
    trees = {}
    for root in roots:
        found, todo = [], [root]
        while todo:
            current = todo.pop()
            found.append(current)
            todo += children.get(current, [])
        trees[root] = found
    return trees


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
    trees = process_trees([h.unshare_pid for h in lab.hosts()[:count]])
    sizes = [memory_mib(pids) for pids in trees.values()]
    return statistics.median(s[0] for s in sizes), statistics.median(s[1] for s in sizes)


def facts(lab: Lab, pattern: str, forks: int, cache: Path) -> dict[str, float]:
    """One `sglfleet facts` CLI run: wall s, the CLI's CPU s and peak RSS MB, the lab hosts' CPU s."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}
    env["SGLFLEET_SSH_CACHE"] = str(cache)  # these hosts' ssh -G answers only, as a user's cache holds
    # ru_maxrss of RUSAGE_CHILDREN is the largest child so far: a wrapper reports the CLI's own
    probe = ("import resource,subprocess,sys;p=subprocess.run(sys.argv[1:]);"
             "print(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss,file=sys.stderr);sys.exit(p.returncode)")
    before, hosts_before = resource.getrusage(resource.RUSAGE_CHILDREN), lab.cpu_seconds()
    started = time.monotonic()
    proc = subprocess.run([sys.executable, "-c", probe, sys.executable, "-m", "orchestrator.cli", "facts", pattern,
                           "-i", str(lab.inventory_path), "--json", "--forks", str(forks)],
                          capture_output=True, text=True, cwd=ROOT, env=env)
    wall = time.monotonic() - started
    after, hosts_after = resource.getrusage(resource.RUSAGE_CHILDREN), lab.cpu_seconds()
    doc = json.loads(proc.stdout) if proc.stdout.startswith("{") else None
    if proc.returncode != 0 or doc is None or doc["summary"]["failed"]:
        raise SystemExit(f"facts {pattern} failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-2000:]}")
    return {"wall": wall, "cpu": (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime),
            "rss": int(proc.stderr.strip().splitlines()[-1]) / 1024, "hosts_cpu": hosts_after - hosts_before}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hosts", type=int, default=1000)
    parser.add_argument("--forks", type=int, default=200,
                        help="hosts at a time (each host's side of a call holds ~10 MB on this machine while it runs)")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--max-lab-gb", type=float, default=4.0)
    args = parser.parse_args()
    lab = Lab(state_dir=Path(os.environ.get("SGLFLEET_BENCH_LAB_DIR", "/var/cache/sglfleet/lab-bench-scale")),
              inventory_path=Path(tempfile.mkdtemp()) / "lab.yaml",
              subnet=os.environ.get("SGLFLEET_BENCH_SUBNET", "127.0.8"), cgroup=True)
    if not lab.cgroup:
        raise SystemExit("no cgroup v2 here: the lab hosts' CPU cannot be measured apart from other work")
    lab.down()
    cores = os.cpu_count() or 1
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
        print(f"lab: {args.hosts} hosts up in {up_s:.0f} s ({lab.hosts()[0].address} .. {lab.hosts()[-1].address}); "
              f"each idle host {pss:.2f} MiB PSS ({rss:.1f} MiB RSS): {pss * args.hosts / 1024:.2f} GB for the lab; "
              f"{cores} cores shared with the lab and other work", flush=True)
        with tempfile.TemporaryDirectory() as tmp_name:
            cache = Path(tmp_name) / "ssh-g.json"
            facts(lab, "all", args.forks, cache)  # warm: byte-code, the ssh -G answers, the hosts' code caches
            one = [facts(lab, lab.hosts()[0].name, 1, cache) for _ in range(args.repeat)]
            many = [facts(lab, "all", args.forks, cache) for _ in range(args.repeat)]
    finally:
        lab.down()
    rows = {1: {k: statistics.median(r[k] for r in one) for k in one[0]},
            args.hosts: {k: statistics.median(r[k] for r in many) for k in many[0]}}
    print(f"\nsglfleet facts, median of {args.repeat}, forks {args.forks} (load average {os.getloadavg()[0]:.1f})")
    print(f"{'hosts':>6}  {'wall s':>7}  {'controller CPU s':>16}  {'peak RSS MB':>11}  {'hosts CPU s':>11}  "
          f"{'floor s':>7}  {'whole floor s':>13}")
    for count, row in rows.items():
        print(f"{count:>6}  {row['wall']:>7.2f}  {row['cpu']:>16.2f}  {row['rss']:>11.1f}  {row['hosts_cpu']:>11.2f}  "
              f"{row['hosts_cpu'] / cores:>7.2f}  {(row['hosts_cpu'] + row['cpu']) / cores:>13.2f}")
    n = rows[args.hosts]
    per = {k: (n[k] - rows[1][k]) / (args.hosts - 1) for k in n}
    print(f"per extra host: controller {per['cpu'] * 1000:.1f} ms CPU and {per['rss'] * 1024:.0f} KiB RSS; "
          f"the host's side {per['hosts_cpu'] * 1000:.1f} ms CPU")
    print(f"floor: the {args.hosts} hosts' CPU over {cores} cores; whole floor: with the controller's CPU too")
    print(f"goal, {args.hosts} hosts: wall <= {GOAL_WALL_S:.0f} s: {'MET' if n['wall'] <= GOAL_WALL_S else 'NOT met'} "
          f"({n['wall']:.1f} s; this machine's floor {n['hosts_cpu'] / cores:.1f} s, whole floor "
          f"{(n['hosts_cpu'] + n['cpu']) / cores:.1f} s); controller RSS <= {GOAL_RSS_MB:.0f} MB: "
          f"{'MET' if n['rss'] <= GOAL_RSS_MB else 'NOT met'} ({n['rss']:.0f} MB)")


if __name__ == "__main__":
    main()
