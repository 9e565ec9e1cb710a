"""Ansible inventories: the hosts, groups and connection settings ansible-core 2.19 reads.

A source is a YAML file, an INI file (`ini_inventory`; told apart by content, as Ansible's
plugins try them), a directory of such files, or several sources merged in order
(`inventory_sources`: which files, and the default source from Ansible's own settings).
An inventory a user already has for Ansible means the same here: the same hosts (ranges such as
`www[01:50].example.com` expanded, `host:port` keys split), the same groups (`all`, `ungrouped`,
children), the same variables per host, and the same SSH target:

    all:
      vars: {ansible_user: root, ansible_python_interpreter: /root/ml-env/bin/python3}
      children:
        gpu-fleet:
          hosts:
            ct129: {ansible_host: 10.1.230.172}

Variables, lowest precedence first (Ansible's): groups sorted by depth (`all` first), then
`ansible_group_priority`, then name; then `group_vars/` files beside the inventory in the same
order; then the host's own vars, then its `host_vars/` files. A host or group defined twice keeps
the later value of a var. Connection settings come only from Ansible's connection variables, the
`ssh` plugin's way (`ansible_ssh_host` over `ansible_host`, likewise for port, user, key file and
timeout), passed to OpenSSH as that plugin passes them: a selected host is resolved by `ssh -G`
with the user's ssh config (`ssh_resolve`), so Hostname, Port, User, keys and ProxyJump /
ProxyCommand are what `ssh` itself would use. `ansible_connection: local` runs on this machine.
Every other var is the user's own
(`port: 8080` is an application's port, not SSH's). sglfleet's own settings carry a `sglfleet_`
prefix (`sglfleet_models_dir`, `sglfleet_host_key_policy`, `sglfleet_proxy_jump`).

What Ansible would do differently only with a warning, or not at all, is refused with file:line
(see `patterns` for host patterns); what sglfleet does not use (passwords, become) is a note.
"""

from __future__ import annotations

import dataclasses
import difflib
import gc
import logging
import os
import pwd
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Sequence


from ..errors import ConfigError
from ..spec.yamlsrc import SourceMap, load_yaml, read_text, without_location
from . import inventory_sources, patterns, ssh_resolve
from .hostkeys import KnownHosts
from .router import check_http_url
from .hostnames import BadRange, NotAnAddress, expand_ranges, parse_address, split_host_key
from .ini_inventory import decode as decode_ini, parse_ini

HOST_KEY_POLICIES = ("strict", "accept-new")
GROUP_KEYS = ("hosts", "vars", "children")
log = logging.getLogger("sglfleet.inventory")


# ---------------------------------------------------------------- variables


def _as_str(value: Any) -> str:
    if isinstance(value, bool) or not isinstance(value, (str, int, float)):
        raise ValueError("must be a string")
    return str(value)


def _as_port(value: Any) -> int:
    if isinstance(value, bool):
        raise ValueError("must be an integer port number")
    try:
        port = int(value)
    except (TypeError, ValueError):
        raise ValueError("must be an integer port number") from None
    if str(port) != str(value).strip() or not 1 <= port <= 65535:
        raise ValueError("must be an integer port number between 1 and 65535")
    return port


def _as_policy(value: Any) -> str:
    if value not in HOST_KEY_POLICIES:
        raise ValueError(f"must be one of {', '.join(HOST_KEY_POLICIES)}")
    return value


def _as_seconds(value: Any) -> float:
    if isinstance(value, str):
        try:
            value = float(value)
        except ValueError:
            raise ValueError("must be a positive number of seconds") from None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
        raise ValueError("must be a positive number of seconds")
    return float(value)


def _as_jump(value: Any) -> str:
    """ProxyJump as ssh takes it: `none`, or hops `[user@]host[:port]` (or ssh://...) joined by commas."""
    text = _as_str(value).strip()
    if not text:
        raise ValueError("must be [user@]host[:port] (several hops joined by commas), or none")
    if text == "none":
        return text
    shape = "[user@]host[:port]" + (" hops joined by commas" if "," in text else "")
    for hop in text.split(","):
        if not hop.strip():
            raise ValueError(f"must be {shape}; {text!r} has an empty hop")
        try:
            ssh_resolve.parse_jump(hop)
        except ValueError as exc:
            raise ValueError(f"must be {shape}; {exc}") from None
    return text


SSH_CONNECTIONS = {"ssh", "smart", "paramiko", "paramiko_ssh", "ansible.builtin.ssh",
                   "ansible.builtin.paramiko_ssh"}
LOCAL_CONNECTIONS = {"local", "ansible.builtin.local"}

# setting -> (variable names, highest precedence first, as the ssh plugin reads them; converter)
CONNECTION_VARS: dict[str, tuple[tuple[str, ...], Callable[[Any], Any]]] = {
    "address": (("ansible_ssh_host", "ansible_host"), _as_str),
    "port": (("ansible_ssh_port", "ansible_port"), _as_port),
    "user": (("ansible_ssh_user", "ansible_user"), _as_str),
    "identity_file": (("ansible_ssh_private_key_file", "ansible_private_key_file"), _as_str),
    "connect_timeout": (("ansible_ssh_timeout", "ansible_timeout"), _as_seconds),
    "python": (("ansible_python_interpreter",), _as_str),
    "connection": (("ansible_connection",), _as_str),
    "ssh_args": (("ansible_ssh_common_args", "ansible_ssh_extra_args"), _as_str),
    "proxy_jump": (("sglfleet_proxy_jump",), _as_jump),
    "models_dir": (("sglfleet_models_dir",), _as_str),
    "host_key_policy": (("sglfleet_host_key_policy",), _as_policy),
}


def _as_str_list(value: Any) -> str | list[str]:
    items = value if isinstance(value, list) else [value]
    if not items or any(isinstance(v, bool) or not isinstance(v, (str, int, float)) or v == "" for v in items):
        raise ValueError("must be a non-empty string or a list of non-empty strings")
    return value


def _as_router_urls(value: Any) -> str | list[str]:
    """sglfleet_router_url: http://HOST:PORT, or a list of them."""
    for url in _as_str_list(value) if isinstance(value, list) else [_as_str_list(value)]:
        check_http_url(url)
    return value


