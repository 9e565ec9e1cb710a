"""build-kernels' cache as plan, push and deploy read it: each build loaded (read and sha256-checked)
once per process, and read again when it is rebuilt."""

from __future__ import annotations

import json
import os

from orchestrator.spec import artifacts
from orchestrator.stages import kernels


def write_build(cache, name, text):
    build = cache / name
    build.mkdir(parents=True, exist_ok=True)
    (build / "ext_mod.py").write_text(text)
    (build / "metadata.json").write_text(json.dumps({"name": name, "module": "ext_mod.py",
                                                     "fingerprint": {"python_tag": "cp311"}}))
    return build


def test_each_build_is_loaded_once_until_it_is_rebuilt(tmp_path, monkeypatch):
    monkeypatch.setenv("SGLFLEET_KERNEL_CACHE", str(tmp_path))
    loads = []
    real = artifacts.load_extension
    monkeypatch.setattr(kernels, "load_extension", lambda d: loads.append(d) or real(d))
    build = write_build(tmp_path, "a", "X = 1\n")
    write_build(tmp_path, "b", "Y = 1\n")
    first = kernels.cached_all()
    assert [e.name for e in first] == ["a", "b"] and len(loads) == 2
    for _ in range(5):  # one lookup per host
        assert kernels.cached_all() == first
    assert len(loads) == 2
    write_build(tmp_path, "a", "X = 22\n")  # rebuilt (another size, so another stamp whatever the clock)
    os.utime(build / "ext_mod.py", ns=(1, 1))
    again = kernels.cached_all()
    assert len(loads) == 3 and again[0].data == b"X = 22\n" and again[1] is first[1]
