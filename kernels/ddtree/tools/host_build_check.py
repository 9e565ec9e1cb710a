"""`build-kernels`' host-side build, run on this machine the way a host runs it (device_run.sh
calls it on the H200, so what issue 32 checked by hand stays checked):

1. the host facts through the call convention (`remote/release.py inspect`, as
   `stages.kernels.fingerprint_of` asks for them; package torch, since this machine has no
   SGLang): python tag, torch and its CUDA (`hostlib.torch_build`), the GPUs (`hostlib.gpus()`),
   and `stages.kernels.host_fingerprint` of them;
2. `stages.kernels.build_on_host` with this machine as the host: exactly the files
   `stages.kernels.sources()` sends (ddtree/...), built by `remote/kernel_build.py build` with
   this machine's python, torch and nvcc, the module fetched back and checked against the sha256
   its build recorded, stored in a build cache of its own;
3. that build's fingerprint against the host facts' (equal, and `Extension.mismatches` empty:
   what plan, push and deploy ask before they ship it), its module's sha256 as recorded;
4. the deploy's import check: the module installed as a deploy installs it (`purelib/<module>`,
   the torch site), then `remote/release.check_python` (`cd / && python -c 'import torch,
   ddtree_ext'`), then a draft on CUDA with that installed module from `/`; the module is removed
   again.

    HOST_CHECK_SITE=/tmp/site python3 kernels/ddtree/tools/host_build_check.py [--json OUT.json]

HOST_CHECK_SITE: a folder holding what the controller code needs that the device image lacks
(pydantic and its dependencies, carried as wheels: README "Host build check"). Exit 0 when every
check holds, 1 otherwise; each check is printed as one line.
"""

from __future__ import annotations

import getpass
import io
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

ROOT = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(ROOT))
if os.environ.get("HOST_CHECK_SITE"):  # in this process only: the host build must see the host's own packages
    sys.path.insert(1, os.environ["HOST_CHECK_SITE"])

from orchestrator.fleet import remote_call  # noqa: E402
from orchestrator.remote import release  # noqa: E402
from orchestrator.spec.artifacts import load_extension  # noqa: E402
from orchestrator.stages import kernels  # noqa: E402

# A draft on CUDA with the installed module, from / (nothing of this checkout on the path).
DRAFT = """import torch, ddtree_ext
x = (torch.randn(1, 15, 151936, device="cuda", generator=torch.Generator("cuda").manual_seed(1)) * 3).bfloat16()
out = ddtree_ext.draft_tree(x, 64, 64)
torch.cuda.synchronize()
n, parents = int(out[3][0]), out[7][0]
assert n == 64 and int(parents[0]) == -1 and all(0 <= int(parents[i]) < i for i in range(1, n + 1)), (n, parents)
print(ddtree_ext.__file__, "nodes", n)
"""


class ThisMachine:
    """What `remote_call.call` needs of a connection, on this machine: the call convention's
    command line run by /bin/sh with its stdin, as a host's shell runs it over SSH."""

    def __init__(self) -> None:
        self.host = SimpleNamespace(name="this-machine", user=getpass.getuser(), python=sys.executable)

    def run(self, command: str, stdin=None, timeout: float | None = None):
        buffer = io.BytesIO()
        if stdin is not None:
            stdin(buffer)
        try:
            proc = subprocess.run(["/bin/sh", "-c", command], input=buffer.getvalue(), capture_output=True,
                                  timeout=timeout)
            code, out, err, timed_out = proc.returncode, proc.stdout, proc.stderr, False
        except subprocess.TimeoutExpired as exc:
            code, out, err, timed_out = None, exc.stdout or b"", exc.stderr or b"", True
        return SimpleNamespace(exit_code=code, stdout=out, timed_out=timed_out,
                               stdout_text=out.decode("utf-8", "replace"), stderr_text=err.decode("utf-8", "replace"))


