"""PID 1 of one simulated lab host (runs inside `unshare --mount --uts --pid`).

It gives the host its own view of the per-host paths, then runs sshd and reaps orphans,
as init does on a real machine. Stdlib only: it runs under any python3.

    hostinit.py CONFIG.json

Signals from the lab manager:
    SIGUSR1  stop sshd (the host stays up, unreachable)   -- fault knob
    SIGUSR2  start sshd again
    SIGTERM  stop everything; the kernel then tears the namespaces down
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time


def mount_overlays(config: dict) -> None:
    for mount in config["overlays"]:
        target = mount["target"]
        for d in (mount["upper"], mount["work"]):
            os.makedirs(d, exist_ok=True)
        lower = ":".join(mount["lower"])
        subprocess.run(["mount", "-t", "overlay", "overlay", "-o",
                        f"lowerdir={lower},upperdir={mount['upper']},workdir={mount['work']}", target],
                       check=True)
    for bind in config.get("binds", []):
        os.makedirs(bind["source"], exist_ok=True)
        os.chmod(bind["source"], bind.get("mode", 0o755))
        subprocess.run(["mount", "--bind", bind["source"], bind["target"]], check=True)


class Init:
    def __init__(self, config: dict):
        self.config = config
        self.sshd: subprocess.Popen | None = None
        self.stopping = False

    def start_sshd(self) -> None:
        if self.sshd is not None and self.sshd.poll() is None:
            return
        log = open(self.config["sshd_log"], "ab")
        self.sshd = subprocess.Popen([self.config["sshd"], "-D", "-e", "-f", self.config["sshd_config"]],
                                     stdout=log, stderr=log, stdin=subprocess.DEVNULL)
        log.close()

    def stop_sshd(self) -> None:
        if self.sshd is not None and self.sshd.poll() is None:
            self.sshd.terminate()
            try:
                self.sshd.wait(5)
            except subprocess.TimeoutExpired:
                self.sshd.kill()
        self.sshd = None

    def on_signal(self, signum: int, _frame) -> None:
        if signum == signal.SIGUSR1:
            self.stop_sshd()
        elif signum == signal.SIGUSR2:
            self.start_sshd()
        else:
            self.stopping = True

    def wait_listening(self, deadline: float) -> bool:
        address = (self.config["address"], self.config["port"])
        while time.monotonic() < deadline:
            try:
                with socket.create_connection(address, timeout=0.5):
                    return True
            except OSError:
                time.sleep(0.05)
        return False

    def serve(self) -> int:
        for sig in (signal.SIGUSR1, signal.SIGUSR2, signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, self.on_signal)
        self.start_sshd()
        ready = self.wait_listening(time.monotonic() + 20)
        # Written aside and renamed: the manager polls for the file and reads it as soon as it
        # exists, and an open("w") shows it empty first (read as "sshd did not start" in CI).
        partial = self.config["ready_file"] + ".partial"
        with open(partial, "w") as fh:
            fh.write("ready\n" if ready else "sshd did not start\n")
        os.replace(partial, self.config["ready_file"])
        while not self.stopping:
            try:
                # Reap every child, including orphans re-parented to us (we are PID 1).
                pid, _status = os.waitpid(-1, os.WNOHANG)
                if pid == 0:
                    time.sleep(0.2)
            except ChildProcessError:
                time.sleep(0.2)
        self.stop_sshd()
        return 0


def main() -> int:
    with open(sys.argv[1]) as fh:
        config = json.load(fh)
    socket.sethostname(config["hostname"])
    mount_overlays(config)
    return Init(config).serve()


if __name__ == "__main__":
    sys.exit(main())
