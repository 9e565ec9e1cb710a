"""One SSH connection per host, reused by every step of a command run.

Fabric's `Connection` sets up the client (gateway/ProxyJump, auth arguments); we replace
its host-key handling (Fabric auto-adds keys) and run commands on raw paramiko channels,
because we need what Fabric's runner does not give: the complete output with no cap,
stdin streamed while output is read, and a timeout that really kills the remote command.
"""

from __future__ import annotations

import io
import os
import shlex
import tarfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any, Callable

import fabric
import paramiko
from tenacity import Retrying, retry_if_exception, stop_after_attempt, wait_exponential

from ..errors import ConfigError, ConnectError, HostKeyError, LoopbackOnlyError
from .hostkeys import KnownHosts, changed_key_error, known_hosts_name, make_policy
from .inventory import Host
from .safety import check_target

# The first line of stdout of every command is this marker with the remote shell's pid.
# sshd makes that shell a session and process-group leader, so `kill -- -PGID` reaches
# the whole command tree when a timeout fires.
_PGID_MARKER = b"sglfleet-pgid "
_CHUNK = 1 << 20

StdinType = bytes | str | IO[bytes] | Callable[[IO[bytes]], None] | None


@dataclass
class CommandResult:
    host: str
    command: str
    exit_code: int | None
    stdout: bytes
    stderr: bytes
    duration: float
    timed_out: bool = False
    stdin_bytes: int = 0

    @property
    def ok(self) -> bool:
        return self.exit_code == 0 and not self.timed_out

    @property
    def stdout_text(self) -> str:
        return self.stdout.decode("utf-8", "replace")

    @property
    def stderr_text(self) -> str:
        return self.stderr.decode("utf-8", "replace")


@dataclass
class PushResult:
    files: int
    bytes_sent: int
    duration: float
    remote_dir: str
    result: CommandResult = field(repr=False)


def _retryable(exc: BaseException) -> bool:
    if isinstance(exc, (LoopbackOnlyError, HostKeyError, paramiko.AuthenticationException,
                        paramiko.BadHostKeyException)):
        return False
    return isinstance(exc, (OSError, EOFError, paramiko.SSHException,
                            paramiko.ssh_exception.NoValidConnectionsError))


class StreamWriter(io.RawIOBase):
    """A file-like sink for tarfile (or any writer): counts what passes and, with `rate`
    (bytes/s), paces it. Streams a command's stdin into a channel, and --bwlimit's pacing."""

    def __init__(self, sink: Callable[[bytes], Any], rate: float | None = None):
        self.sink = sink
        self.rate = rate
        self.count = 0
        self.started = time.monotonic()

    def writable(self) -> bool:
        return True

    def write(self, data: Any) -> int:
        data = bytes(data)
        if self.rate:
            ahead = (self.count + len(data)) / self.rate - (time.monotonic() - self.started)
            if ahead > 0:
                time.sleep(ahead)
        self.sink(data)
        self.count += len(data)
        return len(data)


