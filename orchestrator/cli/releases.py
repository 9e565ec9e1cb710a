"""`plan`, `push`, `releases`, `rollback`, `patchset init`: the artifacts a profile installs."""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path
from typing import Any, Optional

import typer

from ..errors import ConfigError, RemoteError
from ..fleet.group import TaskOutcome
from ..spec.patchset import module_name, package_relative
from ..spec.profile import load_profile
from ..stages import kernels, release
from . import output
from .option_paths import output_dir
from .common import (ForksOpt, InventoryOpt, JsonOpt, PatternArg, PolicyOpt, ProfileArg, command_line, inventory,
                     on_one_host, report, run_group)
from .option_checks import number

ForceOpt = typer.Option(False, "--force", help="Replace drifted files (neither pristine nor ours); "
                        "the release's backup keeps them.")
PackageOpt = typer.Option("sglang", help="The package the releases changed.")


def checked_package(package: str) -> str:
    try:
        return module_name(package)
    except ValueError:
        raise ConfigError(f"--package {package!r} is not an importable package name such as 'sglang'") from None


def register(app: typer.Typer) -> None:
    app.command()(plan)
    app.command()(push)
    app.command()(releases)
    app.command()(rollback)
    patchset_app = typer.Typer(no_args_is_help=True, help="Patchsets: SGLang changes as verifiable manifests.")
    patchset_app.command("init")(patchset_init)
    app.add_typer(patchset_app, name="patchset")


def _refused(exc: RemoteError) -> TaskOutcome:
    """The host's refusal as a failed result that keeps what the host said (lock holder, phase)."""
    document = {"ok": False, "error": str(exc), **exc.detail} if exc.exit_status is not None else None
    return TaskOutcome(False, document, str(exc))


def _file_list(files: list[dict[str, Any]], *statuses: str) -> str:
    """`N: a.py, b.py` of the files in `statuses` (default: those a push changes); base names only,
    --json and --diff have the full paths."""
    statuses = statuses or release.CHANGING
    names = [f["key"].rsplit("/", 1)[-1] for f in files if f["status"] in statuses]
    return f"{len(names)}: {', '.join(names)}" if names else "-"


def _plan_row(value: dict[str, Any]) -> list[str]:
    files = value["files"]
    notes = value["refusals"] + value["notes"]
    return [value.get("package_version") or "?", _file_list(files),
            str(sum(f["status"] == "current" for f in files)), _file_list(files, "drifted"), "; ".join(notes) or "-"]


def plan(pattern: str = PatternArg, profile: str = ProfileArg, inventory_path: Optional[str] = InventoryOpt,
         forks: int = ForksOpt, as_json: bool = JsonOpt,
         diff: bool = typer.Option(False, "--diff", help="Show a unified diff per changing file."),
         force: bool = ForceOpt, host_key_policy: Optional[str] = PolicyOpt) -> None:
    """Show what `push` would change on each host, without changing anything (one round trip per host)."""
    from ..stages import doctor  # here: it imports the renderer and jinja2, which push and rollback never need

    inv, prof = inventory(inventory_path), load_profile(profile)
    artifacts, builds = prof.artifacts(), kernels.candidate_keys(prof)
    plans: dict[str, Any] = {}

    def task(conn):
        inspected = release.inspect(conn, artifacts, with_text=diff, also=builds)
        host_plan = release.make_plan(conn.host.name, inspected,
                                      kernels.artifacts_for_host(prof, artifacts, inspected), force)
        unserved = doctor.unserved(conn.host, prof, artifacts, inv.path)  # the patchset has no worker for it
        host_plan.refusals += [unserved] if unserved else []
        plans[conn.host.name] = host_plan
        return TaskOutcome(not host_plan.refusals, host_plan.summary(), "; ".join(host_plan.refusals) or None)

    results = run_group(inv, pattern, task, "plan", forks, host_key_policy, quiet=as_json)

    def table() -> None:
        output.summary_table("plan", results, ["sglang", "would change", "current", "drifted", "notes"], _plan_row,
                             refusals_have_rows=True)
        if diff:
            for name, host_plan in plans.items():
                for f in host_plan.changes:
                    output.stdout.rule(f"{output.escape(name)}: {output.escape(f.key)} ({f.status})")
                    output.write_host_text(f.diff())  # the host's file: its bytes are shown escaped
            sys.stdout.flush()

    report("plan", results, as_json, table, pattern=pattern, profile=profile)


