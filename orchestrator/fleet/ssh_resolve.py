"""Where a host really is: OpenSSH's own answer (`ssh -G`) for the user's ssh config.

Job: for one destination and the options Ansible's ssh plugin would pass for a host (its
`ansible_port`, `ansible_user`, `ansible_ssh_private_key_file`, `ansible_timeout`, and the
`-o`/`-J`/`-i`/`-l`/`-p` words of `ansible_ssh_common_args` / `_extra_args`), ask OpenSSH what it
would connect to: `ssh -G` reads the same config files with its own rules (Include, Match,
Hostname tokens, first value wins, a typo refused) and prints the result without connecting.
Read back: address, port, user, identity files in order, IdentitiesOnly / IdentityAgent,
ConnectTimeout, HostKeyAlias, and the proxy: a ProxyJump chain, whose last hop is resolved the
way ssh itself does it (`ssh [-l U] [-p P] [-J the other hops] [-F config] -G HOP`, recursively),
or a ProxyCommand. What `ssh -G` prints unexpanded (IdentityFile and ProxyCommand tokens) is
expanded here as ssh.c / sshconnect.c expand it at connect time.

`ssh -G` does run `Match exec` commands. `match_exec=False` (what `sglfleet hosts` uses, which
promises no connection) runs them with SHELL=/bin/false, which ssh uses to run them: each such
criterion fails without running, and the endpoint says where it was and that it did not run.

Round trips: none to any host; one local `ssh -G -vvv` per distinct (destination, options,
config) and per ProxyJump hop, all a command selects run 8 at a time. Answers are kept for the
process and on disk (`_DiskCache`) while every config file ssh read and its folder keep their
mtime and size (an answer that met a Match exec is never kept); with no config at all (`-F none`)
one template answer serves every host whose options are only the inventory's own.
Provenance: `sources` names, per setting, the inventory var (file:line) that passed it or the
config file:line ssh took it from (the first applied Host/Match block that sets it).
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import pwd
import re
import shlex
import shutil
import socket
import subprocess
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Iterable, Sequence

from ..errors import ConfigError
from . import ssh_alike
from .safety import loopback_only

# The ssh client's default when nothing sets ConnectTimeout (sglfleet's, as before).
DEFAULT_CONNECT_TIMEOUT = 10.0
MAX_HOPS = 10  # a ProxyJump chain this deep is a loop in the config
_PARALLEL = 8  # ssh -G processes at once: the machine's cores are the limit, not waiting
_SSH_G_TIMEOUT = 30.0  # a Match exec that hangs must not hang the command

# What the connection applies of the resolved options. Any other option the inventory passes
# gets a note; these the transport replaces with its own (host key policy, keepalives, one
# connection per host, keys only).
APPLIED = frozenset({"hostname", "port", "user", "identityfile", "identitiesonly", "identityagent",
                     "proxyjump", "proxycommand", "connecttimeout", "hostkeyalias"})
REPLACED = frozenset({"stricthostkeychecking", "userknownhostsfile", "controlmaster", "controlpath",
                      "controlpersist", "serveraliveinterval", "serveralivecountmax", "batchmode",
                      "passwordauthentication", "kbdinteractiveauthentication", "preferredauthentications",
                      "loglevel"})


@dataclass(frozen=True)
class SshConfigFiles:
    """The ssh config in use: `ssh -F PATH`, OpenSSH's own files (path None), or none ("none")."""

    path: str | None
    shown: str

    @property
    def args(self) -> tuple[str, ...]:
        return ("-F", self.path) if self.path else ()


def config_files(explicit: str | None = None) -> SshConfigFiles:
    """The config a command uses: `explicit` (an API argument; a path that does not exist reads no
    config, as `ssh -F none`), else $SGLFLEET_SSH_CONFIG (`none`, or a file that must exist), else
    OpenSSH's own ~/.ssh/config and /etc/ssh/ssh_config."""
    if explicit is not None:
        if explicit == "none" or not os.path.exists(explicit):
            return SshConfigFiles("none", "no ssh config (ssh -F none)")
        return SshConfigFiles(os.path.abspath(explicit), explicit)
    env = os.environ.get("SGLFLEET_SSH_CONFIG")
    if env is not None and env != "":
        if env == "none":
            return SshConfigFiles("none", "no ssh config (SGLFLEET_SSH_CONFIG=none)")
        if not os.path.isfile(env):
            raise ConfigError(f"SGLFLEET_SSH_CONFIG names {env!r}, which is not a file; point it at your ssh "
                              "config, set it to 'none' to read no config, or unset it to read "
                              "~/.ssh/config and /etc/ssh/ssh_config as ssh does")
        return SshConfigFiles(os.path.abspath(env), env)
    return SshConfigFiles(None, f"{_home()}/.ssh/config and /etc/ssh/ssh_config")


