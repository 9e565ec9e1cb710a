"""The lab's shared read-only base layer: what every simulated host starts with.

Built once per machine under the lab state dir and used as the lower overlay layer of all
hosts, so a host's own changes never touch it. A stamp file records the recipe version;
a changed recipe rebuilds the base.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

RECIPE_VERSION = "2-plain-venv-skel-dotfiles"


def base_python() -> str:
    """A real interpreter (not a venv's) for the hosts' venv; it stays visible under /root."""
    return getattr(sys, "_base_executable", None) or sys.executable


def ensure_base(state_dir: Path) -> Path:
    base = state_dir / "base"
    stamp = base / ".sglfleet-base"
    if stamp.exists() and stamp.read_text().strip() == RECIPE_VERSION:
        return base
    if base.exists():
        shutil.rmtree(base)
    building = state_dir / "base.building"
    if building.exists():
        shutil.rmtree(building)
    for d in ("root/models", "var/lib/sglfleet", "etc/systemd/system", "var/log/sglfleet"):
        (building / d).mkdir(parents=True, exist_ok=True)
    # A fresh host's root has the distribution's skeleton dotfiles, not this machine's:
    # bash sources ~/.bashrc for every command sshd runs, and a developer's (pyenv init,
    # conda init) would make each lab command ~100 ms slower than on a real GPU host.
    for dotfile in (".bashrc", ".profile"):
        skel = Path("/etc/skel") / dotfile
        (building / "root" / dotfile).write_text(skel.read_text() if skel.exists() else "")
    # The venv is created at its real path's twin; bin/python3 is a link to the base
    # interpreter and sys.prefix follows pyvenv.cfg, so it works when mounted at /root/ml-env.
    subprocess.run([base_python(), "-m", "venv", str(building / "root/ml-env")], check=True)
    (building / ".sglfleet-base").write_text(RECIPE_VERSION + "\n")
    building.rename(base)
    return base
