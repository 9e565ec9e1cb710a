"""Remote side of fact gathering: one process, one JSON document on stdout.

Runs under the host's configured interpreter (or python3 when that is missing, with
--interpreter-missing). argv[1] is a JSON spec {fact name: request}; a request is
{"kind": "cmd", "argv": [...]} (run a command) or {"kind": "py", "fn": NAME, "args": [...]}
(an in-process probe below). Stdlib only; must run on Python 3.8+.
"""

import json
import os
import platform
import shutil
import subprocess
import sys
import time


def run_command(argv, timeout=20):
    started = time.monotonic()
    if shutil.which(argv[0]) is None:
        return {"rc": 127, "stdout": "", "stderr": "%s: command not found" % argv[0], "seconds": 0.0}
    try:
        proc = subprocess.run(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"rc": None, "stdout": "", "stderr": "timed out after %ss" % timeout,
                "seconds": time.monotonic() - started}
    return {"rc": proc.returncode, "stdout": proc.stdout.decode("utf-8", "replace"),
            "stderr": proc.stderr.decode("utf-8", "replace"), "seconds": time.monotonic() - started}


def interpreter(missing=False):
    return {"executable": sys.executable, "version": platform.python_version(),
            "implementation": platform.python_implementation(), "missing": missing}


def distributions(names):
    try:
        from importlib import metadata
    except ImportError:  # Python < 3.8
        return {name: None for name in names}
    found = {}
    for name in names:
        try:
            found[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            found[name] = None
    return found


def disk_free(path):
    probe = path
    while not os.path.exists(probe) and probe not in ("/", ""):
        probe = os.path.dirname(probe)
    usage = shutil.disk_usage(probe or "/")
    return {"path": path, "exists": os.path.isdir(path), "measured_at": probe or "/",
            "free_bytes": usage.free, "total_bytes": usage.total}


PROBES = {"interpreter": interpreter, "distributions": distributions, "disk_free": disk_free}


def main():
    missing = "--interpreter-missing" in sys.argv
    spec = json.loads(sys.argv[1])
    out = {}
    for name, request in spec.items():
        try:
            if request["kind"] == "cmd":
                out[name] = run_command(request["argv"], request.get("timeout", 20))
            elif request["fn"] == "interpreter":
                out[name] = interpreter(missing)
            else:
                out[name] = PROBES[request["fn"]](*request.get("args", []))
        except Exception as exc:  # one broken probe must not hide the other facts
            out[name] = {"probe_error": "%s: %s" % (type(exc).__name__, exc)}
    json.dump(out, sys.stdout)


main()
