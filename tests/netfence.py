"""The test suite's own network fence: any connect, send or name lookup aimed outside 127.0.0.0/8 raises.

One of three layers that keep the suite off real hosts, none depending on another:
  1. `make test` runs pytest in a network namespace whose only interface is lo (the jail);
  2. this fence, installed for the whole session by conftest.py, and in every CLI subprocess
     the tests start (through `fence_site/sitecustomize.py`, which loads it when SGLFLEET_TEST_FENCE_LOG is set);
  3. sglfleet's own guard (orchestrator/fleet/safety.py), the code under test.
The fence is written without the guard's code so a broken guard cannot open it. Each refusal is
also appended to a log, so conftest can fail the test even when the code swallows the exception.
"""

from __future__ import annotations

import contextlib
import ipaddress
import os
import socket
from typing import Any

LOOPBACK = ipaddress.ip_network("127.0.0.0/8")
# The only name allowed: /etc/hosts maps it to 127.0.0.1 and looking it up sends nothing.
LOCAL_NAMES = {"localhost"}

REAL_CONNECT = socket.socket.connect
REAL_CONNECT_EX = socket.socket.connect_ex
REAL_SENDTO = socket.socket.sendto
REAL_SENDMSG = socket.socket.sendmsg
REAL_GETADDRINFO = socket.getaddrinfo


class OutsideLoopback(Exception):
    """Not an OSError on purpose: retry loops that retry OSError must not swallow it."""


_state: dict[str, Any] = {"log": None, "installed": False, "suspended": 0}


def is_loopback(host: Any) -> bool:
    if isinstance(host, bytes):
        host = host.decode("ascii", "replace")
    if not isinstance(host, str):
        return False
    if host in LOCAL_NAMES:
        return True
    try:
        address = ipaddress.ip_address(host.split("%", 1)[0])
    except ValueError:
        return False
    if address.version == 6 and address.ipv4_mapped is not None:
        address = address.ipv4_mapped
    return address.version == 4 and address in LOOPBACK


def _refuse(what: str, target: Any) -> None:
    message = (f"network fence (tests/netfence.py): refused {what} to {target!r}: the test suite may only "
               f"reach 127.0.0.0/8")
    if _state["log"]:
        with open(_state["log"], "a", encoding="utf-8") as fh:
            fh.write(f"pid {os.getpid()}: {message}\n")
    raise OutsideLoopback(message)


def _check(sock: socket.socket | None, address: Any, what: str) -> None:
    if _state["suspended"]:
        return
    if sock is not None and sock.family not in (socket.AF_INET, socket.AF_INET6):
        return  # unix sockets, netlink: no network
    host = address[0] if isinstance(address, tuple) and address else address
    if not is_loopback(host):
        _refuse(what, address)


def _connect(self, address):
    _check(self, address, "connect")
    return REAL_CONNECT(self, address)


def _connect_ex(self, address):
    _check(self, address, "connect")
    return REAL_CONNECT_EX(self, address)


def _sendto(self, data, *rest):
    if rest:
        _check(self, rest[-1], "sendto")
    return REAL_SENDTO(self, data, *rest)


def _sendmsg(self, buffers, *rest):
    if len(rest) >= 3 and rest[2] is not None:
        _check(self, rest[2], "sendmsg")
    return REAL_SENDMSG(self, buffers, *rest)


def _getaddrinfo(host, *args, **kwargs):
    # A name that is not an IP literal would be a DNS query: a packet to a non-loopback resolver.
    if host not in (None, b"", "") and not _state["suspended"]:
        try:
            ipaddress.ip_address(host.decode() if isinstance(host, bytes) else host)
        except ValueError:
            if not is_loopback(host):
                _refuse("name lookup", host)
    return REAL_GETADDRINFO(host, *args, **kwargs)


PATCHES = {(socket.socket, "connect"): _connect, (socket.socket, "connect_ex"): _connect_ex,
           (socket.socket, "sendto"): _sendto, (socket.socket, "sendmsg"): _sendmsg,
           (socket, "getaddrinfo"): _getaddrinfo}


def install(log_path: str | None = None) -> None:
    _state["log"] = log_path
    if not _state["installed"]:
        for (owner, name), replacement in PATCHES.items():
            setattr(owner, name, replacement)
        _state["installed"] = True


def uninstall() -> None:
    for (owner, name), _ in PATCHES.items():
        setattr(owner, name, {"connect": REAL_CONNECT, "connect_ex": REAL_CONNECT_EX, "sendto": REAL_SENDTO,
                              "sendmsg": REAL_SENDMSG, "getaddrinfo": REAL_GETADDRINFO}[name])
    _state["installed"] = False


def installed() -> bool:
    return _state["installed"] and socket.socket.connect is _connect


@contextlib.contextmanager
def unlogged():
    """Refusals still raise but are not logged: for tests of the fence itself."""
    saved, _state["log"] = _state["log"], None
    try:
        yield
    finally:
        _state["log"] = saved


@contextlib.contextmanager
def suspended():
    """Only for tests/test_jail.py, which proves the jail holds with every other layer off."""
    _state["suspended"] += 1
    try:
        yield
    finally:
        _state["suspended"] -= 1
