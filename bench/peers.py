"""sglfleet against its peers: `run HOSTS uname` beside ansible-core and pyinfra, paired in one run.

    .venv/bin/python bench/peers.py --install            # the bench-only virtualenv (needs PyPI)
    jailed SGLFLEET_LOOPBACK_ONLY=1 .venv/bin/python bench/peers.py [--counts 32,128] [--repeat 5]

The same command on the same lab hosts (its own lab: SGLFLEET_BENCH_LAB_DIR, subnet
SGLFLEET_BENCH_SUBNET, default 127.0.6; taken down at the end):

  sglfleet  `sglfleet run all uname --forks N` (its default human output, piped)
  ansible   `ansible all -m command -a uname -f N`, pipelining on, ControlMaster=auto with
            ControlPersist=60s (a fresh ControlPath dir per run: every tool starts cold)
  pyinfra   `pyinfra INVENTORY.py exec -y --parallel N -- uname`

ansible-core and pyinfra come from a virtualenv of their own (VENV below, versions pinned), never
sglfleet's. Each tool's run is one process tree in a cgroup of its own: its CPU is the cgroup's
user+sys (cpu.stat), so the ssh ControlPersist masters Ansible leaves behind count, and no lab
host's does (sshd and the host's Python run in the lab's processes). Runs are interleaved
(the tools' order rotates each round) and the medians of --repeat rounds are printed, with the
ratios and the goals beside them.

This machine's cores are shared by the controller, every lab host and whatever else runs here:
wall seconds are noisy; the controller CPU seconds and the paired ratios are what to trust.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from orchestrator.lab.manager import Lab, _cgroup2_mount  # noqa: E402

os.environ["SGLFLEET_LOOPBACK_ONLY"] = "1"

VENV = Path(os.environ.get("SGLFLEET_BENCH_PEERS_VENV", "/var/cache/sglfleet/bench-peers/venv"))
PINS = ("ansible-core==2.19.14", "pyinfra==3.10.0", "py-spy==0.4.3")
TOOLS = ("sglfleet", "pyinfra", "ansible")
# The goals of issue 31, sglfleet / pyinfra at the largest count.
GOAL_CPU, GOAL_WALL = 0.8, 0.9


def install() -> None:
    """The bench-only virtualenv: the peers at pinned versions (and py-spy for profiling)."""
    if not (VENV / "bin" / "python").exists():
        subprocess.run([sys.executable, "-m", "venv", str(VENV)], check=True)
    subprocess.run([str(VENV / "bin" / "python"), "-m", "pip", "install", "-q", *PINS], check=True)


def check_venv() -> None:
    missing = [tool for tool in ("ansible", "pyinfra") if not (VENV / "bin" / tool).exists()]
    if missing:
        raise SystemExit(f"{VENV} lacks {', '.join(missing)}: run `.venv/bin/python bench/peers.py --install` "
                         "first (outside the network jail: it needs the package index)")


class Cgroup:
    """A cgroup v2 of its own for one tool run: its processes' CPU, then every one of them killed."""

    def __init__(self, name: str):
        mount = _cgroup2_mount()
        if mount is None:
            raise SystemExit("no cgroup2 file system here: the controller's CPU cannot be measured whole")
        self.path = Path(mount) / name
        if self.path.exists():
            self.remove()
        self.path.mkdir()

    def run(self, argv: list[str], env: dict[str, str], timeout: float) -> tuple[float, float, subprocess.CompletedProcess]:
        """(wall s, CPU s of the whole tree, the process) of argv run inside this cgroup."""
        entry = ["sh", "-c", f'echo $$ > {self.path}/cgroup.procs && exec "$@"', "cgroup-entry", *argv]
        started = time.monotonic()
        proc = subprocess.run(entry, env=env, capture_output=True, text=True, timeout=timeout, cwd=ROOT,
                              stdin=subprocess.DEVNULL)
        wall = time.monotonic() - started
        self.remove()  # what the tool left running (ssh ControlPersist masters) ends here, counted
        return wall, self.cpu, proc

    def remove(self) -> None:
        (self.path / "cgroup.kill").write_text("1")
        deadline = time.monotonic() + 10
        while (self.path / "cgroup.procs").read_text().strip() and time.monotonic() < deadline:
            time.sleep(0.05)
        stat = dict(line.split() for line in (self.path / "cpu.stat").read_text().splitlines())
        self.cpu = (int(stat["user_usec"]) + int(stat["system_usec"])) / 1e6
        self.path.rmdir()


