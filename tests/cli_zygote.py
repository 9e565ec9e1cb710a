"""The tests' CLI runs: each a fork of one process per pytest process that has imported the CLI.

A test that runs `sglfleet ...` through `sglfleet()` (conftest.py) used to start a fresh
interpreter that imported orchestrator.cli: ~0.3 s of CPU, ~400 times a run, ~120 s of the
suite's CPU on CI's 2 cores. Here a zygote (`python -m tests.cli_zygote SOCKET`, started by the
first call, gone with its pytest process) imports it once; each call is a fork of it that takes
the call's argv, environment, working directory and pipes and runs `python -m orchestrator.cli`
(runpy, as -m does). The call is a real process: its own pid, exit code, pipes, signals and
interpreter exit (atexit, threads joined); a timeout kills it.

What a fresh start does that a fork would not, and how it is kept:
 * reading the environment at import (cli/output.py sizes its consoles from COLUMNS and the
   terminal, Rich and Python read TERM, NO_COLOR, PYTHON*, LC_*...): a call whose environment
   differs from the zygote's in any name other than SGLFLEET_* and XDG_* (read when a command
   runs) and PYTEST_CURRENT_TEST starts a fresh interpreter instead (tests/test_cli_zygote.py
   checks that an ordinary call is served);
 * the import itself (a command module that fails to import, a warning it prints): the zygote
   that printed anything while importing, or failed, is not used (every call starts fresh); the
   start itself is tested by real starts: test_cli_startup, and the tests that kill a CLI (Popen).

One exchange per call over a Unix seqpacket socket: the request (JSON, with stdin and the two
pipe ends as SCM_RIGHTS), then "pid N" once forked and "exit CODE" when reaped (CODE as
subprocess's returncode: -N for a signal).
"""

from __future__ import annotations

import json
import os
import selectors
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

SAME_AT_IMPORT_EXCEPT = ("SGLFLEET_", "XDG_")  # names the CLI reads only when a command runs
# pytest's name for the test running now: different in every call, read by nothing in the CLI
PER_CALL = ("PYTEST_CURRENT_TEST",)
_lock = threading.Lock()
_zygote: "Zygote | None" = None
_unusable = False


# ---------------------------------------------------------------- the zygote process


def serve(sock_path: str) -> None:
    import importlib
    import pkgutil
    import runpy

    import orchestrator
    from orchestrator.cli import FAMILIES

    # What each fork saves: the CLI, every command family (main() registers only the one it runs:
    # that choice is the same in a fork) and what they call, the stages, specs and transport.
    for family in FAMILIES:
        importlib.import_module(f"orchestrator.cli.{family}")
    for package in ("stages", "spec", "fleet"):
        for module in pkgutil.iter_modules([os.path.join(orchestrator.__path__[0], package)]):
            importlib.import_module(f"orchestrator.{package}.{module.name}")

    sys.stdout.flush()
    sys.stderr.flush()
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    listener.bind(sock_path)
    listener.listen(64)
    wake_r, wake_w = socket.socketpair()
    wake_r.setblocking(False)
    wake_w.setblocking(False)
    signal.signal(signal.SIGCHLD, lambda *_: None)
    signal.set_wakeup_fd(wake_w.fileno())
    selector = selectors.DefaultSelector()
    selector.register(listener, selectors.EVENT_READ, "accept")
    selector.register(wake_r, selectors.EVENT_READ, "reap")
    selector.register(sys.stdin, selectors.EVENT_READ, "parent")  # EOF: its pytest process is gone
    print("ready", flush=True)
    waiting: dict[int, socket.socket] = {}
    while True:
        for key, _ in selector.select():
            if key.data == "parent":
                if not sys.stdin.buffer.read1(1):
                    for pid in waiting:
                        os.kill(pid, signal.SIGKILL)
                    return
            elif key.data == "reap":
                try:
                    wake_r.recv(4096)
                except BlockingIOError:
                    pass
                while waiting:
                    pid, status = os.waitpid(-1, os.WNOHANG)
                    if pid == 0:
                        break
                    conn = waiting.pop(pid, None)
                    if conn is not None:
                        code = os.waitstatus_to_exitcode(status)
                        try:
                            conn.sendall(b"exit %d\n" % code)
                        except OSError:
                            pass
                        conn.close()
            else:
                conn, _ = listener.accept()
                message, fds, _, _ = socket.recv_fds(conn, 1 << 20, 3)
                request = json.loads(message)
                pid = os.fork()
                if pid == 0:  # the call: never returns into this loop
                    selector.close()
                    listener.close()
                    wake_r.close()
                    wake_w.close()
                    for other in waiting.values():
                        other.close()
                    conn.close()
                    run_call(request, fds, runpy)
                for fd in fds:
                    os.close(fd)
                waiting[pid] = conn
                conn.sendall(b"pid %d\n" % pid)


def run_call(request: dict, fds: list[int], runpy) -> None:
    signal.set_wakeup_fd(-1)
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    for target, fd in enumerate(fds):
        os.dup2(fd, target)
        os.close(fd)
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    sys.path[0] = request["cwd"]  # what `python -m` puts first: the directory it started in
    sys.argv = ["-m", *request["argv"]]
    runpy.run_module("orchestrator.cli", run_name="__main__", alter_sys=True)
    raise SystemExit(0)  # up through serve() to the interpreter's own exit


