"""Logs benchmark: `sglfleet logs --bundle` of 8 lab hosts, and what an incremental
`sglfleet logs --since last` moves.

1. Each host gets a server log of --log-mib MiB (SGLang-like decode lines, a random request id
   each so it compresses like a real log, ~4x), then ONE `sglfleet logs --bundle` of all hosts
   runs as a subprocess reaped with wait4: its wall time and the controller's peak RSS.
2. `sglfleet logs HOST bench` reads one host's log whole (the cursor is kept), --append-lines
   lines are appended on the host, and `sglfleet logs HOST bench --since last --json` runs: the
   log bytes the host read and the JSON answer bytes that crossed the wire, against the whole read.

    SGLFLEET_LOOPBACK_ONLY=1 .venv/bin/python bench/logs.py [--hosts 8] [--log-mib 64]

Uses its own lab (state --lab-dir, subnet --subnet), so a demo or test lab keeps running.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
os.environ["SGLFLEET_LOOPBACK_ONLY"] = "1"

from orchestrator.fleet.hostkeys import KnownHosts  # noqa: E402
from orchestrator.fleet.inventory import load_inventory  # noqa: E402
from orchestrator.fleet.transport import Connection  # noqa: E402
from orchestrator.lab.manager import Lab, host_name  # noqa: E402

MAKE_LOG = """import os, time
t = time.strftime('%Y-%m-%d %H:%M:%S')
os.makedirs('/var/log/sglfleet', exist_ok=True)
with open('/var/log/sglfleet/bench.log', 'wb') as f:
    n = 0
    while n < {size}:
        rows = [('[%s] Decode batch, #running-req: 7, #token: 9216, token usage: 0.02, accept len: 3.41, accept rate: '
                 '0.81, cuda graph: True, gen throughput (token/s): 312.55, #queue-req: 0, rid=%s\\n'
                 % (t, os.urandom(16).hex())).encode() for _ in range(4096)]
        b = b''.join(rows)
        f.write(b)
        n += len(b)
"""


def measured(*argv: str) -> tuple[int, str, str, float, float]:
    """(exit code, stdout, stderr, wall s, peak RSS MiB) of one CLI run."""
    started = time.monotonic()
    proc = subprocess.Popen([sys.executable, "-m", "orchestrator.cli", *argv], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, cwd=ROOT)
    out: dict[str, bytes] = {}
    readers = [threading.Thread(target=lambda k=k, f=f: out.__setitem__(k, f.read()), daemon=True)
               for k, f in (("out", proc.stdout), ("err", proc.stderr))]
    for reader in readers:
        reader.start()
    _, status, usage = os.wait4(proc.pid, 0)
    proc.returncode = os.waitstatus_to_exitcode(status)
    wall = time.monotonic() - started
    for reader in readers:
        reader.join(30)
    return proc.returncode, out["out"].decode(), out["err"].decode(), wall, usage.ru_maxrss / 1024


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hosts", type=int, default=8)
    parser.add_argument("--log-mib", type=int, default=64)
    parser.add_argument("--append-lines", type=int, default=100)
    parser.add_argument("--lab-dir", default="/var/cache/sglfleet/lab-logs-bench")
    parser.add_argument("--subnet", default=os.environ.get("SGLFLEET_BENCH_SUBNET", "127.0.6"))
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="sglfleet-logs-bench-"))
    lab = Lab(state_dir=Path(args.lab_dir), inventory_path=work / "lab.yaml", subnet=args.subnet)
    lab.down()
    lab.up(args.hosts)
    try:
        inventory = load_inventory(work / "lab.yaml")
        known = KnownHosts(inventory.known_hosts_path)
        names = [host_name(i) for i in range(args.hosts)]
        started = time.monotonic()
        threads = []
        for name in names:
            def make(name: str = name) -> None:
                with Connection(inventory.hosts[name], known) as conn:
                    result = conn.run(f"{conn.host.python} -", stdin=MAKE_LOG.format(size=args.log_mib << 20),
                                      timeout=900)
                    assert result.ok, result.stderr_text
            threads.append(threading.Thread(target=make))
            threads[-1].start()
        for thread in threads:
            thread.join()
        print(f"lab: {args.hosts} hosts, a {args.log_mib} MiB log each (written in {time.monotonic() - started:.0f}s); "
              f"{os.cpu_count()} CPU cores shared by the controller and every simulated host")
        inv = str(work / "lab.yaml")
        code, out, err, wall, rss = measured("logs", "--bundle", ",".join(names), "bench", "--json", "-i", inv,
                                             "--runs-dir", str(work / "runs"))
        if code != 0:
            raise SystemExit(f"bundle failed ({code}):\n{out}\n{err}")
        document = json.loads(out)
        total = sum(h["bytes"] for h in document["hosts"].values())
        print(f"bundle of {args.hosts} hosts x {args.log_mib} MiB: {wall:.1f}s wall, controller peak RSS {rss:.0f} MiB, "
              f"{total / 2**20:.1f} MiB of tar.gz fetched ({total / 2**20 / wall:.1f} MiB/s)")

        host = names[0]
        code, out, err, wall_whole, rss_whole = measured("logs", host, "bench", "--json", "-i", inv, "--runs-dir",
                                                 str(work / "runs"))
        whole = json.loads(out)["hosts"][host]
        with Connection(inventory.hosts[host], known) as conn:
            stamp = time.strftime("%Y-%m-%d %H:%M:%S")
            added = "".join(f"[{stamp}] Decode batch, #running-req: 1, accept len: 3.0, line {i}\n"
                            for i in range(args.append_lines))
            assert conn.run("cat >> /var/log/sglfleet/bench.log", stdin=added).ok
        code, out, err, wall_new, _ = measured("logs", host, "bench", "--since", "last", "--json", "-i", inv,
                                               "--runs-dir", str(work / "runs"))
        new = json.loads(out)
        state = new["hosts"][host]
        assert len(new["lines"]) == args.append_lines, (len(new["lines"]), err)
        print(f"logs --since last after {args.append_lines} new lines ({len(added)} bytes): {state['bytes_read']} log "
              f"bytes read on the host, {state['answer_bytes']} answer bytes in {state['calls']} call(s), "
              f"{wall_new:.2f}s; the whole read before it: {whole['bytes_read']} log bytes, "
              f"{whole['answer_bytes']} answer bytes in {whole['calls']} calls, {wall_whole:.1f}s, controller peak "
              f"RSS {rss_whole:.0f} MiB")
    finally:
        lab.down()


if __name__ == "__main__":
    main()
