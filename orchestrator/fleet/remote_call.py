"""The one way sglfleet runs its own code on a host: `call(conn, script, command, args, payload)`.

ONE exec round trip on the host's connection (or a local process for a `LocalConnection`):

    python -c BOOT SCRIPT COMMAND            (BOOT: the one-line bootstrap below)
    stdin:  "<hostlib size> <script size> <args size> [<companion> <size>]...\\n"
            remote/hostlib.py, remote/SCRIPT, the args as JSON, the companion scripts (other
            remote/ files whose functions the command calls in the same process, through
            hostlib.companion), then the payload (e.g. a tar stream)
    stdout: ONE JSON envelope, written by hostlib.serve:
            {"ok": true, "value": ...} | {"ok": false, "error": {type, message, traceback, detail}}

The value is returned; a failure is raised as one `RemoteError` carrying the host's message, its
full traceback and detail; no envelope at all (interpreter missing, killed, timed out) is a
`RemoteError` with the whole stdout and stderr. Nothing is written to the host's disk to run it.
"""

from __future__ import annotations

import json
import shlex
import signal
from functools import lru_cache
from typing import IO, Any, Callable

from ..errors import RemoteError
from ..remote import REMOTE_DIR

HOSTLIB = "hostlib.py"
# Drops the working directory from sys.path (`-c` puts it first: on a host that is the login
# directory, locally wherever sglfleet was started, e.g. a checkout whose top-level folders could
# shadow installed distributions that SGLang imports), reads the header, installs hostlib as a
# module, hands the rest of stdin to hostlib.serve.
BOOT = ("import sys,types;sys.path[:]=[p for p in sys.path if p];r=sys.stdin.buffer;n=r.readline().split();"
        "m=types.ModuleType('sglfleet_hostlib');m.__file__='hostlib.py';sys.modules[m.__name__]=m;"
        "exec(compile(r.read(int(n[0])),'hostlib.py','exec'),m.__dict__);"
        "m.INTERPRETER_MISSING='--interpreter-missing' in sys.argv;"
        "sys.exit(m.serve(r,n[1:],sys.argv[1],sys.argv[2]))")

Payload = bytes | Callable[[IO[bytes]], None] | None


@lru_cache(maxsize=None)
def script_bytes(name: str) -> bytes:
    """A remote script's bytes, read once per controller process."""
    return (REMOTE_DIR / name).read_bytes()


# The helper is not exec'd: its shell outlives it to say which signal ended it (SSH reports a
# death by signal without the number; the shell's status is 128 + N), then exits with its status.
SIGNAL_REPORT = ('; s=$?; if [ "$s" -gt 128 ]; then echo "sglfleet: the helper was killed by signal '
                 '$((s - 128))" >&2; fi; exit "$s"')
SIGNALED = 128  # a status above this is 128 + the signal that killed the helper


def command_line(interpreter: str, script: str, command: str, fallback_python: bool = False) -> str:
    argv = " ".join(shlex.quote(a) for a in ("-c", BOOT, script, command))
    if not fallback_python:
        return f"{shlex.quote(interpreter)} {argv}{SIGNAL_REPORT}"
    # The configured interpreter may be missing: run with python3 and tell the script so.
    return (f"if p=$(command -v {shlex.quote(interpreter)}); then \"$p\" {argv}; "
            f"else python3 {argv} --interpreter-missing; fi{SIGNAL_REPORT}")


def no_answer_why(result: Any, timeout: float | None) -> str:
    """Why a helper gave no answer, in words: timed out, killed by signal N, or its exit code."""
    if result.timed_out:
        return f"timed out after {timeout}s"
    code = result.exit_code
    if code is not None and (code > SIGNALED or code < 0):
        number = code - SIGNALED if code > 0 else -code
        try:
            name = f" ({signal.Signals(number).name})"
        except ValueError:
            name = ""
        return f"killed by signal {number}{name}"
    return f"exit code {code}"


def call(conn: Any, script: str, command: str, args: dict[str, Any] | None = None, payload: Payload = None,
         timeout: float | None = 600, python: str | None = None, fallback_python: bool = False,
         companions: tuple[str, ...] = ()) -> Any:
    """Run `COMMANDS[command](args, stdin)` of remote/`script` on conn's host; its value.
    `companions`: other remote/ scripts the command uses in the same process (hostlib.companion)."""
    hostlib, code = script_bytes(HOSTLIB), script_bytes(script)
    args_json = json.dumps(args or {}).encode()
    extra = [script_bytes(name) for name in companions]
    sizes = " ".join(f"{name} {len(data)}" for name, data in zip(companions, extra))
    header = f"{len(hostlib)} {len(code)} {len(args_json)} {sizes}".rstrip().encode() + b"\n"

    def stdin(writer: IO[bytes]) -> None:
        writer.write(header + hostlib + code + args_json + b"".join(extra))
        if isinstance(payload, (bytes, bytearray)):
            writer.write(payload)
        elif callable(payload):
            payload(writer)

    interpreter = python or conn.host.python
    result = conn.run(command_line(interpreter, script, command, fallback_python), stdin=stdin, timeout=timeout)
    try:
        envelope = json.loads(result.stdout) if result.stdout.strip() else None
    except ValueError:
        envelope = None
    name = conn.host.name
    if not isinstance(envelope, dict) or "ok" not in envelope:
        why = no_answer_why(result, timeout)
        raise RemoteError(f"{name}: {script} {command} gave no answer ({why}):\n"
                          f"{result.stdout_text}{result.stderr_text}".rstrip(), "NoAnswer",
                          exit_status=result.exit_code)
    if envelope["ok"]:
        return envelope.get("value")
    error = envelope.get("error") or {}
    message = error.get("message") or "failed"
    if error.get("type") not in (None, "Failure"):  # an exception, not a refusal: show it whole
        message = f"{script} {command} raised {error['type']}: {message}\n{error.get('traceback') or ''}".rstrip()
    raise RemoteError(f"{name}: {message}", error.get("type") or "Failure", error.get("traceback"),
                      error.get("detail") or {}, result.exit_code)
