"""Server groups: the hosts of ONE multi-node SGLang server, as the inventory names them.

SGLang runs one server across nodes: every node starts `python -m sglang.launch_server` with the
same model and parallelism, `--nnodes N`, its own `--node-rank R` and `--dist-init-addr` (rank 0's
address); rank 0 serves HTTP. In the inventory a server group is the hosts whose
`sglfleet_server_group` is the same name, usually a group var of an inventory group:

    llama-a:
      vars: {sglfleet_server_group: llama-a}
      hosts:
        gpu01:                     # rank 0: the first the inventory names
        gpu02: {sglfleet_node_rank: 1}

Ranks: a host's `sglfleet_node_rank` wins; the hosts without one take the lowest free ranks in
the order the inventory first names them (the order of its files and lines, as Ansible first
sees hosts), so adding a host at the end never renumbers the others. The ranks of a group must be
0..N-1, each once. Refused with file:line (ConfigError, exit 2): two hosts with the same rank, a
rank past the group's size (which leaves another missing), and a host that two of its groups put
in different server groups (the host's own var settles it).

This module reads the inventory only; whether a group fits a profile (`nodes: N`) is for the
stages (stages/units.py). No policy, no connection.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..errors import ConfigError
from .inventory import SERVER_GROUP_VAR, Host, Inventory

RANK_VAR = "sglfleet_node_rank"


@dataclass(frozen=True)
class Rank:
    """One host's place in its server group, and why it has that rank."""

    host: Host
    rank: int
    source: str  # "inv.yaml:12 (sglfleet_node_rank)" or "inventory order: ... (sglfleet_server_group at inv.yaml:3)"


@dataclass(frozen=True)
class ServerGroup:
    """A multi-node server's hosts in rank order (ranks[0] serves HTTP)."""

    name: str
    ranks: tuple[Rank, ...]
    source: str  # file:line of rank 0's sglfleet_server_group

    @property
    def hosts(self) -> list[Host]:
        return [r.host for r in self.ranks]

    @property
    def names(self) -> list[str]:
        return [r.host.name for r in self.ranks]

    @property
    def leader(self) -> Host:
        return self.ranks[0].host

    def rank_of(self, host: str) -> Rank:
        return next(r for r in self.ranks if r.host.name == host)


def _ordinal(n: int) -> str:
    return f"{n}{'tsnrhtdd'[(n // 10 % 10 != 1) * (n % 10 < 4) * n % 10::4]}"


def server_groups(inventory: Inventory) -> dict[str, ServerGroup]:
    """Every server group of the inventory, ranks resolved; a ConfigError (file:line) for the
    first mismatch found."""
    members: dict[str, list[Host]] = {}
    for host in inventory.hosts.values():  # the order the inventory first names its hosts
        name = host.vars.get(SERVER_GROUP_VAR)
        if host.server_group_claims:
            claims = "; ".join(f"{group} sets it to {value!r} ({where})" for group, value, where
                               in host.server_group_claims)
            raise ConfigError(f"host {host.name} is in two server groups: {claims}. A host is a node of one "
                              f"multi-node server; take it out of one of those groups, or set "
                              f"{SERVER_GROUP_VAR} on the host itself", inventory.path)
        if name is not None:
            members.setdefault(str(name), []).append(host)
        elif host.vars.get(RANK_VAR) is not None:
            raise ConfigError(f"host {host.name} has {RANK_VAR} ({host.where(RANK_VAR)}) but no {SERVER_GROUP_VAR}: "
                              "a rank is a place in a multi-node server; set the server group too", inventory.path)
    return {name: _ranked(name, hosts) for name, hosts in members.items()}


def _ranked(name: str, hosts: list[Host]) -> ServerGroup:
    size = len(hosts)
    taken: dict[int, Host] = {}
    for host in hosts:
        if RANK_VAR not in host.vars or host.vars[RANK_VAR] is None:
            continue
        rank = int(host.vars[RANK_VAR])
        if rank in taken:
            raise ConfigError(f"server group {name}: {taken[rank].name} ({taken[rank].where(RANK_VAR)}) and "
                              f"{host.name} ({host.where(RANK_VAR)}) both have {RANK_VAR} {rank}; each rank "
                              "is one host's")
        if rank >= size:
            raise ConfigError(f"server group {name} has {size} host(s) ({', '.join(h.name for h in hosts)}), so "
                              f"its ranks are 0..{size - 1}, but {host.name} has {RANK_VAR} {rank} "
                              f"({host.where(RANK_VAR)}), which leaves one of them missing. Add the missing "
                              "host(s) to the group or fix the rank")
        taken[rank] = host
    explicit = {h.name: r for r, h in taken.items()}
    free = iter(sorted(set(range(size)) - set(taken)))
    ranks = []
    for position, host in enumerate(hosts, 1):
        if host.name in explicit:
            ranks.append(Rank(host, explicit[host.name], f"{host.where(RANK_VAR)} ({RANK_VAR})"))
        else:
            rank = next(free)
            ranks.append(Rank(host, rank, f"inventory order: the {_ordinal(position)} host of server group "
                                          f"{name} the inventory names ({SERVER_GROUP_VAR} at "
                                          f"{host.where(SERVER_GROUP_VAR)})"))
    ranks.sort(key=lambda r: r.rank)
    return ServerGroup(name, tuple(ranks), ranks[0].host.where(SERVER_GROUP_VAR))


def group_of(inventory: Inventory, host: str) -> ServerGroup | None:
    """The server group `host` is a node of (None: it serves alone)."""
    name = inventory.hosts[host].vars.get(SERVER_GROUP_VAR) if host in inventory.hosts else None
    return server_groups(inventory).get(str(name)) if name is not None else None
