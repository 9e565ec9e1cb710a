"""Build the DDTree extension and write its artifact: the module plus metadata.json.

    PYTHONPATH=kernels python -m ddtree.build [--out DIR] [--cpu-only] [--arch 9.0]

With CUDA available (nvcc and a CUDA build of torch) the CUDA kernels are compiled for the
given arch list (default sm_90, the H100/H200); otherwise a CPU-only build is made. The
metadata's ABI fingerprint (python tag, torch version, CUDA version, arch list) is what
`sglfleet push` matches against a host's facts before installing the artifact there.

    PYTHONPATH=kernels python -m ddtree.build --check-cuda-syntax

compiles ddtree_cuda.cu alone with nvcc (no torch needed), so a broken .cu fails CI even
on a machine whose torch has no CUDA.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import subprocess
import sys
import sysconfig
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
CSRC = HERE / "csrc"
DEFAULT_OUT = HERE.parent.parent / "build" / "ddtree"
EXT_NAME = "ddtree_ext"


def python_tag() -> str:
    return f"cp{sys.version_info.major}{sys.version_info.minor}"


def check_cuda_syntax(arch: str = "9.0", nvcc: str | None = None) -> None:
    nvcc = nvcc or shutil.which("nvcc")
    if nvcc is None:
        raise SystemExit("nvcc not found")
    code = arch.replace(".", "")
    # The same no-implicit-half-conversion macros torch's CUDAExtension passes, so code that
    # only compiles without them fails here too.
    torch_flags = ["-D__CUDA_NO_HALF_OPERATORS__", "-D__CUDA_NO_HALF_CONVERSIONS__",
                   "-D__CUDA_NO_BFLOAT16_CONVERSIONS__", "-D__CUDA_NO_HALF2_OPERATORS__"]
    # Every stage at -O0 (host compiler, NVVM, ptxas): a check, not a build, and each stage still
    # sees all the code and reports what it would at -O3 (the front end's errors, PTX that ptxas
    # refuses for this arch, static shared memory over the limit); 63 -> 30 s of CPU here.
    no_opt = ["-O0", "-Xcicc", "-O0", "-Xptxas", "-O0"]
    with tempfile.TemporaryDirectory(prefix="ddtree-cuda-check-") as scratch:  # its own: checks may run side by side
        subprocess.run([nvcc, "-std=c++17", *no_opt, *torch_flags, f"-gencode=arch=compute_{code},code=sm_{code}",
                        "-c", str(CSRC / "ddtree_cuda.cu"), "-o", str(Path(scratch) / "ddtree_cuda.o")], check=True)
    print(f"nvcc compiled ddtree_cuda.cu for sm_{code}")


def cxx_standard(torch_version: str) -> str:
    """The C++ standard torch's headers need: torch 2.14 and later refuse anything before C++20."""
    major, minor = (int(part) for part in torch_version.split("+")[0].split(".")[:2])
    return "c++20" if (major, minor) >= (2, 14) else "c++17"


def build(out: Path, cpu_only: bool = False, arch: str = "9.0", verbose: bool = False) -> Path:
    import torch
    from setuptools import setup
    from torch.utils.cpp_extension import CUDA_HOME, BuildExtension, CppExtension, CUDAExtension

    use_cuda = not cpu_only and torch.version.cuda is not None and CUDA_HOME is not None
    sources = [str(CSRC / "bindings.cpp"), str(CSRC / "ddtree_cpu.cpp")]
    std = cxx_standard(torch.__version__)
    cxx = ["-O3", f"-std={std}"]
    if use_cuda:
        os.environ["TORCH_CUDA_ARCH_LIST"] = arch
        ext = CUDAExtension(EXT_NAME, sources + [str(CSRC / "ddtree_cuda.cu")],
                            define_macros=[("WITH_CUDA", None)],
                            # No --use_fast_math: it flushes denormals, and the tree build
                            # must match the CPU reference bit for bit (__expf is explicit).
                            extra_compile_args={"cxx": cxx, "nvcc": ["-O3", f"-std={std}", "-lineinfo"]})
    else:
        ext = CppExtension(EXT_NAME, sources + [str(CSRC / "ddtree_nocuda.cpp")], extra_compile_args={"cxx": cxx})
    out.mkdir(parents=True, exist_ok=True)
    temp = out / "tmp"
    started = time.monotonic()
    setup(name=EXT_NAME, ext_modules=[ext], cmdclass={"build_ext": BuildExtension.with_options(use_ninja=True)},
          script_args=["-q" if not verbose else "-v", "build_ext", "--build-lib", str(out), "--build-temp",
                       str(temp)])
    built = sorted(out.glob(f"{EXT_NAME}*{sysconfig.get_config_var('EXT_SUFFIX')}"))
    if not built:
        raise SystemExit(f"build produced no module in {out}")
    module = built[-1]
    metadata = {
        "name": "ddtree-ext",
        "module": module.name,
        "sha256": {module.name: hashlib.sha256(module.read_bytes()).hexdigest()},
        "fingerprint": {
            "python_tag": python_tag(),
            "torch_version": torch.__version__.split("+")[0],
            "cuda_version": torch.version.cuda if use_cuda else None,
            "arch_list": [f"sm_{arch.replace('.', '')}"] if use_cuda else [],
        },
        "build_seconds": round(time.monotonic() - started, 1),
        "built_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }
    (out / "metadata.json").write_text(json.dumps(metadata, indent=2) + "\n")
    return module


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    parser.add_argument("--cpu-only", action="store_true")
    parser.add_argument("--arch", default="9.0")
    parser.add_argument("--check-cuda-syntax", action="store_true")
    parser.add_argument("-v", "--verbose", action="store_true")
    args = parser.parse_args()
    if args.check_cuda_syntax:
        check_cuda_syntax(args.arch)
        return
    module = build(args.out, args.cpu_only, args.arch, args.verbose)
    print(f"built {module}")
    print((args.out / "metadata.json").read_text())


if __name__ == "__main__":
    main()
