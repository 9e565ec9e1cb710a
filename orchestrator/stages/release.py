"""Releases: plan, push, list and roll back the artifacts of a profile on one host.

The pipeline per host reads top to bottom:
    inspect (one round trip: package, hashes, pristine bases, fingerprint facts)
    -> plan (pure: classify every target file)
    -> apply (one round trip: the changed files as one tar stream, swapped in on the host)
The host side is `remote/release.py`; it holds the lock, the journal and the records. Only when
the host-side helper was killed (no answer, a signal) does a third round trip read what the host
holds, for the message: nothing swapped, mid-swap, or committed.
"""

from __future__ import annotations

import difflib
import getpass
import os
import secrets
import socket
import time
from dataclasses import dataclass, field
from types import SimpleNamespace
from pathlib import Path
from typing import IO, Any, Callable

from ..errors import ConfigError, ConnectError, RemoteError
from ..spec.patchset import NEW, PatchError, sha256
from ..spec.profile import Artifacts
from ..fleet import remote_call
from ..fleet.group import Stopped, stopping
from ..fleet.transport import Connection, StreamWriter


# Statuses of one target file in a plan.
CURRENT = "current"    # already holds the new bytes
ADD = "add"            # absent; the artifact adds it
CHANGE = "change"      # holds the pristine bytes the artifact expects
UPDATE = "update"      # holds an earlier sglfleet release's bytes
DRIFTED = "drifted"    # neither pristine nor ours: refused unless --force
FORCED = "forced"      # drifted, replaced because of --force (the backup keeps it)
CHANGING = (ADD, CHANGE, UPDATE, FORCED)


@dataclass
class FilePlan:
    key: str                  # "pkg/<path>" or "purelib/<file>"
    status: str
    before: str | None        # sha256 now on the host (None: absent)
    after: str                # sha256 the file will have
    data: bytes = field(repr=False, default=b"")
    current_text: str | None = field(repr=False, default=None)
    artifact: str = ""

    def diff(self) -> str:
        if self.status == CURRENT:
            return ""
        try:
            new = self.data.decode("utf-8")
        except UnicodeDecodeError:
            return f"Binary file {self.key} differs ({len(self.data)} bytes)\n"
        old = self.current_text or ""
        return "".join(difflib.unified_diff(old.splitlines(True), new.splitlines(True),
                                            f"a/{self.key}", f"b/{self.key}"))


@dataclass
class HostPlan:
    host: str
    package_version: str | None
    files: list[FilePlan]
    refusals: list[str]       # reasons this host will not be changed
    notes: list[str]          # skipped artifacts and other things worth a line
    interrupted: str | None
    import_check: list[str]

    @property
    def changes(self) -> list[FilePlan]:
        return [f for f in self.files if f.status in CHANGING]

    @property
    def drifted(self) -> list[FilePlan]:
        return [f for f in self.files if f.status == DRIFTED]

    def summary(self) -> dict[str, Any]:
        return {"package_version": self.package_version, "refusals": self.refusals, "notes": self.notes,
                "interrupted": self.interrupted, "import_check": self.import_check,
                "files": [{"key": f.key, "status": f.status, "before": f.before, "after": f.after,
                           "artifact": f.artifact} for f in self.files]}


def holder(command: str) -> dict[str, Any]:
    """Who changes the host, as the lock and a deploy's lease name it. The controller's pid makes
    it one process's: a deploy's own apply and rollback carry the holder its lease was taken
    with, which is how the host tells them from another run's push (remote/release.py)."""
    return {"user": getpass.getuser(), "controller": socket.gethostname(), "command": command,
            "controller_pid": os.getpid()}


def new_release_id() -> str:
    return time.strftime("%Y%m%dT%H%M%SZ", time.gmtime()) + "-" + secrets.token_hex(3)