def _as_profile_overrides(value: Any) -> dict[str, Any]:
    if not isinstance(value, dict) or not all(isinstance(k, str) and isinstance(v, dict) for k, v in value.items()):
        raise ValueError("must map profile names to overrides, e.g. {qwen36-ddtree: {server: {port: 30001}}}")
    return value


def _as_manager(value: Any) -> str:
    if value not in ("systemd", "supervisor"):
        raise ValueError("must be systemd or supervisor")
    return value


# What a shell would read as more than a word: refused in sglfleet_server_command (its argv is
# quoted into the launch script, so none of these would do what they seem to).
SHELL_METACHARACTERS = set(";&|<>()$`\\\"'*?[]{}!#~\n\r\t")


def _as_server_command(value: Any) -> str | list[str]:
    """sglfleet_server_command: an absolute executable, then its arguments (a list, or a string
    split as a shell would split words); no shell syntax, which nothing would interpret."""
    _as_str_list(value)
    if isinstance(value, list):
        argv = [str(v) for v in value]
    else:
        import shlex

        try:
            argv = shlex.split(str(value))
        except ValueError as exc:
            raise ValueError(f"cannot be split into words ({exc})") from None
        if not argv:
            raise ValueError("is empty")
        bad = sorted({c for word in argv for c in word if c in SHELL_METACHARACTERS})
        if bad:
            raise ValueError(f"holds shell syntax ({' '.join(repr(c) for c in bad)}) that nothing would interpret: "
                             "give the executable and its arguments as a list")
    if not argv[0].startswith("/"):
        raise ValueError(f"must start with an absolute executable path, got {argv[0]!r}")
    bad = sorted({c for c in argv[0] if c in SHELL_METACHARACTERS or c.isspace() or not c.isprintable()})
    if bad:
        raise ValueError(f"its executable {argv[0]!r} holds shell metacharacters or spaces ({' '.join(map(repr, bad))})")
    return value


def _as_bind(value: Any) -> str:
    """sglfleet_server_bind: ONE address (IPv4, IPv6 or a host name), no port, no list."""
    from .hostnames import NotAnAddress, parse_address

    text = _as_str(value)
    bare = text[1:-1] if text.startswith("[") and text.endswith("]") else text
    try:
        host, port = parse_address(bare, allow_ranges=False)
    except NotAnAddress:
        raise ValueError(f"must be one address (an IPv4 or IPv6 address or a host name), got {text!r}") from None
    if port is not None:
        raise ValueError(f"must be an address without a port (the port is the profile's server.port), got {text!r}")
    return text


SERVER_GROUP_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,62}")


def _as_server_group(value: Any) -> str:
    """sglfleet_server_group: the name of the multi-node server the host is a node of (a slug:
    it names status rows, records and log prefixes)."""
    text = _as_str(value)
    if not SERVER_GROUP_NAME.fullmatch(text):
        raise ValueError("must be a name of letters, digits, '.', '_', '-' (starting with a letter or digit, "
                         "at most 63 characters)")
    return text


def _as_node_rank(value: Any) -> int:
    """sglfleet_node_rank: the host's --node-rank in its server group, 0 or more."""
    if isinstance(value, bool) or not isinstance(value, (int, str)) or not str(value).strip().isdigit():
        raise ValueError("must be a whole number, 0 or more (rank 0 serves HTTP)")
    return int(value)


# sglfleet's other settings (not connection settings; the stages read them from host.vars),
# validated where they are written like the connection vars.
SETTING_VARS: dict[str, Callable[[Any], Any]] = {
    "sglfleet_server_bind": _as_bind,             # the address the host's server binds
    "sglfleet_server_command": _as_server_command,  # what runs instead of python -m sglang.launch_server
    "sglfleet_server_command_label": _as_str,     # how render and the launch script name it
    "sglfleet_server_manager": _as_manager,       # systemd or the detached supervisor
    "sglfleet_profile_overrides": _as_profile_overrides,
    "sglfleet_router_url": _as_router_urls,       # the router(s) fronting the host: http://HOST:PORT
    "sglfleet_router_worker_url": check_http_url,  # the URL those routers know its server by
    "sglfleet_lab_gpu": _as_str,                  # the GPU a lab host declares (smoke simulates it)
    "sglfleet_server_group": _as_server_group,    # the multi-node server the host is a node of
    "sglfleet_node_rank": _as_node_rank,          # its --node-rank there (default: the inventory's order)
}
# Vars whose file:line a Host keeps (Host.where): the server group's, whose errors name them.
TRACKED_VARS = ("sglfleet_server_group", "sglfleet_node_rank")
SERVER_GROUP_VAR = "sglfleet_server_group"
CONVERTERS = {name: convert for names, convert in CONNECTION_VARS.values() for name in names}
CONVERTERS.update(SETTING_VARS)
OWN_VARS = tuple(sorted(n for n in CONVERTERS if n.startswith("sglfleet_")))
# sglfleet's settings before they had a prefix: ordinary vars now (as in Ansible), with a note.
FORMER_NAMES = {"address": "ansible_host", "port": "ansible_port", "user": "ansible_user",
                "identity_file": "ansible_ssh_private_key_file", "python": "ansible_python_interpreter",
                "proxy_jump": "sglfleet_proxy_jump", "models_dir": "sglfleet_models_dir",
                "host_key_policy": "sglfleet_host_key_policy", "connect_timeout": "ansible_timeout",
                **{name[len("sglfleet_"):]: name for name in SETTING_VARS}}
UNUSED_VARS = {
    "ansible_password": "sglfleet authenticates with keys or the agent only, never a password",
    "ansible_ssh_pass": "sglfleet authenticates with keys or the agent only, never a password",
    "ansible_become": "sglfleet does not become another user; commands run as the SSH user",
    "ansible_become_user": "sglfleet does not become another user; commands run as the SSH user",
    "ansible_become_method": "sglfleet does not become another user; commands run as the SSH user",
    "ansible_become_password": "sglfleet does not become another user; commands run as the SSH user",
    "ansible_become_pass": "sglfleet does not become another user; commands run as the SSH user",
}


