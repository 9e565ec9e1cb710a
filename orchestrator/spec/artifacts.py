"""The two artifact kinds a push deploys: a patchset (see patchset.py) and a built extension.

A built extension is the directory `PYTHONPATH=kernels python -m ddtree.build` writes: the compiled
module plus metadata.json with its ABI fingerprint. It goes into the host's site-packages,
and only onto hosts whose facts match the fingerprint.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..errors import ConfigError
from .patchset import MODULE_NAME, sha256


@dataclass
class Extension:
    directory: Path
    name: str
    module_file: str
    data: bytes
    fingerprint: dict[str, Any]

    @property
    def key(self) -> str:
        return f"purelib/{self.module_file}"

    @property
    def module(self) -> str:
        return self.module_file.split(".", 1)[0]

    def mismatches(self, inspected: dict[str, Any]) -> list[str]:
        """Why this build cannot load on the host (empty: it matches)."""
        fp, why = self.fingerprint, []
        host_tag = inspected["python"]["tag"]
        if fp.get("python_tag") != host_tag:
            why.append(f"python {host_tag} (built for {fp.get('python_tag')})")
        torch = inspected.get("torch") or {}
        host_torch = (torch.get("version") or "").split("+")[0] or None
        if host_torch is None:
            why.append("no torch installed")
        elif fp.get("torch_version") != host_torch:
            why.append(f"torch {host_torch} (built for {fp.get('torch_version')})")
        if fp.get("cuda_version"):
            if torch.get("cuda") != fp["cuda_version"]:
                why.append(f"torch CUDA {torch.get('cuda') or 'none'} (built for {fp['cuda_version']})")
            archs = sorted({g["arch"] for g in inspected.get("gpus") or []})
            missing = [a for a in archs if a not in fp.get("arch_list", [])]
            if not archs:
                why.append("no NVIDIA GPU found")
            elif missing:
                why.append(f"GPU arch {', '.join(missing)} (built for {', '.join(fp.get('arch_list', []))})")
        return why


def load_extension(directory: str | Path) -> Extension:
    directory = Path(directory)
    meta_path = directory / "metadata.json"
    if not meta_path.is_file():
        raise ConfigError(f"{directory} is not a built extension (no metadata.json); build it with `make kernels`")
    try:
        meta = json.loads(meta_path.read_text())
        module_file, fingerprint = meta["module"], meta["fingerprint"]
    except (ValueError, KeyError) as exc:
        raise ConfigError(f"metadata.json is not an extension artifact's metadata ({exc})", str(meta_path)) from None
    module_path = directory / module_file
    if not isinstance(module_file, str) or "/" in module_file or not MODULE_NAME.match(module_file.split(".", 1)[0]):
        raise ConfigError(f"module {module_file!r} must be a file name whose stem is a module name", str(meta_path))
    if not module_path.is_file():
        raise ConfigError(f"the module {module_file} named by metadata.json is missing", str(meta_path))
    data = module_path.read_bytes()
    recorded = (meta.get("sha256") or {}).get(module_file)
    if recorded and recorded != sha256(data):
        raise ConfigError(f"{module_file} does not match the sha256 in metadata.json (rebuilt without "
                          "updating it?)", str(meta_path))
    return Extension(directory, meta.get("name", module_file), module_file, data, fingerprint)
