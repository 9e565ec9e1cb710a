"""The network jail and the fence: the suite cannot leave 127.0.0.0/8, whatever the code under test does.

`make test` runs pytest in a network namespace with only lo (see Makefile). The tests that aim
at a production address do so only after checking, in this same process, that the namespace
has no interface but lo: outside the jail they skip (locally) or fail (CI) without a connect.
"""

from __future__ import annotations

import errno
import json
import os
import socket
import subprocess
import sys

import pytest

from orchestrator.errors import ConnectError
from orchestrator.fleet.hostkeys import KnownHosts
from orchestrator.fleet.inventory import Host
from orchestrator.fleet.transport import Connection

from . import netfence
from .conftest import ROOT, in_network_jail, network_interfaces

PRODUCTION = "10.1.230.172"  # ct129 in inventory/production.example.yaml


@pytest.fixture
def jailed():
    if not in_network_jail():
        why = (f"not inside the network jail (interfaces: {', '.join(network_interfaces())}); `make test` "
               f"runs the suite in one")
        if os.environ.get("CI") not in (None, "", "0", "false"):
            pytest.fail(f"CI must run the suite jailed: {why}")
        pytest.skip(why)


def test_the_suite_runs_in_its_own_network_namespace_with_only_lo_up(jailed):
    assert network_interfaces() == ["lo"]
    # lo is up: a loopback connect reaches the kernel and is refused (nothing listens on port 9),
    # where a down lo would answer "network unreachable" and the lab could not run.
    with socket.socket() as sock, pytest.raises(ConnectionRefusedError):
        sock.connect(("127.0.4.250", 9))


@pytest.mark.parametrize("address", [PRODUCTION, "10.0.0.1", "8.8.8.8"])
def test_connect_outside_loopback_is_unreachable_with_guard_and_fence_off(jailed, monkeypatch, address):
    monkeypatch.delenv("SGLFLEET_LOOPBACK_ONLY")
    with netfence.suspended():
        with socket.socket() as sock, pytest.raises(OSError) as raw:
            sock.settimeout(5)
            sock.connect((address, 22))
        conn = Connection(Host(name="ct129", address=address), KnownHosts(ROOT / "nonexistent-known-hosts"),
                          connect_attempts=1)
        with pytest.raises(ConnectError) as through_sglfleet:
            conn.run("true")
    assert raw.value.errno == errno.ENETUNREACH
    assert "Network is unreachable" in str(through_sglfleet.value)


def test_ipv6_outside_loopback_is_unreachable_too(jailed):
    with netfence.suspended(), socket.socket(socket.AF_INET6) as sock, pytest.raises(OSError) as raw:
        sock.settimeout(5)
        sock.connect(("2001:4860:4860::8888", 22))
    assert raw.value.errno == errno.ENETUNREACH


def test_cli_with_the_guard_off_and_no_fence_cannot_reach_production(jailed):
    """The whole CLI, as a user would run it against production, with nothing but the jail in the way."""
    env = {k: v for k, v in os.environ.items() if k not in ("SGLFLEET_TEST_FENCE_LOG", "PYTHONPATH")}
    env["SGLFLEET_LOOPBACK_ONLY"] = "0"
    proc = subprocess.run([sys.executable, "-m", "orchestrator.cli", "facts", "ct129", "-i",
                           str(ROOT / "inventory" / "production.example.yaml"), "--json"],
                          capture_output=True, text=True, env=env, cwd=ROOT, timeout=120)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    host = json.loads(proc.stdout)["hosts"]["ct129"]
    assert not host["ok"] and "Network is unreachable" in json.dumps(host), host
    assert "No connection was attempted" not in proc.stdout  # the guard really was off


# ---------------------------------------------------------------- the fence (runs anywhere: it refuses first)


def test_fence_is_installed_for_the_session():
    assert netfence.installed()


@pytest.mark.parametrize("target", [(PRODUCTION, 22), ("10.0.0.1", 22), ("::1", 22), ("192.168.1.5", 80)])
def test_fence_refuses_connects_outside_127_8(target):
    family = socket.AF_INET6 if ":" in target[0] else socket.AF_INET
    with netfence.unlogged(), socket.socket(family) as sock:
        with pytest.raises(netfence.OutsideLoopback, match="refused connect"):
            sock.connect(target)
        with pytest.raises(netfence.OutsideLoopback):
            sock.connect_ex(target)


def test_fence_refuses_udp_sends_and_name_lookups():
    with netfence.unlogged(), socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        with pytest.raises(netfence.OutsideLoopback, match="refused sendto"):
            sock.sendto(b"x", ("10.255.255.53", 53))
        with pytest.raises(netfence.OutsideLoopback, match="refused name lookup"):
            socket.getaddrinfo("ct129.example.com", 22)
    assert socket.getaddrinfo("127.0.4.1", 22)  # literals and localhost resolve without a packet
    assert socket.getaddrinfo("localhost", 22, socket.AF_INET)


def test_fence_reaches_cli_subprocesses(tmp_path):
    """sglfleet() runs the CLI with the fence installed: a connect it refuses fails the calling test."""
    from .conftest import fenced_env

    code = ("import socket\n"
            "try:\n    socket.create_connection(('10.0.0.1', 22), timeout=1)\n"
            "except Exception as exc:\n    print(type(exc).__name__)\n")
    log = tmp_path / "fence.log"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                          env={**fenced_env(), "SGLFLEET_TEST_FENCE_LOG": str(log)})
    assert proc.stdout.strip() == "OutsideLoopback", proc.stdout + proc.stderr
    assert "refused connect to ('10.0.0.1', 22)" in log.read_text()
