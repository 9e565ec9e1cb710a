"""The lab's real SGLang router: install it once per machine, start and stop it beside a lab.

The router is the real `sglang-router` from PyPI (the "SGLang Model Gateway", a Rust binary
behind a Python console script), pinned to ROUTER_VERSION and installed into its own venv in the
machine's cache (SGLFLEET_LAB_ROUTER_DIR, default /var/cache/sglfleet/router-<version>), never
into the project's .venv. Installing needs the network, so it is a setup step, run outside the
test jail:

    python -m orchestrator.lab.router install     # idempotent; `make setup` runs it
    python -m orchestrator.lab.router status

`LabRouter` starts the router on the lab's own loopback address (<subnet>.254, port 30000; the
lab's hosts use .1 to .253), with retries off unless asked, in its own session so it outlives
the `lab up` that started it; its pid, argv and log live in the lab's state dir. It starts with
the workers it is given (none by default: the lab's servers are not deployed yet); `restart
--rolling` registers healthy servers it finds missing.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

from ..errors import SglfleetError
from ..fleet.router import RouterClient, RouterError
from ..fleet.safety import check_target

ROUTER_VERSION = "0.3.2"
ROUTER_ADDRESS_OCTET = 254
ROUTER_PORT = 30000
PROMETHEUS_PORT = 29000


class RouterMissing(SglfleetError):
    """sglang-router is not installed in the lab's cache."""


def install_dir() -> Path:
    return Path(os.environ.get("SGLFLEET_LAB_ROUTER_DIR", f"/var/cache/sglfleet/router-{ROUTER_VERSION}"))


def binary() -> Path:
    return install_dir() / "bin" / "sglang-router"


def _stamp() -> Path:
    return install_dir() / ".sglfleet-router"


def installed() -> bool:
    stamp = _stamp()
    return stamp.exists() and stamp.read_text().strip() == ROUTER_VERSION and binary().exists()


def missing_reason() -> str | None:
    if installed():
        return None
    return (f"sglang-router {ROUTER_VERSION} is not installed in {install_dir()}: run "
            f"`python -m orchestrator.lab.router install` (needs PyPI; `make setup` does it)")


def require() -> Path:
    reason = missing_reason()
    if reason:
        raise RouterMissing(reason)
    return binary()


def install(log=print) -> Path:
    """Install sglang-router==ROUTER_VERSION into its own venv; a no-op when it is there.
    Built beside its final place and renamed in, so an interrupted install leaves nothing that
    looks installed."""
    target = install_dir()
    if installed():
        return target
    python = getattr(sys, "_base_executable", None) or sys.executable
    # A venv's scripts carry its path in their shebang: build at the final path, stamp last.
    if target.exists():
        shutil.rmtree(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    log(f"installing sglang-router {ROUTER_VERSION} into {target} (about 90 MB)")
    subprocess.run([python, "-m", "venv", str(target)], check=True)
    result = subprocess.run([str(target / "bin" / "python"), "-m", "pip", "install", "-q", "--disable-pip-version-check",
                             f"sglang-router=={ROUTER_VERSION}"], capture_output=True, text=True)
    if result.returncode != 0 or not binary().exists():
        raise SglfleetError(f"pip install sglang-router=={ROUTER_VERSION} failed (exit {result.returncode}):\n"
                            f"{result.stdout}{result.stderr}".rstrip())
    _stamp().write_text(ROUTER_VERSION + "\n")
    return target


# ---------------------------------------------------------------- a running router


def router_address(subnet: str) -> str:
    return f"{subnet}.{ROUTER_ADDRESS_OCTET}"


class LabRouter:
    """One router process for one lab: `state_dir/router.json` says what runs."""

    def __init__(self, state_dir: Path, subnet: str, port: int = ROUTER_PORT,
                 prometheus_port: int = PROMETHEUS_PORT):
        self.state_dir = Path(state_dir)
        self.address = router_address(subnet)
        self.port = port
        self.prometheus_port = prometheus_port
        self.state_file = self.state_dir / "router.json"
        self.log_path = self.state_dir / "router.log"

    @property
    def url(self) -> str:
        return f"http://{self.address}:{self.port}"

    def _state(self) -> dict | None:
        try:
            return json.loads(self.state_file.read_text())
        except (OSError, ValueError):
            return None

    def running(self) -> bool:
        state = self._state()
        return bool(state) and _same_process(state.get("pid"), state.get("ticks"))

    def start(self, worker_urls: list[str] = (), policy: str = "round_robin", retries: bool = False,
              health_interval_s: float = 1.0, timeout: float = 60.0) -> str:
        """Start it (a no-op when it runs); its URL once it answers GET /workers."""
        if self.running():
            return self.url
        check_target(self.address, "lab router")
        for port in (self.port, self.prometheus_port):
            if _listening(self.address, port):
                raise SglfleetError(f"{self.address}:{port} is already taken by a process this lab did not start "
                                    f"(a router of another lab state dir?); stop it first")
        for url in worker_urls:
            RouterClient(url)  # validates the form; the router itself connects to them
        argv = [str(require()), "launch", "--host", self.address, "--port", str(self.port),
                "--policy", policy, "--prometheus-host", self.address,
                "--prometheus-port", str(self.prometheus_port),
                "--health-check-interval-secs", str(max(1, int(health_interval_s))), "--log-level", "info"]
        if worker_urls:
            argv += ["--worker-urls", *worker_urls]
        if not retries:
            argv.append("--disable-retries")
        self.state_dir.mkdir(parents=True, exist_ok=True)
        log = open(self.log_path, "ab")
        try:
            proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=log, stderr=log,
                                    start_new_session=True, env={**os.environ, "NO_COLOR": "1"})
        finally:
            log.close()
        self.state_file.write_text(json.dumps({"pid": proc.pid, "ticks": _start_ticks(proc.pid), "argv": argv,
                                               "url": self.url, "started": time.time()}))
        client = RouterClient(self.url)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise SglfleetError(f"sglang-router exited with code {proc.returncode} at start; its log "
                                    f"({self.log_path}):\n{_tail(self.log_path)}")
            try:
                client.workers()
                return self.url
            except RouterError:
                time.sleep(0.2)
        self.stop()
        raise SglfleetError(f"sglang-router did not answer on {self.url} within {timeout:.0f}s; its log "
                            f"({self.log_path}):\n{_tail(self.log_path)}")

    def stop(self, grace: float = 10.0) -> bool:
        """SIGTERM, SIGKILL after `grace`; True when one was running."""
        state = self._state()
        self.state_file.unlink(missing_ok=True)
        if not state or not _same_process(state.get("pid"), state.get("ticks")):
            return False
        pid = int(state["pid"])
        for sig, wait in ((signal.SIGTERM, grace), (signal.SIGKILL, 5.0)):
            try:
                os.killpg(pid, sig)
            except ProcessLookupError:
                return True
            deadline = time.monotonic() + wait
            while time.monotonic() < deadline:
                try:
                    os.waitpid(pid, os.WNOHANG)
                except ChildProcessError:
                    pass
                if not _same_process(pid, state.get("ticks")):
                    return True
                time.sleep(0.05)
        return True


