"""`push` honours a deploy's lease, on lab hosts through real sshd.

A deploy holds its host between its round trips (the lease, remote/server.py); a plain
`sglfleet push` in that time is refused naming the deploy (exit 1, nothing changed on the host),
goes through once the lease is dropped or has expired, and the deploy's own push (and its
revert's rollback) still works.
The deploy that holds the lease serves qwen3-8b-dflash (no patchset), so the push of
qwen36-ddtree has files to change: refused, they stay pristine.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from orchestrator.fleet.hostkeys import KnownHosts
from orchestrator.fleet.transport import Connection

from .conftest import ROOT, fenced_env, sglfleet
from .private_lab import lab_fixture
from .test_push import Files

pytestmark = [pytest.mark.lab, pytest.mark.slow]
lab = lab_fixture("push-lease", 20, hosts=2)
STATE = "/var/lib/sglfleet"
PUSHED = "qwen36-ddtree"
HOLDER_PROFILE = "qwen3-8b-dflash"


def profile(tmp_path, name, base, load_delay, port, loads_until=None):
    """A playbook for the lab's stand-in: its load delay (how long the deploy holds the lease) and port;
    with `loads_until`, the load lasts until that file exists on the host too (the test's event)."""
    text = (ROOT / "playbooks" / f"{base}.yaml").read_text().replace("../", f"{ROOT}/")
    text = text.replace("port: 30000", f"port: {port}")
    env = f"  SGLFLEET_SIM_LOAD_DELAY: \"{load_delay}\"\n"
    if loads_until:
        env += f"  SGLFLEET_SIM_LOAD_UNTIL: \"{loads_until}\"\n"
    text = text.replace("env:\n", "env:\n" + env) if "\nenv:\n" in text else text + "env:\n" + env
    path = tmp_path / f"{name}.yaml"
    path.write_text(text)
    return str(path)


def cli(lab, *args):
    return sglfleet(*args, "-i", str(lab.inventory_path))


def on_host(inventory, host, command):
    with Connection(inventory.hosts[host], KnownHosts(inventory.known_hosts_path)) as conn:
        return conn.run(command, timeout=120).stdout_text


def push_json(lab, host):
    proc = cli(lab, "push", host, PUSHED, "--json")
    assert proc.stdout, proc.stderr
    return proc.returncode, json.loads(proc.stdout)["hosts"][host]


def releases(lab, host):
    proc = cli(lab, "releases", host, "--json")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return json.loads(proc.stdout)["hosts"][host]["value"]


def deploy_in_background(lab, tmp_path, host, profile_path):
    argv = [sys.executable, "-m", "orchestrator.cli", "deploy", host, profile_path, "-i", str(lab.inventory_path),
            "--json", "--runs-dir", str(tmp_path / "runs")]
    return subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT,
                            env=fenced_env())


def wait_until_serving_under_lease(inventory, host, proc):
    """Until the deploy has launched its server and polls its health: it holds the lease, not the
    lock (a push refused by the lock would prove nothing about the lease). The lease, as the host has it."""
    deadline = time.monotonic() + 240
    while time.monotonic() < deadline:
        assert proc.poll() is None, proc.communicate()
        if on_host(inventory, host, f"cat {STATE}/servers/{HOLDER_PROFILE}/supervisor.json 2>/dev/null").strip():
            lease = on_host(inventory, host, f"cat {STATE}/deploy-lease.json 2>/dev/null")
            assert lease.strip(), "the deploy launched its server without holding the lease"
            return json.loads(lease)
        time.sleep(0.3)
    raise AssertionError("the deploy never launched its server")


def finished(proc, host):
    out, err = proc.communicate(timeout=300)
    assert out, err[-3000:]
    return proc.returncode, json.loads(out)["hosts"][host]


