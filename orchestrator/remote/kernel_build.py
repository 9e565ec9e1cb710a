"""Build the DDTree extension ON the host, with the host's own torch, Python and compiler.

Command `build` (one exec round trip, fleet/remote_call.py), args {"files": [[path, size], ...],
"cpu_only": bool, "arch": "9.0"}; the payload is those files' bytes back to back (the
`ddtree` package's build script and sources). They are written under
<state>/cache/kernel-build/<sources hash>/src/ and built there with
`python -m ddtree.build --out DIR` (the same script `make kernels` runs); src/ holds only ddtree/,
so nothing in the build's sys.path[0] can shadow an installed distribution. The answer:
the metadata (with its ABI fingerprint), the module's bytes (base64) and the build's output.
Stdlib + hostlib only, Python 3.8+.
"""

import base64
import hashlib
import json
import os
import shutil
import subprocess
import sys
import time

try:  # on the host: sent ahead of this file by the call convention (fleet/remote_call.py)
    import sglfleet_hostlib as hostlib
except ImportError:  # on the controller: unit tests import this file
    from orchestrator.remote import hostlib

Failure = hostlib.Failure


def cmd_build(args, stream):
    digest = hashlib.sha256()
    files = []
    for path, size in args["files"]:
        if path.startswith("/") or ".." in path.split("/"):
            raise Failure("refusing source path %r" % path)
        data = stream.read(size)
        if len(data) != size:
            raise Failure("transfer incomplete: %s" % path, phase="transfer")
        digest.update(path.encode() + b"\0" + data)
        files.append((path, data))
    root = os.path.join(args.get("state_dir") or hostlib.STATE_DIR, hostlib.CACHE_DIR, "kernel-build",
                        digest.hexdigest()[:16])
    if os.path.isdir(root):
        shutil.rmtree(root)
    for path, data in files:
        hostlib.write_bytes_atomic(os.path.join(root, "src", path), data)
    out = os.path.join(root, "out")
    toolkit = cuda_toolkit()
    cpu_only = args.get("cpu_only") or toolkit is None
    argv = [sys.executable, "-m", "ddtree.build", "--out", out] + (["--cpu-only"] if cpu_only
                                                                            else ["--arch", args.get("arch", "9.0")])
    started = time.monotonic()
    env = dict(os.environ, MAX_JOBS=str(args.get("jobs") or 2))
    result = subprocess.run(argv, cwd=os.path.join(root, "src"), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            env=env)
    output = result.stdout.decode("utf-8", "replace")
    if result.returncode != 0:
        fix = ""
        if "C++20 or later compatible compiler is required" in output:
            fix = ("\nfix: this host's torch headers need C++20 and kernels/ddtree/build.py compiles with "
                   "-std=c++17: build with -std=c++20 for this torch")
        raise Failure("building the extension with %s failed (exit %d):\n%s%s" % (sys.executable, result.returncode,
                                                                                output, fix), phase="build",
                      output=output)
    with open(os.path.join(out, "metadata.json")) as fh:
        metadata = json.load(fh)
    with open(os.path.join(out, metadata["module"]), "rb") as fh:
        module = fh.read()
    return {"metadata": metadata, "module_b64": base64.b64encode(module).decode("ascii"), "output": output[-4000:],
            "seconds": round(time.monotonic() - started, 1), "python": sys.executable, "dir": root,
            "cuda_toolkit": toolkit, "cpu_only": cpu_only}


def cuda_toolkit():
    """Where a usable CUDA toolkit is (nvcc AND the runtime headers), or None: a host with a
    CUDA torch but no toolkit (the lab's, a runtime-only image) gets a CPU build, not a failed one."""
    home = os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH")
    if not home:
        nvcc = shutil.which("nvcc")
        home = os.path.dirname(os.path.dirname(os.path.realpath(nvcc))) if nvcc else "/usr/local/cuda"
    ok = os.path.isfile(os.path.join(home, "bin", "nvcc")) and \
        os.path.isfile(os.path.join(home, "include", "cuda_runtime_api.h"))
    return home if ok else None


COMMANDS = {"build": cmd_build}

if __name__ == "__main__":
    sys.exit(hostlib.main(COMMANDS))
