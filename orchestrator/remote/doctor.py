"""Remote side of `sglfleet doctor`: what a server start on this host depends on, measured in
one process. It judges nothing: the policy (thresholds, fixes) is stages/doctor.py's.

Command `check`, args (stages.doctor.request builds them):
    {"package": "sglang", "distributions": [names], "model": path, "draft": path or null,
     "disk": {label: path}, "port": {"profile", "port", "bind"} or absent}
Value: the host's clock (read first, with `date`: the host's own tool, which lab hosts can skew
through a stand-in), the interpreter, the distributions' versions, torch's build (version, CUDA),
the package's location and version, the GPUs (hostlib.gpus) with their memory in use, the
driver's version and CUDA version (nvidia-smi's banner), the model's and the draft's config facts
(server_facts.model_facts) with their size and weight files, free disk per path
(gather_facts.disk_free), and with `port` who listens there and whether it is our own server
(server.py's port_holders / running_state).

Companions (hostlib.companion, same process): server_facts.py, gather_facts.py, and server.py when
`port` is given. `collect` needs no server.py: deploy's plan round trip (remote/server.py plan)
can call it with the port left out, since that plan already reports the port's holders.
Stdlib + hostlib only; Python 3.8+.
"""

import os
import re
import sys

try:  # on the host: sent ahead of this file by the call convention (fleet/remote_call.py)
    import sglfleet_hostlib as hostlib
except ImportError:  # on the controller: unit tests import this file
    from orchestrator.remote import hostlib

MEMORY_QUERY = ["--query-gpu=index,memory.total,memory.used,memory.free", "--format=csv,noheader,nounits"]
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf")
MAX_ENTRIES = 20000  # a model directory is tens of files; stop counting a runaway tree here


def host_clock():
    """The host's wall clock in epoch seconds (None when `date` cannot say)."""
    result = hostlib.run_command(["date", "+%s.%N"], timeout=10)
    try:
        return float(result["stdout"].strip())
    except ValueError:
        return None


def gpu_memory():
    """index -> {total, used, free} MiB ({} without nvidia-smi or when the query fails)."""
    result = hostlib.run_command(["nvidia-smi"] + MEMORY_QUERY)
    found = {}
    for line in result["stdout"].splitlines() if result["rc"] == 0 else []:
        cells = [c.strip() for c in line.split(",")]
        if len(cells) == 4 and all(c.isdigit() for c in cells):
            found[int(cells[0])] = {"memory_total_mib": int(cells[1]), "memory_used_mib": int(cells[2]),
                                    "memory_free_mib": int(cells[3])}
    return found


def driver():
    """The driver's version and the CUDA version it supports, from nvidia-smi's banner."""
    result = hostlib.run_command(["nvidia-smi"])
    if result["rc"] != 0:
        return {"error": (result["stderr"] or "nvidia-smi failed").strip()[-2000:], "rc": result["rc"]}
    out = {"version": None, "cuda": None}
    for key, label in (("version", "Driver Version"), ("cuda", "CUDA Version")):
        match = re.search(label + r":\s*([0-9][0-9.]*)", result["stdout"])
        if match:
            out[key] = match.group(1)
    return out


def tree_size(path):
    """Bytes of the files under `path` (links followed, as a loader reads them) and the weight
    files among them."""
    total, weights, entries = 0, 0, 0
    for directory, dirs, files in os.walk(path, followlinks=False):
        dirs[:] = [d for d in dirs if not d.startswith(".")]
        for name in files:
            entries += 1
            try:
                size = os.stat(os.path.join(directory, name)).st_size
            except OSError:
                continue
            total += size
            weights += name.endswith(WEIGHT_SUFFIXES)
        if entries >= MAX_ENTRIES:
            return {"bytes": total, "weight_files": weights, "truncated": True}
    return {"bytes": total, "weight_files": weights, "truncated": False}


def model(path):
    facts = hostlib.companion("server_facts.py").model_facts(path)
    if facts and facts.get("exists"):
        facts.update(tree_size(path))
    return facts


def collect(args):
    """Everything but the port (see the module docstring)."""
    clock = host_clock()
    package = hostlib.locate_package(args.get("package") or "sglang")
    names = list(dict.fromkeys(["torch"] + list(args.get("distributions") or [])))
    torch = hostlib.locate_package("torch")
    gpus, memory = hostlib.gpus(), gpu_memory()
    for gpu in gpus:
        gpu.update(memory.get(gpu.get("index"), {}))
    disk = hostlib.companion("gather_facts.py").disk_free
    return {"clock": clock,
            "python": {"executable": sys.executable, "version": "%d.%d.%d" % sys.version_info[:3],
                       "tag": "cp%d%d" % sys.version_info[:2], "missing": hostlib.INTERPRETER_MISSING},
            "package": package, "distributions": hostlib.distributions(*names),
            "torch": hostlib.torch_build(torch["site"]) if torch else {"version": None, "cuda": None},
            "gpus": gpus, "driver": driver() if gpus else None,
            "model": model(args.get("model")), "draft": model(args.get("draft")),
            "disk": {label: disk(path) for label, path in sorted((args.get("disk") or {}).items())}}


def port(args):
    server = hostlib.companion("server.py")
    holders = server.port_holders(args.get("bind"), int(args["port"]))
    running = server.running_state(server.paths_for(args))
    return {"holders": holders, "foreign": server.foreign_holders(holders, running),
            "ours": running.get("pid") if running.get("alive") else None}


def cmd_check(args, stream=None):
    out = collect(args)
    if args.get("port"):
        out["port"] = port(args["port"])
    return out


COMMANDS = {"check": cmd_check}

if __name__ == "__main__":
    sys.exit(hostlib.main(COMMANDS))
