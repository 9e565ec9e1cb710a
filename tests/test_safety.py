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


class NoSockets:
    """Records every socket creation; the guard must create none."""

    def __init__(self, monkeypatch):
        self.created = []
        real = socket.socket

        def tracking(*args, **kwargs):
            self.created.append(args)
            return real(*args, **kwargs)

        monkeypatch.setattr(socket, "socket", tracking)
        monkeypatch.setattr(socket, "create_connection",
                            lambda *a, **k: self.created.append(a) or (_ for _ in ()).throw(AssertionError))


@pytest.mark.parametrize("address", ["10.1.230.172", "192.168.1.5", "8.8.8.8", "::1", "ct129.example.com"])
def test_non_loopback_target_refused_without_a_socket(monkeypatch, tmp_path, address):
    monkeypatch.setenv("SGLFLEET_LOOPBACK_ONLY", "1")
    sockets = NoSockets(monkeypatch)
    conn = Connection(Host(name="ct129", address=address), KnownHosts(tmp_path / "kh"))
    with pytest.raises(LoopbackOnlyError, match="No connection was attempted"):
        conn.run("true")
    assert sockets.created == []


def test_jump_host_is_checked_too(monkeypatch, tmp_path):
    monkeypatch.setenv("SGLFLEET_LOOPBACK_ONLY", "1")
    sockets = NoSockets(monkeypatch)
    host = Host(name="ct129", address="127.0.1.1", proxy_jump="root@10.0.0.1")
    with pytest.raises(LoopbackOnlyError, match="jump host"):
        Connection(host, KnownHosts(tmp_path / "kh")).run("true")
    assert sockets.created == []


@pytest.mark.parametrize("address", ["127.0.0.1", "127.0.1.77", "localhost"])
def test_loopback_targets_pass_the_guard(monkeypatch, address):
    monkeypatch.setenv("SGLFLEET_LOOPBACK_ONLY", "1")
    check_target(address)


def test_guard_is_off_without_the_variable(monkeypatch):
    monkeypatch.delenv("SGLFLEET_LOOPBACK_ONLY", raising=False)
    check_target("10.1.230.172")  # no exception: production use


def test_cli_refuses_production_inventory_under_loopback_only():
    proc = sglfleet("facts", "ct129", "-i", str(ROOT / "inventory" / "production.example.yaml"), "--json")
    assert proc.returncode == 1
    assert "10.1.230.172" in proc.stdout and "No connection was attempted" in proc.stdout