@dataclass(frozen=True)
class Host:
    """One inventory host with its resolved connection settings and merged vars."""

    name: str
    address: str
    port: int = 22
    user: str = "root"
    identity_files: tuple[str, ...] = ()
    proxy_jump: str | None = None
    python: str = "python3"
    models_dir: str = "/root/models"
    host_key_policy: str = "strict"
    connect_timeout: float = 10.0
    groups: tuple[str, ...] = ()
    vars: dict[str, Any] = field(default_factory=dict, compare=False, hash=False)
    connection: str = "ssh"  # "ssh", "local" (ansible_connection: local), or what Ansible named
    notes: tuple[tuple[str, str], ...] = field(default=(), compare=False, hash=False)  # (note, file:line)
    # What to ask OpenSSH (ssh -G) for this host, and its answer once the host is selected
    # (None: a Host made in code, reached at its address as it is).
    ssh_request: ssh_resolve.Request | None = field(default=None, compare=False, hash=False)
    ssh: ssh_resolve.SshEndpoint | None = field(default=None, compare=False, hash=False)
    # file:line of the TRACKED_VARS it has; and, when more than one of its groups sets
    # sglfleet_server_group to different names, each (group, name, file:line): a host in two
    # server groups (its own var, which wins, settles it)
    origins: dict[str, str] = field(default_factory=dict, compare=False, hash=False, repr=False)
    server_group_claims: tuple[tuple[str, str, str], ...] = field(default=(), compare=False, hash=False,
                                                                  repr=False)

    def where(self, var: str) -> str:
        """file:line where the host's value of `var` (one of TRACKED_VARS) is written."""
        return self.origins.get(var, "?")

    @property
    def target(self) -> str:
        if self.connection == "local":
            return "local"
        return f"{self.user}@{self.address}:{self.port}"


# ---------------------------------------------------------------- the parsed graph


class _Group:
    __slots__ = ("name", "hosts", "host_set", "children", "parents", "vars", "origins", "priority", "line")

    def __init__(self, name: str, line: int | None):
        self.name = name
        self.hosts: list[str] = []
        self.host_set: set[str] = set()
        self.children: list[str] = []
        self.parents: list[str] = []
        self.vars: dict[str, Any] = {}
        self.origins: dict[str, tuple[SourceMap, Any]] = {}
        self.priority = 1
        self.line = line

    def add_host(self, name: str) -> None:
        if name not in self.host_set:
            self.host_set.add(name)
            self.hosts.append(name)


class _HostDef:
    __slots__ = ("name", "vars", "origins", "line")

    def __init__(self, name: str, line: int | None):
        self.name = name
        self.vars: dict[str, Any] = {}
        self.origins: dict[str, tuple[SourceMap, Any]] = {}
        self.line = line


class _Parser:
    """Reads the YAML document the way Ansible's `yaml` inventory plugin does, refusing what is broken."""

    def __init__(self, shown: str):
        self.shown = shown
        self.groups: dict[str, _Group] = {"all": _Group("all", 1), "ungrouped": _Group("ungrouped", 1)}
        self.link("all", "ungrouped", None, None)
        self.hosts: dict[str, _HostDef] = {}

    def add_group(self, name: str, where: SourceMap, key: Any) -> _Group:
        if name not in self.groups:
            self.groups[name] = _Group(name, where.line_of(key))
        return self.groups[name]

    def link(self, parent: str, child: str, where: SourceMap | None, key: Any) -> None:
        p, c = self.groups[parent], self.groups[child]
        if child in p.children:
            return
        if child == parent or child in self._ancestors(parent):
            chain = f"'{child}' contains '{parent}'" if child != parent else f"'{child}' lists itself"
            message = f"group '{child}' cannot be a child of '{parent}': {chain} (a loop)"
            raise where.error(message, key) if where is not None else ConfigError(message, self.shown)
        if child == "ungrouped" and where is not None:
            raise where.error(f"'ungrouped' cannot be a child of '{parent}': Ansible would then take its hosts "
                              "out of 'ungrouped' and out of every group, 'all' included", key)
        p.children.append(child)
        c.parents.append(parent)

    def _ancestors(self, name: str) -> set[str]:
        seen: set[str] = set()
        todo = list(self.groups[name].parents)
        while todo:
            g = todo.pop()
            if g not in seen:
                seen.add(g)
                todo.extend(self.groups[g].parents)
        return seen

    def document(self, data: SourceMap) -> None:
        """A YAML inventory's top mapping (the caller has checked it is one)."""
        if "plugin" in data:
            raise data.error(f"this is the configuration of Ansible's {data['plugin']!r} inventory plugin (it "
                             "has 'plugin:'), not a YAML inventory; sglfleet reads YAML and INI inventories "
                             "only (save what the plugin lists with `ansible-inventory -i FILE --list -y`)",
                             "plugin")
        for name, body in data.items():
            self.group(name, body, data)

    def group(self, name: Any, body: Any, where: SourceMap) -> str:
        if not isinstance(name, str) or not name:
            raise where.error(f"group name must be a non-empty string, got {name!r}", name)
        if body is not None and not isinstance(body, SourceMap):
            raise where.error(f"group '{name}' must be a mapping with hosts/vars/children, got "
                              f"{type(body).__name__} (Ansible would skip it with a warning)", name)
        group = self.add_group(name, where, name)
        if body is None:
            return name
        for key in body:
            if key not in GROUP_KEYS:
                hint = _did_you_mean(key, GROUP_KEYS)
                raise body.error(f"unknown key {key!r} in group '{name}'{hint}; a group has only "
                                 f"{', '.join(GROUP_KEYS)} (Ansible would skip it with a warning)", key)
            section = body[key]
            if section is None:
                continue
            if not isinstance(section, SourceMap):
                what = {"hosts": "a mapping of host names", "vars": "a mapping",
                        "children": "a mapping of groups"}[key]
                extra = (f" (Ansible would invent a {'host' if key == 'hosts' else 'group'} named "
                         f"{section!r})" if isinstance(section, str) and key != "vars" else "")
                raise body.error(f"'{key}' of group '{name}' must be {what}, got "
                                 f"{type(section).__name__}{extra}", key)
            if key == "vars":
                for var, value in section.items():
                    self.group_var(group, section, var, value)
            elif key == "children":
                for child, child_body in section.items():
                    if child == "all":
                        raise section.error("'all' cannot be a child group", child)
                    child_name = self.group(child, child_body, section)
                    self.link(name, child_name, section, child)
            else:
                for host_key, host_vars in section.items():
                    self.host_entry(group, section, host_key, host_vars)
        return name

    def group_var(self, group: _Group, block: SourceMap, var: Any, value: Any) -> None:
        _check_var(block, var, value, f"group '{group.name}'")
        if var == "ansible_group_priority":
            try:
                group.priority = int(value)
            except (TypeError, ValueError):
                raise block.error(f"'ansible_group_priority' of group '{group.name}' must be an integer, "
                                  f"got {value!r}", var) from None
            return
        group.vars[var] = value
        group.origins[var] = (block, var)

    def host_entry(self, group: _Group, block: SourceMap, key: Any, host_vars: Any) -> None:
        if not isinstance(key, str) or not key:
            raise block.error(f"host name must be a string, got {key!r} (quote numbers)", key)
        if host_vars is not None and not isinstance(host_vars, SourceMap):
            raise block.error(f"vars of host '{key}' must be a mapping, got {type(host_vars).__name__}", key)
        pattern, port = split_host_key(key)
        try:
            names = expand_ranges(pattern)
        except BadRange as exc:
            raise block.error(f"host {exc}", key) from None
        line = block.line_of(key)
        if host_vars:
            for var, value in host_vars.items():
                _check_var(host_vars, var, value, f"host '{key}'")
        for name in names:
            host = self.hosts.get(name)
            if host is None:
                host = self.hosts[name] = _HostDef(name, line)
                if port:  # Ansible takes the port of a `name:port` key when it first sees the host
                    host.vars["ansible_port"] = port
                    host.origins["ansible_port"] = (block, key)
            group.add_host(name)
            if host_vars:
                if name in self.groups:
                    raise host_vars.error(f"host '{name}' has vars and the name of a group: Ansible would set "
                                          f"them on the group '{name}' (so on every host in it), not on the "
                                          "host; rename the host or the group", next(iter(host_vars)))
                for var, value in host_vars.items():
                    host.vars[var] = value
                    host.origins[var] = (host_vars, var)

    def host_list(self, text: str) -> None:
        """`-i 'web1,web2:2222,'`, as Ansible's host_list plugin reads it: comma-separated hosts
        (no ranges) in 'ungrouped', `host:port` split, a host seen before left as it is."""
        where = SourceMap()
        where.path, where.line = text, 1
        for item in text.split(","):
            item = item.strip()
            if not item:
                continue
            try:
                name, port = parse_address(item, allow_ranges=False)
            except NotAnAddress:
                name, port = item, None
            if name in self.hosts:
                continue
            host = self.hosts[name] = _HostDef(name, 1)
            if port:
                host.vars["ansible_port"] = port
                host.origins["ansible_port"] = (where, item)
            self.groups["ungrouped"].add_host(name)

    def finish(self) -> None:
        """Ansible's reconcile step: top groups join `all`; hosts in no other group are `ungrouped`."""
        for name, group in list(self.groups.items()):
            if name != "all" and not group.parents:
                self.link("all", name, None, None)
        if not self.hosts:
            raise ConfigError("the inventory defines no hosts", self.shown, 1)
        ungrouped = self.groups["ungrouped"]
        plain = {"all", "ungrouped"}
        member_of: dict[str, set[str]] = {}
        for group in self.groups.values():
            for h in group.hosts:
                member_of.setdefault(h, set()).add(group.name)
        for h in self.hosts:
            direct = member_of.get(h, set())
            if direct - plain:
                if "ungrouped" in direct:  # listed there and in a real group: Ansible takes it out
                    ungrouped.hosts.remove(h)
                    ungrouped.host_set.discard(h)
            else:
                ungrouped.add_host(h)