@dataclass(frozen=True)
class MatchExec:
    """A `Match exec` criterion ssh met while resolving: where, whether it ran, whether it matched."""

    where: str
    command: str
    ran: bool
    matched: bool


@dataclass(frozen=True)
class SshEndpoint:
    """What OpenSSH would connect to for one destination (a target or a ProxyJump hop)."""

    destination: str                  # what ssh was asked for (%n)
    address: str                      # HostName, as resolved (%h)
    port: int
    user: str
    identity_files: tuple[str, ...]   # expanded, in the order ssh tries them
    identities_only: bool
    use_agent: bool
    connect_timeout: float | None     # ConnectTimeout, None when unset
    host_key_alias: str | None
    proxy_jump: str | None            # the ProxyJump chain as configured, None for none
    proxy_command: str | None         # expanded, run through the user's shell as ssh does
    via: "SshEndpoint | None"         # the last ProxyJump hop, resolved as ssh resolves it
    config: str                       # the config in use, as messages name it
    sources: dict[str, str] = field(default_factory=dict, compare=False, hash=False)
    match_exec: tuple[MatchExec, ...] = ()
    options: tuple[str, ...] = ()     # the ssh options it was resolved with (after `ssh -G`)

    def hops(self) -> list["SshEndpoint"]:
        """The ProxyJump hops in the order they are connected, first hop first."""
        chain: list[SshEndpoint] = []
        hop = self.via
        while hop is not None:
            chain.append(hop)
            hop = hop.via
        return chain[::-1]

    @property
    def key_name(self) -> str:
        """The name host keys are recorded under, as ssh's get_hostfile_hostname_ipaddr: the
        HostKeyAlias as it is (no port), else the address ([address]:port off port 22)."""
        from .hostkeys import known_hosts_name

        return self.host_key_alias or known_hosts_name(self.address, self.port)

    def all_match_exec(self) -> list[MatchExec]:
        found = list(self.match_exec)
        if self.via is not None:
            found += self.via.all_match_exec()
        return found


# ---------------------------------------------------------------- running ssh -G


def ssh_binary() -> str:
    found = _which_ssh(os.environ.get("PATH"))
    if found is None:
        raise ConfigError("OpenSSH's ssh client is not installed; sglfleet asks it (ssh -G) how to reach each "
                          "host from your ssh config. Install it: apt-get install openssh-client (`make setup` "
                          "does)")
    return found


@functools.lru_cache(maxsize=8)
def _which_ssh(path: str | None) -> str | None:
    """ssh on this PATH, looked for once (every answer's cache key names it: 1,000 hosts looked it up
    2,000 times, half a second of CPU)."""
    return shutil.which("ssh", path=path)


def _home() -> str:
    try:
        return pwd.getpwuid(os.getuid()).pw_dir
    except KeyError:
        return os.path.expanduser("~")


_cache: dict[tuple, tuple[tuple, Any, "SshEndpoint"]] = {}  # key -> (files read, their stamp, result)
_cache_lock = threading.Lock()
_now: dict[tuple, Any] = {}  # files -> their stamp now, taken once per selection (new_batch clears it)


def _unchanged(files: Sequence[str], stamp: Any) -> bool:
    """Whether these config files (and folders) still have the mtimes and sizes of `stamp`."""
    return _stamp_now(files) == stamp


def _stamp_now(files: Sequence[str]) -> Any:
    """The files' stamp (as JSON keeps it), taken once per selection."""
    key = tuple(files)
    if key not in _now:
        _now[key] = json.loads(json.dumps(_stamp(files)))
    return _now[key]


def _stamp(paths: Iterable[str]) -> tuple:
    """mtime and size of each config file ssh read and of its folder (a new file an Include glob
    would now match changes the folder)."""
    out = []
    for path in paths:
        for p in (path, os.path.dirname(path) or "."):
            try:
                st = os.stat(p)
                out.append((p, st.st_mtime_ns, st.st_size))
            except OSError:
                out.append((p, None, None))
    return tuple(out)


@dataclass
class _Run:
    values: dict[str, list[str]]
    files_read: list[str]
    segments: list[tuple[str, int | None]]   # applied blocks in order: (file, line of Host/Match or None)
    match_exec: list[MatchExec]
    exec_ran: bool


_READING = re.compile(r"^debug1: Reading configuration data (.+)$")
_APPLYING = re.compile(r"^debug1: (.+) line (\d+): Applying options for ")
_MATCHED = re.compile(r"^debug3: (.+) line (\d+): (not )?matched '(.*)' ?$")
_INCLUDE = re.compile(r"^debug\d: (.+) line (\d+): include (.+) matched no files$")


