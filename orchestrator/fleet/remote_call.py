"""The one way sglfleet runs its own code on a host: `call(conn, script, command, args, payload)`.

ONE exec round trip on the host's connection (or a local process for a `LocalConnection`):

    python -c BOOT SCRIPT COMMAND            (BOOT: the one-line bootstrap below)
    stdin:  "<hostlib size> @<script sha> <args size> [<companion> @<sha>]...\\n"
            remote/hostlib.py, the args as JSON, then the payload (e.g. a tar stream)
    stdout: ONE JSON envelope, written by hostlib.serve:
            {"ok": true, "value": ...} | {"ok": false, "error": {type, message, traceback, detail}}

The script and its companions (other remote/ files whose functions the command calls in the same
process, through hostlib.companion) are named by the sha256 of their source: the host runs the
code it keeps for that hash (hostlib's code cache, per user, checked against its own hash). A host
that lacks one answers so before anything runs, and the call is sent again at once with the
bodies ("N@sha" and the N bytes, after hostlib and after the args), which it keeps. A host that
lacked code once is sent the bodies for the rest of this process: a host new to this version of
sglfleet (or whose cache cannot be used) costs one more round trip per command, not per script.
A call with a payload always sends the bodies (kept too), so no payload is ever streamed twice.

The value is returned; a failure is raised as one `RemoteError` carrying the host's message, its
full traceback and detail; no envelope at all (interpreter missing, killed, timed out) is a
`RemoteError` with the whole stdout and stderr. Nothing but that code cache is written to the
host's disk to run it.
"""

from __future__ import annotations

import hashlib
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


@lru_cache(maxsize=None)
def script_digest(name: str) -> str:
    """The sha256 of a remote script's source: the name of its code in the hosts' code cache."""
    return hashlib.sha256(script_bytes(name)).hexdigest()


# (host, user) pairs that lacked code once in this process: sent the bodies on every later call, so
# a host new to this sglfleet costs one more round trip per command, not one per script it runs.
_SEND_BODIES: set[tuple[str, str]] = set()


# The helper is not exec'd: its shell outlives it to say which signal ended it (SSH reports a
# death by signal without the number; the shell's status is 128 + N), then exits with its status.
SIGNAL_REPORT = ('; s=$?; if [ "$s" -gt 128 ]; then echo "sglfleet: the helper was killed by signal '
                 '$((s - 128))" >&2; fi; exit "$s"')
SIGNALED = 128  # a status above this is 128 + the signal that killed the helper


def command_line(interpreter: str, script: str, command: str, fallback_python: bool = False) -> str:
    argv = " ".join(shlex.quote(a) for a in ("-c", BOOT, script, command))
    if not fallback_python:
        return f"{shlex.quote(interpreter)} {argv}{SIGNAL_REPORT}"
    # The configured interpreter may be missing: run with python3 and tell the script so. (No
    # $(...): a subshell is a fork on every host for every call.)
    quoted = shlex.quote(interpreter)
    return (f"if command -v {quoted} >/dev/null; then {quoted} {argv}; "
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
    where = (conn.host.name, conn.host.user)
    # A call with a payload sends its code along (and the host keeps it): sent again after a miss,
    # a payload writer would run twice, and what it counts (a push's bytes) would count twice.
    send_bodies = where in _SEND_BODIES or payload is not None
    envelope, result = _round_trip(conn, script, command, args, payload, timeout, python, fallback_python,
                                   companions, send_bodies)
    if not send_bodies and _code_missing(envelope):
        # nothing ran: the host named the code it lacks before reading any of it; send it all
        _SEND_BODIES.add(where)
        envelope, result = _round_trip(conn, script, command, args, payload, timeout, python, fallback_python,
                                       companions, True)
    return _value(conn, script, command, envelope, result, timeout)


def _round_trip(conn: Any, script: str, command: str, args: dict[str, Any] | None, payload: Payload,
                timeout: float | None, python: str | None, fallback_python: bool, companions: tuple[str, ...],
                send_bodies: bool) -> tuple[Any, Any]:
    hostlib = script_bytes(HOSTLIB)
    args_json = json.dumps(args or {}).encode()
    bodies = [script_bytes(name) if send_bodies else b"" for name in (script, *companions)]
    tokens = [f"{len(body) if send_bodies else ''}@{script_digest(name)}"
              for name, body in zip((script, *companions), bodies)]
    extra = " ".join(f"{name} {token}" for name, token in zip(companions, tokens[1:]))
    header = f"{len(hostlib)} {tokens[0]} {len(args_json)} {extra}".rstrip().encode() + b"\n"

    def stdin(writer: IO[bytes]) -> None:
        writer.write(header + hostlib + bodies[0] + args_json + b"".join(bodies[1:]))
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
    return envelope, result


def _code_missing(envelope: Any) -> bool:
    """Whether the host answered that it lacked the call's code (hostlib.EXIT_CODE_MISSING)."""
    if isinstance(envelope, dict) and envelope.get("ok") is False:
        detail = (envelope.get("error") or {}).get("detail")
        return isinstance(detail, dict) and "code_missing" in detail
    return False


def _value(conn: Any, script: str, command: str, envelope: Any, result: Any, timeout: float | None) -> Any:
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
