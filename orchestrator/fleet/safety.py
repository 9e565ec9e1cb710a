"""The loopback-only guard: with SGLFLEET_LOOPBACK_ONLY=1 nothing leaves 127.0.0.0/8.

The check runs before any socket is opened. A name that is not an IP literal is looked
up in /etc/hosts only: asking DNS would itself send a packet to a non-loopback resolver.
"""

from __future__ import annotations

import ipaddress
import os

from ..errors import LoopbackOnlyError

LOOPBACK = ipaddress.ip_network("127.0.0.0/8")


def loopback_only() -> bool:
    return os.environ.get("SGLFLEET_LOOPBACK_ONLY", "") not in ("", "0", "false", "no")


def _etc_hosts(name: str, path: str = "/etc/hosts") -> list[str]:
    found = []
    try:
        with open(path, encoding="utf-8") as fh:
            for line in fh:
                fields = line.split("#", 1)[0].split()
                if len(fields) >= 2 and name in fields[1:]:
                    found.append(fields[0])
    except OSError:
        pass
    return found


def resolve_offline(address: str) -> list[str]:
    """IP addresses for `address` without any network traffic."""
    try:
        return [str(ipaddress.ip_address(address))]
    except ValueError:
        return _etc_hosts(address)


def check_target(address: str, what: str = "target") -> None:
    """Refuse a non-loopback target when SGLFLEET_LOOPBACK_ONLY is set. Sends nothing."""
    if not loopback_only():
        return
    addresses = resolve_offline(address)
    if not addresses:
        raise LoopbackOnlyError(
            f"refusing to connect to {what} '{address}': SGLFLEET_LOOPBACK_ONLY=1 is set and the name "
            f"is not an IP literal or an /etc/hosts entry, so it cannot be shown to be in 127.0.0.0/8 "
            f"without a DNS query. No connection was attempted.")
    outside = [a for a in addresses if ipaddress.ip_address(a) not in LOOPBACK]
    if outside:
        raise LoopbackOnlyError(
            f"refusing to connect to {what} '{address}' ({', '.join(outside)}): SGLFLEET_LOOPBACK_ONLY=1 "
            f"allows only 127.0.0.0/8. No connection was attempted. Unset SGLFLEET_LOOPBACK_ONLY "
            f"to reach real hosts.")