def call(conn: Connection, command: str, args: dict[str, Any], payload: Any = None,
         timeout: float | None = 600, companions: tuple[str, ...] = ()) -> dict[str, Any]:
    """One remote/release.py command through the call convention (fleet/remote_call.py)."""
    return remote_call.call(conn, "release.py", command, args, payload=payload, timeout=timeout,
                            companions=companions)


# ---------------------------------------------------------------- inspect + plan


def targets(artifacts: Artifacts) -> list[tuple[str, bool, str | None]]:
    """(key, needs the pristine base, the pristine sha256 the patchset pins) per file it may write."""
    out: list[tuple[str, bool, str | None]] = []
    if artifacts.patchset:
        ps = artifacts.patchset
        out += [(f"pkg/{p}", ps.edited(p), ps.expected_pristine(p) if ps.edited(p) else None) for p in ps.targets()]
    if artifacts.extension:
        out.append((artifacts.extension.key, False, None))
    return out


def inspect_targets(artifacts: Artifacts, with_text: bool = False, also: list[str] = ()) -> list[list[Any]]:
    """The inspection's targets: [key, needs the pristine base, with text, pinned sha256] per file
    the artifacts may write, then the `also` keys (hashed only) not among them."""
    wanted = [[k, base, with_text, pinned] for k, base, pinned in targets(artifacts)]
    return wanted + [[k, False, False, None] for k in dict.fromkeys(also) if k not in {t[0] for t in wanted}]


def inspect(conn: Connection, artifacts: Artifacts, recover: bool = False, command: str = "inspect",
            with_text: bool = False, also: list[str] = ()) -> dict[str, Any]:
    """With `recover` (a push about to change the host): refused while another run's deploy
    holds the host's lease, before anything is recovered or sent. `also`: more file keys to
    hash (the extension builds one of which may be chosen for the host afterwards)."""
    package = artifacts.patchset.manifest.package if artifacts.patchset else "sglang"
    args = {"package": package, "targets": inspect_targets(artifacts, with_text, also),
            "recover": recover, "refuse_while_deployed": recover, "holder": holder(command)}
    return call(conn, "inspect", args)


def make_plan(host: str, inspected: dict[str, Any], artifacts: Artifacts, force: bool = False) -> HostPlan:
    """Classify every target file from one host's inspection (no I/O)."""
    files, refusals, notes = [], [], list(artifacts.notes)
    version = inspected["package"].get("version")
    state = inspected["files"]
    patchset, extension = artifacts.patchset, artifacts.extension
    import_check: list[str] = []
    if patchset is not None:
        if not patchset.supports(version or ""):
            refusals.append(f"{patchset.manifest.package} {version} is not supported by patchset "
                            f"{patchset.name} ({patchset.manifest.versions})")
        else:
            files += _plan_patchset(patchset, state, refusals)
            import_check = list(patchset.manifest.import_check) or [patchset.manifest.package]
    if extension is not None:
        mismatches = extension.mismatches(inspected)
        if mismatches:
            fp = extension.fingerprint
            notes.append(f"extension {extension.name} skipped: host has {'; '.join(mismatches)} "
                         f"[artifact: {fp.get('python_tag')}, torch {fp.get('torch_version')}, "
                         f"CUDA {fp.get('cuda_version') or 'none'}, {','.join(fp.get('arch_list') or []) or 'cpu'}]")
        else:
            files.append(_classify(extension.key, state[extension.key], extension.data, NEW, extension.name))
    for f in files:
        if f.status == DRIFTED and force:
            f.status = FORCED
    if any(f.status == DRIFTED for f in files):
        refusals.append("drifted (neither pristine nor written by sglfleet; --force replaces them, "
                        "the backup keeps them): " + ", ".join(f.key for f in files if f.status == DRIFTED))
    if extension and any(f.key == extension.key and f.status in CHANGING for f in files):
        import_check += ["torch", extension.module]
    interrupted = inspected.get("interrupted")
    if interrupted:
        notes.append(f"an interrupted run ({interrupted['txid']}) left a journal; the next push or "
                     "rollback undoes it first")
    return HostPlan(host, version, files, refusals, notes, interrupted and interrupted["txid"], import_check)


