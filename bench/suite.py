"""What a run of (part of) the test suite costs: wall, CPU of everything it started, peak memory.

    .venv/bin/python bench/suite.py [--repeat N] [--label TEXT] -- PYTEST-ARGS...
    e.g. .venv/bin/python bench/suite.py -- tests/test_deploy.py -x

The suite's time is mostly lab work: lab hosts (sshd, the stand-in servers, SGLang imports) are
processes of their own, outside pytest's own rusage while they run, and the machine is shared,
so wall time alone says little. Each run goes into a fresh cgroup (cpuacct + memory on cgroup v1,
or a cgroup2 directory) and its figures are that cgroup's: the CPU seconds of every process the
run started (a lab host's PID 1, its sshd, the servers; a systemd lab host moves itself into a
cgroup2 group of its own, and on a cgroup2 machine its CPU is then not counted here), and
the peak memory of the group (page cache included). Without a usable cgroup it falls back to the
children's rusage (processes not waited for are missed; said so in the output).

pytest runs in a network jail (a private network namespace with only lo, as `make test`), with
--durations=0, whose lines give the setup / call / teardown split per test module. Printed: one
line per run (wall, CPU, CPU/wall, peak memory, the machine's load average at the start), then
per module: tests, setup s, call s, teardown s. --by-process adds where the CPU went: the run's
processes are sampled every 0.2 s (the cgroup's list) and their CPU summed by kind (KINDS: an
SGLang import on a lab host, the CLI, sshd, ...); a process that ends between two samples loses
at most 0.2 s of its CPU, one that lives less than 0.2 s is missed. --json prints the same as
JSON. --write-durations tests/durations.json keeps each module's seconds for the longest-first
order of `make test`'s workers (tests/conftest.py); --log PATH keeps pytest's whole output. Needs root (cgroups, the jail); it changes nothing outside its own cgroup.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import threading
import time
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DURATION = re.compile(r"^\s*([0-9.]+)s (setup|call|teardown)\s+(\S+)")
OUTCOME = re.compile(r"(\d+) (passed|failed|skipped|errors?|deselected|xfailed|xpassed)")
# Kinds of processes, by their command line (first match). "SGLang" marks those that import it.
KINDS = [
    ("SGLang: stand-in warm validator and its validation children", re.compile(r" -X sglfleet_warm_validator ")),
    ("SGLang: stand-in server (+ its fresh validation child)", re.compile(r"sglfleet-sim-server")),
    ("SGLang: server_facts option list (cache miss)", re.compile(r"ServerArgs\.add_cli_args")),
    ("SGLang: smoke probe (remote call)", re.compile(r"m\.serve\(.* smoke_probe\.py ")),
    ("SGLang: doctor (remote call)", re.compile(r"m\.serve\(.* doctor\.py ")),
    ("remote call (other scripts)", re.compile(r"m\.serve\(")),
    ("test script on a host (python3 - over stdin)", re.compile(r"python3? - ")),
    ("CLI (python -m orchestrator.cli)", re.compile(r"-m orchestrator\.cli")),
    ("CLI (forks of the tests' CLI zygote, and it)", re.compile(r"-m tests\.cli_zygote ")),
    ("pytest", re.compile(r"-m pytest")),
    ("sshd", re.compile(r"sshd")),
    ("lab host PID 1 (hostinit, systemd)", re.compile(r"hostinit\.py|systemd_boot\.py|/lib/systemd/")),
    ("server supervisor", re.compile(r"server\.py supervise")),
    ("router", re.compile(r"router")),
    ("kernel build (compilers)", re.compile(r"\b(cc1plus|c\+\+|g\+\+|gcc|ninja|ld|nvcc)\b")),
]
TICK = os.sysconf("SC_CLK_TCK")


class ProcessSampler:
    """CPU per kind of process in a cgroup, sampled (see --by-process)."""

    def __init__(self, procs_file: Path, interval: float = 0.2):
        self.procs_file, self.interval = procs_file, interval
        self.seen: dict[tuple[int, int], list] = {}  # (pid, start tick) -> [kind, cpu ticks]
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self.run, daemon=True)

    def run(self):
        while not self.stop.wait(self.interval):
            self.sample()

    def sample(self):
        try:
            pids = [int(x) for x in self.procs_file.read_text().split()]
        except OSError:
            return
        for pid in pids:
            try:
                stat = Path(f"/proc/{pid}/stat").read_text()
                fields = stat[stat.rindex(")") + 2:].split()
                key = (pid, int(fields[19]))
                if key not in self.seen:
                    cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
                    self.seen[key] = [classify(cmdline), 0, cmdline[:160]]
                self.seen[key][1] = int(fields[11]) + int(fields[12])
            except (OSError, ValueError, IndexError):
                continue

    def by_kind(self) -> dict[str, dict]:
        """CPU and processes per kind; for a kind KINDS does not name ("other: ..."), its three
        costliest command lines too, to say what to name next."""
        out: dict[str, dict] = {}
        for kind, ticks, cmdline in self.seen.values():
            entry = out.setdefault(kind, {"processes": 0, "cpu_s": 0.0, "by_cmdline": defaultdict(float)})
            entry["processes"] += 1
            entry["cpu_s"] += ticks / TICK
            entry["by_cmdline"][cmdline] += ticks / TICK
        return {k: {"processes": v["processes"], "cpu_s": round(v["cpu_s"], 1),
                    **({"costliest": [[c, round(cpu, 1)] for c, cpu in sorted(v["by_cmdline"].items(),
                                                                              key=lambda x: -x[1])[:3]]}
                       if k.startswith("other") else {})}
                for k, v in sorted(out.items(), key=lambda kv: -kv[1]["cpu_s"])}


# A remote call's command line ends with its script and command (fleet/remote_call.py command_line).
REMOTE_SCRIPT = re.compile(r"m\.serve\(.*\)\) (\S+\.py) (\S+)")


def classify(cmdline: str) -> str:
    for kind, pattern in KINDS:
        if pattern.search(cmdline):
            if kind == "remote call (other scripts)":
                # Split by script and command: a deploy's apply imports SGLang for its smoke,
                # a plain push's apply does not, and a total hides which is which.
                script = REMOTE_SCRIPT.search(cmdline)
                return f"remote call: {script[1]} {script[2]}" if script else kind
            return kind
    argv0 = cmdline.split(" ", 1)[0]
    return f"other: {os.path.basename(argv0) or '?'}"


class Group:
    """A fresh cgroup for one run: cgroup v1 (cpuacct, memory) or cgroup2."""

    def __init__(self, name: str):
        self.dirs: dict[str, Path] = {}
        v1 = Path("/sys/fs/cgroup/cpuacct")
        v2 = Path("/sys/fs/cgroup")
        if (v1 / "cpuacct.usage").exists():
            self.kind = "v1"
            for controller in ("cpuacct", "memory"):
                path = Path("/sys/fs/cgroup") / controller / name
                path.mkdir()
                self.dirs[controller] = path
        elif (v2 / "cgroup.controllers").exists():
            self.kind = "v2"
            path = v2 / name
            path.mkdir()
            self.dirs["v2"] = path
        else:
            raise OSError("no cgroup hierarchy with CPU accounting here")

    def enter(self) -> None:
        """Called in the child before exec: the run and all it starts are counted here."""
        for path in self.dirs.values():
            (path / "cgroup.procs").write_text(str(os.getpid()))

    def cpu_s(self) -> float:
        if self.kind == "v1":
            return int((self.dirs["cpuacct"] / "cpuacct.usage").read_text()) / 1e9
        stat = dict(line.split() for line in (self.dirs["v2"] / "cpu.stat").read_text().splitlines())
        return int(stat["usage_usec"]) / 1e6

    def procs_file(self) -> Path:
        return (self.dirs["cpuacct"] if self.kind == "v1" else self.dirs["v2"]) / "cgroup.procs"

    def peak_mib(self) -> float | None:
        path = (self.dirs["memory"] / "memory.max_usage_in_bytes") if self.kind == "v1" else \
            (self.dirs["v2"] / "memory.peak")
        try:
            return int(path.read_text()) / 2**20
        except (OSError, ValueError):
            return None

    def remove(self) -> None:
        for path in self.dirs.values():
            for _ in range(50):  # processes that outlived pytest (none should) keep it busy
                try:
                    path.rmdir()
                    break
                except OSError:
                    time.sleep(0.1)


def jailed(argv: list[str]) -> list[str]:
    return ["unshare", "--net", "--", "sh", "-c", 'ip link set lo up && exec "$@"', "jail", *argv]


def run_once(pytest_args: list[str], label: str, by_process: bool = False) -> dict:
    argv = jailed([str(ROOT / ".venv" / "bin" / "python"), "-m", "pytest", "-q", "-p", "no:cacheprovider",
                   "--durations=0", *pytest_args])
    env = {**os.environ, "SGLFLEET_LOOPBACK_ONLY": "1"}
    load = os.getloadavg()[0]
    try:
        group = Group(f"sglfleet-suite-{os.getpid()}-{time.monotonic_ns()}")
    except OSError as exc:
        group = None
        print(f"(no cgroup: {exc}; CPU is the waited-for children's rusage)", file=sys.stderr)
    sampler = ProcessSampler(group.procs_file()) if by_process and group is not None else None
    if sampler is not None:
        sampler.thread.start()
    before = os.times()
    started = time.monotonic()
    proc = subprocess.run(argv, cwd=ROOT, env=env, capture_output=True, text=True,
                          preexec_fn=group.enter if group else None)
    wall = time.monotonic() - started
    if sampler is not None:
        sampler.stop.set()
        sampler.thread.join()
    after = os.times()
    if group is not None:
        cpu, peak = group.cpu_s(), group.peak_mib()
        group.remove()
    else:
        cpu = (after.children_user - before.children_user) + (after.children_system - before.children_system)
        peak = None
    modules: dict[str, dict] = defaultdict(lambda: {"tests": set(), "setup": 0.0, "call": 0.0, "teardown": 0.0})
    for line in proc.stdout.splitlines():
        match = DURATION.match(line)
        if match:
            seconds, phase, nodeid = float(match.group(1)), match.group(2), match.group(3)
            module = modules[nodeid.split("::", 1)[0]]
            module["tests"].add(nodeid)
            module[phase] += seconds
    tail = proc.stdout.strip().splitlines()[-1] if proc.stdout.strip() else ""
    outcomes = {kind: int(n) for n, kind in OUTCOME.findall(tail)}
    return {"label": label, "exit": proc.returncode, "wall_s": round(wall, 1), "cpu_s": round(cpu, 1),
            "cpu_per_wall": round(cpu / wall, 2) if wall else None,
            "peak_mib": round(peak) if peak is not None else None, "load_at_start": round(load, 2),
            "outcomes": outcomes,
            "modules": {name: {"tests": len(m["tests"]), **{k: round(m[k], 1) for k in ("setup", "call", "teardown")}}
                        for name, m in sorted(modules.items())},
            "by_process": sampler.by_kind() if sampler is not None else None,
            "failures": proc.stdout[-4000:] if proc.returncode not in (0, 5) else None,
            "output": proc.stdout + proc.stderr}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeat", type=int, default=1)
    parser.add_argument("--label", default="")
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--by-process", action="store_true", help="also sum the CPU by kind of process")
    parser.add_argument("--write-durations", metavar="PATH",
                        help="write each module's seconds (setup + call + teardown) of the last run as JSON, "
                             "e.g. tests/durations.json, which orders a pytest-xdist run longest module first")
    parser.add_argument("--log", metavar="PATH", help="write pytest's whole output of the last run there")
    parser.add_argument("pytest_args", nargs=argparse.REMAINDER)
    args = parser.parse_args()
    pytest_args = args.pytest_args[1:] if args.pytest_args[:1] == ["--"] else args.pytest_args
    if os.geteuid() != 0:
        print("bench/suite.py needs root (cgroups and the network jail)", file=sys.stderr)
        return 2
    runs = []
    for _ in range(args.repeat):
        result = run_once(pytest_args, args.label, args.by_process)
        runs.append(result)
        if args.json:
            print(json.dumps({k: v for k, v in result.items() if k != "output"}))
            continue
        print(f"{args.label or ' '.join(pytest_args)}: exit {result['exit']}  wall {result['wall_s']} s  "
              f"CPU {result['cpu_s']} s ({result['cpu_per_wall']} cores)  peak {result['peak_mib']} MiB  "
              f"load at start {result['load_at_start']}  {result['outcomes']}")
        for name, m in result["modules"].items():
            print(f"  {name:45} {m['tests']:4} tests  setup {m['setup']:7.1f}  call {m['call']:7.1f}  "
                  f"teardown {m['teardown']:6.1f}")
        for kind, figures in (result["by_process"] or {}).items():
            print(f"  CPU {figures['cpu_s']:7.1f} s  {figures['processes']:5} processes  {kind}")
            for cmdline, cpu in figures.get("costliest", []):
                print(f"      {cpu:7.1f} s  {cmdline}")
        if result["failures"]:
            print(result["failures"])
    if args.log:
        Path(args.log).write_text(runs[-1]["output"])
    if args.write_durations and runs[-1]["modules"]:
        seconds = {Path(name).name: round(m["setup"] + m["call"] + m["teardown"], 1)
                   for name, m in runs[-1]["modules"].items()}
        Path(args.write_durations).write_text(json.dumps(dict(sorted(seconds.items())), indent=1) + "\n")
        print(f"module durations of the last run: {args.write_durations} ({len(seconds)} modules)")
    return max(r["exit"] for r in runs) if any(r["exit"] not in (0, 5) for r in runs) else 0


if __name__ == "__main__":
    sys.exit(main())
