"""Units of serving: a host that serves alone, or a server group (one SGLang server over N hosts).

The stages that change what serves (deploy, stop, rolling restart and deploy) act on units; the
read-only ones (render, smoke, status, logs, metrics) on hosts, each rank knowing its place.

    profile with server.nodes == 1   every selected host is a unit of its own
    profile with server.nodes == N   the hosts of each inventory server group (fleet/server_groups.py)
                                     form one unit, in rank order; rank 0 (ranks[0]) serves HTTP and is
                                     the only one a router knows
    no profile (stop, status)        the inventory's server groups, whatever their size

A Placement is what one rank adds to its argv: --nnodes (the profile's server.nodes), --node-rank
(fleet/server_groups: explicit sglfleet_node_rank, else the inventory's order) and
--dist-init-addr (rank 0's address, as ssh resolves it, with the profile's server.dist_init_port),
each with its source for `render`.

Refused before any host is touched (ConfigError, exit 2, with the file:line of both sides): a
group whose size is not the profile's nodes (a rank missing or one too many), a multi-node
profile on a host in no server group, a host of a server group given a single-node profile, the
ranks of one group disagreeing on nodes or dist_init_port (per-host sglfleet_profile_overrides),
and, where a unit is acted on whole (`whole=True`), a pattern that selects only some of a group's
hosts: stopping or restarting one rank takes the whole server down, so the pattern must say so.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ..errors import ConfigError
from ..fleet.inventory import SERVER_GROUP_VAR, Host, Inventory
from ..fleet.server_groups import ServerGroup, server_groups
from ..spec.profile import Profile, with_overrides


@dataclass(frozen=True)
class Placement:
    """One rank of a multi-node server: its flags' values and where each came from."""

    group: str
    rank: int
    nodes: int
    dist_init_addr: str
    hosts: tuple[str, ...]            # the group's hosts in rank order
    sources: dict[str, str] = field(default_factory=dict, compare=False)  # flag -> where it came from

    def to_json(self) -> dict[str, Any]:
        return {"server_group": self.group, "rank": self.rank, "nodes": self.nodes,
                "dist_init_addr": self.dist_init_addr, "ranks": list(self.hosts)}


@dataclass
class Unit:
    """What a deploy, stop or rollout acts on as one: a host, or a server group in rank order."""

    name: str
    hosts: list[Host]
    group: ServerGroup | None = None
    placements: dict[str, Placement] = field(default_factory=dict)  # host -> its place (groups only)

    @property
    def leader(self) -> Host:
        """The host that serves HTTP: the single host, or rank 0."""
        return self.hosts[0]

    @property
    def names(self) -> list[str]:
        return [h.name for h in self.hosts]

    @property
    def is_group(self) -> bool:
        return self.group is not None


def _profile_where(profile: Profile, *keys: str) -> str:
    node, line = profile.source, None
    for key in keys:
        if not hasattr(node, "line_of") or key not in node:
            break
        line, node = node.line_of(key), node[key]
    return f"{profile.path}:{line}" if line else f"{profile.path} (default)"


def _effective(profile: Profile, host: Host, inventory_path: str) -> Profile:
    overrides = host.vars.get("sglfleet_profile_overrides")
    mine = overrides.get(profile.name) if isinstance(overrides, dict) else None
    return with_overrides(profile, mine, f"{inventory_path} ({host.name})")


def _address(host: Host) -> str:
    return f"[{host.address}]" if ":" in host.address and not host.address.startswith("[") else host.address


def _place(group: ServerGroup, leader: Host, profile: Profile, inventory_path: str) -> dict[str, Placement]:
    """Each rank's Placement; the group must fit the profile (size, and the ranks agreeing)."""
    server = _effective(profile, leader, inventory_path).model.server
    nodes_where = _profile_where(profile, "server", "nodes")
    if len(group.ranks) != server.nodes:
        gap = (f"rank(s) {', '.join(str(r) for r in range(len(group.ranks), server.nodes))} missing"
               if len(group.ranks) < server.nodes else f"{len(group.ranks) - server.nodes} host(s) too many")
        raise ConfigError(f"server group {group.name} has {len(group.ranks)} host(s) ({', '.join(group.names)}; "
                          f"{SERVER_GROUP_VAR} at {group.source}) but profile {profile.name} runs on {server.nodes} "
                          f"node(s) (server.nodes at {nodes_where}): {gap}. Make the group {server.nodes} hosts, "
                          "or use a profile for its size")
    for rank in group.ranks[1:]:
        mine = _effective(profile, rank.host, inventory_path).model.server
        if (mine.nodes, mine.dist_init_port, mine.tp, mine.pp) != (server.nodes, server.dist_init_port, server.tp,
                                                                   server.pp):
            raise ConfigError(f"server group {group.name}: {rank.host.name}'s sglfleet_profile_overrides give "
                              f"{profile.name} other parallelism or dist_init_port than rank 0 ({leader.name}): "
                              "every node of one server runs the same nodes, tp, pp and dist_init_port",
                              inventory_path)
    address = f"{_address(leader)}:{server.dist_init_port}"
    port_where = _profile_where(profile, "server", "dist_init_port")
    leader_where = (dict(leader.ssh_request.sources).get("host") if leader.ssh_request else None) or \
        "its inventory name, as ssh resolves it"
    out = {}
    for rank in group.ranks:
        sources = {"--nnodes": f"{nodes_where} (server.nodes)",
                   "--node-rank": f"server group {group.name}: {rank.source}",
                   "--dist-init-addr": f"rank 0 {leader.name}'s address ({leader_where}) : {port_where} "
                                       "(server.dist_init_port)"}
        out[rank.host.name] = Placement(group.name, rank.rank, server.nodes, address, tuple(group.names), sources)
    return out