class _DiskCache:
    """`ssh -G` answers kept between commands ($SGLFLEET_SSH_CACHE, default
    ~/.cache/sglfleet/ssh-g.json; `none` keeps none): an answer is used again only for the same
    ssh binary (path, mtime, size), arguments, working directory and user, while every config file
    ssh read and its folder keep their mtime and size. What ssh -G prints for the settings read
    here depends on nothing else (an answer that met a Match exec is never kept)."""

    KEYS = frozenset(("host", "hostname", "port", "user", "identityfile", "identitiesonly", "identityagent",
                      "proxyjump", "proxycommand", "connecttimeout", "hostkeyalias", "canonicalizehostname"))
    VERSION = 3
    LIMIT = 20000  # answers kept; the oldest go first

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.entries: dict[str, Any] | None = None
        self.filesets: dict[str, Any] = {}  # id -> {"files": [...], "stamp": [...]}: shared by many answers
        self.dirty = False

    @property
    def path(self) -> str | None:
        chosen = os.environ.get("SGLFLEET_SSH_CACHE") or os.path.join(
            os.environ.get("XDG_CACHE_HOME") or os.path.join(_home(), ".cache"), "sglfleet", "ssh-g.json")
        return None if chosen == "none" else chosen

    def key(self, argv: Sequence[str], match_exec: bool) -> str:
        st = os.stat(argv[0])
        return hashlib.sha256(json.dumps([list(argv), match_exec, os.getcwd(), os.getuid(), st.st_mtime_ns,
                                          st.st_size]).encode()).hexdigest()

    def _load(self) -> dict[str, Any]:
        if self.entries is None:
            self.entries = {}
            if self.path:
                try:
                    with open(self.path, encoding="utf-8") as fh:
                        loaded = json.load(fh)
                    if isinstance(loaded, dict) and loaded.get("version") == self.VERSION:
                        self.entries, self.filesets = loaded["entries"], loaded["filesets"]
                except (OSError, ValueError, KeyError):
                    pass  # no cache, or a broken one: ssh answers again
        return self.entries

    def get(self, key: str) -> _Run | None:
        with self.lock:
            entry = self._load().get(key)
            fileset = self.filesets.get(entry["fileset"]) if entry else None
            if fileset is None or not _unchanged(fileset["files"], fileset["stamp"]):
                return None
        return _Run(entry["values"], fileset["files"], [tuple(s) for s in entry["segments"]], [], False)

    def put(self, key: str, run: _Run) -> None:
        if run.exec_ran or run.match_exec or not self.path:
            return
        fileset = hashlib.sha256(json.dumps(run.files_read).encode()).hexdigest()[:16]
        stamp = _stamp_now(run.files_read)
        with self.lock:
            self._load()[key] = {"values": {k: v for k, v in run.values.items() if k in self.KEYS},
                                 "fileset": fileset, "segments": run.segments}
            self.filesets[fileset] = {"files": run.files_read, "stamp": stamp}
            self.dirty = True

    def flush(self) -> None:
        with self.lock:
            if not self.dirty or not self.path or self.entries is None:
                return
            self.dirty = False
            for old in list(self.entries)[:max(0, len(self.entries) - self.LIMIT)]:
                del self.entries[old]
            used = {e["fileset"] for e in self.entries.values()}
            self.filesets = {k: v for k, v in self.filesets.items() if k in used}
            try:
                os.makedirs(os.path.dirname(self.path), exist_ok=True)
                tmp = f"{self.path}.{os.getpid()}.tmp"
                with open(tmp, "w", encoding="utf-8") as fh:
                    # dumps, not dump: json.dump writes through the pure-Python encoder (0.6 s of CPU
                    # for a cache of 1,600 answers), dumps through the C one
                    fh.write(json.dumps({"version": self.VERSION, "entries": self.entries, "filesets": self.filesets}))
                os.replace(tmp, self.path)
            except OSError:
                pass  # a read-only home: answers are not kept, nothing else changes


_disk = _DiskCache()


def _ssh_g_argv(destination: str, options: Sequence[str], files: SshConfigFiles) -> list[str]:
    # Under the loopback guard names are never looked up in DNS: CanonicalizeHostname would have
    # ssh -G ask it (the first value wins, so this one does).
    guard = ("-o", "CanonicalizeHostname=no") if loopback_only() else ()
    return [ssh_binary(), "-G", "-vvv", *files.args, *guard, *options, "--", destination]


_keys: dict[tuple, str] = {}  # (destination, options, files, match_exec) -> answer-cache key, per selection


def _answer_key(destination: str, options: Sequence[str], files: SshConfigFiles, match_exec: bool) -> str:
    """The answer cache's key of one `ssh -G` (its argv, cwd, user, the ssh binary), once per selection."""
    memo = (destination, tuple(options), files, match_exec)
    if memo not in _keys:
        _keys[memo] = _disk.key(_ssh_g_argv(destination, options, files), match_exec)
    return _keys[memo]