def _plan_patchset(patchset: Any, state: dict[str, Any], refusals: list[str]) -> list[FilePlan]:
    keys = {p: f"pkg/{p}" for p in patchset.targets()}
    bases: dict[str, bytes | None] = {}
    for path, key in keys.items():
        text = state[key].get("base_text")
        bases[path] = None if text is None else text.encode("utf-8", "surrogateescape")
    try:
        rendered = patchset.render(bases, verify=False)
    except PatchError as exc:
        refusals.append(f"cannot apply patchset {patchset.name}: {exc}")
        return []
    return [_classify(key, state[key], rendered[path], patchset.expected_pristine(path), patchset.name,
                      base_sha=state[key].get("base_sha256"), refusals=refusals)
            for path, key in keys.items()]


def _classify(key: str, now: dict[str, Any], data: bytes, expected: str | None, artifact: str,
              base_sha: str | None = None, refusals: list[str] | None = None) -> FilePlan:
    after = sha256(data)
    plan = FilePlan(key, DRIFTED, now.get("sha256"), after, data, now.get("text"), artifact)
    if not now["exists"]:
        if expected not in (NEW, None) and refusals is not None:
            refusals.append(f"{key} is missing from the package; the patchset expects a file there")
        plan.status = ADD if expected == NEW or expected is None else DRIFTED
    elif plan.before == after:
        plan.status = CURRENT
    elif now.get("ours"):
        # One of our earlier releases; what is underneath must still be what we expect.
        plan.status = UPDATE if expected in (None, NEW) or base_sha == expected else DRIFTED
    elif expected == NEW:
        plan.status = DRIFTED
    else:
        plan.status = CHANGE if expected is None or plan.before == expected else DRIFTED
    return plan


# ---------------------------------------------------------------- apply


class _Tar:
    """Writes the changed files as one tar stream, counting content bytes, optionally paced."""

    def __init__(self, files: list[FilePlan], bwlimit: float | None):
        self.files = files
        self.bwlimit = bwlimit  # bytes per second of the stream, None = unlimited
        self.content_bytes = 0
        self.stream_bytes = 0

    def __call__(self, writer: IO[bytes]) -> None:
        import io
        import tarfile

        paced = StreamWriter(writer.write, self.bwlimit)
        with tarfile.open(fileobj=paced, mode="w|", format=tarfile.PAX_FORMAT) as tar:
            for f in self.files:
                info = tarfile.TarInfo(f.key)
                info.size, info.mode, info.mtime = len(f.data), 0o644, int(time.time())
                tar.addfile(info, io.BytesIO(f.data))
                self.content_bytes += len(f.data)
        self.stream_bytes = paced.count


@dataclass
class PushOutcome:
    plan: HostPlan
    release: str | None
    content_bytes: int
    recovered: dict[str, Any] | None
    # How the host's import check went: "passed" (imported in a fresh interpreter), "cached" (one
    # passed with every file it could read the same: remote/release.py import_check_key), None
    # where nothing was applied or nothing is to be imported.
    import_check_result: str | None = None

    def to_json(self) -> dict[str, Any]:
        return {"release": self.release, "content_bytes": self.content_bytes, "recovered": self.recovered,
                "import_check_result": self.import_check_result, **self.plan.summary()}