def push(pattern: str = PatternArg, profile: str = ProfileArg, inventory_path: Optional[str] = InventoryOpt,
         forks: int = ForksOpt, as_json: bool = JsonOpt, force: bool = ForceOpt,
         dry_run: bool = typer.Option(False, "--dry-run", help="Only plan (same as `plan`)."),
         bwlimit: Optional[float] = typer.Option(None, "--bwlimit", callback=number(above=0, unit="KiB/s"),
                                                 help="Limit each host's transfer to KiB/s."),
         recheck: bool = typer.Option(False, "--recheck",
                                      help="Run the import check in a fresh interpreter even where the host "
                                           "passed one with every file it reads the same."),
         host_key_policy: Optional[str] = PolicyOpt) -> None:
    """Install the profile's patchset and extension: staged, hash-verified, swapped atomically, reversible.
    A host another run is deploying (its lease) is refused, naming that deploy, and left as it is.
    The import check's pass is recorded on the host by the content of the package and
    site-packages' top level: the same content again is not imported anew (--recheck does)."""
    if dry_run:
        plan(pattern, profile, inventory_path, forks, as_json, False, force, host_key_policy)
        return
    inv, prof = inventory(inventory_path), load_profile(profile)
    artifacts, builds = prof.artifacts(), kernels.candidate_keys(prof)
    release_id, command = release.new_release_id(), command_line()
    # Fault-injection pacing between file swaps, used by the kill trials (tests/test_push.py).
    pace_s = float(os.environ.get("SGLFLEET_SWAP_PACE_S", "0") or 0)

    def task(conn):
        try:
            outcome = release.push(conn, artifacts, release_id, command, force=force,
                                   bwlimit=bwlimit * 1024 if bwlimit else None, pace_s=pace_s,
                                   for_host=lambda inspected: kernels.artifacts_for_host(prof, artifacts, inspected),
                                   also=builds, recheck=recheck)
        except RemoteError as exc:
            return _refused(exc)
        return outcome.to_json()

    results = run_group(inv, pattern, task, "push", forks, host_key_policy, quiet=as_json)

    def row(v: dict[str, Any]) -> list[str]:
        if "files" not in v:  # the host's own refusal (lock, verify) without a plan
            return [v.get("error", "failed"), "", "", ""]
        rec = v.get("recovered")
        notes = v["notes"] + ([f"{'undid' if rec['undone'] else 'finished'} interrupted run {rec['txid']}"]
                              if rec else [])
        if v.get("import_check_result") == "cached":
            notes.append("import check passed earlier with the same files (--recheck reruns it)")
        return [v["release"] or "already current", _file_list(v["files"]),
                output.human_bytes(v["content_bytes"]), "; ".join(notes) or "-"]

    report("push", results, as_json,
           lambda: output.summary_table(f"push {release_id}", results, ["release", "changed", "sent", "notes"], row,
                                        refusals_have_rows=True),
           pattern=pattern, profile=profile, release=release_id)


def releases(pattern: str = PatternArg, inventory_path: Optional[str] = InventoryOpt, forks: int = ForksOpt,
             as_json: bool = JsonOpt, package: str = PackageOpt,
             host_key_policy: Optional[str] = PolicyOpt) -> None:
    """List the releases recorded on each host, newest last."""
    package = checked_package(package)
    results = run_group(inventory(inventory_path), pattern, lambda conn: release.list_releases(conn, package),
                        "releases", forks, host_key_policy, quiet=as_json)

    def tables() -> None:
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

    report("releases", results, as_json, tables, pattern=pattern)


def rollback(pattern: str = PatternArg,
             to: Optional[str] = typer.Option(None, "--to", help="Release id to return to, or 'pristine' "
                                              "(default: undo the newest release)."),
             inventory_path: Optional[str] = InventoryOpt, forks: int = ForksOpt, as_json: bool = JsonOpt,
             package: str = PackageOpt,
             force: bool = typer.Option(False, "--force", help="Roll back even files changed since their release."),
             host_key_policy: Optional[str] = PolicyOpt) -> None:
    """Restore the files of earlier releases (or the pristine package) byte for byte.
    A host another run is deploying (its lease) is refused, naming that deploy, and left as it is."""
    package = checked_package(package)
    command = command_line()

    def task(conn):
        try:
            return release.rollback(conn, package, to, command, force=force)
        except RemoteError as exc:
            return TaskOutcome(False, None, str(exc))

    results = run_group(inventory(inventory_path), pattern, task, "rollback", forks, host_key_policy, quiet=as_json)
    report("rollback", results, as_json,
           lambda: output.summary_table("rollback", results, ["undid", "files restored", "current now"],
                                        lambda v: [", ".join(v["rolled_back"]) or "-", str(len(v["files"])),
                                                   v["current"] or "pristine"]),
           pattern=pattern, to=to)


def patchset_init(from_dir: Path = typer.Option(..., "--from", help="Directory of edited files (flat, or laid "
                                                 "out as in the package, e.g. srt/server_args.py)."),
                  against: str = typer.Option(..., "--against", help="Host whose installed package is pristine."),
                  out: Optional[Path] = typer.Option(None, "--out", callback=output_dir(),
                                                     help="Patchset directory to write "
                                                     "(default: patches/NAME)."),
                  name: Optional[str] = typer.Option(None, "--name", help="Patchset name (default: DIR's name)."),
                  package: str = typer.Option("sglang", help="The package the files belong to."),
                  new_under: Optional[str] = typer.Option(None, "--new-under", help="Package dir for files the "
                                                          "host does not have (e.g. srt/speculative)."),
                  inventory_path: Optional[str] = InventoryOpt, host_key_policy: Optional[str] = PolicyOpt) -> None:
    """Write patchset.yaml for a directory of edited files from the host's pristine hashes."""
    package = checked_package(package)
    if not from_dir.is_dir():
        raise ConfigError(f"--from {from_dir}: not a directory")
    if new_under is not None:
        try:
            new_under = package_relative(new_under)
        except ValueError as exc:
            raise ConfigError(f"--new-under {new_under}: {exc}") from None
    name = name or from_dir.resolve().name
    out = out or Path("patches") / name
    if out.exists() and any(out.iterdir()):
        raise ConfigError(f"{out} already exists and is not empty; choose --out or remove it")
    entries, version = on_one_host(inventory(inventory_path), against, "--against",
                                   lambda conn: release.init_patchset(conn, from_dir, package, new_under),
                                   "patchset init", host_key_policy)
    manifest = release.write_patchset(out, name, package, version, entries)
    table = output.Table(title=f"{manifest}: {len(entries)} file(s) against {package} {version}")
    for col in ("file", "package path", "replaces", "how"):
        table.add_column(col)
    for e in entries:
        table.add_row(str(e.source), e.path, e.replaces[:12] + ("…" if e.replaces != "new" else ""), e.how)
    output.stdout.print(table)