def write_peer_inventories(lab: Lab, tmp: Path, count: int) -> tuple[Path, Path]:
    """An Ansible YAML inventory and a pyinfra inventory.py for the first `count` lab hosts:
    the same addresses, user, key and known_hosts (strict checking for all three tools)."""
    hosts = lab.hosts()[:count]
    ansible = tmp / f"ansible-{count}.yaml"
    lines = ["all:", "  vars:", "    ansible_user: root", f"    ansible_ssh_private_key_file: {lab.key_path}",
             "    ansible_python_interpreter: /root/ml-env/bin/python3", "    ansible_timeout: 60", "  hosts:"]
    lines += [f"    {h.name}: {{ansible_host: {h.address}, ansible_port: {h.port}}}" for h in hosts]
    ansible.write_text("\n".join(lines) + "\n")
    pyinfra = tmp / f"pyinfra_{count}.py"
    data = {"ssh_user": "root", "ssh_key": str(lab.key_path), "ssh_known_hosts_file": str(lab.known_hosts_path),
            "ssh_strict_host_key_checking": "yes", "ssh_connect_timeout": 60}
    pyinfra.write_text(f"hosts = [{', '.join(repr((h.address, data)) for h in hosts)}]\n")
    return ansible, pyinfra


def sglfleet_inventory(lab: Lab, tmp: Path, count: int) -> Path:
    """The lab's own inventory cut to the first `count` hosts (its known_hosts beside it)."""
    import yaml

    doc = yaml.safe_load(lab.inventory_path.read_text())
    names = [h.name for h in lab.hosts()[:count]]
    doc["all"]["hosts"] = {n: doc["all"]["hosts"][n] for n in names}
    doc["all"]["vars"]["ansible_timeout"] = 60
    doc["all"].pop("children", None)
    path = tmp / f"sglfleet-{count}.yaml"
    path.write_text(yaml.safe_dump(doc, sort_keys=False))
    shutil.copyfile(lab.known_hosts_path, path.with_suffix(".known_hosts"))
    return path


def tool_argv(tool: str, count: int, inventories: dict[str, Path], control_dir: Path) -> tuple[list[str], dict]:
    # Each tool as its users run it: byte-code cached (the warm-up run writes sglfleet's, an editable
    # install; pip wrote the peers'). A session that sets PYTHONDONTWRITEBYTECODE would otherwise
    # make sglfleet compile its own sources on every run.
    env = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}
    if tool == "sglfleet":
        # ssh -G answers kept as a user's own would be, for these hosts only (the warm-up run
        # writes them): the machine's shared ~/.cache holds every other lab's and test's answers
        env["SGLFLEET_SSH_CACHE"] = str(control_dir.parent / "ssh-g.json")
        return ([sys.executable, "-m", "orchestrator.cli", "run", "all", "uname", "-i", str(inventories["sglfleet"]),
                 "--forks", str(count)], env)
    if tool == "ansible":
        (control_dir / "ansible.cfg").write_text("[defaults]\n")  # no user or system config is read
        env.update(ANSIBLE_PIPELINING="True", ANSIBLE_HOST_KEY_CHECKING="True", ANSIBLE_FORKS=str(count),
                   ANSIBLE_SSH_ARGS=f"-o ControlMaster=auto -o ControlPersist=60s "
                                    f"-o UserKnownHostsFile={inventories['known_hosts']} -o StrictHostKeyChecking=yes",
                   ANSIBLE_CONTROL_PATH_DIR=str(control_dir), ANSIBLE_HOME=str(control_dir / "home"),
                   ANSIBLE_LOCAL_TEMP=str(control_dir / "tmp"), ANSIBLE_CONFIG=str(control_dir / "ansible.cfg"),
                   ANSIBLE_NOCOLOR="1")
        return ([str(VENV / "bin" / "ansible"), "all", "-i", str(inventories["ansible"]), "-m", "command",
                 "-a", "uname", "-f", str(count)], env)
    return ([str(VENV / "bin" / "pyinfra"), str(inventories["pyinfra"]), "exec", "-y", "--parallel", str(count),
             "--", "uname"], env)


def succeeded(tool: str, count: int, proc: subprocess.CompletedProcess) -> bool:
    if proc.returncode != 0:
        return False
    if tool == "sglfleet":
        return f"{count} ok, 0 failed" in proc.stdout
    if tool == "ansible":
        return proc.stdout.count("| CHANGED | rc=0") == count
    return len(re.findall(r"^ +\[[^]]+\] +Success$", proc.stdout + proc.stderr, re.M)) == count  # one per host