def push(conn: Connection, artifacts: Artifacts, release_id: str, command: str, force: bool = False,
         bwlimit: float | None = None, pace_s: float = 0.0,
         on_plan: Callable[[HostPlan], None] | None = None,
         for_host: Callable[[dict[str, Any]], Artifacts] | None = None, also: list[str] = (),
         recheck: bool = False) -> PushOutcome:
    """Two round trips: inspect (recovering an interrupted run under the lock), then apply
    only what changes. A refused or already-current host gets no second round trip. Another
    run's deploy between its steps (its lease) refuses both, naming the deploy. `for_host`
    picks the artifacts for what the inspection found (the extension build for its fingerprint),
    among those whose keys `also` names. `recheck` imports in a fresh interpreter even where the
    host recorded a pass with the same files."""
    inspected = inspect(conn, artifacts, recover=True, command=command, also=also)
    if for_host is not None:
        artifacts = for_host(inspected)
    plan = make_plan(conn.host.name, inspected, artifacts, force)
    if on_plan:
        on_plan(plan)
    if plan.refusals:
        raise RemoteError(f"{conn.host.name}: refused: " + "; ".join(plan.refusals))
    if stopping():
        raise Stopped("stopped before changing anything: the run was interrupted")
    changes = sorted(plan.changes, key=_apply_order)
    if not changes:
        return PushOutcome(plan, None, 0, inspected.get("recovered"))
    tar = _Tar(changes, bwlimit)
    artifacts_doc = []
    if artifacts.patchset:
        artifacts_doc.append({"kind": "patchset", "name": artifacts.patchset.name,
                              "versions": artifacts.patchset.manifest.versions})
    if artifacts.extension and any(f.key == artifacts.extension.key for f in changes):
        artifacts_doc.append({"kind": "extension", "name": artifacts.extension.name,
                              "fingerprint": artifacts.extension.fingerprint})
    args = {"package": inspected["package"]["name"], "id": release_id, "holder": holder(command),
            "files": [{"key": f.key, "before": f.before, "after": f.after} for f in changes],
            "artifacts": artifacts_doc, "import_check": plan.import_check, "pace_s": pace_s, "recheck": recheck}
    try:
        answer = call(conn, "apply", args, payload=tar)
    except RemoteError as exc:
        if exc.error_type != "NoAnswer" or exc.exit_status is None or not (
                exc.exit_status > remote_call.SIGNALED or exc.exit_status < 0):
            raise
        raise RemoteError(_killed_apply(conn, exc, release_id, inspected["package"]["name"]), "NoAnswer",
                          exc.remote_traceback, exc.detail, exc.exit_status) from None
    return PushOutcome(plan, answer["release"], tar.content_bytes, answer.get("recovered") or
                       inspected.get("recovered"), answer.get("import_check"))


def _killed_apply(conn: Connection, exc: RemoteError, release_id: str, package: str) -> str:
    """What a push whose host-side helper was killed did: one more round trip (only then) reads
    the host's releases, since the helper could not say how far it got."""
    why = remote_call.no_answer_why(SimpleNamespace(timed_out=False, exit_code=exc.exit_status), None)
    head = f"{conn.host.name}: the host-side helper (release.py apply) was {why}"
    try:
        state = list_releases(conn, package)
    except (RemoteError, ConnectError, OSError) as again:
        return f"{head}; its state could not be read afterwards ({again}): see `sglfleet releases {conn.host.name}`"
    if state.get("interrupted"):
        return (f"{head} during the swap: every file is wholly old or new, and the next push or rollback undoes "
                "the interrupted run from its journal first")
    if any(r.get("id") == release_id for r in state.get("releases") or []):
        return f"{head} after release {release_id} was committed: it is in place (`sglfleet releases`)"
    return (f"{head} before it swapped anything: nothing was swapped, every file is as it was; the staging "
            "directory it left is removed by the next push")


def _apply_order(f: FilePlan) -> tuple[int, str]:
    # New files first: every prefix of the swap must still import (a patched module may
    # import a new one; nothing old imports a new file).
    return (0 if f.before is None else 1, f.key)


def list_releases(conn: Connection, package: str) -> dict[str, Any]:
    return call(conn, "releases", {"package": package})