def _did_you_mean(word: Any, choices: Sequence[Any]) -> str:
    close = difflib.get_close_matches(str(word), [str(c) for c in choices], n=1, cutoff=0.75)
    return f" (did you mean '{close[0]}'?)" if close else ""


def _check_var(block: SourceMap, key: Any, value: Any, owner: str) -> None:
    """Validate a connection var where it is written; refuse typos in sglfleet's own namespace."""
    if not isinstance(key, str):
        raise block.error(f"variable names must be strings, got {key!r} in {owner}", key)
    convert = CONVERTERS.get(key)
    if convert is not None:
        if value is None:
            return  # unset, as Ansible reads a null connection var
        if isinstance(value, str) and ("{{" in value or "{%" in value):
            raise block.error(f"'{key}' of {owner} is a Jinja template ({value!r}); sglfleet does not "
                              "evaluate templates, and a connection setting must not be guessed", key)
        try:
            convert(value)
        except ValueError as exc:
            raise block.error(f"'{key}' of {owner} {exc} (got {value!r})", key) from None
    elif key.startswith("sglfleet_"):
        raise block.error(f"unknown sglfleet setting {key!r} in {owner}{_did_you_mean(key, OWN_VARS)}; "
                          f"sglfleet's settings are {', '.join(OWN_VARS)}", key)


def _where(origin: tuple[SourceMap, Any] | None) -> str:
    if origin is None:
        return "?"
    block, key = origin
    return f"{block.path}:{block.line_of(key)}"


# ---------------------------------------------------------------- the inventory


