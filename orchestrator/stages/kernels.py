"""`build-kernels`: the DDTree extension built once per distinct ABI fingerprint of the hosts.

    fingerprints (one round trip per host: remote/release.py inspect with no targets: the
    python tag, torch and its CUDA, the GPUs) -> group the hosts by fingerprint -> per group:
    the local cache has it: nothing to do; this controller's python/torch/CUDA match: build
    here (`python -m ddtree.build` from kernels/); otherwise build on ONE host of the group
    (remote/kernel_build.py: sources pushed, built with the host's torch and compiler, the
    module fetched back; one round trip) -> the cache, keyed by fingerprint:
    <cache>/<key>/{metadata.json, module}.

`deploy`, `plan` and `push` give each host the cached build whose fingerprint matches it
(`artifacts_for_host`).
"""

from __future__ import annotations

import base64
import dataclasses
import hashlib
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

from ..errors import SglfleetError
from ..fleet import remote_call
from ..remote.hostlib import torch_build
from ..spec.artifacts import Extension, load_extension
from ..spec.profile import Artifacts, Profile

KERNELS = Path(__file__).resolve().parent.parent.parent / "kernels"


def cache_dir() -> Path:
    return Path(os.environ.get("SGLFLEET_KERNEL_CACHE", "build/ddtree-builds"))


def host_fingerprint(inspected: dict[str, Any]) -> dict[str, Any]:
    """What a build must match on this host (see spec.artifacts.Extension.mismatches)."""
    torch = inspected.get("torch") or {}
    cuda = torch.get("cuda")
    archs = sorted({g["arch"] for g in inspected.get("gpus") or [] if g.get("arch")}) if cuda else []
    return {"python_tag": inspected["python"]["tag"], "torch_version": (torch.get("version") or "").split("+")[0]
            or None, "cuda_version": cuda, "arch_list": archs}


def key(fp: dict[str, Any]) -> str:
    return "-".join([fp["python_tag"], f"torch{fp['torch_version']}", f"cuda{fp['cuda_version']}" if
                     fp.get("cuda_version") else "cpu", *(fp.get("arch_list") or [])])


def local_fingerprint() -> dict[str, Any] | None:
    """This controller's python/torch/CUDA (read from torch/version.py: no torch import)."""
    import importlib.util

    spec = importlib.util.find_spec("torch")
    if spec is None or not spec.submodule_search_locations:
        return None
    torch = torch_build(os.path.dirname(list(spec.submodule_search_locations)[0]))
    if not torch["version"]:
        return None
    return {"python_tag": f"cp{sys.version_info.major}{sys.version_info.minor}",
            "torch_version": torch["version"].split("+")[0], "cuda_version": torch["cuda"]}


def fingerprint_of(conn: Any) -> dict[str, Any]:
    inspected = remote_call.call(conn, "release.py", "inspect", {"package": "sglang", "targets": [],
                                                                 "recover": False}, timeout=120)
    return host_fingerprint(inspected)


def cached(fp: dict[str, Any]) -> Extension | None:
    """The build made for hosts of this fingerprint (a CPU build where they had no CUDA toolkit)."""
    alias = cache_dir() / "by-host" / key(fp)
    if not alias.is_file():
        return None
    where = cache_dir() / alias.read_text().strip()
    return _load(where) if (where / "metadata.json").is_file() else None


def _store_alias(host_fp: dict[str, Any], artifact_key: str) -> None:
    alias = cache_dir() / "by-host" / key(host_fp)
    alias.parent.mkdir(parents=True, exist_ok=True)
    alias.write_text(artifact_key + "\n")


def cached_all() -> list[Extension]:
    base = cache_dir()
    return [_load(d) for d in sorted(base.iterdir()) if (d / "metadata.json").is_file()] \
        if base.is_dir() else []


_LOADED: dict[Path, tuple[tuple[int, ...], Extension]] = {}
_LOADED_LOCK = threading.Lock()


def _load(directory: Path) -> Extension:
    """load_extension, once per build and process: it reads and hashes the whole module (MBs),
    and plan, push and deploy look the cache up for every host. A rebuilt directory (its
    metadata.json or module changed) is read again."""
    meta = directory / "metadata.json"
    try:
        module = directory / str(json.loads(meta.read_text()).get("module", ""))
        stamp = tuple(x for f in (meta, module) for x in (f.stat().st_mtime_ns, f.stat().st_size))
    except (OSError, ValueError, AttributeError):
        return load_extension(directory)  # its own clear error
    with _LOADED_LOCK:
        hit = _LOADED.get(directory)
        if hit is not None and hit[0] == stamp:
            return hit[1]
    extension = load_extension(directory)
    with _LOADED_LOCK:
        _LOADED[directory] = (stamp, extension)
    return extension


