"""known_hosts handling: `strict` (default) or `accept-new` (record once, then strict).

The file sits next to the inventory (`inventory/lab.yaml` -> `inventory/lab.known_hosts`).
A changed key is never accepted; the error names the file and line to fix.
"""

from __future__ import annotations

import fcntl
import os
import threading
from pathlib import Path

from ..errors import ConfigError, HostKeyError
from .ssh_library import paramiko
from paramiko.hostkeys import HostKeyEntry, HostKeys  # noqa: E402  (paramiko comes from ssh_library)

_write_lock = threading.Lock()


def known_hosts_name(address: str, port: int) -> str:
    """The name OpenSSH and paramiko look a key up by."""
    return address if port == 22 else f"[{address}]:{port}"


class KnownHosts:
    """One known_hosts file, parsed once per change of the file (not once per host), into an index
    by host name: paramiko's HostKeys.load checks every line against every earlier one and its
    lookup scans every entry (N^2 name comparisons to load, N per host), which at 1,000 hosts is
    seconds of the controller's CPU. Same answers: a name's keys are those of the entries naming
    it (hashed entries included), the first entry of each key type winning, as paramiko's lookup."""

    def __init__(self, path: str | os.PathLike):
        self.path = str(path)
        self._parsed: tuple[tuple[int, int] | None, _KeyIndex] | None = None
        self._lock = threading.Lock()

    def validate(self) -> list[tuple[int, HostKeyEntry]]:
        """Refuse a file paramiko cannot read (not UTF-8, a broken key) with file:line, before any
        connection; paramiko would raise from inside the connect, with no line at all. The
        file's entries with their lines, in order."""
        if not os.path.exists(self.path):
            return []
        try:
            raw = Path(self.path).read_bytes()
        except OSError as exc:
            raise ConfigError(f"cannot read the known_hosts file: {exc.strerror}", self.path) from None
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise ConfigError(f"the known_hosts file is not UTF-8 text (byte 0x{raw[exc.start]:02x}); "
                              "fix or delete that line", self.path, raw[:exc.start].count(b"\n") + 1) from None
        entries = []
        for number, line in enumerate(text.splitlines(), 1):
            if not line.strip() or line.strip().startswith("#"):  # skipped, as ssh and paramiko skip them
                continue
            try:
                entry = HostKeyEntry.from_line(line, number)
            except Exception as exc:  # paramiko: InvalidHostKey, SSHException, base64 errors
                reason = exc.args[1] if isinstance(exc, paramiko.hostkeys.InvalidHostKey) and len(exc.args) > 1 \
                    else exc
                raise ConfigError(f"the known_hosts file has a broken entry ({reason}); fix or delete "
                                  f"line {number}", self.path, number) from None
            if entry is not None and entry.key is not None:  # None: a key type paramiko does not know
                entries.append((number, entry))
        return entries

    def _index(self) -> "_KeyIndex":
        try:
            stat = os.stat(self.path)
            version: tuple[int, int] | None = (stat.st_mtime_ns, stat.st_size)
        except FileNotFoundError:
            version = None
        with self._lock:
            if self._parsed is None or self._parsed[0] != version:
                self._parsed = (version, _KeyIndex(self.validate() if version is not None else []))
            return self._parsed[1]

    def keys_for(self, name: str) -> dict[str, paramiko.PKey]:
        """Key type -> key recorded for `name` (as `known_hosts_name` spells it), hashed entries included."""
        return self._index().keys_for(name)

    def line_of(self, name: str) -> int | None:
        """1-based line of the first entry for `name` (hashed entries included)."""
        return self._index().line_of(name)

    def add(self, name: str, key: paramiko.PKey) -> None:
        """Append one entry, safe against concurrent writers (threads and processes)."""
        Path(self.path).parent.mkdir(parents=True, exist_ok=True)
        with _write_lock, open(self.path, "a+", encoding="utf-8") as fh:
            fcntl.flock(fh, fcntl.LOCK_EX)
            fh.seek(0)
            if any(line.split()[:1] == [name] for line in fh if line.strip()):
                return
            fh.write(f"{name} {key.get_name()} {key.get_base64()}\n")
            fh.flush()
            os.fsync(fh.fileno())


class StrictPolicy(paramiko.MissingHostKeyPolicy):
    def __init__(self, known_hosts: KnownHosts):
        self.known_hosts = known_hosts

    def missing_host_key(self, client, hostname, key):  # noqa: ANN001 - paramiko's signature
        raise HostKeyError(
            f"unknown host key for {hostname} ({key.get_name()} {key.fingerprint}): it is not in "
            f"{self.known_hosts.path}. Verify the fingerprint, then rerun with "
            f"--host-key-policy accept-new to record it (or set host_key_policy: accept-new).")


class AcceptNewPolicy(paramiko.MissingHostKeyPolicy):
    """Records a key seen for the first time; a changed key still fails (paramiko checks it)."""

    def __init__(self, known_hosts: KnownHosts):
        self.known_hosts = known_hosts

    def missing_host_key(self, client, hostname, key):  # noqa: ANN001
        self.known_hosts.add(hostname, key)
        client.get_host_keys().add(hostname, key.get_name(), key)


class _KeyIndex:
    """The entries of one known_hosts file by host name; hashed names (|1|salt|hash) are checked
    one by one, since only hashing the name asked for can match them."""

    def __init__(self, entries: list[tuple[int, HostKeyEntry]]):
        self.by_name: dict[str, list[int]] = {}
        self.hashed: list[tuple[int, str]] = []
        self.lines = [number for number, _ in entries]
        self.entries = [entry for _, entry in entries]
        for index, entry in enumerate(self.entries):
            for name in entry.hostnames:
                if name.startswith("|1|"):
                    self.hashed.append((index, name))
                else:
                    self.by_name.setdefault(name, []).append(index)

    def _matching(self, name: str) -> list[int]:
        """The entries naming `name`, in file order."""
        found = set(self.by_name.get(name, ()))
        if name.startswith("|1|"):  # paramiko compares a hashed name as it is
            found.update(index for index, hashed in self.hashed if hashed == name)
        else:
            found.update(index for index, hashed in self.hashed if HostKeys.hash_host(name, hashed) == hashed)
        return sorted(found)

    def keys_for(self, name: str) -> dict[str, paramiko.PKey]:
        keys: dict[str, paramiko.PKey] = {}
        for index in self._matching(name):
            key = self.entries[index].key
            keys.setdefault(key.get_name(), key)
        return keys

    def line_of(self, name: str) -> int | None:
        found = self._matching(name)
        return self.lines[found[0]] if found else None


def changed_key_error(known_hosts: KnownHosts, exc: paramiko.BadHostKeyException) -> HostKeyError:
    line = known_hosts.line_of(exc.hostname)
    where = f"{known_hosts.path}:{line}" if line else known_hosts.path
    return HostKeyError(
        f"HOST KEY CHANGED for {exc.hostname}: the server offered {exc.key.get_name()} "
        f"{exc.key.fingerprint} but {where} records {exc.expected_key.get_name()} "
        f"{exc.expected_key.fingerprint}. This can mean a reinstalled host or an attack; refusing to "
        f"connect. If the change is expected, delete line {line or '?'} of {known_hosts.path} and "
        f"reconnect with --host-key-policy accept-new.")


def make_policy(name: str, known_hosts: KnownHosts) -> paramiko.MissingHostKeyPolicy:
    if name == "accept-new":
        return AcceptNewPolicy(known_hosts)
    return StrictPolicy(known_hosts)