def main() -> int:
    report_path = sys.argv[sys.argv.index("--json") + 1] if "--json" in sys.argv else None
    for name in ("PYTHONPATH", "DDTREE_EXT_DIR", "HOST_CHECK_SITE"):  # a host's shell has none of this checkout's
        os.environ.pop(name, None)  # (device_run.sh puts kernels/ on PYTHONPATH: the build would import it)
    work = Path(tempfile.mkdtemp(prefix="host-build-check-"))
    os.environ["SGLFLEET_KERNEL_CACHE"] = str(work / "cache")
    conn, checks, report = ThisMachine(), [], {}

    def check(name: str, ok: bool, detail: str) -> None:
        checks.append(ok)
        print(f"{'ok  ' if ok else 'FAIL'} {name}: {detail}", flush=True)

    inspected = remote_call.call(conn, "release.py", "inspect", {"package": "torch", "targets": [],
                                                                 "recover": False, "state_dir": str(work / "state")})
    host_fp = kernels.host_fingerprint(inspected)
    report["host_fingerprint"], report["gpus"] = host_fp, inspected["gpus"]
    print(f"host facts: {json.dumps(host_fp)} (torch {inspected['torch']['version']}, "
          f"GPUs {[g.get('arch') for g in inspected['gpus']]})", flush=True)
    sent = [path for path, _ in kernels.sources()]
    report["sources"] = sent
    check("sources", bool(sent) and all(p.startswith("ddtree/") for p in sent), f"{len(sent)} files, all under ddtree/")
    started = time.monotonic()
    built = kernels.build_on_host(conn, host_fp)  # raises if the fetched module is not the one recorded
    report["build"] = built
    check("host build", not built["cpu_only"] or not host_fp["cuda_version"],
          f"{built['artifact']} in {built['seconds']} s on the host ({time.monotonic() - started:.0f} s the call), "
          f"{built['module_bytes']} bytes, toolkit {built['cuda_toolkit']}")
    ext = load_extension(built["dir"])  # raises if the module does not match the sha256 in metadata.json
    meta = json.loads((Path(built["dir"]) / "metadata.json").read_text())
    report["fingerprint"], report["sha256"] = ext.fingerprint, meta["sha256"]
    wanted = {k: ext.fingerprint.get(k) for k in host_fp}
    check("fingerprint", wanted == host_fp and not ext.mismatches(inspected),
          f"build {json.dumps(wanted)}; mismatches {ext.mismatches(inspected)}")
    recorded = meta["sha256"][ext.module_file]
    check("sha256", release.hostlib.sha256_file(str(Path(built["dir"]) / ext.module_file)) == recorded,
          f"{ext.module_file} {recorded} (as recorded)")
    installed = Path(inspected["package"]["site"]) / ext.module_file  # the deploy's purelib/<module>
    if installed.exists():
        check("install", False, f"{installed} exists already; not replacing it")
    else:
        try:
            shutil.copyfile(Path(built["dir"]) / ext.module_file, installed)
            try:
                release.check_python(None, [], ["torch", ext.module])  # the deploy's check: a fresh python, cwd /
                check("import check", True, f"cd / && {sys.executable} -c 'import torch, {ext.module}' ({installed})")
            except release.Failure as exc:
                check("import check", False, str(exc))
            if host_fp["cuda_version"]:
                proc = subprocess.run([sys.executable, "-c", DRAFT], cwd="/", capture_output=True, text=True)
                check("draft on CUDA", proc.returncode == 0, (proc.stdout + proc.stderr).strip()[-600:])
        finally:
            installed.unlink(missing_ok=True)
    report["ok"] = all(checks)
    if report_path:
        Path(report_path).write_text(json.dumps(report, indent=2, default=str) + "\n")
    shutil.rmtree(work, ignore_errors=True)
    print(f"host build check: {'all ' + str(len(checks)) + ' hold' if all(checks) else 'FAILED'}", flush=True)
    return 0 if all(checks) else 1


if __name__ == "__main__":
    sys.exit(main())
