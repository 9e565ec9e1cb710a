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
from ..errors import ConfigError, SglfleetError
from ..fleet.facts import gather
from ..fleet.group import DEFAULT_FORKS, Group, TaskOutcome
from ..fleet.inventory import HOST_KEY_POLICIES, Inventory, default_inventory_path, load_inventory

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


def _on_one_host(inv: Inventory, pattern: str, what: str, task: Any, label: str, policy: Optional[str]) -> Any:
    """Run `task(conn)` on the one host `pattern` selects and return its value; a failure is
    raised as the task's own error, so it keeps its exit code (2 for a render error)."""
    selected = inv.select(pattern)
    if len(selected) != 1:
        raise ConfigError(f"{what} takes one host; '{pattern}' selects {len(selected)}")
    raised: list[SglfleetError] = []

    def capture(conn):
        try:
            return task(conn)
        except SglfleetError as exc:
            raised.append(exc)
            raise

    result = _run_group(inv, pattern, capture, label, 1, policy, quiet=True)[selected[0].name]
    if not result.ok:
        raise raised[0] if raised else SglfleetError(result.error or f"{label} failed")
    return result.value


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


# ---------------------------------------------------------------- releases

ForceOpt = typer.Option(False, "--force", help="Replace drifted files (neither pristine nor ours); "
                        "the release's backup keeps them.")


def _command_line() -> str:
    return "sglfleet " + " ".join(sys.argv[1:])


def _file_list(files: list[dict[str, Any]], *statuses: str) -> str:
    """`N: a.py, b.py` of the files in `statuses` (default: those a push changes); base names only,
    --json and --diff have the full paths."""
    from ..stages.release import CHANGING

    statuses = statuses or CHANGING
    names = [f["key"].rsplit("/", 1)[-1] for f in files if f["status"] in statuses]
    return f"{len(names)}: {', '.join(names)}" if names else "-"


def _plan_row(value: dict[str, Any]) -> list[str]:
    files = value["files"]
    notes = value["refusals"] + value["notes"]
    return [value.get("package_version") or "?", _file_list(files),
            str(sum(f["status"] == "current" for f in files)), _file_list(files, "drifted"), "; ".join(notes) or "-"]


@app.command()
def plan(pattern: str = typer.Argument(..., help="Host pattern."),
         profile: str = typer.Argument(..., help="Profile name (playbooks/NAME.yaml) or a .yaml path."),
         inventory: Optional[str] = InventoryOpt, forks: int = ForksOpt, as_json: bool = JsonOpt,
         diff: bool = typer.Option(False, "--diff", help="Show a unified diff per changing file."),
         force: bool = ForceOpt, host_key_policy: Optional[str] = PolicyOpt) -> None:
    """Show what `push` would change on each host, without changing anything (one round trip per host)."""
    from ..spec.profile import load_profile
    from ..stages.release import inspect, make_plan

    inv, artifacts = _inventory(inventory), load_profile(profile).artifacts()
    plans: dict[str, Any] = {}

    def task(conn):
        host_plan = make_plan(conn.host.name, inspect(conn, artifacts, with_text=diff), artifacts, force)
        plans[conn.host.name] = host_plan
        value = host_plan.summary()
        return TaskOutcome(not host_plan.refusals, value, "; ".join(host_plan.refusals) or None)

    results = _run_group(inv, pattern, task, "plan", forks, host_key_policy, quiet=as_json)
    if as_json:
        output.print_json(output.group_json("plan", results, pattern=pattern, profile=profile))
        raise typer.Exit(results.exit_code)
    output.summary_table("plan", results, ["sglang", "would change", "current", "drifted", "notes"], _plan_row,
                         refusals_have_rows=True)
    if diff:
        for name, host_plan in plans.items():
            for f in host_plan.changes:
                output.stdout.rule(f"{name}: {f.key} ({f.status})")
                sys.stdout.write(f.diff())
        sys.stdout.flush()
    raise typer.Exit(results.exit_code)


