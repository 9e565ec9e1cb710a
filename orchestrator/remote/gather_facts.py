"""Remote side of fact gathering: every requested fact of a host in one process.

Command `gather`, args {"requests": [{"name", "kind", "args"}]}: kind "cmd" runs argv `args`;
kind "py" calls the probe `args[0]` below with the rest as arguments. The value maps each name
to its raw answer, which the controller's Fact classes (fleet/facts.py) interpret.

Runs under the host's configured interpreter, or python3 when that is missing
(hostlib.INTERPRETER_MISSING). It runs on every host for every command, so it stays cheap: no
subprocess module (hostlib.run_command spawns directly), no process for what Python can read
itself. Stdlib + hostlib only; Python 3.8+.
"""

import os
import sys

try:  # on the host: sent ahead of this file by the call convention (fleet/remote_call.py)
    import sglfleet_hostlib as hostlib
except ImportError:  # on the controller: unit tests import this file
    from orchestrator.remote import hostlib


def hostname():
    return os.uname().nodename


def read_file(path):
    try:
        with open(path, encoding="utf-8", errors="surrogateescape") as fh:
            return {"exists": True, "text": fh.read()}
    except OSError as exc:
        return {"exists": False, "error": exc.strerror}


def interpreter():
    return {"executable": sys.executable, "version": "%d.%d.%d" % sys.version_info[:3],
            "implementation": sys.implementation.name, "missing": hostlib.INTERPRETER_MISSING}


def disk_free(path):
    probe = path
    while not os.path.exists(probe) and probe not in ("/", ""):
        probe = os.path.dirname(probe)
    stat = os.statvfs(probe or "/")
    return {"path": path, "exists": os.path.isdir(path), "measured_at": probe or "/",
            "free_bytes": stat.f_bavail * stat.f_frsize, "total_bytes": stat.f_blocks * stat.f_frsize}


PROBES = {"hostname": hostname, "read_file": read_file, "interpreter": interpreter,
          "distributions": hostlib.distributions, "disk_free": disk_free, "gpus": hostlib.gpus}


def gather(args, stream=None):
    out = {}
    for request in args["requests"]:
        name, kind, rest = request["name"], request["kind"], request["args"]
        try:
            out[name] = hostlib.run_command(rest) if kind == "cmd" else PROBES[rest[0]](*rest[1:])
        except Exception as exc:  # one broken probe must not hide the other facts
            out[name] = {"probe_error": "%s: %s" % (type(exc).__name__, exc)}
    return out


COMMANDS = {"gather": gather}

if __name__ == "__main__":
    sys.exit(hostlib.main(COMMANDS))