def measure(tool: str, count: int, inventories: dict[str, Path], tmp: Path, timeout: float) -> tuple[float, float]:
    control_dir = Path(tempfile.mkdtemp(dir=tmp, prefix=f"{tool}-"))
    argv, env = tool_argv(tool, count, inventories, control_dir)
    wall, cpu, proc = Cgroup(f"sglfleet-bench-peers-{os.getpid()}").run(argv, env, timeout)
    if not succeeded(tool, count, proc):
        raise SystemExit(f"{tool} on {count} hosts failed (exit {proc.returncode}):\n{proc.stdout[-3000:]}\n"
                         f"{proc.stderr[-3000:]}")
    shutil.rmtree(control_dir, ignore_errors=True)
    return wall, cpu


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--install", action="store_true", help="create the bench-only virtualenv and stop")
    parser.add_argument("--counts", default="32,128")
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--tools", default=",".join(TOOLS))
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds one tool run may take")
    args = parser.parse_args()
    if args.install:
        install()
        return
    tools = [t for t in args.tools.split(",") if t]
    if set(tools) - {"sglfleet"}:
        check_venv()
    counts = [int(c) for c in args.counts.split(",")]
    lab = Lab(state_dir=Path(os.environ.get("SGLFLEET_BENCH_LAB_DIR", "/var/cache/sglfleet/lab-bench-peers")),
              inventory_path=Path(tempfile.mkdtemp()) / "lab.yaml",
              subnet=os.environ.get("SGLFLEET_BENCH_SUBNET", "127.0.6"))
    lab.down()
    rows: dict[tuple[str, int], tuple[float, float]] = {}
    try:
        began = time.monotonic()
        lab.up(max(counts))
        print(f"lab: {max(counts)} hosts up in {time.monotonic() - began:.0f} s; {os.cpu_count()} CPU cores on this "
              "machine, shared by the controller, every lab host and anything else running here", flush=True)
        with tempfile.TemporaryDirectory() as tmp_name:
            tmp = Path(tmp_name)
            for count in counts:
                ansible, pyinfra = write_peer_inventories(lab, tmp, count)
                inventories = {"sglfleet": sglfleet_inventory(lab, tmp, count), "ansible": ansible,
                               "pyinfra": pyinfra, "known_hosts": lab.known_hosts_path}
                for tool in tools:  # warm the page cache (and each tool's byte-code) once
                    measure(tool, count, inventories, tmp, args.timeout)
                samples: dict[str, list[tuple[float, float]]] = {t: [] for t in tools}
                for round_ in range(args.repeat):
                    order = tools[round_ % len(tools):] + tools[:round_ % len(tools)]
                    for tool in order:
                        samples[tool].append(measure(tool, count, inventories, tmp, args.timeout))
                for tool in tools:
                    rows[tool, count] = (statistics.median(s[0] for s in samples[tool]),
                                         statistics.median(s[1] for s in samples[tool]))
                    # paired ratios: each round's sglfleet over the same round's peer
                    if tool != "sglfleet" and "sglfleet" in tools:
                        pairs = list(zip(samples["sglfleet"], samples[tool]))
                        rows[f"ratio-{tool}", count] = (statistics.median(a[0] / b[0] for a, b in pairs),
                                                        statistics.median(a[1] / b[1] for a, b in pairs))
                print(f"{count} hosts: " + ", ".join(f"{t} {rows[t, count][0]:.2f} s / {rows[t, count][1]:.2f} s CPU"
                                                     for t in tools), flush=True)
    finally:
        lab.down()
    report(rows, tools, counts, args.repeat)


def report(rows: dict, tools: list[str], counts: list[int], repeat: int) -> None:
    print(f"\nmedians of {repeat} paired rounds; wall s / controller CPU s (user+sys of the tool's whole "
          "process tree)")
    print(f"{'hosts':>5}  " + "  ".join(f"{t:>17}" for t in tools)
          + "".join(f"  {'sglfleet/' + t + ' wall, CPU':>28}" for t in tools if t != "sglfleet"))
    for count in counts:
        cells = [f"{rows[t, count][0]:>7.2f} / {rows[t, count][1]:>5.2f} s" for t in tools]
        ratios = [f"{rows[f'ratio-{t}', count][0]:>18.2f}x, {rows[f'ratio-{t}', count][1]:.2f}x"
                  for t in tools if t != "sglfleet" and "sglfleet" in tools]
        print(f"{count:>5}  " + "  ".join(cells) + "".join(f"  {r:>28}" for r in ratios))
    if {"sglfleet", "pyinfra"} <= set(tools):
        last = counts[-1]
        wall, cpu = rows["ratio-pyinfra", last]
        print(f"\nat {last} hosts, sglfleet / pyinfra: CPU {cpu:.2f}x (goal <= {GOAL_CPU}x: "
              f"{'MET' if cpu <= GOAL_CPU else 'MISSED'}), wall {wall:.2f}x (goal <= {GOAL_WALL}x: "
              f"{'MET' if wall <= GOAL_WALL else 'MISSED'})")
        for count in counts[1:]:
            for tool in tools:
                per_host = (rows[tool, count][1] - rows[tool, counts[0]][1]) / (count - counts[0]) * 1000
                print(f"  {tool}: controller CPU per host beyond {counts[0]}: {per_host:.1f} ms")
    print("(wall is noisy here: the cores are shared with the lab hosts and other work; trust CPU and ratios)")


if __name__ == "__main__":
    main()