def _run_ssh_g(destination: str, options: Sequence[str], files: SshConfigFiles, match_exec: bool) -> _Run:
    argv = _ssh_g_argv(destination, options, files)
    key = _answer_key(destination, options, files, match_exec)
    kept = _alike_answers.get(key) or _disk.get(key)
    if kept is not None:
        return kept
    run = _ssh_g(argv, destination, files, match_exec)
    if files.path is None:  # ssh's own files count even while missing: creating one changes answers
        run.files_read += [p for p in (os.path.join(_home(), ".ssh", "config"), "/etc/ssh/ssh_config")
                           if p not in run.files_read]
    _disk.put(key, run)
    return run


def _ssh_g(argv: list[str], destination: str, files: SshConfigFiles, match_exec: bool) -> _Run:
    env = dict(os.environ, LC_ALL="C")
    if not match_exec:
        env["SHELL"] = "/bin/false"  # ssh runs Match exec with $SHELL -c: the criterion fails unrun
    try:
        done = subprocess.run(argv, stdin=subprocess.DEVNULL, capture_output=True, env=env,
                              timeout=_SSH_G_TIMEOUT)
    except subprocess.TimeoutExpired:
        raise ConfigError(f"ssh -G {destination} did not finish in {_SSH_G_TIMEOUT:.0f} s (a Match exec "
                          f"command that hangs?) with {files.shown}") from None
    stderr = done.stderr.decode("utf-8", "replace")
    if done.returncode != 0:
        said = [line for line in stderr.splitlines() if not line.startswith(("debug", "OpenSSH_"))
                and "Pseudo-terminal" not in line]
        reason = "; ".join(said) or f"exit status {done.returncode}"
        raise ConfigError(f"ssh config: OpenSSH refuses it for {destination!r}: {reason} (config in use: "
                          f"{files.shown})")
    values: dict[str, list[str]] = {}
    for line in done.stdout.decode("utf-8", "replace").splitlines():
        key, _, value = line.partition(" ")
        values.setdefault(key, []).append(value)
    return _parse_log(stderr, values, match_exec)


def _parse_log(stderr: str, values: dict[str, list[str]], match_exec: bool) -> _Run:
    files_read: list[str] = []
    segments: list[tuple[str, int | None]] = []
    found: list[MatchExec] = []
    exec_ran = False
    pending: tuple[str, int] | None = None  # the Match line being checked
    for line in stderr.splitlines():
        if m := _READING.match(line):
            files_read.append(m.group(1))
            segments.append((m.group(1), None))
        elif m := _APPLYING.match(line):
            segments.append((m.group(1), int(m.group(2))))
        elif m := _MATCHED.match(line):
            pending = (m.group(1), int(m.group(2)))
            criterion = m.group(4)
            if criterion.startswith(("exec ", "!exec ")):
                found.append(MatchExec(f"{m.group(1)}:{m.group(2)}", criterion.split(" ", 1)[1],
                                       exec_ran and match_exec, m.group(3) is None))
                exec_ran = False
        elif line.startswith("debug1: Executing command:"):
            exec_ran = True
        elif line.startswith("debug2: match found") and pending is not None:
            segments.append(pending)
            pending = None
        elif line.startswith("debug2: checking match for"):
            pending = None
        elif m := _INCLUDE.match(line):
            files_read.append(expand_tilde(m.group(3)))  # its folder's stamp: a file added there now matches
    return _Run(values, files_read, segments, found, any(e.ran for e in found))


# ---------------------------------------------------------------- tokens, as ssh expands them


def expand_percent(text: str, table: dict[str, str], what: str) -> str:
    """OpenSSH's percent_expand: %% is %, %X from the table, anything else refused."""
    out, i = [], 0
    while i < len(text):
        ch = text[i]
        if ch != "%":
            out.append(ch)
            i += 1
            continue
        if i + 1 >= len(text):
            raise ConfigError(f"{what}: {text!r} ends with a lone '%' (ssh refuses it)")
        key = text[i + 1]
        if key == "%":
            out.append("%")
        elif key in table:
            out.append(table[key])
        else:
            raise ConfigError(f"{what}: {text!r} has the unknown token %{key} (ssh refuses it; %% is a literal %)")
        i += 2
    return "".join(out)


_DOLLAR = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)\}")


def expand_dollar(text: str, what: str) -> str:
    """OpenSSH's dollar_expand: ${NAME} from the environment; an unset one is refused."""
    def value(m: re.Match) -> str:
        if m.group(1) not in os.environ:
            raise ConfigError(f"{what}: {text!r} uses ${{{m.group(1)}}}, which is not set (ssh refuses it)")
        return os.environ[m.group(1)]
    return _DOLLAR.sub(value, text)


def expand_tilde(path: str) -> str:
    """OpenSSH's tilde_expand_filename: ~ and ~/ are this user's home (from passwd), ~user/ another's."""
    if not path.startswith("~"):
        return path
    name, sep, rest = path[1:].partition("/")
    if not name:
        home = _home()
    else:
        try:
            home = pwd.getpwnam(name).pw_dir
        except KeyError:
            raise ConfigError(f"IdentityFile {path!r}: no local user {name!r}") from None
    return home.rstrip("/") + "/" + rest if sep else home


