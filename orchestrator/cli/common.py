"""What every command shares: the common options, the inventory, running a task on a pattern's
hosts with live progress, and `report` — JSON or table, then the exit code.

Exit codes: 0 every host ok, 1 some host failed (the others still ran), 2 usage or configuration
error (a one-paragraph message, nothing done).
"""

from __future__ import annotations

import os
import signal
import sys
import threading
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Callable, Iterator, NoReturn, Optional

import typer

from ..errors import ConfigError
from ..fleet.group import DEFAULT_FORKS, Group, GroupResult
from ..fleet.hostkeys import KnownHosts
from ..stages.health import DEFAULT_TIMEOUTS
from ..fleet.inventory import HOST_KEY_POLICIES, Inventory, default_inventory, load_inventory
from ..numbers import check_number
from . import output
from .option_checks import POSITIVE_SECONDS, number

InventoryOpt = typer.Option(None, "-i", "--inventory", help="Inventory: an Ansible YAML or INI file, or a "
                            "directory of them (default: $SGLFLEET_INVENTORY, else $ANSIBLE_INVENTORY or "
                            "ansible.cfg's inventory, else inventory/lab.yaml when the lab is up).")
ForksOpt = typer.Option(DEFAULT_FORKS, "--forks", "-f", callback=number(low=1),
                        help="How many hosts to work on at once.")
JsonOpt = typer.Option(False, "--json", help="Print one JSON document on stdout.")
PolicyOpt = typer.Option(None, "--host-key-policy",
                         help=f"Override the inventory's host key policy: {' or '.join(HOST_KEY_POLICIES)}.")
PatternArg = typer.Argument(..., help="Host pattern (Ansible --limit syntax), e.g. all, gpu-fleet:!ct130.")
ProfileArg = typer.Argument(..., help="Profile name (playbooks/NAME.yaml) or a .yaml path.")


@dataclass
class Globals:
    """Options given before the subcommand (`sglfleet -i FILE facts all`)."""

    inventory: Optional[str] = None


GLOBALS = Globals()


def inventory(path: Optional[str]) -> Inventory:
    """The subcommand's -i, else the one given before it, else the default (`default_inventory`:
    $SGLFLEET_INVENTORY, Ansible's ANSIBLE_INVENTORY or ansible.cfg, the lab's), which is named on
    stderr when Ansible's settings chose it."""
    given = path or GLOBALS.inventory
    if given:
        return load_inventory(given)
    chosen = default_inventory()
    if chosen is None:
        raise ConfigError("no inventory given: pass -i FILE (or a directory), set SGLFLEET_INVENTORY or "
                          "ANSIBLE_INVENTORY, set `inventory =` in ansible.cfg, or start the local lab with "
                          "`sglfleet lab up`")
    try:
        inv = load_inventory(chosen.paths)
    except ConfigError as exc:
        raise ConfigError(f"{exc} (the inventory chosen by {chosen.chosen_by})") from None
    inv.chosen_by = chosen.chosen_by
    if chosen.chosen_by not in ("SGLFLEET_INVENTORY", "the lab (inventory/lab.yaml)"):
        output.stderr.print(f"inventory: {output.escape(', '.join(chosen.paths))} (chosen by "
                            f"{output.escape(chosen.chosen_by)})", highlight=False)
    return inv


def host_key_policy(value: Optional[str]) -> Optional[str]:
    if value is not None and value not in HOST_KEY_POLICIES:
        raise ConfigError(f"--host-key-policy must be one of {', '.join(HOST_KEY_POLICIES)}, got '{value}'")
    return value


def health_timeouts(load_timeout: Optional[float], health_timeout: Optional[float]) -> dict[str, float]:
    """The staged health's timeouts from --load-timeout / --health-timeout (positive, finite)."""
    out: dict[str, float] = {}
    if load_timeout is not None:
        out["port"] = check_number("--load-timeout", load_timeout, **POSITIVE_SECONDS)
    if health_timeout is not None:
        check_number("--health-timeout", health_timeout, **POSITIVE_SECONDS)
        out.update({k: health_timeout for k in DEFAULT_TIMEOUTS if k not in ("port", "alive")})
    return out


