"""`deploy` on the 8 lab hosts at once, one of them failing alone (its inventory override makes
its server crash during load): the other seven serve, the failing one is reported whole."""

from __future__ import annotations

import json

import pytest
import yaml

from .conftest import TEST_HOSTS, sglfleet
from .private_lab import lab_fixture
from .test_deploy import profile_variant

pytestmark = [pytest.mark.lab, pytest.mark.slow]

# Servers and releases of these tests stay on a lab of their own (the shared lab's tests expect
# pristine hosts).
lab = lab_fixture("deploy-fanout", 6)


def test_eight_hosts_in_parallel_one_failing_alone(lab, inventory, tmp_path):
    doc = yaml.safe_load(lab.inventory_path.read_text())
    doc["all"]["hosts"]["ct133"]["sglfleet_profile_overrides"] = {"qwen36-ddtree": {"env": {
        "SGLFLEET_SIM_CRASH_AFTER": "1", "SGLFLEET_SIM_LOAD_DELAY": "30"}}}
    inv = tmp_path / "lab.yaml"
    inv.write_text(yaml.safe_dump(doc))
    (tmp_path / "lab.known_hosts").write_text(lab.known_hosts_path.read_text())
    proc = sglfleet("deploy", "all", profile_variant(tmp_path, "good"), "-i", str(inv), "--json", "--runs-dir",
                    str(tmp_path / "runs"))
    result = json.loads(proc.stdout)
    hosts = result["hosts"]
    assert len(hosts) == TEST_HOSTS and proc.returncode == 1
    failed = {name for name, d in hosts.items() if not d["ok"]}
    assert failed == {"ct133"}, {n: d.get("summary") for n, d in hosts.items()}
    assert "server exited with code 1" in hosts["ct133"]["summary"]
    assert "illegal memory access" in hosts["ct133"]["server_log"]
    for name, d in hosts.items():
        if name != "ct133":
            assert d["action"] in ("deployed", "unchanged") and d["pid"], (name, d.get("summary"))
    assert result["summary"] == {"ok": TEST_HOSTS - 1, "failed": 1}
