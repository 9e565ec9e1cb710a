"""Fan-out over real lab hosts: facts, failures that stay local, JSON, exit codes."""

from __future__ import annotations

import json
import threading

import pytest

from orchestrator.fleet.group import Group

from .conftest import TEST_HOSTS, sglfleet

pytestmark = pytest.mark.lab


def facts_cli(lab, *args):
    return sglfleet("facts", *args, "-i", str(lab.inventory_path))


def test_facts_all_json(lab):
    proc = facts_cli(lab, "all", "--json")
    assert proc.returncode == 0, proc.stderr + proc.stdout
    doc = json.loads(proc.stdout)
    assert doc["summary"] == {"ok": TEST_HOSTS, "failed": 0, "total": TEST_HOSTS}
    ct130 = doc["hosts"]["ct130"]["value"]
    assert ct130["hostname"] == "ct130"
    assert ct130["interpreter"]["executable"] == "/root/ml-env/bin/python3"
    assert ct130["interpreter"]["version"].startswith("3.")
    assert ct130["models_disk"]["path"] == "/root/models" and ct130["models_disk"]["free_bytes"] > 0


def test_facts_table_and_pattern(lab):
    proc = facts_cli(lab, "gpu-fleet:!ct130")
    assert proc.returncode == 0, proc.stderr
    assert "ct129" in proc.stdout and "ct130" not in proc.stdout
    assert f"{TEST_HOSTS - 1} ok, 0 failed" in proc.stdout


def test_one_host_down_others_succeed(lab):
    lab.stop_sshd("ct130")
    try:
        proc = facts_cli(lab, "all", "--json")
    finally:
        lab.start_sshd("ct130")
    assert proc.returncode == 1
    doc = json.loads(proc.stdout)
    assert doc["summary"]["failed"] == 1 and doc["summary"]["ok"] == TEST_HOSTS - 1
    error = doc["hosts"]["ct130"]["error"]
    assert f"cannot connect to root@{lab._host('ct130').address}:22 after 3 attempts" in error
    assert "Connection refused" in error or "Unable to connect" in error


def test_missing_interpreter_fails_that_host_only(lab, tmp_path):
    inv = tmp_path / "inv.yaml"
    text = lab.inventory_path.read_text().replace(
        "ct131:\n      ansible_host", "ct131:\n      ansible_python_interpreter: /opt/nope/python3\n      ansible_host")
    inv.write_text(text)
    (tmp_path / "inv.known_hosts").write_text(lab.known_hosts_path.read_text())
    proc = sglfleet("facts", "all", "-i", str(inv), "--json")
    doc = json.loads(proc.stdout)
    assert proc.returncode == 1
    assert doc["hosts"]["ct131"]["error"] == "configured python /opt/nope/python3 not found on the host"
    assert doc["hosts"]["ct131"]["value"]["hostname"] == "ct131"  # the other facts still came back
    assert doc["summary"]["ok"] == TEST_HOSTS - 1


def test_forks_bounds_concurrency(inventory):
    active, peak = [0], [0]
    lock = threading.Lock()

    def task(conn):
        with lock:
            active[0] += 1
            peak[0] = max(peak[0], active[0])
        conn.run("sleep 0.3")
        with lock:
            active[0] -= 1
        return conn.host.name

    with Group.from_inventory(inventory, "all", forks=2) as group:
        results = group.run(task)
    assert peak[0] == 2
    assert sorted(results.succeeded) == sorted(inventory.hosts)


def test_task_exception_is_contained(inventory):
    def task(conn):
        if conn.host.name == "ct129":
            raise RuntimeError("boom")
        return conn.run("hostname").stdout_text.strip()

    with Group.from_inventory(inventory, "all") as group:
        results = group.run(task)
    assert list(results.failed) == ["ct129"] and "RuntimeError: boom" in results["ct129"].error
    assert results["ct130"].value == "ct130"
    assert results.exit_code == 1


def test_one_connection_per_host_for_every_step_of_its_task_closed_when_the_task_ends(inventory):
    def task(conn):
        first = conn.transport
        conn.run("true")
        conn.run("true")
        return conn.transport is first and first.is_active()

    with Group.from_inventory(inventory, "ct129,ct130") as group:
        results = group.run(task)
        assert all(r.value is True for r in results.values())
        # a finished host's connection is not kept until the last host is done
        assert all(not c._clients for c in group.connections.values())


def test_run_command_cli_exit_codes(lab):
    proc = sglfleet("run", "ct129,ct130", "test $(hostname) = ct129", "-i", str(lab.inventory_path), "--json")
    doc = json.loads(proc.stdout)
    assert proc.returncode == 1
    assert doc["hosts"]["ct129"]["ok"] and not doc["hosts"]["ct130"]["ok"]
    assert doc["hosts"]["ct130"]["value"]["exit_code"] == 1
    proc = sglfleet("run", "ct129", "true", "-i", str(lab.inventory_path))
    assert proc.returncode == 0