def _jump_host(spec: str | None) -> str:
    """The last hop's host name, which ssh calls jump_host (%j)."""
    if not spec:
        return ""
    return parse_jump(spec.split(",")[-1])[1]


def connection_tokens(destination: str, address: str, port: int, user: str, alias: str | None,
                      jump: str | None) -> dict[str, str]:
    """ssh.c's DEFAULT_CLIENT_PERCENT_EXPAND_ARGS for one connection."""
    thishost = socket.gethostname()
    try:
        entry = pwd.getpwuid(os.getuid())
        home, local_user = entry.pw_dir, entry.pw_name
    except KeyError:
        home, local_user = _home(), os.environ.get("USER", "")
    jump_host = _jump_host(jump)
    conn_hash = hashlib.sha1(f"{thishost}{address}{port}{user}{jump_host}".encode()).hexdigest()
    return {"C": conn_hash, "L": thishost.split(".", 1)[0], "i": str(os.getuid()), "k": alias or destination,
            "l": thishost, "n": destination, "p": str(port), "d": home, "h": address, "r": user,
            "u": local_user, "j": jump_host}


# ---------------------------------------------------------------- ProxyJump


def parse_jump(hop: str) -> tuple[str | None, str, int | None]:
    """One ProxyJump hop as ssh's parse_jump reads it: ssh://[user@]host[:port] or [user@]host[:port]."""
    text = hop.strip()
    if text.startswith("ssh://"):
        text = text[len("ssh://"):].rstrip("/")
    user, at, hostport = text.rpartition("@")
    if hostport.startswith("["):
        host, _, rest = hostport[1:].partition("]")
        port = rest[1:] if rest.startswith(":") else None
    elif hostport.count(":") == 1:
        host, _, port = hostport.partition(":")
    else:
        host, port = hostport, None
    if not host or (at and not user):
        raise ValueError(f"the {'host' if not host else 'user'} is missing in {hop!r}")
    if port is not None and not (port.isdigit() and 1 <= int(port) <= 65535):
        raise ValueError(f"the port {port!r} is not a port number")
    return (user or None), host, (int(port) if port is not None else None)


# ---------------------------------------------------------------- resolving


@dataclass(frozen=True)
class Request:
    """One destination to resolve, with the ssh options the inventory passes and where each came from."""

    destination: str
    options: tuple[str, ...]
    files: SshConfigFiles
    sources: tuple[tuple[str, str], ...] = ()   # (ssh keyword, inventory file:line)
    name: str = field(default="", compare=False)  # the inventory host, for messages


_UNSPEAKABLE = re.compile(r"[\x00-\x20\x7f]")


def resolve(request: Request, match_exec: bool = True, _depth: int = 0) -> SshEndpoint:
    """OpenSSH's resolution of one destination (and its ProxyJump hops), cached for the process."""
    if request.name and _depth == 0:
        try:
            return _resolve(request, match_exec, 0)
        except ConfigError as exc:
            raise ConfigError(f"host '{request.name}': {exc}") from None
    return _resolve(request, match_exec, _depth)


def _resolve(request: Request, match_exec: bool, _depth: int) -> SshEndpoint:
    if _depth > MAX_HOPS:
        raise ConfigError(f"ProxyJump of {request.destination!r} goes through more than {MAX_HOPS} hops; a "
                          f"loop in the ssh config? (config in use: {request.files.shown})")
    if request.destination.startswith("-") or _UNSPEAKABLE.search(request.destination):
        raise ConfigError(f"ssh destination {request.destination!r} (ansible_host or the host name) cannot be "
                          "given to ssh: it starts with '-' or holds a control character or blank")
    if any("\x00" in option for option in request.options):
        raise ConfigError(f"an ssh option for {request.destination!r} holds a NUL character: {request.options!r}")
    key = (request, match_exec)
    with _cache_lock:
        cached = _cache.get(key)
    if cached is not None and _unchanged(cached[0], cached[1]):
        return cached[2]
    run = _without_config(request) or _run_ssh_g(request.destination, request.options, request.files, match_exec)
    endpoint = _endpoint(request, run, match_exec, _depth)
    if not run.exec_ran:
        with _cache_lock:
            _cache[key] = (tuple(run.files_read), _stamp_now(run.files_read), endpoint)
    return endpoint


_PLAIN_OPTION = re.compile(r'^(Port|IdentityFile|User|ConnectTimeout)=(.*)$')
_template: list[_Run] = []


