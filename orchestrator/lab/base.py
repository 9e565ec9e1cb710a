"""The lab's shared read-only base layer: what every simulated GPU host starts with.

Built once per machine (in SGLFLEET_LAB_BASE, default /var/cache/sglfleet/base-<recipe>) and
used as the lower overlay layer of all hosts of every lab, so a host's own changes never touch
it. It holds:

* /root/ml-env: a venv with the real sglang==0.5.23 (installed --no-deps, plus what its imports
  need; torch 2.14.1 + torchvision 0.29.1 come from the machine's local wheel cache);
* /root/models: Qwen3.6-27B (hybrid), Qwen3.6-27B-DFlash (draft, block size 16), Qwen3-8B —
  config.json only;
* the distribution's skeleton dotfiles for /root.

The two stand-ins (nvidia-smi, sglfleet-sim-server with its warm validator) are not baked in: `lab up` writes them into
each host's own layer (install_tools), so editing them needs no rebuild of this base.

The venv is built at its real path: a private mount namespace binds the build dir over
/root/ml-env, so every shebang and path inside it is the one hosts see.
"""

from __future__ import annotations

import functools
import os
import shlex
import shutil
import subprocess
import sys
import time
from pathlib import Path

from ..errors import SglfleetError
from .image.models import write_models

SGLANG_VERSION = "0.5.23"
RECIPE_VERSION = f"3-sglang-{SGLANG_VERSION}"
# What sglang's imports need (see shared notes); versions pinned where newer ones break it.
SGLANG_IMPORT_DEPS = [
    "numpy", "orjson", "psutil", "pybase64", "requests", "packaging", "pillow", "starlette", "msgspec",
    "pydantic", "pyzmq", "tqdm", "ipython", "aiohttp", "transformers==5.19.0", "dill",
    "apache-tvm-ffi==0.1.11", "sentencepiece==0.2.1", "compressed-tensors==0.18.0", "gguf",
    "openai==2.8.0", "partial_json_parser", "einops", "triton",
]
TORCH = ["torch==2.14.1", "torchvision==0.29.1"]  # sglang's pin; taken from the local wheel cache
IMAGE = Path(__file__).parent / "image"


def base_python() -> str:
    """A real interpreter (not a venv's) for the hosts' venv; it stays visible under /root."""
    return getattr(sys, "_base_executable", None) or sys.executable


def base_dir() -> Path:
    return Path(os.environ.get("SGLFLEET_LAB_BASE", f"/var/cache/sglfleet/base-{RECIPE_VERSION}"))


def shared_records_dir() -> Path:
    """Where the stand-ins of every plain lab host on this machine keep their validation records
    (sim_validator.py, SHARED RECORDS): beside the base layer, which all hosts see, and kept
    across labs as the base is. Made 0700: a record holds the resolved args, an --api-key too."""
    path = base_dir().parent / "sim-validated"
    path.mkdir(mode=0o700, parents=True, exist_ok=True)
    return path


def ensure_base(log=print) -> Path:
    base = base_dir()
    stamp = base / ".sglfleet-base"
    if stamp.exists() and stamp.read_text().strip() == RECIPE_VERSION:
        return base
    building = base.with_name(base.name + ".building")
    if building.exists():
        shutil.rmtree(building)
    started = time.monotonic()
    log(f"building the lab base image in {base} (once per machine; several minutes)")
    for d in ("root/models", "var/lib/sglfleet", "etc/systemd/system", "var/log/sglfleet"):
        (building / d).mkdir(parents=True, exist_ok=True)
    # A fresh host's root has the distribution's skeleton dotfiles, not this machine's:
    # bash sources ~/.bashrc for every command sshd runs, and a developer's (pyenv init,
    # conda init) would make each lab command ~100 ms slower than on a real GPU host.
    for dotfile in (".bashrc", ".profile"):
        skel = Path("/etc/skel") / dotfile
        (building / "root" / dotfile).write_text(skel.read_text() if skel.exists() else "")
    write_models(building / "root" / "models")
    _build_venv(building / "root", log)
    (building / ".sglfleet-base").write_text(RECIPE_VERSION + "\n")
    if base.exists():
        shutil.rmtree(base)
    building.rename(base)
    log(f"lab base image built in {time.monotonic() - started:.0f}s")
    return base