# ---------------------------------------------------------------- the pytest side


class Zygote:
    def __init__(self, env: dict[str, str], cwd: Path):
        import tempfile

        self.env = env
        self.calls = 0  # served by a fork (tests/test_cli_zygote.py reads it)
        self.dir = tempfile.mkdtemp(prefix="sglfleet-cli-zygote-")
        self.sock_path = os.path.join(self.dir, "sock")
        self.proc = subprocess.Popen([sys.executable, "-m", "tests.cli_zygote", self.sock_path], cwd=cwd, env=env,
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        first = self.proc.stdout.readline()
        self.usable = first == b"ready\n"
        self.said = b""  # what it printed to its stderr after "ready" (then it is not used)
        if self.usable:  # anything it printed while importing would be missing from each call's output
            threading.Thread(target=self._watch_stderr, daemon=True).start()
        else:
            self.close()

    def _watch_stderr(self):
        said = self.proc.stderr.read(1)
        if said:
            self.said = said
            self.usable = False  # at once: reading more may wait for the zygote's next write
            self.said += self.proc.stderr.read1(2000)

    def why_not(self, env: dict[str, str]) -> str:
        """Why a call in `env` would start fresh: '' where this zygote serves it."""
        if not self.usable:
            return f"the zygote printed {self.said!r} to its stderr"
        if self.proc.poll() is not None:
            return f"the zygote exited with code {self.proc.returncode}"
        differ = sorted(n for n in set(env) | set(self.env) if env.get(n) != self.env.get(n)
                        and not n.startswith(SAME_AT_IMPORT_EXCEPT) and n not in PER_CALL)
        return f"names read at import differ from the zygote's: {', '.join(differ)}" if differ else ""

    def serves(self, env: dict[str, str]) -> bool:
        return not self.why_not(env)

    def run(self, argv: list[str], env: dict[str, str], cwd: Path, timeout: float) -> subprocess.CompletedProcess:
        out_r, out_w = os.pipe()
        err_r, err_w = os.pipe()
        devnull = os.open(os.devnull, os.O_RDONLY)
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            sock.connect(self.sock_path)
            request = json.dumps({"argv": argv, "env": env, "cwd": str(cwd)}).encode()
            socket.send_fds(sock, [request], [devnull, out_w, err_w])
        finally:
            for fd in (devnull, out_w, err_w):
                os.close(fd)
        pid = int(sock.recv(64).split()[1])
        self.calls += 1
        chunks: dict[int, list[bytes]] = {out_r: [], err_r: []}
        deadline = time.monotonic() + timeout
        with selectors.DefaultSelector() as selector:
            for fd in chunks:
                selector.register(fd, selectors.EVENT_READ)
            while selector.get_map():
                left = deadline - time.monotonic()
                if left <= 0:
                    os.kill(pid, signal.SIGKILL)
                    for fd in chunks:
                        os.close(fd)
                    sock.close()
                    raise subprocess.TimeoutExpired(["sglfleet", *argv], timeout, output=b"".join(chunks[out_r]),
                                                    stderr=b"".join(chunks[err_r]))
                for key, _ in selector.select(min(left, 1.0)):
                    data = os.read(key.fd, 65536)
                    if data:
                        chunks[key.fd].append(data)
                    else:
                        selector.unregister(key.fd)
                        os.close(key.fd)
        code = int(sock.recv(64).split()[1])
        sock.close()
        out, err = (b"".join(chunks[fd]).decode("utf-8", "replace") for fd in (out_r, err_r))
        return subprocess.CompletedProcess([sys.executable, "-m", "orchestrator.cli", *argv], code, out, err)

    def close(self):
        import shutil

        if self.proc.poll() is None:
            self.proc.stdin.close()  # its EOF: it kills what it still waits for and exits
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        shutil.rmtree(self.dir, ignore_errors=True)


def zygote_for(env: dict[str, str], cwd: Path) -> Zygote | None:
    """This pytest process's zygote for its environment `env` (started by the first call in it,
    in `cwd`), or None where there is none to use (SGLFLEET_TEST_FRESH_CLI=1: every call starts
    fresh; a zygote that printed while importing)."""
    global _zygote, _unusable
    if os.environ.get("SGLFLEET_TEST_FRESH_CLI") == "1":
        return None
    with _lock:
        if _zygote is not None and _zygote.usable and _zygote.why_not(env):
            # This process's own environment is not the one the zygote started in: a library the
            # tests run here set a name (distutils sets PLAT, torch's inductor TORCHINDUCTOR_CACHE_DIR,
            # in the kernel tests), and from then on no call was served. One started in the
            # environment of now serves the calls after.
            _zygote.close()
            _zygote = None
        if _zygote is None and not _unusable:
            import atexit

            _zygote = Zygote(env, cwd)
            _unusable = not _zygote.usable
            atexit.register(_zygote.close)
    return _zygote if _zygote is not None and _zygote.usable else None


if __name__ == "__main__":
    serve(sys.argv[1])
