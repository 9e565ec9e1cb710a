"""Ansible-style YAML inventories and `--limit` host patterns.

Structure (as Ansible's YAML inventory):

    all:
      vars: {...}
      hosts: {ct129: {address: 10.1.230.172}}
      children:
        gpu-fleet:
          hosts: {ct129: }

Variable precedence, lowest first: `all.vars`, group vars from shallow to deep groups
(ties by group name), host vars. Host vars accept Ansible's names (`ansible_host`, ...)
and ours (`address`, ...); when both are given, ours wins. `~/.ssh/config` fills what
the inventory leaves unset (HostName, Port, User, IdentityFile, ProxyJump).
"""

from __future__ import annotations

import difflib
import fnmatch
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import paramiko

from ..errors import ConfigError
from ..spec.yamlsrc import SourceMap, load_yaml

HOST_KEY_POLICIES = ("strict", "accept-new")


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
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
        raise ValueError("must be a positive number of seconds")
    return float(value)


# Our name -> (Ansible alias or None, converter). Ours wins when both are set.
CONNECTION_VARS: dict[str, tuple[str | None, Callable[[Any], Any]]] = {
    "address": ("ansible_host", _as_str),
    "port": ("ansible_port", _as_port),
    "user": ("ansible_user", _as_str),
    "identity_file": ("ansible_ssh_private_key_file", _as_str),
    "proxy_jump": (None, _as_str),
    "python": ("ansible_python_interpreter", _as_str),
    "models_dir": (None, _as_str),
    "host_key_policy": (None, _as_policy),
    "connect_timeout": (None, _as_seconds),
}
ANSIBLE_ALIASES = {alias: ours for ours, (alias, _) in CONNECTION_VARS.items() if alias}
KNOWN_VARS = set(CONNECTION_VARS) | set(ANSIBLE_ALIASES)
GROUP_KEYS = ("hosts", "vars", "children")


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

    @property
    def target(self) -> str:
        return f"{self.user}@{self.address}:{self.port}"


@dataclass
class _Group:
    name: str
    hosts: list[str] = field(default_factory=list)
    children: list[str] = field(default_factory=list)
    vars: list[SourceMap] = field(default_factory=list)
    line: int | None = None


class Inventory:
    """Hosts and groups of one inventory file, with pattern selection."""

    def __init__(self, path: str, hosts: dict[str, Host], groups: dict[str, set[str]]):
        self.path = path
        self.hosts = hosts  # name -> Host, in file order
        self.groups = groups  # group name -> host names (transitively), incl. 'all'
        self.known_hosts_path = str(Path(path).with_suffix("")) + ".known_hosts"

    def select(self, pattern: str) -> list[Host]:
        """Hosts matching an Ansible `--limit` pattern, in inventory order."""
        names = match_pattern(pattern, self)
        return [host for name, host in self.hosts.items() if name in names]


# ---------------------------------------------------------------- loading