def install_tools(bin_dir: Path, gpu: str) -> None:
    """Write the lab stand-ins into a host's /usr/local/bin (its upper layer).

    nvidia-smi is a small sh script: the query `sglfleet facts` sends is answered from text
    rendered here, for this host's GPU; anything else execs the full Python stand-in. Every host
    runs it on every facts call, and on a lab machine all hosts share the controller's cores: a
    Python start per host made the 32-host fan-out benchmark measure the simulator, not sglfleet.
    """
    from ..remote.hostlib import GPU_QUERY

    bin_dir.mkdir(parents=True, exist_ok=True)
    for source, name, interpreter in ((IMAGE / "nvidia_smi.py", "nvidia-smi.py", "/usr/bin/env python3"),
                                      (Path(__file__).with_name("sim_server.py"), "sglfleet-sim-server",
                                       "/root/ml-env/bin/python3"),
                                      # the stand-in's warm validator, imported by it from beside it
                                      (Path(__file__).with_name("sim_validator.py"), "sglfleet_sim_validator.py",
                                       "/root/ml-env/bin/python3")):
        text = source.read_text()
        if text.startswith("#!"):
            text = text.split("\n", 1)[1]
        (bin_dir / name).write_text(f"#!{interpreter}\n" + text)
        (bin_dir / name).chmod(0o755)
    query = GPU_QUERY
    rendered = _rendered_gpu_query(gpu)
    (bin_dir / "nvidia-smi").write_text(
        "#!/bin/sh\n# sglfleet lab simulation of nvidia-smi (see nvidia-smi.py beside it).\n"
        f'if [ "$*" = {shlex.quote(" ".join(query))} ]; then\n'
        f"cat <<'SGLFLEET_EOF'\n{rendered}SGLFLEET_EOF\nexit 0\nfi\n"
        'exec /usr/local/bin/nvidia-smi.py "$@"\n')
    (bin_dir / "nvidia-smi").chmod(0o755)
    # A host whose clock is off (`sglfleet doctor` reads the host's clock with `date +%s.%N`):
    # every lab host shares this machine's kernel clock, so a skew is simulated here, from the
    # seconds in /var/lib/sglfleet-lab/clock-offset; without that file it is the real date.
    (bin_dir / "date").write_text(
        "#!/bin/sh\n# sglfleet lab simulation: date, skewed by /var/lib/sglfleet-lab/clock-offset when it exists.\n"
        'if [ -r /var/lib/sglfleet-lab/clock-offset ] && [ "$*" = "+%s.%N" ]; then\n'
        '  exec awk -v now="$(/usr/bin/date +%s.%N)" -v off="$(cat /var/lib/sglfleet-lab/clock-offset)" '
        "'BEGIN { printf \"%.6f\\n\", now + off }'\n"
        "fi\n"
        'exec /usr/bin/date "$@"\n')
    (bin_dir / "date").chmod(0o755)


@functools.lru_cache(maxsize=None)
def _rendered_gpu_query(gpu: str) -> str:
    """The stand-in's answer to facts' query for this GPU (one Python run per GPU kind, not per host:
    `lab up` of 1,000 hosts started 1,000 interpreters for it)."""
    from ..remote.hostlib import GPU_QUERY

    return subprocess.run([sys.executable, str(IMAGE / "nvidia_smi.py"), *GPU_QUERY], capture_output=True,
                          text=True, check=True, env={**os.environ, "SGLFLEET_LAB_GPU": gpu}).stdout


def _build_venv(root_upper: Path, log) -> None:
    """Create /root/ml-env where hosts will see it: inside a private mount namespace, /root is
    an overlay whose upper layer is the base's root/, so the venv is written straight there."""
    work = root_upper.with_name("root.work")
    work.mkdir(exist_ok=True)
    pip = "/root/ml-env/bin/python3 -m pip install -q --disable-pip-version-check"
    script = " && ".join([
        f"mount -t overlay overlay -o lowerdir=/root,upperdir={root_upper},workdir={work} /root",
        f"{base_python()} -m venv /root/ml-env",
        f"{pip} {' '.join(TORCH)}",
        f"{pip} --no-deps sglang=={SGLANG_VERSION}",
        f"{pip} {' '.join(repr(d) for d in SGLANG_IMPORT_DEPS)}",
        "/root/ml-env/bin/python3 -c 'from sglang.srt.server_args import prepare_server_args'",
    ])
    log("  installing sglang and torch into the base venv")
    # No pip cache: it would land in the image (the local wheels come from pip's find-links).
    env = {**os.environ, "PIP_NO_CACHE_DIR": "1"}
    proc = subprocess.run(["unshare", "--mount", "--propagation", "private", "--", "bash", "-c", script],
                          capture_output=True, text=True, env=env)
    shutil.rmtree(work, ignore_errors=True)
    for stray in (".cache", ".python_history", ".bash_history"):
        target = root_upper / stray
        if target.is_dir():
            shutil.rmtree(target, ignore_errors=True)
        elif target.exists():
            target.unlink()
    if proc.returncode != 0:
        raise SglfleetError(f"building the lab base venv failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