def _start_ticks(pid: int) -> int | None:
    """Field 22 of /proc/PID/stat: when it started. (The router renames itself `sglang::router`,
    so its cmdline cannot identify it; a reused pid has another start time.)"""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[-1].split()
    except OSError:
        return None
    return None if fields[0] == "Z" else int(fields[19])


def _same_process(pid: object, ticks: object) -> bool:
    """The pid is still the router we started (alive, not a zombie, not a reused pid)."""
    return isinstance(pid, int) and ticks is not None and _start_ticks(pid) == ticks


def _listening(address: str, port: int) -> bool:
    import socket

    try:
        with socket.create_connection((address, port), timeout=0.5):
            return True
    except OSError:
        return False


def _tail(path: Path, limit: int = 4000) -> str:
    try:
        return path.read_text(errors="replace")[-limit:]
    except OSError:
        return "(no log)"


def main(argv: list[str]) -> int:
    command = argv[0] if argv else "status"
    if command == "install":
        path = install()
        print(f"sglang-router {ROUTER_VERSION}: {binary()} ({'installed' if installed() else 'MISSING'}) in {path}")
        return 0
    if command == "status":
        reason = missing_reason()
        print(reason or f"sglang-router {ROUTER_VERSION}: {binary()}")
        return 1 if reason else 0
    print("usage: python -m orchestrator.lab.router install|status", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))


STAND_IN_PROFILE = """name: {name}
description: {description}
model:
  path: /root/models/Qwen3-8B
hybrid: auto
server:
  host: 0.0.0.0
  port: {port}
  tp: 1
  extra_args: [--enable-metrics]
env:
  SGLFLEET_SIM_LOAD_DELAY: "{load_delay}"
  SGLFLEET_SIM_SLOW_MS: "{slow_ms}"
  SGLFLEET_SIM_DRAIN_LOG_S: "1"
"""


def stand_in_profile(name: str, description: str, port: int, load_delay: float, slow_ms: int,
                     env: dict[str, str] | None = None) -> str:
    """A profile for the lab's stand-in servers behind the router (rolling tests and benchmark):
    a dense model, metrics on, the stand-in's load delay and per-request latency; `env` adds vars."""
    text = STAND_IN_PROFILE.format(name=name, description=description, port=port, load_delay=load_delay,
                                   slow_ms=slow_ms)
    return text + "".join(f'  {key}: "{value}"\n' for key, value in (env or {}).items())