class Connection:
    """An SSH connection to one inventory host, opened lazily and reused."""

    def __init__(self, host: Host, known_hosts: KnownHosts, host_key_policy: str | None = None,
                 jump_host: Host | None = None, connect_attempts: int = 3):
        self.host = host
        self.known_hosts = known_hosts
        self.policy_name = host_key_policy or host.host_key_policy
        self.jump_host = jump_host
        self.connect_attempts = connect_attempts
        self._fabric: fabric.Connection | None = None
        self._lock = threading.Lock()

    # ------------------------------------------------------------ connecting

    def _make_fabric(self, host: Host, gateway: fabric.Connection | None) -> fabric.Connection:
        # lazy=True: Fabric must not read ~/.ssh/config itself; the inventory already merged it.
        config = fabric.Config(lazy=True)
        connect_kwargs: dict[str, Any] = {"banner_timeout": host.connect_timeout,
                                          "auth_timeout": host.connect_timeout}
        if host.identity_files:
            connect_kwargs["key_filename"] = list(host.identity_files)
            connect_kwargs["look_for_keys"] = False
        conn = fabric.Connection(host=host.address, user=host.user, port=host.port, config=config,
                                 gateway=gateway or False, connect_timeout=int(host.connect_timeout),
                                 connect_kwargs=connect_kwargs)
        client = paramiko.SSHClient()
        # Only this host's recorded keys: paramiko checks the server's key against these.
        name = known_hosts_name(host.address, host.port)
        for key_type, key in self.known_hosts.keys_for(name).items():
            client.get_host_keys().add(name, key_type, key)
        client.set_missing_host_key_policy(make_policy(self.policy_name, self.known_hosts))
        conn.client = client
        return conn

    def _jump(self) -> fabric.Connection | None:
        if not self.host.proxy_jump:
            return None
        jump = self.jump_host or _parse_jump(self.host.proxy_jump, self.host)
        check_target(jump.address, f"jump host of {self.host.name}")
        return self._make_fabric(jump, None)

    def open(self) -> None:
        with self._lock:
            if self._fabric is not None and self._fabric.is_connected:
                return
            check_target(self.host.address, f"host {self.host.name}")
            missing = [f for f in self.host.identity_files if not os.path.isfile(os.path.expanduser(f))]
            if missing:
                raise ConnectError(f"{self.host.name}: identity_file {', '.join(missing)} does not exist on this "
                                   "machine; fix identity_file (or ansible_ssh_private_key_file) in the inventory")
            try:
                for attempt in Retrying(stop=stop_after_attempt(self.connect_attempts),
                                        wait=wait_exponential(multiplier=0.25, max=2),
                                        retry=retry_if_exception(_retryable), reraise=True):
                    with attempt:
                        conn = self._make_fabric(self.host, self._jump())
                        conn.open()
                        conn.transport.set_keepalive(15)
                        self._fabric = conn
            except paramiko.BadHostKeyException as exc:
                raise changed_key_error(self.known_hosts, exc) from None
            except paramiko.AuthenticationException as exc:
                raise ConnectError(f"{self.host.name}: authentication failed for {self.host.target} "
                                   f"({exc}); check user and identity_file in the inventory") from None
            except (HostKeyError, LoopbackOnlyError):
                raise
            except (OSError, EOFError, paramiko.SSHException) as exc:
                reason = getattr(exc, "strerror", None) or str(exc) or type(exc).__name__
                raise ConnectError(f"{self.host.name}: cannot connect to {self.host.target} after "
                                   f"{self.connect_attempts} attempts: {reason}") from None

    @property
    def transport(self) -> paramiko.Transport:
        self.open()
        assert self._fabric is not None
        return self._fabric.transport

    def close(self) -> None:
        # Swapped out first: `logs -f` closes a connection from its host's thread (a dropped
        # read) and from the main thread (Ctrl-C) at once; a closed fabric may be closed twice.
        fabric, self._fabric = self._fabric, None
        if fabric is not None:
            fabric.close()

    def __enter__(self) -> "Connection":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    # ------------------------------------------------------------ running

    def run(self, command: str, stdin: StdinType = None, timeout: float | None = None) -> CommandResult:
        """Run `command` in the remote user's shell; never retried, never truncated."""
        channel = self.transport.open_session()
        wrapped = f"printf 'sglfleet-pgid %s\\n' \"$$\"; {command}"
        started = time.monotonic()
        channel.exec_command(wrapped)
        writer = StreamWriter(channel.sendall)
        # Blocking reader threads, one per stream: no polling, so many hosts at once cost
        # no CPU while they wait.
        stdout, stderr = _StreamReader(channel.recv), _StreamReader(channel.recv_stderr)
        threads = [threading.Thread(target=_feed_stdin, args=(channel, writer, stdin), daemon=True),
                   threading.Thread(target=stdout.read_all, daemon=True),
                   threading.Thread(target=stderr.read_all, daemon=True)]
        for thread in threads:
            thread.start()
        deadline = None if timeout is None else started + timeout
        for thread in threads[1:]:
            thread.join(None if deadline is None else max(0.0, deadline - time.monotonic()))
        timed_out = any(t.is_alive() for t in threads[1:])
        if timed_out:
            self._kill_group(_pgid(stdout))
            channel.close()
            exit_code = None
        else:
            exit_code = channel.recv_exit_status()
            channel.close()
        for thread in threads:
            thread.join(timeout=5)
        return CommandResult(self.host.name, command, exit_code, _strip_header(stdout.data), bytes(stderr.data),
                             time.monotonic() - started, timed_out, writer.count)

    def _kill_group(self, pgid: int | None) -> None:
        if pgid is None:
            return
        # TERM first so the command can clean up, KILL for whatever ignores it.
        group = shlex.quote(f"-{pgid}")
        cleanup = self.transport.open_session()
        cleanup.exec_command(f"kill -TERM -- {group} 2>/dev/null; sleep 1; kill -KILL -- {group} 2>/dev/null; true")
        cleanup.recv_exit_status()
        cleanup.close()

    def put_tree(self, local_dir: str | Path, remote_dir: str, timeout: float | None = None) -> PushResult:
        """Push a directory tree as ONE tar stream over one exec channel."""
        local = Path(local_dir)
        if not local.is_dir():
            raise FileNotFoundError(f"not a directory: {local}")
        files = sum(1 for p in local.rglob("*") if p.is_file())

        def write_tar(fileobj: IO[bytes]) -> None:
            with tarfile.open(fileobj=fileobj, mode="w|", format=tarfile.PAX_FORMAT) as tar:
                for path in sorted(local.rglob("*")):
                    tar.add(path, arcname=str(path.relative_to(local)), recursive=False)

        dest = shlex.quote(remote_dir)
        result = self.run(f"mkdir -p {dest} && tar -x -f - -C {dest} --no-same-owner",
                          stdin=write_tar, timeout=timeout)
        return PushResult(files, result.stdin_bytes, result.duration, remote_dir, result)


