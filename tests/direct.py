"""Run our remote scripts' code on a lab host WITHOUT sglfleet's call convention.

For tests that compare what sglfleet reports with what the host says directly: plain
`python3 -` over stdin, the script's function called by name, its value printed as JSON. The
host library is pasted in as the module the scripts import (`sglfleet_hostlib`).
"""

from __future__ import annotations

import json
import shlex
from pathlib import Path
from typing import Any

from orchestrator.remote import REMOTE_DIR

RUNNER = """
import json, sys, types
hostlib = types.ModuleType("sglfleet_hostlib")
exec(compile({hostlib!r}, "hostlib.py", "exec"), hostlib.__dict__)
sys.modules["sglfleet_hostlib"] = hostlib
script = types.ModuleType("script")
exec(compile({source!r}, {name!r}, "exec"), script.__dict__)
print(json.dumps(getattr(script, {function!r})(*json.loads(sys.argv[1])), default=str))
"""


def run_function(conn: Any, script: str, function: str, *args: Any, timeout: float = 600):
    """`function(*args)` of remote/`script` on conn's host; the CommandResult (stdout: the JSON value)."""
    code = RUNNER.format(hostlib=(REMOTE_DIR / "hostlib.py").read_text(), source=(REMOTE_DIR / script).read_text(),
                         name=script, function=function)
    return conn.run(f"exec {shlex.quote(conn.host.python)} - {shlex.quote(json.dumps(list(args)))}",
                    stdin=code.encode(), timeout=timeout)


def run_python(conn: Any, script: Path, args: list[str], timeout: float = 600):
    """A standalone .py file of the tests run with the host's python over stdin."""
    argv = " ".join(shlex.quote(a) for a in args)
    return conn.run(f"exec {shlex.quote(conn.host.python)} - {argv}", stdin=Path(script).read_bytes(),
                    timeout=timeout)
