"""Shared fixtures. Lab tests talk to real sshd processes on loopback (see `lab` below).

The test lab has its own state dir and subnet (127.0.2.N), so a developer's own lab
(127.0.1.N, started by `make demo`) keeps running while the tests run.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
TEST_LAB_DIR = Path(os.environ.get("SGLFLEET_TEST_LAB_DIR", "/var/cache/sglfleet/lab-test"))
TEST_SUBNET = os.environ.get("SGLFLEET_TEST_SUBNET", "127.0.2")  # helpers running side by side pick their own
TEST_HOSTS = 8  # the smoke test fans out to 8 hosts

# Every test runs under the loopback-only rule.
os.environ["SGLFLEET_LOOPBACK_ONLY"] = "1"


def pytest_addoption(parser):
    parser.addoption("--skip-slow", action="store_true", help="skip tests marked slow (CI runs them)")


def pytest_collection_modifyitems(config, items):
    if config.getoption("--skip-slow"):
        skip = pytest.mark.skip(reason="--skip-slow")
        for item in items:
            if "slow" in item.keywords:
                item.add_marker(skip)


def lab_prerequisites_missing() -> str | None:
    if os.geteuid() != 0:
        return "the lab needs root"
    if not os.path.exists("/usr/sbin/sshd"):
        return "openssh-server is not installed (make test installs it)"
    if shutil.which("unshare") is None:
        return "unshare (util-linux) is missing"
    return None


@pytest.fixture(scope="session")
def lab(tmp_path_factory):
    """A running lab of TEST_HOSTS hosts; torn down at the end of the session."""
    missing = lab_prerequisites_missing()
    if missing:
        if os.environ.get("CI"):
            pytest.fail(f"lab prerequisites missing in CI: {missing}")
        pytest.skip(missing)
    from orchestrator.lab.manager import Lab

    inv_dir = tmp_path_factory.mktemp("inventory")
    the_lab = Lab(state_dir=TEST_LAB_DIR, inventory_path=inv_dir / "lab.yaml", subnet=TEST_SUBNET)
    the_lab.down()  # leftovers of an interrupted run
    the_lab.up(TEST_HOSTS)
    yield the_lab
    the_lab.down()


@pytest.fixture
def inventory(lab):
    from orchestrator.fleet.inventory import load_inventory

    return load_inventory(lab.inventory_path)


@pytest.fixture
def conn(inventory):
    from orchestrator.fleet.hostkeys import KnownHosts
    from orchestrator.fleet.transport import Connection

    c = Connection(inventory.hosts["ct129"], KnownHosts(inventory.known_hosts_path))
    yield c
    c.close()


def sglfleet(*args: str, env: dict | None = None, cwd: Path | None = None) -> subprocess.CompletedProcess:
    """Run the real CLI in a subprocess, as a user would."""
    full_env = {**os.environ, "SGLFLEET_LOOPBACK_ONLY": "1", **(env or {})}
    return subprocess.run([sys.executable, "-m", "orchestrator.cli", *args], capture_output=True,
                          text=True, env=full_env, cwd=cwd or ROOT, timeout=300)
