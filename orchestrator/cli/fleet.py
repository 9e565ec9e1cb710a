"""`hosts`, `facts`, `run`: what a pattern selects, what the hosts are, an ad-hoc command."""

from __future__ import annotations

import dataclasses
import sys
import time
from typing import Any, Optional

import typer

from ..fleet.facts import gather
from ..fleet.group import TaskOutcome
from . import output
from .common import ForksOpt, InventoryOpt, JsonOpt, PatternArg, PolicyOpt, inventory, report, run_group
from .option_checks import POSITIVE_SECONDS, number


def register(app: typer.Typer) -> None:
    app.command()(hosts)
    app.command()(facts)
    app.command("run")(run_command)


def hosts(pattern: str = typer.Argument("all", help="Host pattern (Ansible --limit syntax)."),
          inventory_path: Optional[str] = InventoryOpt, as_json: bool = JsonOpt,
          match_exec: bool = typer.Option(False, "--match-exec",
                                          help="Run the ssh config's Match exec commands, as every command "
                                               "that connects does (off: they are taken as not matching).")) -> None:
    """List the hosts a pattern selects and how they would be reached (no connection): what OpenSSH
    resolves for each (`ssh -G`) and where each value comes from."""
    inv = inventory(inventory_path)
    selected = inv.select(pattern, match_exec=match_exec)
    execs = _match_exec_notes(selected, match_exec)
    if as_json:
        output.print_json({"command": "hosts", "pattern": pattern, "inventory": inv.path,
                           "match_exec": execs,
                           "hosts": [_host_json(h) for h in selected]})
        return
    table = output.Table(title=f"{len(selected)} host(s) for '{pattern}'")
    for col in ("host", "target", "via", "python", "groups"):
        table.add_column(col)
    for h in selected:
        table.add_row(h.name, h.target, _via_text(h.ssh) if h.ssh else "", h.python, ", ".join(h.groups))
    output.stdout.print(table)
    for note in execs:
        output.stderr.print(output.escape(note["note"]))


def _via_text(endpoint: Any) -> str:
    hops = [f"{e.user}@{e.address}:{e.port}" for e in endpoint.hops()]
    if endpoint.proxy_command:
        return f"ProxyCommand {endpoint.proxy_command}"
    first = endpoint.hops()[0] if hops else None
    if first is not None and first.proxy_command:
        hops[0] = f"ProxyCommand {first.proxy_command} -> " + hops[0]
    return " -> ".join(hops)


def _endpoint_json(e: Any) -> dict[str, Any]:
    """Each value OpenSSH resolved, with where it came from (inventory file:line or ssh config file:line)."""
    src = e.sources
    return {"destination": e.destination,
            "address": {"value": e.address, "from": src.get("hostname")},
            "port": {"value": e.port, "from": src.get("port")},
            "user": {"value": e.user, "from": src.get("user")},
            "identity_files": {"value": list(e.identity_files), "from": src.get("identityfile")},
            "identities_only": {"value": e.identities_only, "from": src.get("identitiesonly")},
            "connect_timeout": {"value": e.connect_timeout, "from": src.get("connecttimeout")},
            "host_key_alias": {"value": e.host_key_alias, "from": src.get("hostkeyalias")},
            "proxy_jump": {"value": e.proxy_jump, "from": src.get("proxyjump")},
            "proxy_command": {"value": e.proxy_command, "from": src.get("proxycommand")},
            "ssh_options": list(e.options)}


def _host_json(h: Any) -> dict[str, Any]:
    data = {k: v for k, v in dataclasses.asdict(h).items() if k not in ("ssh", "ssh_request")}
    if h.ssh is not None:
        data["ssh"] = {**_endpoint_json(h.ssh), "config": h.ssh.config,
                       "via": [_endpoint_json(e) for e in h.ssh.hops()],
                       "match_exec": [dataclasses.asdict(m) for m in h.ssh.all_match_exec()]}
    return data