def rollback(conn: Connection, package: str, to: str | None, command: str, force: bool = False,
             pace_s: float = 0.0) -> dict[str, Any]:
    return call(conn, "rollback", {"package": package, "to": to, "force": force, "id": new_release_id(),
                                   "holder": holder(command), "pace_s": pace_s})


# ---------------------------------------------------------------- patchset init


@dataclass
class InitEntry:
    source: Path      # the user's edited file
    path: str         # where it goes in the package
    replaces: str     # pristine sha256, or "new"
    how: str          # how the path was found


def init_patchset(conn: Connection, from_dir: Path, package: str, new_under: str | None) -> tuple[list[InitEntry], str]:
    """Map a directory of edited files onto the host's package (one round trip): a file kept at
    its package path (DIR/srt/x.py) stays there; a flat file is found by name on the host."""
    links = sorted(str(p) for p in from_dir.rglob("*") if p.is_symlink())
    if links:
        raise ConfigError(f"{from_dir} holds symlinks ({', '.join(links)}); a patchset is made of the regular files "
                          "you edited, so replace each link with the file itself")
    edited = sorted(p for p in from_dir.rglob("*") if p.is_file() and "__pycache__" not in p.parts
                    and p.suffix != ".pyc")
    if not edited:
        raise ConfigError(f"{from_dir} has no files to turn into a patchset")
    flat = [p for p in edited if p.parent == from_dir]
    placed = {p: str(p.relative_to(from_dir)) for p in edited if p.parent != from_dir}
    answer = call(conn, "index", {"package": package, "names": sorted({p.name for p in flat}),
                                  "paths": sorted(placed.values())})
    by_name, paths = answer["by_name"], answer["paths"]
    entries, problems = [], []
    for p in edited:
        if p in placed:
            rel, how = placed[p], "kept from the directory layout"
        else:
            matches = by_name.get(p.name, [])
            if len(matches) > 1:
                problems.append(f"{p.name} matches {len(matches)} files in {package} ({', '.join(matches)}); put it "
                                f"at its package path inside {from_dir}")
                continue
            if not matches:
                if new_under is None:
                    problems.append(f"{p.name} is not in {package} on {conn.host.name}: a new file needs a place; "
                                    f"pass --new-under DIR (e.g. srt/speculative) or put it at its package path "
                                    f"inside {from_dir}")
                    continue
                rel, how = f"{new_under.strip('/')}/{p.name}", "new (--new-under)"
            else:
                rel, how = matches[0], f"found by name on {conn.host.name}"
        state = paths.get(rel)
        replaces = NEW if state is None else state["pristine_sha256"]
        if replaces is None:  # an sglfleet release added it: pristine is "absent"
            replaces = NEW
        entries.append(InitEntry(p, rel, replaces, how))
    if problems:
        raise ConfigError("cannot map every edited file onto the package:\n  " + "\n  ".join(problems))
    return entries, answer["package"]["version"]


def write_patchset(out: Path, name: str, package: str, version: str | None, entries: list[InitEntry]) -> Path:
    import shutil

    import yaml

    files_dir = out / "files"
    for e in entries:  # every file lands inside --out, whatever the names say
        if files_dir.resolve() not in (files_dir / e.path).resolve().parents:
            raise ConfigError(f"{e.path} would be written outside {out}; refusing")
    files_dir.mkdir(parents=True)
    manifest = {"name": name, "package": package, "versions": f"=={version}" if version else ">=0",
                "files": []}
    for e in entries:
        target = files_dir / e.path
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(e.source, target)
        manifest["files"].append({"path": e.path, "source": f"files/{e.path}", "replaces": e.replaces})
    header = (f"# Written by `sglfleet patchset init` against {package} {version}: each file replaces the\n"
              "# pristine file with that sha256 ('new': added). Edit freely; `sglfleet plan` checks it.\n")
    (out / "patchset.yaml").write_text(header + yaml.safe_dump(manifest, sort_keys=False, width=120))
    return out / "patchset.yaml"
