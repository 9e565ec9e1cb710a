"""`build-kernels` on a lab host (torch 2.14.1, CPU: not this controller's torch, so the build
runs on the host with its own torch and compiler), then `deploy` ships that build and the host
imports it."""

from __future__ import annotations

import json

import pytest

from .conftest import sglfleet
from .private_lab import lab_fixture
from .test_deploy import connect, profile_variant

pytestmark = [pytest.mark.lab, pytest.mark.slow]

# Servers and releases of these tests stay on a lab of their own (the shared lab's tests expect
# pristine hosts).
lab = lab_fixture("deploy-kernels", 7)
HOST_FP = "cp311-torch2.14.1-cuda13.0-sm_90"  # the lab's torch is a CUDA build; the hosts have no toolkit
CPU_BUILD = "cp311-torch2.14.1-cpu"


def test_build_on_the_host_then_deploy_installs_and_imports_it(lab, inventory, tmp_path):
    host = "ct136"
    cache = tmp_path / "cache"
    env = {"SGLFLEET_KERNEL_CACHE": str(cache)}
    proc = sglfleet("build-kernels", host, "-i", str(lab.inventory_path), "--json", env=env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr
    builds = json.loads(proc.stdout)["builds"]
    assert list(builds) == [HOST_FP], builds
    group = builds[HOST_FP]
    assert group["hosts"] == [host] and group["where"] == host and group["built"]["where"] == host
    assert group["built"]["artifact"] == CPU_BUILD and group["built"]["cpu_only"]  # no CUDA toolkit: CPU
    meta = json.loads((cache / CPU_BUILD / "metadata.json").read_text())
    assert meta["fingerprint"] == {"python_tag": "cp311", "torch_version": "2.14.1", "cuda_version": None,
                                   "arch_list": []} and meta["built_on"] == host
    # A second run finds it in the cache: no build.
    again = json.loads(sglfleet("build-kernels", host, "-i", str(lab.inventory_path), "--json", env=env).stdout)
    assert again["builds"][HOST_FP]["built"]["where"] == "cache"

    # plan (and push) pick the same cached build as deploy: the extension is listed, not "not built"
    variant = profile_variant(tmp_path, "good")
    proc = sglfleet("plan", host, variant, "-i", str(lab.inventory_path), "--json", env=env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    planned = json.loads(proc.stdout)["hosts"][host]["value"]
    assert not any("is not built" in n for n in planned["notes"]), planned["notes"]
    assert any(f["key"].startswith("purelib/ddtree_ext") and f["status"] == "add" for f in planned["files"]), \
        planned["files"]

    proc = sglfleet("deploy", host, variant, "-i", str(lab.inventory_path), "--json",
                    "--runs-dir", str(tmp_path / "runs"), env=env)
    doc = json.loads(proc.stdout)["hosts"][host]
    assert proc.returncode == 0, doc["summary"]
    assert any(key.startswith("purelib/ddtree_ext") for key in doc["pushed"]["files"]), doc["pushed"]
    assert doc["extension"]["fingerprint"]["torch_version"] == "2.14.1"
    with connect(inventory, host) as conn:
        imported = conn.run(f"{conn.host.python} -c 'import torch, ddtree_ext; print(ddtree_ext.__file__)'",
                            timeout=300)
    assert imported.ok and "site-packages/ddtree_ext" in imported.stdout_text, imported.stderr_text
    # and once deployed, plan finds the build current there
    proc = sglfleet("plan", host, variant, "-i", str(lab.inventory_path), "--json", env=env)
    files = json.loads(proc.stdout)["hosts"][host]["value"]["files"]
    assert [f["status"] for f in files if f["key"].startswith("purelib/ddtree_ext")] == ["current"], files