def _without_config(request: Request) -> _Run | None:
    """With no config (-F none) and only the options the inventory's own vars pass, nothing ssh
    prints depends on the destination but the destination itself (lowercased, as ssh does) and those
    options: one `ssh -G -F none` per process gives the rest (its default identity files are this
    ssh's own). Inventories of 10,000 hosts select without 10,000 processes."""
    if request.files.path != "none" or len(request.options) % 2 or re.search(r"[@%:/]", request.destination):
        return None  # user@host, ssh:// and tokens are ssh's to read
    given: dict[str, str] = {}
    for flag, value in zip(request.options[::2], request.options[1::2]):
        m = _PLAIN_OPTION.match(value)
        if flag != "-o" or m is None or m.group(1).lower() in given or '"' in m.group(2)[1:-1]:
            return None
        given[m.group(1).lower()] = m.group(2).strip('"')
    if not _template:
        _template.append(_run_ssh_g("sglfleet-template", (), request.files, False))
    values = {k: list(v) for k, v in _template[0].values.items()}
    values["host"] = [request.destination]
    values["hostname"] = [request.destination.lower()]
    for key, value in given.items():
        values[key] = [value]
    return _Run(values, [], [], [], False)


def resolve_many(requests: Sequence[Request], match_exec: bool = True) -> list[SshEndpoint]:
    """Each request resolved, in parallel; the first error (in the requests' order) is raised."""
    if not requests:
        return []
    unique = list(dict.fromkeys(requests))
    _now.clear()  # config files are looked at again once per selection
    try:
        if len(unique) == 1:
            found = {unique[0]: resolve(unique[0], match_exec)}
        else:
            with ThreadPoolExecutor(max_workers=min(_PARALLEL, len(unique))) as pool:
                _answer_alike(unique, match_exec, pool)
                # what is answered already is resolved here (a thread for each costs more than it)
                answered = {r for r in unique if _answered(r, match_exec)}
                futures = {r: pool.submit(resolve, r, match_exec) for r in unique if r not in answered}
                found = {r: resolve(r, match_exec) if r in answered else futures[r].result() for r in unique}
    finally:
        _alike_answers.clear()
        _keys.clear()
        _disk.flush()
    return [found[r] for r in requests]


# ---------------------------------------------------------------- one ssh -G for many (ssh_alike)

_ALIKE_MIN = 3  # a class of fewer members gains nothing: two of them are asked anyway
_alike_answers: dict[str, _Run] = {}  # answer-cache key -> answer, for the selection in progress


def _argv_key(request: Request, match_exec: bool) -> str:
    return _answer_key(request.destination, request.options, request.files, match_exec)


def _answer_alike(requests: list[Request], match_exec: bool, pool: ThreadPoolExecutor) -> None:
    """Answers for the destinations OpenSSH provably answers alike but for their name (ssh_alike),
    two `ssh -G` per class, into _alike_answers (and the answer cache); the rest are asked one
    by one as before. Destinations whose answers are kept already are left to the cache."""
    groups: dict[tuple, list[Request]] = {}
    for request in requests:
        if request.files.path != "none" and ssh_alike.plain(request.destination) \
                and not _known(request, match_exec) and _disk.get(_argv_key(request, match_exec)) is None:
            groups.setdefault((request.options, request.files), []).append(request)
    asked: dict[Request, _Run | None] = {}

    def ask(batch: list[Request]) -> None:
        todo = [r for r in dict.fromkeys(batch) if r not in asked]
        for request, run in zip(todo, pool.map(lambda r: _ask_quietly(r, match_exec), todo)):
            asked[request] = run
            if run is not None and not (run.exec_ran or run.match_exec):  # not asked again below
                _alike_answers[_argv_key(request, match_exec)] = run

    pending = [members for members in groups.values() if len(members) >= _ALIKE_MIN]
    ask([members[0] for members in pending])  # each group's first member: the files its config reads
    files = {id(members): set(asked[members[0]].files_read) for members in pending if asked[members[0]] is not None}
    pending = [members for members in pending if id(members) in files]
    while pending:  # until the members asked read no file the patterns were not taken from
        classes: dict[int, list[list[Request]]] = {}
        for members in pending:
            patterns = ssh_alike.config_patterns("\n".join(_file_lines(f)) for f in sorted(files[id(members)]))
            if patterns is None:
                continue
            by_signature: dict[tuple, list[Request]] = {}
            for request in members:
                by_signature.setdefault(ssh_alike.signature(request.destination, patterns), []).append(request)
            classes[id(members)] = [cls for cls in by_signature.values() if len(cls) >= _ALIKE_MIN]
        ask([r for group in classes.values() for cls in group for r in cls[:2]])  # all groups at once
        still = []
        for members in pending:
            if id(members) not in classes:
                continue
            read = {f for cls in classes[id(members)] for r in cls[:2] if asked[r] is not None
                    for f in asked[r].files_read}
            if read <= files[id(members)]:
                for cls in classes[id(members)]:
                    _derive(cls, asked, match_exec)
            else:
                files[id(members)] |= read
                still.append(members)
        pending = still