@app.command()
def push(pattern: str = typer.Argument(..., help="Host pattern."),
         profile: str = typer.Argument(..., help="Profile name (playbooks/NAME.yaml) or a .yaml path."),
         inventory: Optional[str] = InventoryOpt, forks: int = ForksOpt, as_json: bool = JsonOpt,
         force: bool = ForceOpt, dry_run: bool = typer.Option(False, "--dry-run", help="Only plan (same as `plan`)."),
         bwlimit: Optional[float] = typer.Option(None, "--bwlimit", help="Limit each host's transfer to KiB/s."),
         host_key_policy: Optional[str] = PolicyOpt) -> None:
    """Install the profile's patchset and extension: staged, hash-verified, swapped atomically, reversible."""
    import os

    from ..spec.profile import load_profile
    from ..stages.release import RemoteError, new_release_id
    from ..stages.release import push as push_host

    if dry_run:
        plan(pattern, profile, inventory, forks, as_json, False, force, host_key_policy)
        return
    inv, artifacts = _inventory(inventory), load_profile(profile).artifacts()
    if bwlimit is not None and bwlimit <= 0:
        raise ConfigError(f"--bwlimit must be a positive KiB/s figure, got {bwlimit}")
    release_id, command = new_release_id(), _command_line()
    # Fault-injection pacing between file swaps, used by the kill trials (tests/test_push.py).
    pace_s = float(os.environ.get("SGLFLEET_SWAP_PACE_S", "0") or 0)

    def task(conn):
        try:
            outcome = push_host(conn, artifacts, release_id, command, force=force,
                                bwlimit=bwlimit * 1024 if bwlimit else None, pace_s=pace_s)
        except RemoteError as exc:
            return TaskOutcome(False, exc.document or None, str(exc))
        return outcome.to_json()

    results = _run_group(inv, pattern, task, "push", forks, host_key_policy, quiet=as_json)
    if as_json:
        output.print_json(output.group_json("push", results, pattern=pattern, profile=profile, release=release_id))
        raise typer.Exit(results.exit_code)

    def row(v: dict[str, Any]) -> list[str]:
        if "files" not in v:  # the host's own refusal (lock, verify) without a plan
            return [v.get("error", "failed"), "", "", ""]
        rec = v.get("recovered")
        notes = v["notes"] + ([f"{'undid' if rec['undone'] else 'finished'} interrupted run {rec['txid']}"]
                              if rec else [])
        return [v["release"] or "already current", _file_list(v["files"]),
                output.human_bytes(v["content_bytes"]), "; ".join(notes) or "-"]

    output.summary_table(f"push {release_id}", results, ["release", "changed", "sent", "notes"], row,
                         refusals_have_rows=True)
    raise typer.Exit(results.exit_code)


@app.command()
def releases(pattern: str = typer.Argument(..., help="Host pattern."),
             inventory: Optional[str] = InventoryOpt, forks: int = ForksOpt, as_json: bool = JsonOpt,
             package: str = typer.Option("sglang", help="The package the releases changed."),
             host_key_policy: Optional[str] = PolicyOpt) -> None:
    """List the releases recorded on each host, newest last."""
    from ..stages.release import list_releases

    results = _run_group(_inventory(inventory), pattern, lambda conn: list_releases(conn, package), "releases",
                         forks, host_key_policy, quiet=as_json)
    if as_json:
        output.print_json(output.group_json("releases", results, pattern=pattern))
        raise typer.Exit(results.exit_code)
    for name, r in results.items():
        if not r.ok:
            output.stdout.print(f"[red]{output.escape(name)}[/]: {output.escape(r.error or 'failed')}")
            continue
        table = output.Table(title=f"{name}: {len(r.value['releases'])} release(s), current "
                                   f"{r.value['current'] or 'none (pristine)'}")
        for col in ("id", "when", "by", "status", "artifacts", "files"):
            table.add_column(col)
        for rec in r.value["releases"]:
            when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(rec["time"]))
            by = f"{rec['controller'].get('user')}@{rec['controller'].get('controller')}"
            status = rec["status"] + (f" by {rec['rolled_back_by']}" if rec.get("rolled_back_by") else "")
            arts = ", ".join(a["name"] for a in rec.get("artifacts", []))
            table.add_row(rec["id"], when, by, status, arts, str(len(rec["files"])))
        output.stdout.print(table)
        if r.value.get("interrupted"):
            output.stdout.print(f"  interrupted run {r.value['interrupted']} will be undone by the next push or "
                                "rollback", style="yellow")
    raise typer.Exit(results.exit_code)