def for_host(inspected: dict[str, Any]) -> Extension | None:
    """The cached build that loads on this host (None: none built for its fingerprint): the one
    made for its fingerprint, else any that loads there, a CUDA build before a CPU one."""
    own = cached(host_fingerprint(inspected))
    if own is not None and not own.mismatches(inspected):
        return own
    loadable = [e for e in cached_all() if not e.mismatches(inspected)]
    loadable.sort(key=lambda e: e.fingerprint.get("cuda_version") is None)
    return loadable[0] if loadable else None


def candidate_keys(profile: Profile) -> list[str]:
    """The file keys of the cached builds one of which `artifacts_for_host` may choose: what the
    host's inspection must hash too (none when the profile deploys no extension)."""
    return [e.key for e in cached_all()] if profile.model.artifacts.extension is not None else []


def artifacts_for_host(profile: Profile, artifacts: Artifacts, inspected: dict[str, Any]) -> Artifacts:
    """The profile's artifacts with the extension build that loads on this host: the profile's
    own build when it matches, else build-kernels' cached build for the host's fingerprint (the
    "not built" note then goes). Unchanged when the profile deploys no extension or none fits."""
    if profile.model.artifacts.extension is None:
        return artifacts
    if artifacts.extension is not None and not artifacts.extension.mismatches(inspected):
        return artifacts
    built = for_host(inspected)
    if built is None:
        return artifacts
    notes = [n for n in artifacts.notes if "is not built" not in n]
    return dataclasses.replace(artifacts, extension=built, notes=notes)


def sources() -> list[tuple[str, bytes]]:
    """The files the build needs, relative to the build's own directory: the `ddtree` package
    (kernels/ddtree) and nothing beside it, so the build process's sys.path[0] holds no other
    top-level name that could shadow an installed distribution (Hugging Face's `kernels` is one)."""
    out = [("ddtree/__init__.py", (KERNELS / "ddtree" / "__init__.py").read_bytes()),
           ("ddtree/build.py", (KERNELS / "ddtree" / "build.py").read_bytes())]
    for path in sorted((KERNELS / "ddtree" / "csrc").iterdir()):
        if path.is_file():
            out.append((f"ddtree/csrc/{path.name}", path.read_bytes()))
    return out


def build_on_host(conn: Any, fp: dict[str, Any], arch: str = "9.0") -> dict[str, Any]:
    files = sources()
    args = {"files": [[p, len(d)] for p, d in files], "cpu_only": not fp.get("cuda_version"), "arch": arch}
    answer = remote_call.call(conn, "kernel_build.py", "build", args, payload=b"".join(d for _, d in files),
                              timeout=3600)
    metadata = answer["metadata"]
    artifact_key = key(metadata["fingerprint"])  # what was built: CPU where the host had no CUDA toolkit
    target = cache_dir() / artifact_key
    target.mkdir(parents=True, exist_ok=True)
    module = base64.b64decode(answer["module_b64"])
    if hashlib.sha256(module).hexdigest() != metadata["sha256"][metadata["module"]]:
        raise SglfleetError(f"{conn.host.name}: the fetched module does not match the sha256 its build recorded")
    (target / metadata["module"]).write_bytes(module)
    metadata["built_on"] = conn.host.name
    (target / "metadata.json").write_text(json.dumps(metadata, indent=2) + "\n")
    _store_alias(fp, artifact_key)
    return {"where": conn.host.name, "seconds": answer["seconds"], "dir": str(target), "artifact": artifact_key,
            "module_bytes": len(module), "cpu_only": answer.get("cpu_only"),
            "cuda_toolkit": answer.get("cuda_toolkit")}


def build_here(fp: dict[str, Any], arch: str = "9.0") -> dict[str, Any]:
    target = cache_dir() / key(fp)
    started = time.monotonic()
    argv = [sys.executable, "-m", "ddtree.build", "--out", str(target.resolve())]
    argv += ["--cpu-only"] if not fp.get("cuda_version") else ["--arch", arch]
    # cwd kernels/: `-m` puts it first on sys.path, and it holds only the ddtree package
    proc = subprocess.run(argv, cwd=KERNELS, capture_output=True, text=True)
    if proc.returncode != 0:
        raise SglfleetError(f"building the extension on this controller failed:\n{proc.stdout}{proc.stderr}")
    _store_alias(fp, key(fp))
    return {"where": "controller", "seconds": round(time.monotonic() - started, 1), "dir": str(target),
            "artifact": key(fp)}


def controller_matches(fp: dict[str, Any]) -> bool:
    local = local_fingerprint()
    return bool(local) and all(local[k] == fp[k] for k in ("python_tag", "torch_version", "cuda_version"))


def plan_builds(fingerprints: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """key -> {fingerprint, hosts, cached, where}: where each distinct fingerprint is built."""
    groups: dict[str, dict[str, Any]] = {}
    for host, fp in sorted(fingerprints.items()):
        group = groups.setdefault(key(fp), {"fingerprint": fp, "hosts": []})
        group["hosts"].append(host)
    for k, group in groups.items():
        group["cached"] = cached(group["fingerprint"]) is not None
        group["where"] = "controller" if controller_matches(group["fingerprint"]) else group["hosts"][0]
    return groups