def _known(request: Request, match_exec: bool) -> bool:
    """Whether this process resolved the request already (and its files are unchanged)."""
    with _cache_lock:
        cached = _cache.get((request, match_exec))
    return cached is not None and _unchanged(cached[0], cached[1])


def _answered(request: Request, match_exec: bool) -> bool:
    """Whether the request's answer is at hand without asking ssh (this process, this selection's
    classes, or the answer cache)."""
    if _known(request, match_exec):
        return True
    key = _argv_key(request, match_exec)
    return key in _alike_answers or _disk.get(key) is not None


def _ask_quietly(request: Request, match_exec: bool) -> _Run | None:
    """`ssh -G` for one member (or its kept answer); None where ssh refuses: the member is then
    asked again on its own, which reports it as before."""
    try:
        return _run_ssh_g(request.destination, request.options, request.files, match_exec)
    except ConfigError:
        return None


def _derive(members: list[Request], asked: dict[Request, _Run | None], match_exec: bool) -> None:
    (a, b), runs = members[:2], (asked[members[0]], asked[members[1]])
    if runs[0] is None or runs[1] is None or any(r.exec_ran or r.match_exec for r in runs) \
            or runs[0].files_read != runs[1].files_read or runs[0].segments != runs[1].segments:
        return
    hostname = ssh_alike.alike(a.destination, runs[0].values, b.destination, runs[1].values, _DiskCache.KEYS)
    if hostname is None:
        return
    for member in members[2:]:
        run = _Run(ssh_alike.answer_for(member.destination, runs[0].values, hostname), list(runs[0].files_read),
                   list(runs[0].segments), [], False)
        key = _argv_key(member, match_exec)
        _alike_answers[key] = run
        _disk.put(key, run)


def _first(values: dict[str, list[str]], key: str) -> str | None:
    got = values.get(key)
    return got[0] if got else None


def _endpoint(request: Request, run: _Run, match_exec: bool, depth: int) -> SshEndpoint:
    values = run.values
    shown = request.files.shown
    destination = _first(values, "host") or request.destination
    address = _first(values, "hostname") or destination
    port = int(_first(values, "port") or 22)
    user = _first(values, "user") or ""
    alias = _first(values, "hostkeyalias")
    alias = None if alias in (None, "none") else alias
    jump = _first(values, "proxyjump")
    jump = None if jump in (None, "none") else jump
    command = _first(values, "proxycommand")
    command = None if command in (None, "none") or jump else command
    timeout_text = _first(values, "connecttimeout")
    timeout = float(timeout_text) if timeout_text and timeout_text != "none" else None
    tokens = connection_tokens(request.destination, address, port, user, alias, jump)
    identities = []
    for path in values.get("identityfile", []):
        what = f"IdentityFile {path!r} of {request.destination} ({shown})"
        expanded = expand_percent(expand_dollar(expand_tilde(path), what), tokens, what)
        identities.append(os.path.abspath(expanded))
    if command is not None:
        what = f"ProxyCommand of {request.destination} ({shown})"
        command = expand_percent(command, {k: tokens[k] for k in "hknpr"}, what)
    via = None
    if jump is not None:
        hops = jump.split(",")
        try:
            hop_user, hop_host, hop_port = parse_jump(hops[-1])
        except ValueError as exc:
            raise ConfigError(f"ProxyJump {jump!r} of {request.destination} must be [user@]host[:port] hops "
                              f"joined by commas: {exc} (config in use: {shown})") from None
        args: list[str] = []
        given = []  # what the ProxyJump spec sets for the hop, from where the spec is set
        where = f"ProxyJump at {sources_of(request, run).get('proxyjump')}"
        if hop_user:
            args += ["-l", hop_user]
            given.append(("user", where))
        if hop_port:
            args += ["-p", str(hop_port)]
            given.append(("port", where))
        if len(hops) > 1:
            args += ["-J", ",".join(hops[:-1])]
            given.append(("proxyjump", where))
        via = resolve(Request(hop_host, tuple(args), request.files, tuple(given)), match_exec, depth + 1)
    sources = sources_of(request, run)
    return SshEndpoint(
        destination=destination, address=address, port=port, user=user, identity_files=tuple(identities),
        identities_only=_first(values, "identitiesonly") == "yes",
        use_agent=_first(values, "identityagent") != "none",
        connect_timeout=timeout, host_key_alias=alias, proxy_jump=jump, proxy_command=command, via=via,
        config=shown, sources=sources, match_exec=tuple(run.match_exec), options=request.options)


# ---------------------------------------------------------------- where each value came from

_KEYWORD = re.compile(r"^\s*([A-Za-z]+)\s*(?:=|\s)")
_SETTINGS = ("hostname", "port", "user", "identityfile", "proxyjump", "proxycommand", "connecttimeout",
             "hostkeyalias", "identitiesonly")
_lines_cache: dict[tuple[str, int], list[str]] = {}


