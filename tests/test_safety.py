"""SGLFLEET_LOOPBACK_ONLY=1 refuses non-loopback targets before any socket exists."""

from __future__ import annotations

import socket

import pytest

from orchestrator.errors import LoopbackOnlyError
from orchestrator.fleet.hostkeys import KnownHosts
from orchestrator.fleet.inventory import Host
from orchestrator.fleet.safety import check_target
from orchestrator.fleet.transport import Connection

from .conftest import ROOT, sglfleet


class BlockedByTest(Exception):
    """What the fake network raises. Not an OSError, so no retry loop takes it for a flaky link."""


class NoNetwork:
    """A blocking fake of the socket module's ways out: each attempt is recorded and raises, and
    none reaches the real network, so a broken guard fails the test without a packet sent. (Under
    `make test` the network jail and the suite's fence would stop it too; this test does not rely on them.)"""

    ENTRY_POINTS = ("socket", "create_connection", "getaddrinfo", "socketpair", "fromfd")

    def __init__(self, monkeypatch):
        self.attempts: list[tuple[str, tuple]] = []
        for name in self.ENTRY_POINTS:
            monkeypatch.setattr(socket, name, self._refuse(name))

    def _refuse(self, name):
        def blocked(*args, **kwargs):
            self.attempts.append((name, args))
            raise BlockedByTest(f"socket.{name}{args} called: the guard let a connection through")
        return blocked


def test_the_fake_blocks_and_records(monkeypatch):
    net = NoNetwork(monkeypatch)
    with pytest.raises(BlockedByTest):
        socket.create_connection(("10.1.230.172", 22))
    with pytest.raises(BlockedByTest):
        socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    assert [name for name, _ in net.attempts] == ["create_connection", "socket"]


@pytest.mark.parametrize("address", ["10.1.230.172", "192.168.1.5", "8.8.8.8", "::1", "ct129.example.com"])
def test_non_loopback_target_refused_without_a_socket(monkeypatch, tmp_path, address):
    monkeypatch.setenv("SGLFLEET_LOOPBACK_ONLY", "1")
    net = NoNetwork(monkeypatch)
    conn = Connection(Host(name="ct129", address=address), KnownHosts(tmp_path / "kh"))
    with pytest.raises(LoopbackOnlyError, match="No connection was attempted"):
        conn.run("true")
    assert net.attempts == []


def test_jump_host_is_checked_too(monkeypatch, tmp_path):
    monkeypatch.setenv("SGLFLEET_LOOPBACK_ONLY", "1")
    net = NoNetwork(monkeypatch)
    host = Host(name="ct129", address="127.0.1.1", proxy_jump="root@10.0.0.1")
    with pytest.raises(LoopbackOnlyError, match="jump host"):
        Connection(host, KnownHosts(tmp_path / "kh")).run("true")
    assert net.attempts == []


@pytest.mark.parametrize("address", ["127.0.0.1", "127.0.1.77", "localhost"])
def test_loopback_targets_pass_the_guard(monkeypatch, address):
    monkeypatch.setenv("SGLFLEET_LOOPBACK_ONLY", "1")
    check_target(address)


def test_guard_is_off_without_the_variable(monkeypatch):
    monkeypatch.delenv("SGLFLEET_LOOPBACK_ONLY", raising=False)
    check_target("10.1.230.172")  # no exception: production use


def test_cli_refuses_production_inventory_under_loopback_only():
    # sglfleet() runs the CLI with the suite's network fence installed (a refused connect fails
    # this test through conftest's fence log), and `make test` runs it all in the network jail.
    proc = sglfleet("facts", "ct129", "-i", str(ROOT / "inventory" / "production.example.yaml"), "--json")
    assert proc.returncode == 1
    assert "10.1.230.172" in proc.stdout and "No connection was attempted" in proc.stdout
