"""The `sglfleet` command line.

Exit codes: 0 every host ok, 1 some host failed, 2 usage or configuration error.
"""

from __future__ import annotations

import dataclasses
import sys
import time
from pathlib import Path
from typing import Any, Optional

import typer

from . import output
from .errors import ConfigError, SglfleetError
from .facts import gather
from .group import DEFAULT_FORKS, Group, TaskOutcome
from .inventory import HOST_KEY_POLICIES, Inventory, default_inventory_path, load_inventory

app = typer.Typer(no_args_is_help=True, add_completion=False, pretty_exceptions_enable=False,
                  help="Deploy and operate SGLang + DDTree on your own GPU hosts over SSH.")
lab_app = typer.Typer(no_args_is_help=True, help="The local lab: simulated hosts on loopback.")
app.add_typer(lab_app, name="lab")

InventoryOpt = typer.Option(None, "-i", "--inventory", help="Inventory YAML (default: $SGLFLEET_INVENTORY, "
                            "else inventory/lab.yaml when the lab is up).")
ForksOpt = typer.Option(DEFAULT_FORKS, "--forks", "-f", help="How many hosts to work on at once.")
JsonOpt = typer.Option(False, "--json", help="Print one JSON document on stdout.")
PolicyOpt = typer.Option(None, "--host-key-policy",
                         help=f"Override the inventory's host key policy: {' or '.join(HOST_KEY_POLICIES)}.")


def _inventory(path: Optional[str]) -> Inventory:
    chosen = path or default_inventory_path()
    if chosen is None:
        raise ConfigError("no inventory given: pass -i FILE, set SGLFLEET_INVENTORY, "
                          "or start the local lab with `sglfleet lab up`")
    return load_inventory(chosen)


def _policy(value: Optional[str]) -> Optional[str]:
    if value is not None and value not in HOST_KEY_POLICIES:
        raise ConfigError(f"--host-key-policy must be one of {', '.join(HOST_KEY_POLICIES)}, got '{value}'")
    return value


def _run_group(inventory: Inventory, pattern: str, task: Any, label: str, forks: int,
               policy: Optional[str], quiet: bool):
    group = Group.from_inventory(inventory, pattern, forks=forks, host_key_policy=_policy(policy))
    progress = output.Progress([h.name for h in group.hosts], label, enabled=not quiet)
    group.progress = progress
    with group, progress:
        return group.run(task, label)


@app.command()
def hosts(pattern: str = typer.Argument("all", help="Host pattern (Ansible --limit syntax)."),
          inventory: Optional[str] = InventoryOpt, as_json: bool = JsonOpt) -> None:
    """List the hosts a pattern selects and how they would be reached (no connection)."""
    inv = _inventory(inventory)
    selected = inv.select(pattern)
    if as_json:
        output.print_json({"command": "hosts", "pattern": pattern, "inventory": inv.path,
                           "hosts": [dataclasses.asdict(h) for h in selected]})
        return
    table = output.Table(title=f"{len(selected)} host(s) for '{pattern}'")
    for col in ("host", "target", "python", "groups"):
        table.add_column(col)
    for h in selected:
        table.add_row(h.name, h.target + (f" via {h.proxy_jump}" if h.proxy_jump else ""), h.python,
                      ", ".join(h.groups))
    output.stdout.print(table)


@app.command()
def facts(pattern: str = typer.Argument(..., help="Host pattern, e.g. all, gpu-fleet:!ct130."),
          inventory: Optional[str] = InventoryOpt, forks: int = ForksOpt, as_json: bool = JsonOpt,
          host_key_policy: Optional[str] = PolicyOpt) -> None:
    """Gather facts (hostname, OS, interpreter, SGLang, GPUs, disk) in one round trip per host."""
    inv = _inventory(inventory)
    started = time.monotonic()

    def task(conn):
        values = gather(conn)
        if values["interpreter"]["missing"]:
            return TaskOutcome(False, values, f"configured python {conn.host.python} not found on the host")
        return values

    results = _run_group(inv, pattern, task, "facts", forks, host_key_policy, quiet=as_json)
    if as_json:
        output.print_json(output.group_json("facts", results, pattern=pattern, inventory=inv.path,
                                            wall_s=round(time.monotonic() - started, 3)))
    else:
        output.summary_table("facts", results, ["hostname", "os", "python", "sglang", "gpus", "models free"],
                             _facts_row)
    raise typer.Exit(results.exit_code)


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