@app.command()
def rollback(pattern: str = typer.Argument(..., help="Host pattern."),
             to: Optional[str] = typer.Option(None, "--to", help="Release id to return to, or 'pristine' "
                                              "(default: undo the newest release)."),
             inventory: Optional[str] = InventoryOpt, forks: int = ForksOpt, as_json: bool = JsonOpt,
             package: str = typer.Option("sglang", help="The package the releases changed."),
             force: bool = typer.Option(False, "--force", help="Roll back even files changed since their release."),
             host_key_policy: Optional[str] = PolicyOpt) -> None:
    """Restore the files of earlier releases (or the pristine package) byte for byte."""
    from ..stages.release import RemoteError
    from ..stages.release import rollback as rollback_host

    command = _command_line()

    def task(conn):
        try:
            return rollback_host(conn, package, to, command, force=force)
        except RemoteError as exc:
            return TaskOutcome(False, None, str(exc))

    results = _run_group(_inventory(inventory), pattern, task, "rollback", forks, host_key_policy, quiet=as_json)
    if as_json:
        output.print_json(output.group_json("rollback", results, pattern=pattern, to=to))
        raise typer.Exit(results.exit_code)
    output.summary_table("rollback", results, ["undid", "files restored", "current now"],
                         lambda v: [", ".join(v["rolled_back"]) or "-", str(len(v["files"])),
                                    v["current"] or "pristine"])
    raise typer.Exit(results.exit_code)


patchset_app = typer.Typer(no_args_is_help=True, help="Patchsets: SGLang changes as verifiable manifests.")
app.add_typer(patchset_app, name="patchset")


@patchset_app.command("init")
def patchset_init(from_dir: Path = typer.Option(..., "--from", help="Directory of edited files (flat, or laid "
                                                 "out as in the package, e.g. srt/server_args.py)."),
                  against: str = typer.Option(..., "--against", help="Host whose installed package is pristine."),
                  out: Optional[Path] = typer.Option(None, "--out", help="Patchset directory to write "
                                                     "(default: patches/NAME)."),
                  name: Optional[str] = typer.Option(None, "--name", help="Patchset name (default: DIR's name)."),
                  package: str = typer.Option("sglang", help="The package the files belong to."),
                  new_under: Optional[str] = typer.Option(None, "--new-under", help="Package dir for files the "
                                                          "host does not have (e.g. srt/speculative)."),
                  inventory: Optional[str] = InventoryOpt, host_key_policy: Optional[str] = PolicyOpt) -> None:
    """Write patchset.yaml for a directory of edited files from the host's pristine hashes."""
    from ..stages.release import init_patchset, write_patchset

    if not from_dir.is_dir():
        raise ConfigError(f"--from {from_dir}: not a directory")
    name = name or from_dir.resolve().name
    out = out or Path("patches") / name
    if out.exists() and any(out.iterdir()):
        raise ConfigError(f"{out} already exists and is not empty; choose --out or remove it")
    entries, version = _on_one_host(_inventory(inventory), against, "--against",
                                    lambda conn: init_patchset(conn, from_dir, package, new_under),
                                    "patchset init", host_key_policy)
    manifest = write_patchset(out, name, package, version, entries)
    table = output.Table(title=f"{manifest}: {len(entries)} file(s) against {package} {version}")
    for col in ("file", "package path", "replaces", "how"):
        table.add_column(col)
    for e in entries:
        table.add_row(str(e.source), e.path, e.replaces[:12] + ("…" if e.replaces != "new" else ""), e.how)
    output.stdout.print(table)