def load_inventory(path: str | Path, ssh_config_path: str | None = None) -> Inventory:
    shown = str(path)
    data = load_yaml(path, shown)
    if data is None:
        raise ConfigError("the inventory is empty; expected a mapping with an 'all' group", shown, 1)
    if not isinstance(data, SourceMap):
        raise ConfigError("the inventory must be a mapping of groups (e.g. 'all:')", shown, 1)
    inventory_dir = Path(path).resolve().parent

    groups: dict[str, _Group] = {}
    host_vars: dict[str, list[SourceMap]] = {}
    host_order: list[str] = []

    def walk(name: str, body: Any, where: SourceMap, key: Any) -> None:
        if not isinstance(name, str) or not name:
            raise where.error(f"group name must be a non-empty string, got {name!r}", key)
        group = groups.setdefault(name, _Group(name, line=where.line_of(key)))
        if body is None:
            return
        if not isinstance(body, SourceMap):
            raise where.error(
                f"group '{name}' must be a mapping with hosts/vars/children, got {type(body).__name__}", key)
        for gkey in body:
            if gkey not in GROUP_KEYS:
                hint = _did_you_mean(gkey, GROUP_KEYS)
                raise body.error(f"unknown key {gkey!r} in group '{name}'{hint}; "
                                 f"a group has only {', '.join(GROUP_KEYS)}", gkey)
        hosts = body.get("hosts")
        if hosts is not None:
            if not isinstance(hosts, SourceMap):
                raise body.error(f"'hosts' of group '{name}' must be a mapping of host names", "hosts")
            for host_name, hvars in hosts.items():
                if not isinstance(host_name, str) or not host_name:
                    raise hosts.error(f"host name must be a string, got {host_name!r}", host_name)
                if hvars is not None and not isinstance(hvars, SourceMap):
                    raise hosts.error(f"vars of host '{host_name}' must be a mapping", host_name)
                if host_name not in host_vars:
                    host_vars[host_name] = []
                    host_order.append(host_name)
                if hvars:
                    _check_vars(hvars, f"host '{host_name}'")
                    host_vars[host_name].append(hvars)
                group.hosts.append(host_name)
        gvars = body.get("vars")
        if gvars is not None:
            if not isinstance(gvars, SourceMap):
                raise body.error(f"'vars' of group '{name}' must be a mapping", "vars")
            _check_vars(gvars, f"group '{name}'")
            group.vars.append(gvars)
        children = body.get("children")
        if children is not None:
            if not isinstance(children, SourceMap):
                raise body.error(f"'children' of group '{name}' must be a mapping of groups", "children")
            for child_name, child_body in children.items():
                if child_name == "all":
                    raise children.error("'all' cannot be a child group", child_name)
                group.children.append(child_name)
                walk(child_name, child_body, children, child_name)

    for top_name, top_body in data.items():
        walk(top_name, top_body, data, top_name)
    all_group = groups.setdefault("all", _Group("all", line=1))
    for name in groups:
        if name != "all" and name not in all_group.children:
            all_group.children.append(name)

    depth = _group_depths(groups, shown)
    members = {name: _members(name, groups, {}) for name in groups}
    members["all"] = set(host_order)

    if not host_order:
        raise ConfigError("the inventory defines no hosts", shown, data.line)

    ssh_config = _load_ssh_config(ssh_config_path)
    hosts: dict[str, Host] = {}
    for host_name in host_order:
        host_groups = sorted((g for g, m in members.items() if host_name in m and g != "all"),
                             key=lambda g: (depth[g], g))
        layers: list[SourceMap] = list(groups["all"].vars)
        for g in host_groups:
            layers.extend(groups[g].vars)
        layers.extend(host_vars[host_name])
        hosts[host_name] = _build_host(host_name, layers, tuple(host_groups), ssh_config, inventory_dir, shown)
    return Inventory(shown, hosts, members)


def _did_you_mean(word: Any, choices: Any) -> str:
    close = difflib.get_close_matches(str(word), [str(c) for c in choices], n=1, cutoff=0.75)
    return f" (did you mean '{close[0]}'?)" if close else ""


def _check_vars(block: SourceMap, owner: str) -> None:
    """Reject likely typos of connection vars; other vars are the user's own."""
    for key, value in block.items():
        if not isinstance(key, str):
            raise block.error(f"variable names must be strings, got {key!r} in {owner}", key)
        if key in KNOWN_VARS:
            ours = ANSIBLE_ALIASES.get(key, key)
            try:
                CONNECTION_VARS[ours][1](value)
            except ValueError as exc:
                raise block.error(f"'{key}' of {owner} {exc} (got {value!r})", key) from None
            continue
        hint = _did_you_mean(key, KNOWN_VARS)
        if hint:
            raise block.error(f"unknown key {key!r} in {owner}{hint}", key)


def _group_depths(groups: dict[str, _Group], shown: str) -> dict[str, int]:
    depth = {"all": 0}
    stack: list[tuple[str, int, tuple[str, ...]]] = [("all", 0, ())]
    while stack:
        name, d, path = stack.pop()
        for child in groups[name].children:
            if child in path or child == name:
                raise ConfigError(f"group '{child}' is its own ancestor ({' -> '.join(path + (name, child))})",
                                  shown, groups[child].line)
            if depth.get(child, -1) < d + 1:
                depth[child] = d + 1
                stack.append((child, d + 1, path + (name,)))
    return depth


def _members(name: str, groups: dict[str, _Group], memo: dict[str, set[str]]) -> set[str]:
    if name in memo:
        return memo[name]
    result = set(groups[name].hosts)
    for child in groups[name].children:
        if child != "all":
            result |= _members(child, groups, memo)
    memo[name] = result
    return result


def _load_ssh_config(path: str | None) -> paramiko.SSHConfig:
    path = path or os.environ.get("SGLFLEET_SSH_CONFIG") or os.path.expanduser("~/.ssh/config")
    if os.path.exists(path):
        try:
            return paramiko.SSHConfig.from_path(path)
        except Exception as exc:  # paramiko raises plain exceptions for bad config lines
            raise ConfigError(f"cannot parse ssh config: {exc}", path) from None
    return paramiko.SSHConfig()


