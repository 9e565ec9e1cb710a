"""`LocalConnection`: the Connection interface on this machine, for `smoke --local` and tests.

The Local/Remote split of invoke and Fabric (pyinfra's local connector): everything above the
fleet layer calls `conn.run(command, stdin, timeout)` and `remote_call.call(conn, ...)` and never
asks where the command runs. Same shell, same stdin streaming, same complete output, same
timeout that kills the whole process group, same CommandResult.
"""

from __future__ import annotations

import os
import signal
import subprocess
import threading
import time
from typing import Any

from .inventory import Host
from .transport import CommandResult, StdinType, StreamWriter, feed


class LocalConnection:
    """Runs commands in a local shell; `host` describes this machine (its `python`, its name)."""

    def __init__(self, host: Host):
        self.host = host

    def open(self) -> None:
        """Nothing to open; here so a LocalConnection can stand where a Connection does."""

    def close(self) -> None:
        """Nothing to close."""

    def __enter__(self) -> "LocalConnection":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def run(self, command: str, stdin: StdinType = None, timeout: float | None = None) -> CommandResult:
        started = time.monotonic()
        # A session of its own, so a timeout can kill the command's whole process group.
        proc = subprocess.Popen(["/bin/sh", "-c", command], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, start_new_session=True)
        assert proc.stdin is not None and proc.stdout is not None and proc.stderr is not None
        writer = StreamWriter(proc.stdin.write)
        out: dict[str, bytes] = {}

        def write_stdin() -> None:
            try:
                feed(writer, stdin)
            except (BrokenPipeError, OSError):
                pass  # the command exited early; its exit status and stderr say why
            finally:
                try:
                    proc.stdin.close()
                except OSError:
                    pass

        threads = [threading.Thread(target=write_stdin, daemon=True),
                   threading.Thread(target=lambda: out.__setitem__("stdout", proc.stdout.read()), daemon=True),
                   threading.Thread(target=lambda: out.__setitem__("stderr", proc.stderr.read()), daemon=True)]
        for thread in threads:
            thread.start()
        timed_out = False
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            timed_out = True
            for sig in (signal.SIGTERM, signal.SIGKILL):
                try:
                    os.killpg(proc.pid, sig)
                except ProcessLookupError:
                    break
                time.sleep(0.5 if sig == signal.SIGTERM else 0)
            proc.wait()
        for thread in threads:
            thread.join(timeout=5)
        return CommandResult(self.host.name, command, None if timed_out else proc.returncode,
                             out.get("stdout", b""), out.get("stderr", b""), time.monotonic() - started,
                             timed_out, writer.count)
