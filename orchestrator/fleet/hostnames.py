"""Ansible's host-name syntax: `name:port` keys and `[x:y]` / `[x:y:step]` / `[a:f]` ranges.

Both the inventory (host keys such as `www[01:50].example.com` or `badwolf.example.com:5309`)
and the host pattern splitter (a pattern that is a single address is not split on `:`) need to
tell an address apart from other text, the way ansible-core does:

- a trailing `:NN` is a port when what precedes it has no bare `:` (ranges in brackets may);
  `[anything]:NN` is a bracketed address (the only way to give an IPv6 address a port);
- what remains must be an IPv4 address, an IPv6 address or a DNS-like host name, each of which
  may contain ranges (numeric in addresses, numeric or one-letter in names).

Range expansion follows Ansible's rules: `[01:10]` keeps the zero padding (begin and end must
then have the same width), `[:5]` starts at 0, `[a:f]` walks a-z then A-Z, a step may follow,
and several ranges in one name multiply out, left to right.
"""

from __future__ import annotations

import ipaddress
import re
import string

# Ranges accepted inside an address or a name (the grammar Ansible's parse_address accepts).
_NUMERIC_RANGE = r"\[[0-9]+:[0-9]+(?::[0-9]+)?\]"
_HEX_RANGE = r"\[[0-9a-f]+:[0-9a-f]+(?::[0-9]+)?\]"
_NAME_RANGE = r"\[(?:[a-z]:[a-z]|[0-9]+:[0-9]+)(?::[0-9]+)?\]"

_BRACKETED_WITH_PORT = re.compile(r"^\[(.+)\]:([0-9]+)$")
_WITH_PORT = re.compile(r"^((?:[^:\[\]]|\[[^\]]*\])*):([0-9]+)$")
_IPV4_PART = rf"(?:25[0-5]|2[0-4][0-9]|[01]?[0-9]{{1,2}}|{_NUMERIC_RANGE})"
_IPV4 = re.compile(rf"^(?:{_IPV4_PART}\.){{3}}{_IPV4_PART}$", re.I)
_LABEL = rf"(?:\w|{_NAME_RANGE})(?:[\w-]|{_NAME_RANGE})*(?<![_-])"
_HOSTNAME = re.compile(rf"^{_LABEL}(?:\.{_LABEL})*$", re.I | re.UNICODE)
_HEX_RANGE_RE = re.compile(_HEX_RANGE, re.I)

MAX_EXPANSION = 1_000_000  # hosts from one key; more is a typo, not a fleet


class NotAnAddress(ValueError):
    """The text is not a host name or address with an optional port."""


class BadRange(ValueError):
    """A `[...]` range in a host name that cannot be expanded."""


def _is_ipv6(text: str) -> bool:
    # Ranges stand where a 16-bit group would: check the shape with a plain group in their place.
    plain = _HEX_RANGE_RE.sub("0", text)
    if "[" in plain or "]" in plain or "%" in plain:
        return False
    try:
        ipaddress.IPv6Address(plain)
    except ValueError:
        return False
    return True


def parse_address(text: str, allow_ranges: bool = True) -> tuple[str, int | None]:
    """(host, port or None) for `host`, `host:port`, `[host]:port`; NotAnAddress otherwise."""
    port: int | None = None
    host_part = text
    for form in (_BRACKETED_WITH_PORT, _WITH_PORT):  # as Ansible: the second may apply after the first
        found = form.match(host_part)
        if found:
            host_part, port = found.group(1), int(found.group(2))
    if not (_IPV4.match(host_part) or _HOSTNAME.match(host_part) or _is_ipv6(host_part)):
        raise NotAnAddress(f"not a host name or address: {text}")
    if not allow_ranges and "[" in host_part:
        raise NotAnAddress(f"a range is not allowed here: {text}")
    return host_part, port


def split_host_key(key: str) -> tuple[str, int | None]:
    """An inventory host key as Ansible reads it: (name pattern, port or None)."""
    try:
        return parse_address(key)
    except NotAnAddress:
        return key, None  # Ansible keeps keys it cannot parse as they are (ranges still expand)


def expand_ranges(name: str) -> list[str]:
    """Every host name a key with `[begin:end(:step)]` ranges stands for, in Ansible's order."""
    if "[" not in name:
        return [name]
    head, sep, rest = name.partition("[")
    body, close, tail = rest.partition("]")
    if not close:
        raise BadRange(f"'{name}': '[' without a closing ']'")
    bounds = body.split(":")
    if len(bounds) not in (2, 3):
        raise BadRange(f"'{name}': a host range is [begin:end] or [begin:end:step], got [{body}]")
    begin, end = bounds[0] or "0", bounds[1]
    if not end:
        raise BadRange(f"'{name}': the host range [{body}] has no end")
    try:
        step = int(bounds[2]) if len(bounds) == 3 else 1
    except ValueError:
        raise BadRange(f"'{name}': the step of [{body}] is not a number") from None
    if step < 1:
        raise BadRange(f"'{name}': the step of [{body}] must be at least 1")
    width = len(begin) if begin.startswith("0") and len(begin) > 1 else 0
    if width and len(end) != width:
        raise BadRange(f"'{name}': a zero-padded range needs begin and end of the same width, got [{body}]")
    letters = string.ascii_letters  # a..z then A..Z, as Ansible walks them
    if len(begin) == 1 and len(end) == 1 and begin in letters and end in letters:
        first, last = letters.index(begin), letters.index(end)
        if first > last:
            raise BadRange(f"'{name}': the range [{body}] must have begin <= end")
        items = list(letters[first:last + 1:step])
    else:
        try:
            first, last = int(begin), int(end)
        except ValueError:
            raise BadRange(f"'{name}': [{body}] is neither a numeric nor a one-letter range") from None
        if first > last:
            # Ansible quietly expands this to no host at all; a key that names no host is a typo.
            raise BadRange(f"'{name}': the range [{body}] is empty (begin > end)")
        if (last - first) // step + 1 > MAX_EXPANSION:
            raise BadRange(f"'{name}': the range [{body}] names more than {MAX_EXPANSION} hosts")
        items = [str(i).zfill(width) if width else str(i) for i in range(first, last + 1, step)]
    result: list[str] = []
    for item in items:
        result.extend(expand_ranges(head + item + tail))
        if len(result) > MAX_EXPANSION:
            raise BadRange(f"'{name}' names more than {MAX_EXPANSION} hosts")
    return result