def test_push_is_refused_while_a_deploy_holds_the_host_then_goes_through(lab, inventory, tmp_path):
    host = "ct129"
    with Connection(inventory.hosts[host], KnownHosts(inventory.known_hosts_path)) as conn:
        files = Files(conn)
        pristine = files.hashes()
    loaded = f"/tmp/{tmp_path.name}-holder-loads"
    holder = deploy_in_background(lab, tmp_path, host, profile(tmp_path, "holder", HOLDER_PROFILE, 0.5, 30001,
                                                               loaded))
    lease = wait_until_serving_under_lease(inventory, host, holder)

    code, refused = push_json(lab, host)
    on_host(inventory, host, f"touch {loaded}")  # refused while the deploy held the host: its load may end
    assert code == 1 and not refused["ok"], refused
    error = refused["error"]
    assert "being deployed by another sglfleet run" in error and f"deploy {lease['id']}" in error, error
    assert f"running `sglfleet deploy {host} " in error and "nothing was changed" in error, error
    assert refused["value"]["lease"]["id"] == lease["id"] and refused["value"]["holder"] == lease["holder"]
    with Connection(inventory.hosts[host], KnownHosts(inventory.known_hosts_path)) as conn:
        assert Files(conn).hashes() == pristine and Files(conn).temp_files() == ""
    assert releases(lab, host)["releases"] == []

    code, doc = finished(holder, host)  # the deploy it held back was not disturbed
    assert code == 0 and doc["action"] == "deployed", doc.get("summary")
    assert not on_host(inventory, host, f"cat {STATE}/deploy-lease.json 2>/dev/null").strip()

    code, pushed = push_json(lab, host)  # the lease is dropped: the same push goes through
    assert code == 0, pushed
    assert pushed["value"]["release"] and pushed["value"]["content_bytes"] > 0
    with Connection(inventory.hosts[host], KnownHosts(inventory.known_hosts_path)) as conn:
        assert Files(conn).hashes() != pristine


def test_a_deploys_own_push_and_revert_go_through_and_an_expired_lease_binds_nobody(lab, inventory, tmp_path):
    host = "ct130"
    with Connection(inventory.hosts[host], KnownHosts(inventory.known_hosts_path)) as conn:
        pristine = Files(conn).hashes()
    # The deploy's own push, then its revert's rollback, both under its lease: a crash during load.
    crash = profile(tmp_path, "crash", PUSHED, 30, 30000)
    Path(crash).write_text(Path(crash).read_text().replace("env:\n", "env:\n  SGLFLEET_SIM_CRASH_AFTER: \"1\"\n"))
    code, doc = finished(deploy_in_background(lab, tmp_path, host, crash), host)
    assert code == 1 and doc["phase"] == "health", doc.get("summary")
    assert doc["pushed"]["release"] and doc["pushed"]["content_bytes"] > 0, doc.get("summary")
    assert doc.get("rolled_back") == {"release": doc["pushed"]["release"], "to": None}, doc.get("summary")
    assert "FAILED" not in doc["summary"] and "rolled back to pristine" in doc["summary"], doc["summary"]
    with Connection(inventory.hosts[host], KnownHosts(inventory.known_hosts_path)) as conn:
        assert Files(conn).hashes() == pristine
    code, doc = finished(deploy_in_background(lab, tmp_path, host, profile(tmp_path, "own", PUSHED, 0.5, 30000)),
                         host)
    assert code == 0 and doc["action"] == "deployed", doc.get("summary")
    assert doc["pushed"]["release"] and doc["pushed"]["content_bytes"] > 0
    assert cli(lab, "stop", host).returncode == 0  # the push below has work again
    assert cli(lab, "rollback", host, "--to", "pristine").returncode == 0

    # A deploy whose lease outlived it (as if its controller died and the ttl passed).
    # Its load lasts until the push below is done: the deploy's own last step takes the host's lock,
    # which that push holds while it runs (a load that ended meanwhile failed the deploy there).
    loaded = f"/tmp/{tmp_path.name}-holder-loads"
    holder = deploy_in_background(lab, tmp_path, host, profile(tmp_path, "holder", HOLDER_PROFILE, 0.5, 30001,
                                                               loaded))
    lease = wait_until_serving_under_lease(inventory, host, holder)
    code, refused = push_json(lab, host)
    assert code == 1 and f"deploy {lease['id']}" in refused["error"], refused
    on_host(inventory, host, f"python3 -c 'import json; p=\"{STATE}/deploy-lease.json\"; d=json.load(open(p)); "
                             f"d[\"since\"] -= d[\"ttl\"] + 60; json.dump(d, open(p, \"w\"))'")
    code, pushed = push_json(lab, host)
    on_host(inventory, host, f"touch {loaded}")
    assert code == 0 and pushed["value"]["release"] and pushed["value"]["content_bytes"] > 0, pushed
    code, doc = finished(holder, host)
    assert code == 0, doc.get("summary")