def _parse_jump(spec: str, target: Host) -> Host:
    """`[user@]host[:port]` as in OpenSSH's ProxyJump."""
    user, _, rest = spec.rpartition("@")
    address, _, port = rest.partition(":")
    if not address or (port and not (port.isdigit() and 1 <= int(port) <= 65535)):
        raise ConfigError(f"{target.name}: proxy jump {spec!r} is not [user@]host[:port]")
    return Host(name=f"jump:{spec}", address=address, port=int(port) if port else 22,
                user=user or target.user, identity_files=target.identity_files,
                host_key_policy=target.host_key_policy, connect_timeout=target.connect_timeout)


def feed(writer: IO[bytes], stdin: StdinType) -> None:
    """Write a command's stdin (bytes, text, a file, or a function that writes) into `writer`."""
    if stdin is None:
        return
    if isinstance(stdin, (bytes, bytearray, memoryview)):
        writer.write(stdin)
    elif isinstance(stdin, str):
        writer.write(stdin.encode())
    elif callable(stdin):
        stdin(writer)
    else:
        while chunk := stdin.read(_CHUNK):
            writer.write(chunk)


def _feed_stdin(channel: paramiko.Channel, writer: StreamWriter, stdin: StdinType) -> None:
    try:
        feed(writer, stdin)
    except (OSError, EOFError, paramiko.SSHException):
        pass  # the remote side closed early; its exit status and stderr say why
    finally:
        try:
            channel.shutdown_write()
        except (OSError, EOFError, paramiko.SSHException):
            pass


class _StreamReader:
    """Reads one channel stream to EOF into memory (no cap: callers asked for everything)."""

    def __init__(self, recv: Callable[[int], bytes]):
        self.recv = recv
        self.data = bytearray()

    def read_all(self) -> None:
        try:
            while chunk := self.recv(_CHUNK):
                self.data += chunk
        except (OSError, EOFError, paramiko.SSHException):
            pass  # channel closed under us (timeout kill); keep what arrived


def _pgid(reader: _StreamReader) -> int | None:
    line, newline, _ = bytes(reader.data[:64]).partition(b"\n")
    if newline and line.startswith(_PGID_MARKER):
        return int(line[len(_PGID_MARKER):])
    return None


def _strip_header(data: bytearray) -> bytes:
    if data.startswith(_PGID_MARKER):
        newline = data.find(b"\n")
        if newline >= 0:
            return bytes(data[newline + 1:])
    return bytes(data)
