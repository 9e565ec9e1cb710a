"""One SSH connection per host, reused by every step of a command run.

The host is reached as OpenSSH would reach it (`ssh_resolve`: address, port, user, identity
files in order, IdentitiesOnly, ConnectTimeout, HostKeyAlias), through its ProxyJump chain (one
paramiko client per hop, each next hop a `direct-tcpip` channel of the previous one) or its
ProxyCommand (run with the user's shell, as ssh runs it, through `paramiko.ProxyCommand`). Host
keys are sglfleet's own (`hostkeys`: one policy, one known_hosts file) for every hop. Commands run
on raw paramiko channels: the complete output with no cap, stdin streamed while output is read,
and a timeout that really kills the remote command.

Under SGLFLEET_LOOPBACK_ONLY every hop and the target are checked before any socket exists, and
a ProxyCommand runs only when what it reaches can be read off it: `nc`/`ncat`/`netcat` [-4 -6 -N
-n -v -wN -qN] HOST PORT with HOST in 127.0.0.0/8, no shell syntax (anything else can reach any
address once it runs, so it is refused).
Round trips: the SSH handshake per hop, once per command run; then one channel per `run`.
"""

from __future__ import annotations

import dataclasses
import io
import os
import re
import select
import shlex
import socket
import tarfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any, Callable

from tenacity import Retrying, retry_if_exception, stop_after_attempt, wait_exponential

