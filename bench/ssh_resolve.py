"""SSH config resolution at scale: `Inventory.select` of 1,000 hosts, each resolved by OpenSSH.

Writes an inventory of N hosts (default 1,000; ansible_host, some with ansible_port/ansible_user)
and an ssh config of the kind people have (a bastion block with Hostname/User/Port/IdentityFile,
`Include conf.d/*.conf` with per-rack blocks, Match user, Host * defaults, ProxyJump for half the
fleet), then, in a fresh process each round, times `load_inventory` and the first `select('all')`:
cold (an empty answer cache: `ssh -G` for two hosts of each class ssh answers alike but for the
name (fleet/ssh_alike.py) and for every other host and hop, run in parallel), then warm (a new
process, the answers kept on disk from the cold round, every config file checked); and a second
`select('all')` in the warm process (the in-process cache). Median of --rounds, wall and CPU (the
process and its ssh children), with the machine's load: other work shares these cores. The answer
cache lives apart from the config's folder, as ~/.cache does (a file written in that folder
changes its mtime, which every answer's stamp checks). Nothing connects anywhere: `ssh -G` opens
no connection. Usage: python bench/ssh_resolve.py [--hosts N] [--rounds R]
Aim (issue 33): 1,000 hosts resolved in <= 2 s wall.
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
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

CONFIG = """\
Include {dir}/conf.d/*.conf
Host bastion
    Hostname 127.0.0.2
    User jumper
    Port 2222
    IdentityFile ~/.ssh/bastion_key
Match user deploy
    IdentityFile ~/.ssh/deploy_%r
Host h*
    ServerAliveInterval 30
Host *
    IdentityFile ~/.ssh/fleet_key
    ConnectTimeout 5
"""

CHILD = """
import json, resource, sys, time
sys.path.insert(0, {root!r})
from orchestrator.fleet.inventory import load_inventory
started = time.perf_counter()
inventory = load_inventory({inventory!r}, ssh_config_path={config!r})
loaded = time.perf_counter()
cpu = lambda: sum(getattr(resource.getrusage(w), f) for w in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN)
                  for f in ("ru_utime", "ru_stime"))
before = cpu()
hosts = inventory.select("all")
first = time.perf_counter()
resolve_cpu = cpu() - before
again = inventory.select("all")
second = time.perf_counter()
jumped = sum(1 for h in hosts if h.ssh.hops())
print(json.dumps({{"load_s": loaded - started, "resolve_s": first - loaded, "cached_s": second - first,
                  "resolve_cpu_s": resolve_cpu, "load_average": __import__("os").getloadavg()[0],
                  "hosts": len(hosts), "jumped": jumped, "same": [h.address for h in hosts] == [h.address for h in again]}}))
"""


def write_files(directory: Path, count: int, own_blocks: bool = False) -> tuple[Path, Path]:
    """The racks' config and inventory; with `own_blocks`, every host also has a Host block of
    its own (a HostKeyAlias), so no two hosts are answered alike: one `ssh -G` per host."""
    (directory / "conf.d").mkdir()
    for rack in range(0, count, 50):
        (directory / "conf.d" / f"rack{rack // 50:03d}.conf").write_text(
            f"Host 10.{rack >> 8 & 255}.{rack & 255}.*\n    ProxyJump bastion\n" if rack // 50 % 2 == 0 else
            f"Host 10.{rack >> 8 & 255}.{rack & 255}.*\n    Port 2{rack // 50 % 1000:03d}\n")
    config = directory / "ssh_config"
    config.write_text(CONFIG.format(dir=directory))
    lines = ["all:", "  hosts:"]
    own = []
    for h in range(count):
        rack = h - h % 50
        extra = ", ansible_user: deploy" if h % 7 == 0 else (", ansible_port: 2200" if h % 11 == 0 else "")
        address = f"10.{rack >> 8 & 255}.{rack & 255}.{h % 50 + 1}"
        lines.append(f"    h{h}: {{ansible_host: {address}{extra}}}")
        own.append(f"Host {address}\n    HostKeyAlias h{h}\n")
    if own_blocks:
        (directory / "conf.d" / "000-own.conf").write_text("".join(own))
    inventory = directory / "inventory.yaml"
    inventory.write_text("\n".join(lines) + "\n")
    return inventory, config


def measure(count: int, rounds: int, own_blocks: bool) -> tuple[list[dict], list[dict]]:
    """(cold runs, warm runs), each in a fresh process."""
    with tempfile.TemporaryDirectory(prefix="sglfleet-bench-ssh-") as tmp, \
            tempfile.TemporaryDirectory(prefix="sglfleet-bench-ssh-cache-") as caches:
        inventory, config = write_files(Path(tmp), count, own_blocks)
        cold, warm = [], []
        for round_ in range(rounds):
            env = {**os.environ, "SGLFLEET_LOOPBACK_ONLY": "1", "SGLFLEET_SSH_CACHE": f"{caches}/cache-{round_}.json"}
            child = [sys.executable, "-c", CHILD.format(root=str(ROOT), inventory=str(inventory), config=str(config))]
            for runs in (cold, warm):
                done = subprocess.run(child, capture_output=True, text=True, check=True, env=env)
                runs.append(json.loads(done.stdout))
    return cold, warm


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hosts", type=int, default=1000)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    same = True
    for own_blocks, title in ((False, "racks: hosts alike by rack and options"),
                              (True, "every host with a Host block of its own: no two alike, one ssh -G each")):
        cold, warm = measure(args.hosts, args.rounds, own_blocks)
        same = same and all(r["same"] for r in cold + warm)
        print(f"{title}: {args.hosts} hosts ({cold[0]['jumped']} through a ProxyJump bastion), {args.rounds} rounds, "
              f"{os.cpu_count()} cores, load average {os.getloadavg()[0]:.1f}")
        print(f"  load_inventory                     {statistics.median(r['load_s'] for r in cold):.3f} s")
        for label, runs in (("cold (no answer kept)", cold), ("warm (answers kept on disk)", warm)):
            each = ", ".join(f"{r['resolve_s']:.2f} s at load {r['load_average']:.1f}" for r in runs)
            print(f"  select('all'), {label:29s} {statistics.median(r['resolve_s'] for r in runs):.3f} s wall, "
                  f"{statistics.median(r['resolve_cpu_s'] for r in runs):.2f} s CPU with ssh's  ({each})")
        print(f"  select('all') again in the process {statistics.median(r['cached_s'] for r in warm):.3f} s")
        for label, runs in (("cold", cold), ("warm", warm)):
            wall = statistics.median(r["resolve_s"] for r in runs)
            print(f"  goal <= 2 s wall, {label}: {'met' if wall <= 2.0 else 'NOT met'} ({wall:.2f} s)")
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