def _build_host(name: str, layers: list[SourceMap], groups: tuple[str, ...],
                ssh_config: paramiko.SSHConfig, inventory_dir: Path, shown: str) -> Host:
    # Deeper layers win; within one layer our name wins over its Ansible alias.
    settings: dict[str, Any] = {}
    free_vars: dict[str, Any] = {}
    for layer in layers:
        for ours, (alias, convert) in CONNECTION_VARS.items():
            if ours in layer:
                settings[ours] = convert(layer[ours])
            elif alias is not None and alias in layer:
                settings[ours] = convert(layer[alias])
        free_vars.update({k: v for k, v in layer.items() if k not in KNOWN_VARS})
    free_vars.update(settings)

    ssh = ssh_config.lookup(name)
    address = settings.get("address") or ssh.get("hostname") or name
    port = settings.get("port") or _as_port(ssh.get("port", 22))
    user = settings.get("user") or ssh.get("user") or "root"
    if "identity_file" in settings:
        identity = (settings["identity_file"],)
    else:
        identity = tuple(ssh.get("identityfile", ()))
    identity = tuple(str((inventory_dir / os.path.expanduser(p)).resolve()) for p in identity)
    proxy_jump = settings.get("proxy_jump") or ssh.get("proxyjump")
    if proxy_jump and "," in proxy_jump:
        raise ConfigError(f"host '{name}': proxy_jump with several hops ({proxy_jump}) is not supported; "
                          "chain them in ~/.ssh/config instead", shown)
    return Host(
        name=name,
        address=str(address),
        port=int(port),
        user=str(user),
        identity_files=identity,
        proxy_jump=proxy_jump,
        python=settings.get("python", "python3"),
        models_dir=settings.get("models_dir", "/root/models"),
        host_key_policy=settings.get("host_key_policy", "strict"),
        connect_timeout=settings.get("connect_timeout", 10.0),
        groups=groups,
        vars=free_vars,
    )


# ---------------------------------------------------------------- patterns

_SPLIT = re.compile(r"[,:]")


def match_pattern(pattern: str, inventory: Inventory) -> set[str]:
    """Ansible `--limit` semantics: unions first, then `&` intersections, then `!` exclusions.

    Terms are separated by `,` or `:`. A term is a host, a group, `all`/`*`, a glob
    (`ct1*`), or `~regex`. A term that matches nothing is an error, so that a typo in a
    group name cannot silently shrink a rollout.
    """
    if not pattern or not pattern.strip():
        raise ConfigError("empty host pattern; use 'all' for every host", inventory.path)
    terms = [t.strip() for t in _SPLIT.split(pattern) if t.strip()]
    union: set[str] = set()
    intersections: list[set[str]] = []
    exclusions: set[str] = set()
    saw_union = False
    for term in terms:
        if term.startswith("!"):
            exclusions |= _match_term(term[1:], inventory)
        elif term.startswith("&"):
            intersections.append(_match_term(term[1:], inventory))
        else:
            saw_union = True
            union |= _match_term(term, inventory)
    if not saw_union:  # e.g. '!ct130' alone means all hosts but ct130, as in Ansible
        union = set(inventory.hosts)
    for inter in intersections:
        union &= inter
    union -= exclusions
    if not union:
        raise ConfigError(f"host pattern '{pattern}' matches no host", inventory.path)
    return union


def _match_term(term: str, inventory: Inventory) -> set[str]:
    if not term:
        raise ConfigError("empty term in host pattern", inventory.path)
    if term in ("all", "*"):
        return set(inventory.hosts)
    if term in inventory.groups:
        return set(inventory.groups[term])
    if term in inventory.hosts:
        return {term}
    found: set[str] = set()
    if term.startswith("~"):
        try:
            regex = re.compile(term[1:])
        except re.error as exc:
            raise ConfigError(f"bad regex in host pattern '{term}': {exc}", inventory.path) from None
        found |= {h for h in inventory.hosts if regex.search(h)}
        for g, members in inventory.groups.items():
            if regex.search(g):
                found |= members
    elif any(ch in term for ch in "*?["):
        found |= {h for h in inventory.hosts if fnmatch.fnmatchcase(h, term)}
        for g, members in inventory.groups.items():
            if fnmatch.fnmatchcase(g, term):
                found |= members
    if not found:
        hint = _did_you_mean(term, list(inventory.hosts) + list(inventory.groups))
        raise ConfigError(f"'{term}' is not a host or group in this inventory{hint}", inventory.path)
    return found


def default_inventory_path(repo_root: Path | None = None) -> str | None:
    """`SGLFLEET_INVENTORY`, else `inventory/lab.yaml` when the lab is up."""
    env = os.environ.get("SGLFLEET_INVENTORY")
    if env:
        return env
    root = repo_root or Path.cwd()
    lab = root / "inventory" / "lab.yaml"
    return str(lab) if lab.exists() else None