def _match_exec_notes(selected: list[Any], ran: bool) -> list[dict[str, Any]]:
    """One note per Match exec line the resolution met: where, and whether it ran."""
    seen: dict[str, dict[str, Any]] = {}
    for h in selected:
        for m in (h.ssh.all_match_exec() if h.ssh else []):
            entry = seen.setdefault(m.where, {"where": m.where, "command": m.command, "ran": ran, "hosts": []})
            entry["hosts"].append(h.name)
    for entry in seen.values():
        if ran:
            how = "ran it for each host, as ssh does when it connects"
        else:
            how = ("did not run it (taken as not matching; `sglfleet hosts` makes no connection and runs "
                   "nothing; --match-exec runs it, as every command that connects does)")
        entry["note"] = f"{entry['where']}: the ssh config has Match exec {entry['command']}; sglfleet hosts {how}"
    return list(seen.values())


def facts(pattern: str = PatternArg, inventory_path: Optional[str] = InventoryOpt, forks: int = ForksOpt,
          as_json: bool = JsonOpt, host_key_policy: Optional[str] = PolicyOpt) -> None:
    """Gather facts (hostname, OS, interpreter, SGLang, GPUs, disk) in one round trip per host."""
    inv = inventory(inventory_path)
    started = time.monotonic()

    def task(conn):
        values = gather(conn)
        if values["interpreter"]["missing"]:
            return TaskOutcome(False, values, f"configured python {conn.host.python} not found on the host")
        return values

    results = run_group(inv, pattern, task, "facts", forks, host_key_policy, quiet=as_json)
    report("facts", results, as_json,
           lambda: output.summary_table("facts", results, ["hostname", "os", "python", "sglang", "gpus",
                                                           "models free"], _facts_row),
           pattern=pattern, inventory=inv.path, wall_s=round(time.monotonic() - started, 3))


def _facts_row(v: dict[str, Any]) -> list[str]:
    interp = v["interpreter"]
    gpus = v["gpus"] or []
    gpu_text = ", ".join(f"{g.get('name')} ({g.get('memory_mib')} MiB)" if "name" in g else g.get("error", "?")
                         for g in gpus) or "none"
    disk = v["models_disk"]
    disk_text = output.human_bytes(disk.get("free_bytes")) + ("" if disk.get("exists") else " (dir missing)")
    os_name = (v["os"] or "?").split(" (")[0]
    return [v["hostname"] or "?", os_name, interp["version"] or "?",
            (v["packages"] or {}).get("sglang") or "-", gpu_text, disk_text]


def run_command(pattern: str = PatternArg,
                command: str = typer.Argument(..., help="Shell command to run on each host."),
                inventory_path: Optional[str] = InventoryOpt, forks: int = ForksOpt, as_json: bool = JsonOpt,
                timeout: Optional[float] = typer.Option(None, callback=number(**POSITIVE_SECONDS),
                                                        help="Kill the command after this many seconds."),
                host_key_policy: Optional[str] = PolicyOpt) -> None:
    """Run one shell command on every selected host and show its complete output."""
    inv = inventory(inventory_path)

    def task(conn):
        result = conn.run(command, timeout=timeout)
        # surrogateescape, not the replacement character: bytes that are not UTF-8 are shown as \xNN
        value = {"exit_code": result.exit_code, "stdout": result.stdout.decode("utf-8", "surrogateescape"),
                 "stderr": result.stderr.decode("utf-8", "surrogateescape"),
                 "duration_s": round(result.duration, 3), "timed_out": result.timed_out}
        if result.ok:
            return value
        why = f"timed out after {timeout}s" if result.timed_out else f"exit code {result.exit_code}"
        return TaskOutcome(False, value, why)

    results = run_group(inv, pattern, task, "run", forks, host_key_policy, quiet=as_json)

    def print_outputs() -> None:
        for name, r in results.items():
            output.host_rule(name, "ok" if r.ok else (r.error or "failed").splitlines()[0], "green" if r.ok else "red")
            if r.value:
                output.write_host_text(r.value["stdout"])
                if r.value["stderr"]:
                    output.say(output.shown(r.value["stderr"]), style="yellow", end="")
            elif r.error:
                output.say(output.shown(r.error), style="red")
        sys.stdout.flush()
        output.say(f"{len(results.succeeded)} ok, {len(results.failed)} failed")

    report("run", results, as_json, print_outputs, pattern=pattern, inventory=inv.path)