class Inventory:
    """Hosts and groups of one inventory file, with Ansible's pattern selection."""

    def __init__(self, path: str, hosts: dict[str, Host], groups: dict[str, _Group],
                 depths: dict[str, int], implicit_vars: dict[str, Any] | None = None,
                 known_hosts_path: str | None = None):
        self.path = path
        self.hosts = hosts  # name -> Host, in the order Ansible first sees them
        self._groups = groups
        self._depths = depths
        self._implicit_vars = implicit_vars or {}
        self._orders: dict[str, patterns.GroupOrder] = {}
        self._members: dict[str, set[str]] | None = None
        self._host_names: list[str] | None = None
        self.known_hosts_path = known_hosts_path or str(Path(path).with_suffix("")) + ".known_hosts"
        self.chosen_by: str | None = None  # the setting that named the inventory, when not -i
        self.notes: list[str] = []  # the notes of the last selection, also logged

    # -- the PatternSource protocol
    def has_host(self, name: str) -> bool:
        return name in self.hosts

    def host_names(self) -> Sequence[str]:
        if self._host_names is None:
            self._host_names = list(self.hosts)
        return self._host_names

    def group_names(self) -> Sequence[str]:
        return list(self._groups)

    def has_group(self, name: str) -> bool:
        return name in self._groups

    def first_localhost(self) -> str | None:
        """The first host named localhost, 127.0.0.1 or ::1: Ansible's localhost when it has one."""
        found = [n for n in patterns.LOCALHOST_NAMES if n in self.hosts]
        order = {n: i for i, n in enumerate(self.hosts) if n in found} if len(found) > 1 else {}
        return min(found, key=order.__getitem__) if len(found) > 1 else (found[0] if found else None)

    def group_order(self, name: str) -> patterns.GroupOrder:
        """The group's hosts as Ansible's Group.get_hosts lists them (see patterns.GroupOrder)."""
        if name not in self._orders:
            self._orders[name] = self._compute_order(name)
        return self._orders[name]

    def _compute_order(self, name: str) -> patterns.GroupOrder:
        groups = self._groups
        ordered = [name] + groups[name].children
        seen = set(ordered)
        level = [name] + groups[name].children
        unfixed_at: int | None = None  # index into `ordered` where the unfixed part starts
        while level:
            contributions = []
            for parent in level:
                new = [c for c in groups[parent].children if c not in seen]
                if new:
                    contributions.append(new)
            if len(contributions) > 1 and unfixed_at is None:
                unfixed_at = len(ordered)
            following: list[str] = []
            for new in contributions:
                for child in new:
                    if child not in seen:
                        seen.add(child)
                        following.append(child)
            ordered.extend(following)
            level = following
        names: list[str] = []
        seen_hosts: set[str] = set()
        unfixed_from: int | None = None
        for index, group in enumerate(ordered):
            if unfixed_at is not None and index == unfixed_at:
                unfixed_from = len(names)
            for h in groups[group].hosts:
                if h not in seen_hosts:
                    seen_hosts.add(h)
                    names.append(h)
        return patterns.GroupOrder(tuple(names), len(names) if unfixed_from is None else unfixed_from)

    # -- the old view: group name -> host names (transitively), 'all' and 'ungrouped' included
    @property
    def groups(self) -> dict[str, set[str]]:
        if self._members is None:
            self._members = {g: set(self.group_order(g).names) for g in self._groups}
        return self._members

    def select(self, pattern: str, match_exec: bool = True) -> list[Host]:
        """The hosts `ansible PATTERN --list-hosts` lists, in its order, each resolved by OpenSSH
        (`resolve_hosts`; `match_exec=False` runs no Match exec); or a ConfigError (exit 2)."""
        chosen = patterns.select(pattern, self)
        hosts = [self.hosts[n] if n in self.hosts else self._implicit_localhost(n) for n in chosen.names]
        for host in hosts:
            if host.connection not in ("ssh", "local"):
                origin = host.vars.get("ansible_connection")
                raise ConfigError(f"host '{host.name}' has ansible_connection: {origin}; sglfleet connects "
                                  "over SSH (ssh, paramiko, smart) or runs locally (local) only", self.path)
        hosts = resolve_hosts(hosts, match_exec, self.hosts)
        self.notes = _notes(hosts)
        for note in self.notes:
            log.warning("note: %s", note)
        return hosts

    def _implicit_localhost(self, name: str) -> Host:
        """Ansible's implicit localhost: this machine, without SSH, with the `all` group's vars."""
        merged = dict(self._implicit_vars)
        merged.update({"ansible_connection": "local", "ansible_python_interpreter": sys.executable})
        return Host(name=name, address="127.0.0.1", port=22, user=_local_user(), python=sys.executable,
                    models_dir=str(merged.get("sglfleet_models_dir") or "/root/models"),
                    connection="local", vars=merged)