def _file_lines(path: str) -> list[str]:
    """A config file's lines (for provenance only: the values are ssh's), read once per version."""
    try:
        key = (path, os.stat(path).st_mtime_ns)
    except OSError:
        return []
    if key not in _lines_cache:
        try:
            with open(path, encoding="utf-8", errors="replace") as fh:
                _lines_cache[key] = fh.read().splitlines()
        except OSError:
            _lines_cache[key] = []
    return _lines_cache[key]


_blocks_cache: dict[tuple[int, str, int | None], list[tuple[str, int]]] = {}


def _block_keywords(path: str, start: int | None) -> list[tuple[str, int]]:
    """(keyword, line) of the options in one block: after its Host/Match line (or the file's top)
    up to the next Host or Match; read once per version of the file (every host applying the
    block asks for it)."""
    lines = _file_lines(path)
    memo = (id(lines), path, start)  # _file_lines keeps one list per version of the file
    if memo not in _blocks_cache:
        found: list[tuple[str, int]] = []
        for index in range(0 if start is None else start, len(lines)):  # lines after the Host line (1-based)
            m = _KEYWORD.match(lines[index])
            if not m:
                continue
            keyword = m.group(1).lower()
            if keyword in ("host", "match"):
                break
            found.append((keyword, index + 1))
        _blocks_cache[memo] = found
    return _blocks_cache[memo]


def sources_of(request: Request, run: _Run) -> dict[str, str]:
    """Per setting, where its value came from: an inventory var (file:line) for an option given on
    ssh's command line (it wins over the config), else the config file:line of the first applied
    block that sets it, else OpenSSH's default."""
    given = {k: where for k, where in request.sources}
    found: dict[str, str] = {}
    identity: list[str] = [given["identityfile"]] if "identityfile" in given else []
    for path, start in run.segments:
        for keyword, line in _block_keywords(path, start):
            if keyword == "identityfile":
                identity.append(f"{path}:{line}")
            elif keyword in _SETTINGS and keyword not in found:
                found[keyword] = f"{path}:{line}"
    found.update((k, v) for k, v in given.items() if k != "host")
    # no HostName: the destination itself, which is ansible_host when that is set
    found.setdefault("hostname", given.get("host", "the destination (the inventory host name)"))
    for key in _SETTINGS:
        found.setdefault(key, "OpenSSH default")
    found["identityfile"] = ", ".join(identity) or "OpenSSH default"
    return found


# ---------------------------------------------------------------- the inventory's ssh options


def inventory_options(port: int | None, identity_file: str | None, user: str | None, timeout: float | None,
                      proxy_jump: str | None, ssh_args: Sequence[str]) -> tuple[list[str], list[str]]:
    """The options Ansible's ssh plugin passes for these vars, in its order (the first value of an
    option wins in ssh), then sglfleet_proxy_jump, then the usable words of the ssh args; and the
    words sglfleet cannot apply (for a note)."""
    options: list[str] = []
    if port is not None:
        options += ["-o", f"Port={port}"]
    if identity_file is not None:
        options += ["-o", f'IdentityFile="{identity_file}"']
    if user is not None:
        options += ["-o", f'User="{user}"']
    if timeout is not None:
        options += ["-o", f"ConnectTimeout={max(1, int(timeout))}"]
    if proxy_jump is not None:
        options += ["-o", f"ProxyJump={proxy_jump}"]
    ignored: list[str] = []
    for text in ssh_args:
        more, skipped = ssh_words(text)
        options += more
        ignored += skipped
    return options, ignored


_WITH_VALUE = ("-o", "-J", "-i", "-l", "-p")


def ssh_words(text: str) -> tuple[list[str], list[str]]:
    """From `ansible_ssh_common_args`-style text: the words ssh -G resolves (-o, -J, -i, -l, -p), and
    the rest, which sglfleet does not apply. An -o option the connection does not apply is in
    both (ssh still resolves it, so it stays in the options)."""
    try:
        words = shlex.split(text)
    except ValueError:
        return [], [text]
    options: list[str] = []
    ignored: list[str] = []
    i = 0
    while i < len(words):
        word = words[i]
        flag = word[:2]
        if flag in _WITH_VALUE:
            if len(word) > 2:
                value, i = word[2:], i + 1
            elif i + 1 < len(words):
                value, i = words[i + 1], i + 2
            else:
                ignored.append(word)
                i += 1
                continue
            options += [flag, value]
            if flag == "-o":
                keyword = option_keyword(value)
                if keyword not in APPLIED and keyword not in REPLACED:
                    ignored.append(f"-o {value}")
            continue
        ignored.append(word)
        i += 1
    return options, ignored


def option_keyword(value: str) -> str:
    """The keyword of an `-o` value: `Port=22` and `Port 22` are `port`."""
    return re.split(r"[=\s]", value.strip(), maxsplit=1)[0].lower()