# ---------------------------------------------------------------- render + smoke


def _simulate_for(host: Any, simulate: Optional[str]) -> Optional[str]:
    """--simulate wins; lab hosts validate as their declared GPU (lab_gpu) by default."""
    return simulate or host.vars.get("lab_gpu")


@app.command("render")
def render_command(host: str = typer.Argument(..., help="One host name."),
                   profile: str = typer.Argument(..., help="Profile name or .yaml path."),
                   inventory: Optional[str] = InventoryOpt, as_json: bool = JsonOpt,
                   what: str = typer.Option("command", "--what", help="command | env | unit | launch-script"),
                   host_key_policy: Optional[str] = PolicyOpt) -> None:
    """Print the final launch command for HOST and, per flag, the rule or file line that put it there."""
    from ..spec.profile import load_profile
    from ..stages.render import render, server_facts

    inv, prof = _inventory(inventory), load_profile(profile)
    rendered = _on_one_host(inv, host, "render", lambda conn: render(conn.host, prof, server_facts(conn, prof),
                                                                     inv.path), "render", host_key_policy)
    if as_json:
        output.print_json(rendered.to_json())
        return
    if what == "env":
        sys.stdout.write(rendered.template("sglang.env.j2"))
    elif what == "unit":
        sys.stdout.write(rendered.template("sglang-server.service.j2", launch_script="/var/lib/sglfleet/launch.sh",
                                           stop_timeout_s=120))
    elif what == "launch-script":
        sys.stdout.write(rendered.template("launch.sh.j2", env_file="/var/lib/sglfleet/sglang.env"))
    else:
        import shlex
        output.stdout.print(shlex.join(rendered.command), highlight=False, soft_wrap=True)
        table = output.Table(title=f"{rendered.host}: {len(rendered.flags)} flags for SGLang "
                                   f"{rendered.facts['sglang'].get('version')}")
        table.add_column("flag")
        table.add_column("value")
        table.add_column("from")
        for flag in rendered.flags:
            table.add_row(flag.name, " ".join(flag.values), output.escape(flag.source))
        output.stdout.print(table)


