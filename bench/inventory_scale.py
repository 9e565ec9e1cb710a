"""Inventory scale: load + match time and peak RSS for a 10,000- and a 200,000-host inventory.

Each size runs in a fresh Python process (so peak RSS is that size's own): it writes an Ansible
YAML inventory (hosts under racks of 50, racks under two regions, a var per host and per group),
then times `load_inventory` and `select('h12345')` and a group pattern, and reports ru_maxrss.
Nothing connects anywhere. Usage: python bench/inventory_scale.py [SIZE ...] (default 10000 200000).
Aim (issue 17 §6): 10,000 hosts load and match in < 2 s and < 300 MB.
"""

from __future__ import annotations

import json
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def write_inventory(path: Path, hosts: int) -> None:
    lines = ["all:", "  vars: {ansible_user: root, sglfleet_models_dir: /root/models}", "  children:"]
    per_rack = 50
    for region in ("east", "west"):
        lines += [f"    {region}:", "      children:"]
        for rack in range(0 if region == "east" else 1, (hosts + per_rack - 1) // per_rack, 2):
            lines += [f"        rack{rack}:", f"          vars: {{rack_id: {rack}}}", "          hosts:"]
            for h in range(rack * per_rack, min(hosts, (rack + 1) * per_rack)):
                lines.append(f"            h{h}: {{ansible_host: 10.{h >> 16 & 255}.{h >> 8 & 255}.{h & 255}, slot: {h % 8}}}")
    path.write_text("\n".join(lines) + "\n")


def measure(size: int) -> dict:
    from orchestrator.fleet.inventory import load_inventory

    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "inv.yaml"
        write_inventory(path, size)
        started = time.perf_counter()
        inv = load_inventory(path, ssh_config_path="/nonexistent")
        loaded = time.perf_counter()
        one = inv.select(f"h{min(12345, size - 1)}")
        matched = time.perf_counter()
        many = inv.select("east:!rack0")
        group_matched = time.perf_counter()
    return {"hosts": size, "load_s": round(loaded - started, 2), "match_one_s": round(matched - loaded, 3),
            "match_group_s": round(group_matched - matched, 3), "load_and_match_s": round(matched - started, 2),
            "selected": [len(one), len(many)],
            "peak_rss_mb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1)}


def main() -> None:
    if len(sys.argv) > 2 and sys.argv[1] == "--one":
        print(json.dumps(measure(int(sys.argv[2]))))
        return
    sizes = [int(a) for a in sys.argv[1:]] or [10_000, 200_000]
    root = Path(__file__).resolve().parent.parent
    for size in sizes:
        proc = subprocess.run([sys.executable, __file__, "--one", str(size)], capture_output=True, text=True,
                              cwd=root, env={"PYTHONPATH": str(root), "PATH": "/usr/bin:/bin"})
        if proc.returncode != 0:
            sys.exit(proc.stderr)
        print(proc.stdout.strip())


if __name__ == "__main__":
    main()