def _single_node_refusal(host: Host, group: ServerGroup, profile: Profile) -> ConfigError:
    return ConfigError(f"{host.name} is a node of server group {group.name} ({SERVER_GROUP_VAR} at "
                       f"{host.where(SERVER_GROUP_VAR)}), but profile {profile.name} runs on one node (server.nodes "
                       f"at {_profile_where(profile, 'server', 'nodes')}): give the profile nodes: "
                       f"{len(group.ranks)}, or take the host out of the server group")


def _no_group_refusal(host: Host, profile: Profile, nodes: int) -> ConfigError:
    return ConfigError(f"profile {profile.name} runs on {nodes} nodes (server.nodes at "
                       f"{_profile_where(profile, 'server', 'nodes')}) but {host.name} is in no server group: set "
                       f"{SERVER_GROUP_VAR}: NAME on the {nodes} hosts of one server (usually as a group var)")


def _resolved(inventory: Inventory, hosts: list[Host], wanted: list[str]) -> list[Host]:
    """`wanted` hosts as ssh resolves them: the selected ones as they are, others resolved now."""
    have = {h.name: h for h in hosts}
    missing = [n for n in wanted if n not in have]
    if missing:
        for h in inventory.select(",".join(missing)):
            have[h.name] = h
    return [have[n] for n in wanted]


def units(inventory: Inventory, hosts: list[Host], profile: Profile | None, whole: bool = True) -> list[Unit]:
    """The units the selected `hosts` make, in the selection's order of their first host. With
    `whole`, a server group must be selected whole; without, a group is completed with its other
    ranks only to place the selected ones (rank 0's address), and a unit holds the selected ranks."""
    groups = server_groups(inventory)
    nodes = profile.model.server.nodes if profile is not None else None
    out: list[Unit] = []
    seen: set[str] = set()
    for host in hosts:
        name = host.vars.get(SERVER_GROUP_VAR)
        group = groups.get(str(name)) if name is not None else None
        if profile is not None:
            host_nodes = _effective(profile, host, inventory.path).model.server.nodes
            if group is None and host_nodes > 1:
                raise _no_group_refusal(host, profile, host_nodes)
            if group is not None and host_nodes == 1:
                raise _single_node_refusal(host, group, profile)
        if group is None:
            out.append(Unit(host.name, [host]))
            continue
        if group.name in seen:
            continue
        seen.add(group.name)
        selected = {h.name for h in hosts}
        left_out = [n for n in group.names if n not in selected]
        if whole and left_out:
            raise ConfigError(f"the pattern selects {', '.join(n for n in group.names if n in selected)} but not "
                              f"{', '.join(left_out)} of server group {group.name} ({SERVER_GROUP_VAR} at "
                              f"{group.source}): one SGLang server runs on all of them, and stopping or restarting "
                              "one rank takes the whole server down. Select the whole group (its hosts, or an "
                              "inventory group that holds them)")
        members = _resolved(inventory, hosts, group.names)
        resolved = ServerGroup(group.name, tuple(type(r)(m, r.rank, r.source) for r, m in zip(group.ranks, members)),
                               group.source)
        placements = _place(resolved, members[0], profile, inventory.path) if profile is not None else {}
        chosen = [m for m in members if m.name in selected or whole]
        out.append(Unit(group.name, chosen, resolved, placements))
    return out


def placements(inventory: Inventory, hosts: list[Host], profile: Profile) -> dict[str, Placement]:
    """Host -> its Placement, for the selected hosts that are ranks of a multi-node server (render,
    smoke, status: read-only, so any ranks may be selected)."""
    found: dict[str, Placement] = {}
    for unit in units(inventory, hosts, profile, whole=False):
        found.update({h.name: unit.placements[h.name] for h in unit.hosts if h.name in unit.placements})
    return found


def rank_labels(inventory: Inventory) -> dict[str, str]:
    """Host -> `host/rank` for every rank of a server group (how `logs` prefixes their lines)."""
    return {r.host.name: f"{r.host.name}/{r.rank}" for group in server_groups(inventory).values() for r in group.ranks}


def serving_hosts(inventory: Inventory, hosts: list[Host]) -> tuple[list[str], list[str]]:
    """The hosts whose server answers for itself (`metrics` reads them): a lone host, or rank 0 of
    a server group in place of any of its ranks (the others log no decode lines and serve no
    metrics of the server); and a note for each rank so replaced."""
    groups = server_groups(inventory)
    names: list[str] = []
    notes: list[str] = []
    for host in hosts:
        name = host.vars.get(SERVER_GROUP_VAR)
        group = groups.get(str(name)) if name is not None else None
        chosen = group.leader.name if group is not None else host.name
        if chosen != host.name:
            notes.append(f"{host.name} is rank {group.rank_of(host.name).rank} of server group {group.name}: "
                         f"its server's figures are rank 0's ({chosen})")
        if chosen not in names:
            names.append(chosen)
    return names, notes
