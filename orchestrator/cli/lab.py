"""`lab up|status|down|fault|proxy`: the local lab of simulated hosts on loopback."""

from __future__ import annotations

import dataclasses
import os
import time
from pathlib import Path

import typer

from ..errors import ConfigError
from ..fleet.hostkeys import known_hosts_name
from ..lab.base import ensure_base
from ..lab.manager import HOSTS_PER_SUBNET, Lab, host_name
from ..lab.proxy import LatencyProxy
from ..lab.router import LabRouter
from . import output
from .common import JsonOpt
from .option_checks import number

lab_app = typer.Typer(no_args_is_help=True, help="The local lab: simulated hosts on loopback.")


def register(app: typer.Typer) -> None:
    app.add_typer(lab_app, name="lab")


def _lab() -> Lab:
    return Lab(inventory_path=Path(os.environ.get("SGLFLEET_LAB_INVENTORY", "inventory/lab.yaml")))


@lab_app.command("up")
def lab_up(count: int = typer.Option(4, "--hosts", "-n", help="How many hosts (ct129, ct130, ...)."),
           gpu: str = typer.Option("h200", help="The GPU each host declares (sglfleet_lab_gpu)."),
           systemd: int = typer.Option(0, "--systemd", help="How many of the hosts (the last ones) boot real "
                                       "systemd as PID 1, each in a root of its own (an overlay: systemd's boot "
                                       "cleans /tmp, /run, /var of the root it sees); their servers run as units "
                                       "and log to journald."),
           router: bool = typer.Option(False, "--router", help="Also start a real sglang-router (installed by "
                                       "`python -m orchestrator.lab.router install`) on the lab's .254 address, "
                                       "retries off, and write its sglfleet_router_url into the inventory.")) -> None:
    """Start the lab (idempotent) and write inventory/lab.yaml and its known_hosts."""
    lab = _lab()
    started = time.monotonic()
    lab_router = LabRouter(lab.state_dir, lab.subnet)
    if (router or lab_router.running()) and count >= HOSTS_PER_SUBNET:
        raise ConfigError(f"the lab's router listens on {lab.subnet}.254, the address of host {HOSTS_PER_SUBNET} "
                          f"({host_name(HOSTS_PER_SUBNET - 1)}): with the router the lab holds at most "
                          f"{HOSTS_PER_SUBNET - 1} hosts (--hosts {count})")
    if router:
        lab.check_prerequisites()
        lab_router.start()
    # A router started by an earlier `lab up --router` stays in the inventory.
    extra = {"sglfleet_router_url": lab_router.url} if lab_router.running() else None
    hosts = lab.up(count, gpu=gpu, extra_vars=extra, systemd=systemd)
    output.stdout.print(f"lab up: {len(hosts)} host(s) in {time.monotonic() - started:.1f}s; "
                        f"inventory {lab.inventory_path}, known_hosts {lab.known_hosts_path}")
    for h in hosts:
        output.stdout.print(f"  {h.name}  {h.address}:{h.port}  gpu={h.gpu}"
                            + ("  systemd (PID 1)" if h.kind == "systemd" else ""), highlight=False)
    if extra:
        output.stdout.print(f"  router  {lab_router.url}  sglang-router (retries off; log {lab_router.log_path}); "
                            "`sglfleet restart --rolling` adds serving hosts missing from it", highlight=False)


@lab_app.command("image")
def lab_image() -> None:
    """Build the lab's GPU-host base image if it is missing (needs the package index: run it before
    anything that has no network, such as the test suite's jail). A no-op once built."""
    started = time.monotonic()
    base = ensure_base(log=lambda line: output.stderr.print(line, highlight=False))
    output.stdout.print(f"lab base image: {base} ({time.monotonic() - started:.1f}s)", highlight=False)


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
            output.stdout.print(f"{s.name}  {s.address}:22  {state}" + ("  systemd" if s.kind == "systemd" else ""))
    raise typer.Exit(0 if statuses and all(s.running and s.sshd for s in statuses) else 1)


@lab_app.command("down")
def lab_down() -> None:
    """Stop every lab host; no process, mount or namespace is left behind."""
    lab = _lab()
    router = LabRouter(lab.state_dir, lab.subnet).stop()
    stopped = lab.down()
    output.stdout.print(f"lab down: stopped {len(stopped)} host(s)" + (" and the router" if router else ""))


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
              delay_ms: float = typer.Option(50.0, "--delay-ms", callback=number(low=0, unit="ms"),
                                             help="Added latency each way."),
              port: int = typer.Option(0, callback=number(low=0, high=65535),
                                       help="Listen port on 127.0.0.1 (0: any free port).")) -> None:
    """Run a latency proxy in front of a lab host until Ctrl-C (known_hosts gets its entry)."""
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