def _notes(hosts: list[Host]) -> list[str]:
    """One line per kind of note, naming where it is first set and for which hosts."""
    by_note: dict[str, tuple[str, list[str]]] = {}
    for host in hosts:
        for note, where in host.notes:
            by_note.setdefault(note, (where, []))[1].append(host.name)
    lines = []
    for note, (where, names) in by_note.items():
        shown = ", ".join(names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")
        lines.append(f"{where}: {note} (hosts {shown})")
    return lines


# ---------------------------------------------------------------- loading


def _local_user() -> str:
    try:
        return pwd.getpwuid(os.getuid()).pw_name
    except KeyError:
        return os.environ.get("USER") or "root"


def _load_document(path: str | Path, shown: str) -> Any:
    """The YAML document with file:line on every mapping, parsed by libyaml where it is there: the
    pure-Python parser spends ~1.5 s on 10,000 hosts, libyaml a tenth of that."""
    return load_yaml(path, shown, what="the inventory", fast=True)


def load_inventory(path: str | Path | Sequence[str | Path], ssh_config_path: str | None = None) -> Inventory:
    """One inventory from a source (a YAML or INI file, or a directory of them) or several, merged
    in order, as `ansible -i A -i B` merges them."""
    # Loading makes millions of small objects and no reference cycles: the cyclic collector would
    # scan them again and again as they pile up (and once more on the first select). Off while
    # loading, then the survivors are moved out of its sight (gc.freeze; refcounting still frees them).
    collecting = gc.isenabled()
    gc.disable()
    try:
        sources = [path] if isinstance(path, (str, Path)) else list(path)
        return _load_inventory(sources, ssh_config_path)
    finally:
        gc.freeze()
        if collecting:
            gc.enable()


def _read_inventory_file(parser: _Parser, path: Path) -> None:
    """One file into the graph, tried as Ansible's plugins try it: YAML first when the extension
    lets the yaml plugin take it (none, .yaml, .yml, .json) and the document is a mapping, else
    INI (any file; the ini plugin goes by content, not by extension)."""
    shown = str(path)
    inventory_sources.refuse_other_plugins(path, shown)
    try:
        text = read_text(path, shown, "the inventory")  # a missing or unreadable file ends here
    except ConfigError:
        # bytes that are not UTF-8: Ansible's ini plugin takes them in comment lines (none else reads it)
        try:
            text = decode_ini(path.read_bytes())
        except OSError:
            text = None
        if text is None:
            raise
        parse_ini(text, shown, parser)
        return
    yaml_problem: ConfigError | None = None
    if inventory_sources.reads_as_yaml(path):
        try:
            data = _load_document(path, shown)
        except ConfigError as exc:
            yaml_problem = exc
        else:
            if isinstance(data, SourceMap):
                parser.document(data)
                return
            if data is not None:
                yaml_problem = ConfigError(f"a YAML inventory is a mapping of groups (e.g. 'all:'), this "
                                           f"document is a {type(data).__name__}", shown, 1)
    try:
        parse_ini(text, shown, parser)
    except ConfigError as ini_problem:
        if yaml_problem is None:
            raise
        if path.suffix in (".yaml", ".yml", ".json"):  # its name says YAML: the YAML problem is the one
            raise yaml_problem from None
        # no extension: Ansible tries both; the problem that counts is that of the format its first line has
        if _looks_like_yaml(text):
            raise ConfigError(f"{without_location(yaml_problem)} (read as YAML; it is no INI inventory either)",
                              shown, yaml_problem.line) from None
        raise ConfigError(f"{without_location(ini_problem)} (read as INI: it is no YAML inventory)",
                          shown, ini_problem.line) from None


_YAML_START = re.compile(r"^(?:---|%YAML|[^\[\s=#;][^=]*:(?:\s|$))")


def _looks_like_yaml(text: str) -> bool:
    """Whether a file's first line that is no comment reads as YAML (`---`, `key:`), not INI."""
    for line in text.splitlines():
        line = line.strip()
        if line and line[0] not in "#;":
            return bool(_YAML_START.match(line))
    return False


def _load_inventory(sources: list[str | Path], ssh_config_path: str | None) -> Inventory:
    if not sources:
        raise ConfigError("no inventory source given")
    shown = ", ".join(str(s) for s in sources)
    parser = _Parser(shown)
    files = [s for s in sources if not inventory_sources.is_host_list(s)]
    for source in sources:
        if inventory_sources.is_host_list(source):
            parser.host_list(str(source))
            continue
        for file in inventory_sources.inventory_files(source):
            _read_inventory_file(parser, file)
    parser.finish()
    # group_vars/ and host_vars/ beside each source: in a directory source, inside it (host lists have none)
    basedirs = [Path(s).resolve() if Path(s).is_dir() else Path(s).resolve().parent for s in files]
    inventory_dir = basedirs[0] if basedirs else Path.cwd()
    depths = _group_depths(parser.groups)
    ssh_config = _load_ssh_config(ssh_config_path)
    local_user = _local_user()

    ancestors: dict[str, frozenset[str]] = {}

    def closure(group: str) -> frozenset[str]:
        if group not in ancestors:
            result = {group}
            for parent in parser.groups[group].parents:
                result |= closure(parent)
            ancestors[group] = frozenset(result)
        return ancestors[group]

    direct: dict[str, list[str]] = {}
    for group in parser.groups.values():
        for h in group.hosts:
            direct.setdefault(h, []).append(group.name)
    layered: dict[frozenset[str], tuple[tuple[str, ...], dict[str, Any], dict[str, Any]]] = {}
    group_files = [_VarsDir(b / "group_vars") for b in basedirs]
    host_files = [_VarsDir(b / "host_vars") for b in basedirs]

    def file_vars(dirs: list[_VarsDir], names: Sequence[str], kind: str, merged: dict, origins: dict,
                  claims: list | None = None) -> None:
        for vars_dir in dirs:  # per source, then per group (Ansible's get_vars_from_inventory_sources)
            for name in names:
                found, found_origins = vars_dir.vars_of(name, f"{kind} '{name}'")
                merged.update(found)
                origins.update(found_origins)
                if claims is not None and SERVER_GROUP_VAR in found:
                    claims.append((name, found[SERVER_GROUP_VAR], _where(found_origins[SERVER_GROUP_VAR])))

    def group_layers(member_of: frozenset[str]):
        if member_of not in layered:
            ordered = sorted(member_of, key=lambda g: (depths[g], parser.groups[g].priority, g))
            merged: dict[str, Any] = {}
            origins: dict[str, Any] = {}
            claims: list[tuple[str, str, str]] = []  # each group that sets sglfleet_server_group
            for g in ordered:  # deeper, higher-priority, later-named groups win
                merged.update(parser.groups[g].vars)
                origins.update(parser.groups[g].origins)
                if SERVER_GROUP_VAR in parser.groups[g].vars:
                    claims.append((g, parser.groups[g].vars[SERVER_GROUP_VAR],
                                   _where(parser.groups[g].origins[SERVER_GROUP_VAR])))
            # then group_vars/ files over every inventory group var: 'all' first, then the others
            file_vars(group_files, ["all"], "group", merged, origins, claims)
            file_vars(group_files, [g for g in ordered if g != "all"], "group", merged, origins, claims)
            conflicting = tuple(claims) if len({str(c[1]) for c in claims}) > 1 else ()
            layered[member_of] = (tuple(g for g in ordered if g != "all"), merged, origins, conflicting)
        return layered[member_of]

    hosts: dict[str, Host] = {}
    for name, definition in parser.hosts.items():
        member_of = frozenset().union(*(closure(g) for g in direct.get(name, ()))) | {"all"}
        group_names, merged, origins, claims = group_layers(member_of)
        merged = {**merged, **definition.vars}  # host vars over group vars, host_vars/ last
        origins = {**origins, **definition.origins}
        own_claims: list[tuple[str, str, str]] = []
        file_vars(host_files, [name], "host", merged, origins, own_claims)
        if claims and (SERVER_GROUP_VAR in definition.vars or own_claims):
            claims = ()  # the host's own value settles which server group it is in
        hosts[name] = _build_host(name, merged, origins, group_names, ssh_config, inventory_dir, local_user,
                                  shown, claims)
    # beside the first inventory file; for host lists alone, the one ssh and Ansible use
    known_hosts = (str(Path(files[0]).with_suffix("")) + ".known_hosts" if files
                   else os.path.expanduser("~/.ssh/known_hosts"))
    if os.path.exists(known_hosts):
        KnownHosts(known_hosts).validate()
    implicit_vars = dict(parser.groups["all"].vars)
    file_vars(group_files, ["all"], "group", implicit_vars, {})
    return Inventory(shown, hosts, parser.groups, depths, implicit_vars, known_hosts_path=known_hosts)


class _VarsDir:
    """`group_vars/` or `host_vars/` beside the inventory, read as Ansible's host_group_vars plugin does:
    for a name, the first of `NAME`, `NAME.yml`, `NAME.yaml`, `NAME.json` (a directory `NAME/` gives
    all its files, sorted, recursively, hidden and `~` backups skipped), each a mapping, later files
    winning."""

    EXTENSIONS = ("", ".yml", ".yaml", ".json")

    def __init__(self, directory: Path):
        self.directory = directory
        self.entries = set(os.listdir(directory)) if directory.is_dir() else set()

    def vars_of(self, name: str, owner: str) -> tuple[dict[str, Any], dict[str, Any]]:
        if not self.entries or name.startswith("/"):
            return {}, {}
        for ext in self.EXTENSIONS:
            if name + ext in self.entries:
                found = self.directory / (name + ext)
                files = self._files_under(found) if found.is_dir() else [found]
                break
        else:
            return {}, {}
        merged: dict[str, Any] = {}
        origins: dict[str, Any] = {}
        for file in files:
            shown = str(file)
            if read_text(file, shown, "the vars file").lstrip().startswith("$ANSIBLE_VAULT"):
                raise ConfigError("this vars file is encrypted with Ansible Vault; sglfleet cannot read it, and "
                                  "a connection var inside it would be missed (decrypt it, or move the "
                                  "connection vars out of it)", shown, 1)
            data = _load_document(file, shown)
            if data is None:
                continue
            if not isinstance(data, SourceMap):
                raise ConfigError(f"a vars file for {owner} must be a mapping of variables, got "
                                  f"{type(data).__name__}", shown, 1)
            for key, value in data.items():
                _check_var(data, key, value, f"{owner} ({self.directory.name}/)")
                merged[key] = value
                origins[key] = (data, key)
        return merged, origins

    @classmethod
    def _files_under(cls, directory: Path) -> list[Path]:
        found: list[Path] = []
        for entry in sorted(os.listdir(directory)):
            if entry.startswith(".") or entry.endswith("~"):
                continue
            full = directory / entry
            ext = os.path.splitext(entry)[1]
            if full.is_dir() and not ext:
                found.extend(cls._files_under(full))
            elif full.is_file() and (not ext or ext in cls.EXTENSIONS):
                found.append(full)
        return found


def _group_depths(groups: dict[str, _Group]) -> dict[str, int]:
    """Each group's longest distance from `all` (Ansible's Group.depth); loops were refused earlier."""
    depth: dict[str, int] = {}
    order: list[str] = []
    state: dict[str, int] = {}

    def visit(name: str) -> None:  # a topological order, children after all their parents
        stack = [(name, iter(groups[name].children))]
        state[name] = 1
        while stack:
            node, children = stack[-1]
            child = next(children, None)
            if child is None:
                stack.pop()
                order.append(node)
            elif child not in state:
                state[child] = 1
                stack.append((child, iter(groups[child].children)))
    visit("all")
    for name in groups:  # unreachable groups cannot exist after finish(); kept safe anyway
        if name not in state:
            visit(name)
    for name in reversed(order):
        parents = groups[name].parents
        depth[name] = max((depth[p] + 1 for p in parents if p in depth), default=0)
    return depth


def _load_ssh_config(path: str | None) -> ssh_resolve.SshConfigFiles:
    """The ssh config the hosts are resolved with (see ssh_resolve.config_files); nothing is read yet:
    OpenSSH reads it when the selected hosts are resolved."""
    return ssh_resolve.config_files(path)


def _first(merged: dict[str, Any], names: tuple[str, ...]) -> tuple[str | None, Any]:
    for name in names:
        value = merged.get(name)
        if value is not None:
            return name, value
    return None, None


# ssh keyword -> the connection setting whose inventory var passes it (for provenance)
_OPTION_SETTINGS = {"port": "port", "identityfile": "identity_file", "user": "user",
                    "connecttimeout": "connect_timeout", "proxyjump": "proxy_jump", "host": "address"}
_FLAG_KEYWORDS = {"-J": "proxyjump", "-i": "identityfile", "-l": "user", "-p": "port"}


def _build_host(name: str, merged: dict[str, Any], origins: dict[str, Any], groups: tuple[str, ...],
                ssh_config: ssh_resolve.SshConfigFiles, inventory_dir: Path, local_user: str, shown: str,
                server_group_claims: tuple[tuple[str, str, str], ...] = ()) -> Host:
    """The host as the inventory says, with the `ssh -G` request Ansible's ssh plugin would make for it
    (destination ansible_host or the name; -o Port/IdentityFile/User/ConnectTimeout from the vars,
    then sglfleet_proxy_jump, then the ssh args); `resolve_hosts` asks OpenSSH once it is selected."""
    settings: dict[str, Any] = {}
    setting_vars: dict[str, str] = {}
    for setting, (names, convert) in CONNECTION_VARS.items():
        var, value = _first(merged, names)
        if var is not None:
            settings[setting] = convert(value)  # validated where written; cannot fail here
            setting_vars[setting] = var
    notes: list[str] = []
    unused: dict[str, list[str]] = {}  # reason -> the vars it covers (one note for all become vars)
    for var, reason in UNUSED_VARS.items():
        if merged.get(var) not in (None, False, ""):
            unused.setdefault(reason, []).append(var)
    for reason, names in unused.items():
        label = "ansible_become*" if names[0].startswith("ansible_become") else "ansible_password/ansible_ssh_pass"
        notes.append((f"{label} not used: {reason}", _where(origins.get(names[0]))))
    for former, now in FORMER_NAMES.items():
        if former in merged and now not in merged:
            notes.append((f"'{former}' is an ordinary variable, as in Ansible; sglfleet reads {now} "
                          "(rename it if it was meant for sglfleet)", _where(origins.get(former))))

    connection = settings.get("connection", "ssh")
    if connection in SSH_CONNECTIONS:
        connection = "ssh"
    elif connection in LOCAL_CONNECTIONS:
        connection = "local"
    destination = str(settings.get("address") or name)
    # As Ansible passes the key file: ~ expanded, a relative path left to ssh (the working directory).
    key_file = os.path.expanduser(settings["identity_file"]) if "identity_file" in settings else None
    args_vars = [v for v in CONNECTION_VARS["ssh_args"][0] if merged.get(v) not in (None, "")]
    options, ignored = ssh_resolve.inventory_options(
        settings.get("port"), key_file, settings.get("user"), settings.get("connect_timeout"),
        settings.get("proxy_jump"), [_as_str(merged[v]) for v in args_vars])
    if ignored:
        var = args_vars[0] if len(args_vars) == 1 else "/".join(args_vars)
        notes.append((f"{var}: sglfleet connects with what ssh resolves of -o/-J/-i/-l/-p (address, port, user, "
                      f"keys, ProxyJump, ProxyCommand, ConnectTimeout, HostKeyAlias) and does not apply "
                      f"{' '.join(ignored)}", _where(origins.get(args_vars[0]))))
    given: dict[str, str] = {}  # ssh keyword -> the inventory var (file:line) that passes it
    for keyword, setting in _OPTION_SETTINGS.items():
        if setting in setting_vars:
            given[keyword] = f"{_where(origins.get(setting_vars[setting]))} ({setting_vars[setting]})"
    if args_vars:  # what the ssh args set, unless a var above already did (the first value wins)
        where = f"{_where(origins.get(args_vars[0]))} ({args_vars[0]})"
        for flag, value in zip(options[::2], options[1::2]):
            keyword = ssh_resolve.option_keyword(value) if flag == "-o" else _FLAG_KEYWORDS.get(flag, "")
            if keyword in ssh_resolve.APPLIED:
                given.setdefault(keyword, where)
    sources = list(given.items())
    request = ssh_resolve.Request(destination, tuple(options), ssh_config, tuple(sources), name)
    return Host(
        name=name,
        address=destination,
        port=settings.get("port") or 22,
        user=str(settings.get("user") or local_user),
        identity_files=(key_file,) if key_file else (),
        proxy_jump=settings.get("proxy_jump"),
        python=settings.get("python", "python3"),
        models_dir=settings.get("models_dir", "/root/models"),
        host_key_policy=settings.get("host_key_policy", "strict"),
        connect_timeout=settings.get("connect_timeout", ssh_resolve.DEFAULT_CONNECT_TIMEOUT),
        groups=groups,
        vars=merged,
        connection=connection,
        notes=tuple(notes),
        ssh_request=request if connection == "ssh" else None,
        origins={var: _where(origins.get(var)) for var in TRACKED_VARS if var in merged},
        server_group_claims=server_group_claims,
    )


def resolve_hosts(hosts: Sequence[Host], match_exec: bool = True,
                  inventory_hosts: dict[str, Host] | None = None) -> list[Host]:
    """Each SSH host with what OpenSSH resolves for it (address, port, user, keys, proxy), all at once
    in parallel; local hosts and hosts made in code as they are. A refused config is a ConfigError.
    A `sglfleet_proxy_jump` naming one of `inventory_hosts` goes through that host as the inventory
    has it (its own vars, resolved too), as the connection does."""
    inventory_hosts = inventory_hosts or {}
    jumps = {h.proxy_jump: inventory_hosts[h.proxy_jump] for h in hosts
             if h.ssh_request is not None and h.proxy_jump in inventory_hosts}
    todo = [h for h in [*hosts, *jumps.values()] if h.ssh_request is not None and h.ssh is None]
    found = dict(zip((h.name for h in todo),
                     ssh_resolve.resolve_many([h.ssh_request for h in todo], match_exec)))  # type: ignore[misc]
    resolved = [resolved_host(h, found[h.name]) if h.name in found else h for h in hosts]
    for index, host in enumerate(resolved):
        jump = jumps.get(host.proxy_jump) if host.proxy_jump else None
        jump_ssh = found.get(jump.name, jump.ssh) if jump is not None else None
        if host.ssh is not None and jump_ssh is not None:
            resolved[index] = dataclasses.replace(host, ssh=dataclasses.replace(host.ssh, via=jump_ssh))
    return resolved


def resolved_host(host: Host, endpoint: ssh_resolve.SshEndpoint) -> Host:
    """The host at what OpenSSH resolved; ansible_timeout (a float) over the config's ConnectTimeout."""
    given = dict(host.ssh_request.sources) if host.ssh_request is not None else {}
    timeout = (host.connect_timeout if "connecttimeout" in given
               else endpoint.connect_timeout or ssh_resolve.DEFAULT_CONNECT_TIMEOUT)
    return dataclasses.replace(host, address=endpoint.address, port=endpoint.port, user=endpoint.user,
                               identity_files=endpoint.identity_files, connect_timeout=timeout, ssh=endpoint)


def match_pattern(pattern: str, inventory: Inventory) -> set[str]:
    """The names of the hosts a pattern selects (kept for callers of the old API)."""
    return {h.name for h in inventory.select(pattern)}


ANSIBLE_DEFAULT_HOSTS = "/etc/ansible/hosts"


def default_inventory(repo_root: Path | None = None) -> inventory_sources.DefaultSource | None:
    """The inventory when no -i is given: `SGLFLEET_INVENTORY`; else Ansible's own setting
    (`ANSIBLE_INVENTORY`, else `inventory =` of the ansible.cfg Ansible reads); else
    `inventory/lab.yaml` when the lab is up; else Ansible's default /etc/ansible/hosts if it exists."""
    env = os.environ.get("SGLFLEET_INVENTORY")
    if env:
        return inventory_sources.DefaultSource((env,), "SGLFLEET_INVENTORY")
    ansible = inventory_sources.default_source()
    if ansible is not None:
        return ansible
    lab = (repo_root or Path.cwd()) / "inventory" / "lab.yaml"
    if lab.exists():
        return inventory_sources.DefaultSource((str(lab),), "the lab (inventory/lab.yaml)")
    if os.path.exists(ANSIBLE_DEFAULT_HOSTS):
        return inventory_sources.DefaultSource((ANSIBLE_DEFAULT_HOSTS,), "Ansible's default inventory")
    return None


def default_inventory_path(repo_root: Path | None = None) -> str | None:
    """The first source of `default_inventory` (kept for callers of the old API)."""
    chosen = default_inventory(repo_root)
    return chosen.paths[0] if chosen else None