@app.command("run")
def run_command(pattern: str = typer.Argument(..., help="Host pattern."),
                command: str = typer.Argument(..., help="Shell command to run on each host."),
                inventory: Optional[str] = InventoryOpt, forks: int = ForksOpt, as_json: bool = JsonOpt,
                timeout: Optional[float] = typer.Option(None, help="Kill the command after this many seconds."),
                host_key_policy: Optional[str] = PolicyOpt) -> None:
    """Run one shell command on every selected host and show its complete output."""
    inv = _inventory(inventory)

    def task(conn):
        result = conn.run(command, timeout=timeout)
        value = {"exit_code": result.exit_code, "stdout": result.stdout_text, "stderr": result.stderr_text,
                 "duration_s": round(result.duration, 3), "timed_out": result.timed_out}
        if result.ok:
            return value
        why = f"timed out after {timeout}s" if result.timed_out else f"exit code {result.exit_code}"
        return TaskOutcome(False, value, why)

    results = _run_group(inv, pattern, task, "run", forks, host_key_policy, quiet=as_json)
    if as_json:
        output.print_json(output.group_json("run", results, pattern=pattern, inventory=inv.path))
        raise typer.Exit(results.exit_code)
    for name, r in results.items():
        style = "green" if r.ok else "red"
        output.stdout.rule(f"[{style}]{name}[/] " + ("ok" if r.ok else (r.error or "failed").splitlines()[0]))
        if r.value:
            sys.stdout.write(r.value["stdout"])
            if r.value["stderr"]:
                output.stdout.print(output.escape(r.value["stderr"]), style="yellow", end="")
        elif r.error:
            output.stdout.print(output.escape(r.error), style="red")
    sys.stdout.flush()
    output.stdout.print(f"{len(results.succeeded)} ok, {len(results.failed)} failed")
    raise typer.Exit(results.exit_code)


# ---------------------------------------------------------------- lab


def _lab():
    import os

    from .lab.manager import Lab
    return Lab(inventory_path=Path(os.environ.get("SGLFLEET_LAB_INVENTORY", "inventory/lab.yaml")))


@lab_app.command("up")
def lab_up(count: int = typer.Option(4, "--hosts", "-n", help="How many hosts (ct129, ct130, ...)."),
           gpu: str = typer.Option("h200", help="The GPU each host declares (lab_gpu).")) -> None:
    """Start the lab (idempotent) and write inventory/lab.yaml and its known_hosts."""
    lab = _lab()
    started = time.monotonic()
    hosts = lab.up(count, gpu=gpu)
    output.stdout.print(f"lab up: {len(hosts)} host(s) in {time.monotonic() - started:.1f}s; "
                        f"inventory {lab.inventory_path}, known_hosts {lab.known_hosts_path}")
    for h in hosts:
        output.stdout.print(f"  {h.name}  {h.address}:{h.port}  gpu={h.gpu}", highlight=False)


@lab_app.command("status")
def lab_status(as_json: bool = JsonOpt) -> None:
    """Show each lab host: running, sshd reachable."""
    statuses = _lab().status()
    if as_json:
        output.print_json({"command": "lab status", "hosts": [dataclasses.asdict(s) for s in statuses]})
    elif not statuses:
        output.stdout.print("lab is down")
    else:
        for s in statuses:
            state = "[green]up[/]" if s.running and s.sshd else ("[yellow]sshd stopped[/]" if s.running
                                                                 else "[red]down[/]")
            output.stdout.print(f"{s.name}  {s.address}:22  {state}")
    raise typer.Exit(0 if statuses and all(s.running and s.sshd for s in statuses) else 1)


@lab_app.command("down")
def lab_down() -> None:
    """Stop every lab host; no process, mount or namespace is left behind."""
    stopped = _lab().down()
    output.stdout.print(f"lab down: stopped {len(stopped)} host(s)")


@lab_app.command("fault")
def lab_fault(action: str = typer.Argument(..., help="stop-sshd | start-sshd | kill-host"),
              host: str = typer.Argument(..., help="Lab host name, e.g. ct130.")) -> None:
    """Fault knobs: stop or restart a host's sshd, or kill the whole host."""
    lab = _lab()
    actions = {"stop-sshd": lab.stop_sshd, "start-sshd": lab.start_sshd, "kill-host": lab.kill_host}
    if action not in actions:
        raise ConfigError(f"unknown fault '{action}'; choose one of {', '.join(actions)}")
    actions[action](host)
    output.stdout.print(f"{host}: {action} done")


@lab_app.command("proxy")
def lab_proxy(host: str = typer.Argument(..., help="Lab host to put the proxy in front of."),
              delay_ms: float = typer.Option(50.0, "--delay-ms", help="Added latency each way."),
              port: int = typer.Option(0, help="Listen port on 127.0.0.1 (0: any free port).")) -> None:
    """Run a latency proxy in front of a lab host until Ctrl-C (known_hosts gets its entry)."""
    from .hostkeys import known_hosts_name
    from .lab.proxy import LatencyProxy
    lab = _lab()
    target = lab._host(host)
    proxy = LatencyProxy((target.address, target.port), delay_ms, ("127.0.0.1", port)).start()
    assert proxy.address is not None
    pub = (lab.host_dir(host) / "ssh_host_ed25519_key.pub").read_text().split()
    name = known_hosts_name(proxy.address[0], proxy.address[1])
    with open(lab.known_hosts_path, "a") as fh:
        fh.write(f"{name} {pub[0]} {pub[1]}\n")
    output.stdout.print(f"proxy {proxy.address[0]}:{proxy.address[1]} -> {host} "
                        f"({target.address}:22), +{delay_ms:g} ms each way; Ctrl-C to stop")
    try:
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        proxy.stop()


def main() -> None:
    try:
        app()
    except SglfleetError as exc:
        output.stderr.print(f"[red]error:[/] {output.escape(str(exc))}", highlight=False)
        sys.exit(exc.exit_code)
    except KeyboardInterrupt:
        output.stderr.print("interrupted")
        sys.exit(130)


if __name__ == "__main__":
    main()