def command_line() -> str:
    return "sglfleet " + " ".join(sys.argv[1:])


def run_group(inv: Inventory, pattern: str, task: Callable[..., Any], label: str, forks: int,
              policy: Optional[str], quiet: bool, notes: bool = False) -> GroupResult:
    """`task(conn)` on every host `pattern` selects, with live per-host progress on stderr; with
    `notes`, `task(conn, note)` where `note(text)` shows the host's current step live.
    Ctrl-C or SIGTERM stops it as `stop_on_signals` says."""
    group = Group.from_inventory(inv, pattern, forks=forks, host_key_policy=host_key_policy(policy))
    progress = output.Progress([h.name for h in group.hosts], label, enabled=not quiet)
    group.progress = progress
    run = task if not notes else (lambda conn: task(conn, lambda text: progress(conn.host.name, "running", text)))
    with group, progress, stop_on_signals(group):
        return group.run(run, label)


def run_units(inv: Inventory, units: dict[str, list[Any]], task: Callable[..., Any], label: str, forks: int,
              policy: Optional[str], quiet: bool) -> GroupResult:
    """`task(conns, note)` once per unit (name -> hosts, e.g. a multi-node server's ranks), with
    live progress per unit on stderr; Ctrl-C as `run_group`."""
    hosts = [h for members in units.values() for h in members]
    group = Group(hosts, KnownHosts(inv.known_hosts_path), forks=forks, host_key_policy=host_key_policy(policy),
                  inventory=inv)
    progress = output.Progress(list(units), label, enabled=not quiet)
    group.progress = progress
    unit_of = {members[0].name: name for name, members in units.items()}

    def run(conns: list[Any]) -> Any:
        name = unit_of[conns[0].host.name]
        return task(conns, lambda text: progress(name, "running", text))

    with group, progress, stop_on_signals(group):
        return group.run_units(units, run, label)


@contextmanager
def stop_on_signals(group: Group) -> Iterator[None]:
    """The first Ctrl-C (or SIGTERM) stops starting hosts and steps and lets each host finish the
    step it is in; the command then reports every host and exits 130. A second one stops waiting
    and exits 130 at once: the host side still finishes or undoes its step under its lock."""
    if threading.current_thread() is not threading.main_thread():
        yield  # signal handlers belong to the main thread; a caller elsewhere stops the group itself
        return
    received = []

    def handler(signum: int, frame: Any) -> None:
        received.append(signum)
        if len(received) == 1:
            group.stop.set()
            output.stderr.print(f"[yellow]{signal.Signals(signum).name}[/]: no new host or step will start; "
                                "waiting for the hosts already working to finish the step they are in "
                                "(press Ctrl-C again to stop waiting)", highlight=False)
            return
        output.stderr.print("[red]stopped waiting[/]: hosts still working finish or undo their current step on "
                            "their own, under their lock; no host is ever left half-swapped (an interrupted swap "
                            "is undone from its journal by the next push or rollback). Check with "
                            "`sglfleet releases PATTERN`.", highlight=False)
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(130)  # worker threads are blocked on the network; nothing else would end them now

    previous = {sig: signal.signal(sig, handler) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for sig, old in previous.items():
            signal.signal(sig, old)


def on_one_host(inv: Inventory, pattern: str, what: str, task: Callable[[Any], Any], label: str,
                policy: Optional[str]) -> Any:
    """`task(conn)` on the one host `pattern` selects; its value, or its exception raised as it
    was (so a render error keeps exit code 2)."""
    selected = inv.select(pattern)
    if len(selected) != 1:
        raise ConfigError(f"{what} takes one host; '{pattern}' selects {len(selected)}")
    result = run_group(inv, pattern, task, label, 1, policy, quiet=True)[selected[0].name]
    if not result.ok:
        assert result.exception is not None
        raise result.exception
    return result.value


def report(command: str, results: GroupResult, as_json: bool, table: Callable[[], None], **extra: Any) -> NoReturn:
    """One JSON document (--json) or the command's own table, then exit with the results' code."""
    if as_json:
        output.print_json(output.group_json(command, results, **extra))
    else:
        table()
    raise typer.Exit(results.exit_code)