@app.command()
def smoke(pattern: Optional[str] = typer.Argument(None, help="Host pattern (not with --local)."),
          profile: Optional[str] = typer.Argument(None, help="Profile name or .yaml path."),
          inventory: Optional[str] = InventoryOpt, forks: int = ForksOpt, as_json: bool = JsonOpt,
          simulate: Optional[str] = typer.Option(None, "--simulate", help="Validate as if on this GPU (h200, "
                                                 "h100, a100, l40s) inside SGLang's platform override."),
          local: Optional[str] = typer.Option(None, "--local", help="PROFILE: run the probe against a local "
                                              "SGLang install instead of hosts (offline preflight)."),
          python: Optional[str] = typer.Option(None, "--python", help="Interpreter for --local (default: this one)."),
          runs: str = typer.Option("runs", "--runs-dir", help="Where results are stored."),
          host_key_policy: Optional[str] = PolicyOpt) -> None:
    """Run SGLang's prepare_server_args AND its full validation with the rendered flags on each host."""
    from ..fleet.inventory import Host
    from ..spec.profile import load_profile
    from ..stages.smoke import run_dir, store

    if local:
        if pattern and not profile:
            raise ConfigError("with --local give only the profile: sglfleet smoke --local PROFILE")
        prof = load_profile(local)
        host = Host(name="local", address="127.0.0.1", python=python or sys.executable)
        directory = run_dir(runs)
        document = _smoke_one(None, host, prof, "local", simulate, python)
        store(directory, "local", document)
        results = {"local": document}
    else:
        if not pattern or not profile:
            raise ConfigError("usage: sglfleet smoke PATTERN PROFILE (or sglfleet smoke --local PROFILE)")
        inv, prof = _inventory(inventory), load_profile(profile)
        directory = run_dir(runs)

        def task(conn):
            document = _smoke_one(conn, conn.host, prof, inv.path, _simulate_for(conn.host, simulate), None)
            store(directory, conn.host.name, document)
            return TaskOutcome(document["ok"], document, None if document["ok"] else document["summary"])

        group_results = _run_group(inv, pattern, task, "smoke", forks, host_key_policy, quiet=as_json)
        results = {}
        for name, r in group_results.items():
            if r.value is None:  # never reached the probe (connection)
                r.value = {"ok": False, "summary": (r.error or "failed").splitlines()[0], "error": r.error}
                store(directory, name, r.value)
            results[name] = r.value
    failed = [n for n, d in results.items() if not d["ok"]]
    if as_json:
        output.print_json({"command": "smoke", "run_dir": str(directory), "hosts": results,
                           "summary": {"ok": len(results) - len(failed), "failed": len(failed)},
                           "exit_code": 1 if failed else 0})
        raise typer.Exit(1 if failed else 0)
    table = output.Table(title=f"smoke {profile or local} -> {directory}")
    for col in ("host", "result", "phase", "algorithm", "draft tokens", "budget", "topk cap", "shadow linear",
                "mamba", "seconds"):
        table.add_column(col)
    for name, d in results.items():
        f = (d.get("probe") or {}).get("fields") or {}
        total = ((d.get("probe") or {}).get("timings") or {}).get("total_s")
        table.add_row(name, "[green]ok[/]" if d["ok"] else "[red]failed[/]", d.get("phase") or "-",
                      *[str(f.get(k, "-")) for k in ("speculative_algorithm", "speculative_num_draft_tokens",
                                                     "speculative_ddtree_budget", "speculative_ddtree_topk_cap",
                                                     "speculative_ddtree_shadow_linear",
                                                     "mamba_radix_cache_strategy")], str(total or "-"))
    output.stdout.print(table)
    for name in failed:
        d = results[name]
        output.stdout.rule(f"[red]{name}[/]: {output.escape(d['summary'])}")
        probe = d.get("probe") or {}
        if probe.get("traceback"):  # whole, never cut: this is what the seed story lost
            sys.stdout.write(probe["traceback"])
            sys.stdout.flush()
        for fix in d.get("diagnosis", []):
            output.stdout.print(f"[yellow]fix:[/] {output.escape(fix)}", highlight=False)
    output.stdout.print(f"{len(results) - len(failed)} ok, {len(failed)} failed; results in {directory}",
                        highlight=False)
    raise typer.Exit(1 if failed else 0)


def _smoke_one(conn, host, prof, inventory_path, simulate, python) -> dict[str, Any]:
    """Render, then probe, one host (conn None: locally); the stored document."""
    from ..stages.render import RenderError, render, server_facts
    from ..stages.smoke import diagnose, run_probe

    started = time.monotonic()
    try:
        rendered = render(host, prof, server_facts(conn, prof, python), inventory_path)
    except RenderError as exc:
        return {"ok": False, "phase": "render", "summary": str(exc), "diagnosis": [], "probe": None}
    probe = run_probe(conn, rendered, simulate, python)
    document = {"ok": probe["ok"], "phase": probe.get("phase"), "simulate": simulate,
                "command_line": rendered.to_json()["command_line"], "render": rendered.to_json(), "probe": probe,
                "diagnosis": diagnose(probe, rendered), "seconds": round(time.monotonic() - started, 3)}
    exc = probe.get("exception") or {}
    document["summary"] = "ok" if probe["ok"] else f"{probe.get('phase')} failed: {exc.get('type')}: " \
        f"{(exc.get('message') or '').splitlines()[0] if exc.get('message') else ''}"
    return document


# ---------------------------------------------------------------- lab


def _lab():
    import os

    from ..lab.manager import Lab
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
    from ..fleet.hostkeys import known_hosts_name
    from ..lab.proxy import LatencyProxy
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