from ..errors import ConfigError, ConnectError, HostKeyError, LoopbackOnlyError
from .hostkeys import KnownHosts, changed_key_error, make_policy
from .inventory import Host, resolve_hosts
from .safety import check_target, loopback_only
from .ssh_library import paramiko
from .ssh_resolve import DEFAULT_CONNECT_TIMEOUT, SshEndpoint, parse_jump

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
        # An inventory host that sglfleet_proxy_jump names: reached as that host (its own vars).
        self.jump_host = jump_host
        self.connect_attempts = connect_attempts
        self._clients: list[paramiko.SSHClient] = []  # first hop ... target
        self._lock = threading.Lock()

    # ------------------------------------------------------------ connecting

    def route(self) -> list[SshEndpoint]:
        """The endpoints connected in turn: the ProxyJump hops, first hop first, then the host."""
        # A host not selected through Inventory.select (inventory.hosts[...]) is resolved now.
        self.host = _resolved(self.host)
        target = _endpoint_of(self.host)
        if self.jump_host is not None and self.host.proxy_jump == self.jump_host.name:
            self.jump_host = _resolved(self.jump_host)
            jump = _endpoint_of(self.jump_host)
            return jump.hops() + [jump, target]
        return target.hops() + [target]

    def _check_route(self, route: list[SshEndpoint]) -> None:
        """The loopback guard for every hop and for what a ProxyCommand would reach; sends nothing."""
        for index, endpoint in enumerate(route):
            what = f"host {self.host.name}" if index == len(route) - 1 else f"jump host of {self.host.name}"
            if endpoint.proxy_command is not None:
                _check_proxy_command(endpoint, what)
            else:
                check_target(endpoint.address, what)

    def _client(self, endpoint: SshEndpoint, sock: Any, timeout: float) -> paramiko.SSHClient:
        client = paramiko.SSHClient()
        # Only this name's recorded keys: paramiko checks the server's key against these.
        name = endpoint.key_name
        for key_type, key in self.known_hosts.keys_for(name).items():
            client.get_host_keys().add(name, key_type, key)
        client.set_missing_host_key_policy(make_policy(self.policy_name, self.known_hosts))
        # ssh skips identity files that do not exist; paramiko would fail on them
        keys = [f for f in endpoint.identity_files if os.path.isfile(f)]
        # The first key comes read already (paramiko tries `pkey`, then each file in order).
        first = private_key(keys[0]) if keys else None
        try:
            # hostname names the key (HostKeyAlias, [host]:port); the socket is already there
            # (paramiko names it [host]:port off port 22; a HostKeyAlias is used as it is, as ssh does)
            client.connect(endpoint.host_key_alias or endpoint.address,
                           22 if endpoint.host_key_alias else endpoint.port, endpoint.user, sock=sock,
                           pkey=first, key_filename=(keys[1:] if first else keys) or None, look_for_keys=False,
                           allow_agent=endpoint.use_agent and not endpoint.identities_only,
                           timeout=timeout, banner_timeout=timeout, auth_timeout=timeout,
                           transport_factory=_aead_first)
        except BaseException:
            client.close()
            raise
        return client

    def _open_route(self, route: list[SshEndpoint]) -> list[paramiko.SSHClient]:
        clients: list[paramiko.SSHClient] = []
        try:
            for index, endpoint in enumerate(route):
                # the host's own timeout is the inventory's or its config's; a hop's its config's
                timeout = (self.host.connect_timeout if index == len(route) - 1
                           else endpoint.connect_timeout or DEFAULT_CONNECT_TIMEOUT)
                if index == 0:
                    sock = _first_socket(endpoint, timeout)
                else:
                    sock = clients[-1].get_transport().open_channel(  # type: ignore[union-attr]
                        "direct-tcpip", (endpoint.address, endpoint.port), ("", 0), timeout=timeout)
                clients.append(self._client(endpoint, sock, timeout))
        except BaseException:
            for client in reversed(clients):
                client.close()
            raise
        return clients

    def open(self) -> None:
        with self._lock:
            if self._clients and self._clients[-1].get_transport() is not None \
                    and self._clients[-1].get_transport().is_active():  # type: ignore[union-attr]
                return
            self._close_clients()
            route = self.route()
            self._check_route(route)
            self._check_key_file()
            try:
                for attempt in Retrying(stop=stop_after_attempt(self.connect_attempts),
                                        wait=wait_exponential(multiplier=0.25, max=2),
                                        retry=retry_if_exception(_retryable), reraise=True):
                    with attempt:
                        clients = self._open_route(route)
                        clients[-1].get_transport().set_keepalive(15)  # type: ignore[union-attr]
                        self._clients = clients
            except paramiko.BadHostKeyException as exc:
                raise changed_key_error(self.known_hosts, exc) from None
            except paramiko.AuthenticationException as exc:
                raise ConnectError(f"{self.host.name}: authentication failed for {self.host.target}{_via(route)} "
                                   f"({exc}); check user and identity_file in the inventory"
                                   f"{_config_hint(route)}") from None
            except (HostKeyError, LoopbackOnlyError):
                raise
            except (OSError, EOFError, paramiko.SSHException) as exc:
                reason = getattr(exc, "strerror", None) or str(exc) or type(exc).__name__
                raise ConnectError(f"{self.host.name}: cannot connect to {self.host.target}{_via(route)} after "
                                   f"{self.connect_attempts} attempts: {reason}{_config_hint(route)}") from None

    def _check_key_file(self) -> None:
        """The inventory's own key file must exist (ssh warns and goes on; a deploy must not)."""
        for var in ("ansible_ssh_private_key_file", "ansible_private_key_file"):
            value = self.host.vars.get(var)
            if value:
                path = os.path.expanduser(str(value))
                if not os.path.isfile(path):
                    raise ConnectError(f"{self.host.name}: {var} {path} does not exist on this machine; fix it "
                                       "in the inventory")
                return
        if self.host.ssh_request is None:  # a Host made in code: its identity files are its own
            missing = [f for f in self.host.identity_files if not os.path.isfile(os.path.expanduser(f))]
            if missing:
                raise ConnectError(f"{self.host.name}: identity_file {', '.join(missing)} does not exist on this "
                                   "machine; fix identity_file (or ansible_ssh_private_key_file) in the inventory")

    @property
    def transport(self) -> paramiko.Transport:
        self.open()
        transport = self._clients[-1].get_transport()
        assert transport is not None
        return transport

    def _close_clients(self) -> None:
        for client in reversed(self._clients):  # the target first, then each hop it went through
            client.close()
        self._clients = []

    def close(self) -> None:
        self._close_clients()

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
        # stdin is fed by a thread of its own (a large stdin must not wait for the output to be
        # read); without stdin the write side is closed at once and no thread starts. Both output
        # streams are read by this thread, woken by the channel's readiness pipe: no polling, so
        # many hosts at once cost no CPU while they wait, and no reader threads (each is a thread
        # start, and one more thread contending for the GIL on every packet of every host).
        feeder = None
        if stdin is None:
            _shut_write(channel)
        else:
            feeder = threading.Thread(target=_feed_stdin, args=(channel, writer, stdin), daemon=True)
            feeder.start()
        deadline = None if timeout is None else started + timeout
        stdout, stderr = bytearray(), bytearray()
        timed_out = not _read_streams(channel, stdout, stderr, deadline)
        if timed_out:
            self._kill_group(_pgid(stdout))
            channel.close()
            exit_code = None
        else:
            exit_code = channel.recv_exit_status()
            channel.close()
        if feeder is not None:
            feeder.join(timeout=5)
        return CommandResult(self.host.name, command, exit_code, _strip_header(stdout), bytes(stderr),
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


AEAD_CIPHERS = ("aes128-gcm@openssh.com", "aes256-gcm@openssh.com")


def _aead_first(*args: Any, **kwargs: Any) -> paramiko.Transport:
    """A paramiko Transport that offers AES-GCM before paramiko's own order (AES-CTR with an HMAC):
    both are OpenSSH defaults, and the server still picks from what it allows, but with GCM the
    integrity check is the cipher's own, in C, where paramiko checks each packet's HMAC with a
    Python loop over its bytes (~0.2 ms of the controller's CPU per host, bench/peers.py)."""
    transport = paramiko.Transport(*args, **kwargs)
    options = transport.get_security_options()
    offered = tuple(options.ciphers)
    options.ciphers = tuple(c for c in AEAD_CIPHERS if c in offered) + tuple(c for c in offered
                                                                            if c not in AEAD_CIPHERS)
    return transport


_private_keys: dict[tuple[str, int, int, int], Any] = {}  # (path, inode, mtime, size) -> PKey or None
_private_keys_lock = threading.Lock()


def private_key(path: str) -> paramiko.PKey | None:
    """The private key in `path`, read once per command while the file stays the same (paramiko
    reads and parses a key file on every connection, trying each key type in turn); a certificate
    beside it (`path-cert.pub`) is loaded with it, as paramiko does. None when it cannot be read
    without help (a passphrase, a format paramiko does not know): the file then goes to paramiko
    as it is, which tries it and reports it as before."""
    try:
        st = os.stat(path)
    except OSError:
        return None
    version = (path, st.st_ino, st.st_mtime_ns, st.st_size)
    with _private_keys_lock:
        if version not in _private_keys:
            try:
                _private_keys[version] = paramiko.PKey.from_path(path)
            except Exception:  # paramiko's own errors, ValueError/TypeError from cryptography
                _private_keys[version] = None
        return _private_keys[version]


def _resolved(host: Host) -> Host:
    return resolve_hosts([host])[0] if host.ssh is None and host.ssh_request is not None else host


def _endpoint_of(host: Host) -> SshEndpoint:
    """What OpenSSH resolved for the host, or, for a Host made in code, the host as it is. The Host's
    own address, port, user and keys are what is connected to (resolution wrote them there; a Host
    changed after it, `dataclasses.replace(host, address=...)`, is reached where it now says)."""
    if host.ssh is not None:
        return dataclasses.replace(host.ssh, address=host.address, port=host.port, user=host.user,
                                   identity_files=host.identity_files)
    via = _literal_jump(host.proxy_jump, host) if host.proxy_jump and host.proxy_jump != "none" else None
    return SshEndpoint(destination=host.name, address=host.address, port=host.port, user=host.user,
                       identity_files=tuple(os.path.expanduser(f) for f in host.identity_files),
                       identities_only=False, use_agent=True,
                       connect_timeout=host.connect_timeout, host_key_alias=None, proxy_jump=host.proxy_jump,
                       proxy_command=None, via=via, config="none")


def _literal_jump(spec: str, target: Host) -> SshEndpoint:
    """A Host made in code with `proxy_jump` `[user@]host[:port]`: the hop with the target's keys."""
    try:
        user, address, port = parse_jump(spec.split(",")[-1])
    except ValueError as exc:
        raise ConfigError(f"{target.name}: {exc}") from None
    return SshEndpoint(destination=address, address=address, port=port or 22, user=user or target.user,
                       identity_files=tuple(os.path.expanduser(f) for f in target.identity_files),
                       identities_only=False, use_agent=True,
                       connect_timeout=target.connect_timeout, host_key_alias=None, proxy_jump=None,
                       proxy_command=None, via=None, config="none")


def _first_socket(endpoint: SshEndpoint, timeout: float) -> Any:
    """The first hop's byte stream: its ProxyCommand, run as ssh runs it, or a TCP connection."""
    if endpoint.proxy_command is not None:
        shell = os.environ.get("SHELL") or "/bin/sh"
        return paramiko.ProxyCommand(shlex.join([shell, "-c", f"exec {endpoint.proxy_command}"]))
    return socket.create_connection((endpoint.address, endpoint.port), timeout=timeout)


_NC = {"nc", "ncat", "netcat"}
_NC_FLAG = re.compile(r"^-(?:[46Nnv]+|[wq]\d+)$")
_SHELL_SYNTAX = re.compile(r"[;&|<>`$(){}\\*?!#~\n]")


def _check_proxy_command(endpoint: SshEndpoint, what: str) -> None:
    """Under the loopback guard, a ProxyCommand whose target cannot be read off it is refused."""
    if not loopback_only():
        return
    command = endpoint.proxy_command or ""
    refusal = (f"refusing the ProxyCommand of {what} ({command!r}, {endpoint.sources.get('proxycommand', '?')}): "
               "SGLFLEET_LOOPBACK_ONLY=1 is set and ")
    if _SHELL_SYNTAX.search(command):
        raise LoopbackOnlyError(refusal + "it uses shell syntax, so where it connects cannot be known before "
                                "it runs. Under the guard only `nc HOST PORT` (ncat, netcat; flags -4 -6 -N -n -v "
                                "-wN -qN) to 127.0.0.0/8 runs. No command was run.")
    words = shlex.split(command)
    positional = [w for w in words[1:] if not _NC_FLAG.match(w)]
    if (not words or os.path.basename(words[0]) not in _NC or len(positional) != 2
            or any(w.startswith("-") for w in positional) or not positional[1].isdigit()):
        raise LoopbackOnlyError(refusal + "where it connects cannot be read off it (only `nc HOST PORT`, ncat "
                                "or netcat, with flags -4 -6 -N -n -v -wN -qN, runs under the guard). No command "
                                "was run.")
    check_target(positional[0], f"{what} (its ProxyCommand)")


def _via(route: list[SshEndpoint]) -> str:
    if len(route) > 1:
        return " via " + " -> ".join(f"{e.user}@{e.address}:{e.port}" for e in route[:-1])
    if route[-1].proxy_command is not None:
        return f" via ProxyCommand {route[-1].proxy_command!r}"
    return ""


def _config_hint(route: list[SshEndpoint]) -> str:
    configs = {e.config for e in route if e.config != "none"}
    return f" (ssh config in use: {', '.join(sorted(configs))})" if configs else ""


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
        _shut_write(channel)


def _shut_write(channel: paramiko.Channel) -> None:
    try:
        channel.shutdown_write()
    except (OSError, EOFError, paramiko.SSHException):
        pass


def _read_streams(channel: paramiko.Channel, stdout: bytearray, stderr: bytearray, deadline: float | None) -> bool:
    """Read both output streams of a channel to EOF (no cap: callers asked for everything); False
    when the deadline came first. Waits in poll() on the channel's pipe, which paramiko sets while
    either stream has data, and for good once the channel is at EOF or closed."""
    waiter = select.poll()
    waiter.register(channel.fileno(), select.POLLIN)
    streams = [(channel.recv_ready, channel.recv, stdout), (channel.recv_stderr_ready, channel.recv_stderr, stderr)]
    try:
        while streams:
            remaining = None if deadline is None else deadline - time.monotonic()
            if remaining is not None and remaining <= 0:
                return False
            if not waiter.poll(None if remaining is None else max(1, int(remaining * 1000))):
                continue
            ended = channel.eof_received or channel.closed
            for stream in list(streams):
                ready, recv, data = stream
                while ready() or ended:  # at EOF recv returns what is left, then b"", without waiting
                    chunk = recv(_CHUNK)
                    if not chunk:
                        streams.remove(stream)
                        break
                    data += chunk
    except (OSError, EOFError, paramiko.SSHException):
        pass  # channel closed under us; keep what arrived
    return True


def _pgid(stdout: bytearray) -> int | None:
    line, newline, _ = bytes(stdout[:64]).partition(b"\n")
    if newline and line.startswith(_PGID_MARKER):
        return int(line[len(_PGID_MARKER):])
    return None


def _strip_header(data: bytearray) -> bytes:
    if data.startswith(_PGID_MARKER):
        newline = data.find(b"\n")
        if newline >= 0:
            return bytes(data[newline + 1:])
    return bytes(data)
