"""Remote side of releases: inspect, apply, list and roll back changes to an installed package.

Run through the one call convention (fleet/remote_call.py -> hostlib.serve): `COMMANDS[name](args,
stream)`, where for `apply` the stream carries the tar of the new files after the args. Progress
goes to stderr. Stdlib + hostlib only, Python 3.8+; importable on the controller for unit tests.
After the swap, apply py_compiles the new files and imports the patchset's import_check modules in
a fresh interpreter; a deploy's apply (args `smoke`, smoke_probe.py and server_facts.py sent as
companions) imports them in its own process instead and runs the smoke probe there: one import of
SGLang, and a failing smoke undoes the swap as a failed import check does. A fresh-interpreter
check that passed is recorded under cache/ by the content of everything it could read (see
`import_check_key`); the same content again (a push after a rollback, a recovery after a killed
push) is answered from that record instead of importing SGLang anew (~6 s of CPU), unless the
args say `recheck`. Failures are never recorded.

Everything lives under the state dir (hostlib.STATE_DIR):
    lock                      flock'd by the run changing this host; holds the holder's JSON
    deploy-lease.json         a deploy's lease (written by remote/server.py): while it is live,
                              apply and rollback (and push's recovering inspect) are refused
                              naming the deploy, unless they come from that deploy itself
    journal.json              exists only while files are being swapped (see `Transaction`)
    current                   id of the newest active release
    releases/<id>/files/...   the files the release installed (verified by hash)
    releases/<id>/backup/...  what they replaced, byte for byte (rollback restores these)
    releases/<id>/release.json
    rollbacks/<id>/...        the same for each rollback, so an interrupted one can be undone
    cache/import-ok-<key>.json  a passed import check, by import_check_key (newest IMPORT_RECORDS kept)

A target is named `<root>/<path>`: root `pkg` is the package directory (site-packages/sglang),
root `purelib` is site-packages itself (where a built extension module goes).
"""

import hashlib
import os
import re
import shutil
import subprocess
import sys
import tarfile
import time

try:  # on the host: sent ahead of this file by the call convention (fleet/remote_call.py)
    import sglfleet_hostlib as hostlib
except ImportError:  # on the controller: unit tests import this file
    from orchestrator.remote import hostlib

Failure, Lock, log, read_json = hostlib.Failure, hostlib.Lock, hostlib.log, hostlib.read_json
copy_durable, fsync_dir, sha256_file = hostlib.copy_durable, hostlib.fsync_dir, hostlib.sha256_file
swap_in, temp_name, write_json_atomic = hostlib.swap_in, hostlib.temp_name, hostlib.write_json_atomic

MODULE_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*\Z")
# Imports the modules named in argv, by name: nothing from a patchset is ever run as source.
IMPORT_MODULES = "import importlib, sys\nfor name in sys.argv[1:]:\n    importlib.import_module(name)\n"
IMPORT_RECORDS = 16  # passed import checks kept per host (each a few hundred bytes)


class Host:
    def __init__(self, args):
        self.state = args.get("state_dir") or hostlib.STATE_DIR
        self.package = hostlib.locate_package(args["package"])
        if self.package is None:
            raise Failure("package %r is not importable by %s" % (args["package"], sys.executable),
                          package_missing=True)
        self.roots = {"pkg": self.package["root"], "purelib": self.package["site"]}

    def path(self, key):
        root, _, rel = key.partition("/")
        if root not in self.roots or not rel or rel.startswith("/") or ".." in rel.split("/"):
            raise Failure("bad target name %r" % key)
        return os.path.join(self.roots[root], rel)

    def releases(self):
        """Every release record, oldest first."""
        base = os.path.join(self.state, hostlib.RELEASES_DIR)
        records = []
        for name in sorted(os.listdir(base)) if os.path.isdir(base) else []:
            record = read_json(os.path.join(base, name, "release.json"))
            if record:
                record["dir"] = os.path.join(base, name)
                records.append(record)
        records.sort(key=lambda r: (r.get("time", 0), r["id"]))
        return records

    def current(self):
        try:
            with open(os.path.join(self.state, hostlib.CURRENT_FILE)) as fh:
                return fh.read().strip() or None
        except OSError:
            return None

    def set_current(self, release_id):
        path = os.path.join(self.state, hostlib.CURRENT_FILE)
        tmp = path + ".tmp"
        with open(tmp, "w") as fh:
            fh.write((release_id or "") + "\n")
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
        fsync_dir(self.state)

    def pristine_source(self, key, sha, records, expected=None):
        """The bytes that were there before sglfleet changed the file: (path or None when there
        was no file, hash). With the pristine hash the patchset pins (`expected`), any copy of
        exactly those bytes wins: the file itself or a backup in any release."""
        source = self.path(key)
        if expected is not None:
            if sha == expected:
                return source, sha
            for record in reversed(records):
                if record["files"].get(key, {}).get("before") == expected:
                    return os.path.join(record["dir"], "backup", key), expected
        if not any(r["files"].get(key, {}).get("after") == sha for r in records):
            # Not our bytes. If a release ever changed this file, someone edited it since:
            # the bytes under our change are still the ones that release backed up.
            touched = [r for r in records if key in r["files"]]
            if touched:
                before = touched[-1]["files"][key]["before"]
                if before is None:
                    return None, None
                source, sha = os.path.join(touched[-1]["dir"], "backup", key), before
        for _ in range(len(records) + 1):
            record = next((r for r in reversed(records) if r["files"].get(key, {}).get("after") == sha), None)
            if record is None:
                return source, sha
            before = record["files"][key]["before"]
            if before is None:
                return None, None
            source, sha = os.path.join(record["dir"], "backup", key), before
        return source, sha


# ---------------------------------------------------------------- transactions


class Transaction:
    """Swap a set of files so that an interruption at ANY point leaves each file wholly old or
    wholly new and is undone to all-old by the next run (`recover`).

    Before the first rename: every current file is copied to <dir>/backup and journal.json
    lists each target with its old copy (or "absent"). Renames are atomic per file; the
    journal is deleted only after the caller has committed its record."""

    def __init__(self, host, txid, directory, pace_s=0.0):
        self.host, self.txid, self.dir, self.pace_s = host, txid, directory, pace_s
        self.journal = os.path.join(host.state, hostlib.JOURNAL_FILE)
        self.ops = []

    def prepare(self, changes):
        """changes: [(key, source path or None to delete)], in the order they will be applied."""
        for key, source in changes:
            target = self.host.path(key)
            old = None
            if os.path.lexists(target):
                old = os.path.join(self.dir, "backup", key)
                copy_durable(target, old)
            self.ops.append({"key": key, "target": target, "new": source, "old": old,
                             "tmp": temp_name(target, self.txid)})
        write_json_atomic(self.journal, {"txid": self.txid, "dir": self.dir, "ops": self.ops,
                                         "started": time.time()})

    def apply(self):
        for index, op in enumerate(self.ops):
            if op["new"] is None:
                if os.path.lexists(op["target"]):
                    os.unlink(op["target"])
                    fsync_dir(os.path.dirname(op["target"]))
                drop_bytecode(op["target"])
            else:
                os.makedirs(os.path.dirname(op["target"]), exist_ok=True)
                swap_in(op["new"], op["target"], self.txid)
            log("swapped %d/%d %s" % (index + 1, len(self.ops), op["key"]))
            if self.pace_s:
                time.sleep(self.pace_s)

    def finish(self):
        os.unlink(self.journal)
        fsync_dir(self.host.state)

    def undo(self):
        undo_ops(self.ops)
        self.finish()


def drop_bytecode(target):
    """A removed module's cached bytecode goes too (py_compile and the import check made it)."""
    if target.endswith(".py"):
        cache = os.path.join(os.path.dirname(target), "__pycache__")
        stem = os.path.basename(target)[:-3] + "."
        for name in os.listdir(cache) if os.path.isdir(cache) else []:
            if name.startswith(stem) and name.endswith(".pyc"):
                os.unlink(os.path.join(cache, name))


def undo_ops(ops):
    for op in reversed(ops):
        if os.path.lexists(op["tmp"]):
            os.unlink(op["tmp"])
        if op["old"] is None:
            if os.path.lexists(op["target"]):
                os.unlink(op["target"])
            drop_bytecode(op["target"])
        elif not os.path.exists(op["target"]) or sha256_file(op["target"]) != sha256_file(op["old"]):
            swap_in(op["old"], op["target"], "undo")
        fsync_dir(os.path.dirname(op["target"]))


def mark_rolled_back(host, rollback):
    """Records of the releases a committed rollback undid say so, and `current` names the newest
    release still active, which is returned. Idempotent: recovery runs it again after a kill."""
    undid = set(rollback["undid"])
    still_active = []
    for record in host.releases():
        if record.get("status") != "active":
            continue
        if record["id"] in undid:
            path = os.path.join(record.pop("dir"), "release.json")
            record.update(status="rolled_back", rolled_back_by=rollback["id"], rolled_back_at=rollback["time"])
            write_json_atomic(path, record)
        else:
            still_active.append(record["id"])
    current = still_active[-1] if still_active else None
    host.set_current(current)
    return current


def recover(host):
    """Finish what an interrupted run left: a journal whose release was committed is just
    removed; otherwise every file it lists is put back to its old bytes."""
    journal = read_json(os.path.join(host.state, hostlib.JOURNAL_FILE))
    if journal is None:
        return None
    record = read_json(os.path.join(journal["dir"], "release.json")) or \
        read_json(os.path.join(journal["dir"], "rollback.json"))
    committed = bool(record and record.get("committed"))
    if not committed:
        undo_ops(journal["ops"])
        log("undid interrupted run %s (%d files restored)" % (journal["txid"], len(journal["ops"])))
    elif "undid" in record:
        # A rollback commits rollback.json before it updates the release records: a run killed
        # in between left the files restored but the records still saying active.
        mark_rolled_back(host, record)
        log("finished the records of interrupted rollback %s" % journal["txid"])
    os.unlink(os.path.join(host.state, hostlib.JOURNAL_FILE))
    fsync_dir(host.state)
    return {"txid": journal["txid"], "undone": not committed, "files": [op["key"] for op in journal["ops"]]}


def remove_orphans(host):
    """Release directories with no record: what a helper killed during the transfer or the
    verify left (nothing of them was swapped in, and after recover() no journal names them).
    Removed, so `releases` and the disk never show a half-staged release. Their ids."""
    base = os.path.join(host.state, hostlib.RELEASES_DIR)
    removed = []
    for name in sorted(os.listdir(base)) if os.path.isdir(base) else []:
        path = os.path.join(base, name)
        if os.path.isdir(path) and not os.path.lexists(os.path.join(path, "release.json")):
            shutil.rmtree(path, ignore_errors=True)
            removed.append(name)
    if removed:
        log("removed %d orphan staging dir(s) of killed runs: %s" % (len(removed), ", ".join(removed)))
    return removed


def check_python(host, keys, modules, smoke=None, recheck=False):
    """py_compile the changed .py files, then import the modules in a fresh interpreter; with
    `smoke` (a deploy's probe request), import them here instead and run the smoke probe after
    them. (the probe's document or None, how the import check went: "passed", "cached", None)."""
    import py_compile

    for key in keys:
        if key.endswith(".py"):
            try:
                py_compile.compile(host.path(key), doraise=True)
            except py_compile.PyCompileError as exc:
                raise Failure("py_compile failed for %s:\n%s" % (key, exc.msg), phase="compile")
    if modules:
        bad = [m for m in modules if not MODULE_NAME.match(m)]
        if bad:  # the controller checks this too; names are data here, never source code
            raise Failure("import check: not module names: %s" % ", ".join(repr(m) for m in bad), phase="import")
    if smoke is not None:
        return import_and_probe(modules, smoke, host.state), "passed"
    if not modules:
        return None, None
    return None, import_in_fresh_interpreter(host, modules, recheck)


def import_check_key(host, modules):
    """What a fresh interpreter's import of `modules` can depend on that a push, a hand edit or
    pip can change: the interpreter, PYTHONPATH, the module names, the content of every file of
    the package (__pycache__ aside: written by imports, derived from the sources), the content of
    every file at the top of site-packages (.pth files, an extension module: a push's `purelib/`
    keys are files there) with the names of its directories (a dist-info names its version: an
    upgraded dependency). Not which files this apply changed: a recovery after a killed push
    changes some, finds the rest new already, and imports the same as a whole push. Hashing the
    package (~120 MB for SGLang) costs ~0.25 s of CPU; the import it spares, ~6 s. Files inside
    other packages' directories are not read: an in-place edit there that keeps their version is
    what `push --recheck` is for."""
    digest = hashlib.sha256()

    def add(*parts):
        for part in parts:
            digest.update(str(part).encode("utf-8", "surrogateescape") + b"\0")

    add("import-check-v1", sys.executable, sys.version, os.environ.get("PYTHONPATH", ""), *modules)
    add("|")
    root, site = host.package["root"], host.package["site"]
    for directory, dirs, names in os.walk(root):
        dirs[:] = sorted(d for d in dirs if d != "__pycache__")
        for name in sorted(names):
            path = os.path.join(directory, name)
            if os.path.isfile(path):
                add(os.path.relpath(path, root), sha256_file(path))
    add("|")
    for name in sorted(os.listdir(site)):
        path = os.path.join(site, name)
        add(name, sha256_file(path) if os.path.isfile(path) else "dir")
    return digest.hexdigest()[:32]


def import_in_fresh_interpreter(host, modules, recheck):
    """Import the modules in a fresh interpreter started here, or find that one passed with all
    it could read the same (import_check_key). "passed" or "cached"; a failure raises."""
    started = time.monotonic()
    key = import_check_key(host, modules)
    record_path = os.path.join(host.state, hostlib.CACHE_DIR, "import-ok-%s.json" % key)
    record = None if recheck else read_json(record_path)
    if record is not None:
        log("import check: passed at %s with the same files (key %s, %.2fs to compute); not rerun"
            % (time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(record.get("time", 0))), key[:12],
               time.monotonic() - started))
        os.utime(record_path)  # the newest used are the ones kept (prune_import_records)
        return "cached"
    result = subprocess.run([sys.executable, "-c", IMPORT_MODULES] + list(modules), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, cwd="/")
    if result.returncode != 0:
        raise Failure("import check failed (%s):\n%s" % (", ".join(modules),
                                                         result.stdout.decode("utf-8", "replace")),
                      phase="import")
    os.makedirs(os.path.dirname(record_path), exist_ok=True)
    write_json_atomic(record_path, {"time": time.time(), "modules": list(modules), "python": sys.executable,
                                    "seconds": round(time.monotonic() - started, 3)})
    prune_import_records(os.path.dirname(record_path))
    return "passed"


def prune_import_records(directory):
    records = [os.path.join(directory, n) for n in os.listdir(directory)
               if n.startswith("import-ok-") and n.endswith(".json")]
    records.sort(key=lambda p: os.stat(p).st_mtime)
    for path in records[:-IMPORT_RECORDS]:
        try:
            os.unlink(path)
        except OSError:
            pass


def import_and_probe(modules, smoke, state_dir):
    """The import check and a deploy's smoke probe in this process, in one import of SGLang: this
    process has not imported the package (Host reads its files and metadata only), so what it
    imports now is what the swap put on disk. The probe (remote/smoke_probe.py, a companion of
    this call) reports a failed validation in its document; an import that fails here is the
    import check's failure, as in a fresh interpreter."""
    import importlib
    import traceback

    importlib.invalidate_caches()  # directory listings read before the swap
    started = time.monotonic()
    for name in modules:
        try:
            importlib.import_module(name)
        except BaseException:  # noqa: BLE001 - SystemExit from a module is a failed import too
            raise Failure("import check failed (%s):\n%s" % (", ".join(modules), traceback.format_exc()),
                          phase="import")
    checked = time.monotonic() - started
    probe = hostlib.companion("smoke_probe.py").probe(dict(smoke, state_dir=state_dir))
    probe.setdefault("timings", {})["import_check_s"] = round(checked, 3)
    return probe


# ---------------------------------------------------------------- the deploy lease


def refuse_while_deployed(host, args):
    """Under the lock: refuse to change the host while another run's deploy holds its lease
    (hostlib.DEPLOY_LEASE_FILE, taken by remote/server.py), naming it, as a second deploy is
    refused. A deploy's own steps (its apply, its revert's rollback) come from the controller
    process that took the lease, under the same holder (user, controller, command line, pid),
    and go through. An expired lease (its deploy died without dropping it) binds nobody."""
    held = hostlib.deploy_lease_conflict(host.state)
    if held is None or held.get("holder") == args["holder"]:
        return
    age = time.time() - held.get("since", 0)
    raise Failure("host is being deployed by another sglfleet run: %s (deploy %s, %.0fs ago); it holds the "
                  "host until it ends or its lease expires in %.0fs; nothing was changed"
                  % (hostlib.describe_holder(held.get("holder")), held.get("id"), age, held.get("ttl", 0) - age),
                  hostlib.EXIT_LOCKED, holder=held.get("holder"), lease=held)


# ---------------------------------------------------------------- commands


def cmd_inspect(host, args):
    """Everything plan/push need to decide, in one round trip. With `recover`, an interrupted
    run is undone first (under the lock), so the answer describes what apply will find."""
    recovered = None
    if args.get("recover"):
        with Lock(host.state, args["holder"]):
            if args.get("refuse_while_deployed"):  # a push: refused here, before any byte is sent
                refuse_while_deployed(host, args)
            recovered = recover(host)
    records = host.releases()
    files = {}
    for key, want_base, want_text, expected in args["targets"]:
        target = host.path(key)
        entry = {"exists": os.path.lexists(target), "sha256": None}
        if entry["exists"]:
            entry["sha256"] = sha256_file(target)
            if want_text:
                with open(target, "rb") as fh:
                    entry["text"] = fh.read().decode("utf-8", "replace")
            ours = [r["id"] for r in records if r["files"].get(key, {}).get("after") == entry["sha256"]]
            entry["ours"] = ours[-1] if ours else None
            if want_base:
                source, base_sha = host.pristine_source(key, entry["sha256"], records, expected)
                entry["base_sha256"] = base_sha
                if source is not None:
                    with open(source, "rb") as fh:
                        entry["base_text"] = fh.read().decode("utf-8", "surrogateescape")
        files[key] = entry
    journal = read_json(os.path.join(host.state, hostlib.JOURNAL_FILE))
    return {"package": host.package, "python": {"executable": sys.executable,
                                                  "tag": "cp%d%d" % sys.version_info[:2]},
            "torch": hostlib.torch_build(host.package["site"]), "gpus": [g for g in hostlib.gpus() if g.get("arch")],
            "files": files,
            "current": host.current(), "releases": len(records), "recovered": recovered,
            "interrupted": journal and {"txid": journal["txid"], "files": len(journal["ops"])}}


def cmd_index(host, args):
    """Where files named like the user's edited ones live in the package, with their hashes and
    the hash of the pristine bytes under any sglfleet release (for `patchset init`)."""
    names, records, found = set(args.get("names") or []), host.releases(), {}
    root = host.roots["pkg"]
    for directory, dirs, files in os.walk(root):
        dirs[:] = [d for d in dirs if d != "__pycache__"]
        for name in files:
            if name in names:
                rel = os.path.relpath(os.path.join(directory, name), root)
                found.setdefault(name, []).append(rel)
    paths = {}
    for rel in set(args.get("paths") or []) | {r for rels in found.values() for r in rels}:
        key = "pkg/" + rel
        target = host.path(key)
        if not os.path.lexists(target):
            paths[rel] = None
            continue
        sha = sha256_file(target)
        paths[rel] = {"sha256": sha, "pristine_sha256": host.pristine_source(key, sha, records)[1]}
    return {"package": host.package, "by_name": {n: sorted(r) for n, r in found.items()}, "paths": paths}


def safe_members(tar):
    """The archive's members, refusing absolute paths, `..` and anything but files and dirs."""
    for member in tar:
        name = member.name
        if name.startswith("/") or ".." in name.split("/") or not (member.isfile() or member.isdir()):
            raise Failure("refusing tar member %r" % name)
        yield member


def cmd_apply(host, args, stream):
    release_id = args["id"]
    rdir = os.path.join(host.state, hostlib.RELEASES_DIR, release_id)
    with Lock(host.state, args["holder"]):
        refuse_while_deployed(host, args)
        recovered = recover(host)
        orphans = remove_orphans(host)  # after recover: no journal can name one any more
        if os.path.exists(rdir):
            raise Failure("release %s already exists on this host" % release_id)
        staging = os.path.join(rdir, "files")
        os.makedirs(staging)
        try:
            try:
                with tarfile.open(fileobj=stream, mode="r|") as tar:
                    for member in safe_members(tar):
                        extra = {"filter": "data"} if hasattr(tarfile, "data_filter") else {}
                        tar.extract(member, staging, set_attrs=False, **extra)
            except (tarfile.TarError, EOFError, OSError) as exc:
                raise Failure("transfer incomplete: %s" % exc, phase="transfer")
            files = args["files"]  # [{key, before, after}] in apply order
            for item in files:
                staged = os.path.join(staging, item["key"])
                if not os.path.isfile(staged) or sha256_file(staged) != item["after"]:
                    raise Failure("staged %s does not match its sha256; nothing was changed" % item["key"],
                                  phase="verify")
                target = host.path(item["key"])
                now = sha256_file(target) if os.path.lexists(target) else None
                if now != item["before"]:
                    raise Failure("%s changed since it was inspected (now %s, expected %s); rerun"
                                  % (item["key"], (now or "absent")[:12], (item["before"] or "absent")[:12]),
                                  phase="verify")
            log("staged and verified %d files" % len(files))
        except Failure:
            shutil.rmtree(rdir, ignore_errors=True)
            raise
        tx = Transaction(host, release_id, rdir, args.get("pace_s", 0.0))
        tx.prepare([(item["key"], os.path.join(staging, item["key"])) for item in files])
        probe = imported = None
        try:
            tx.apply()
            probe, imported = check_python(host, [item["key"] for item in files], args.get("import_check", []),
                                           args.get("smoke"), args.get("recheck", False))
            if probe is not None and not probe.get("ok"):
                exc = probe.get("exception") or {}
                raise Failure("smoke failed (%s): %s: %s" % (probe.get("phase"), exc.get("type"),
                                                             (exc.get("message") or "").split("\n")[0]),
                              phase="smoke", probe=probe)
        except Exception as exc:
            tx.undo()
            shutil.rmtree(rdir, ignore_errors=True)
            if isinstance(exc, Failure):
                exc.detail["restored"] = True
                raise
            raise Failure("swap failed (%s: %s); every file was restored" % (type(exc).__name__, exc),
                          restored=True)
        previous = host.current()
        record = {"id": release_id, "time": time.time(), "committed": True, "status": "active",
                  "controller": args["holder"], "artifacts": args["artifacts"], "previous": previous,
                  "files": {item["key"]: {"before": item["before"], "after": item["after"]} for item in files}}
        write_json_atomic(os.path.join(rdir, "release.json"), record)
        host.set_current(release_id)
        tx.finish()
    return {"release": release_id, "previous": previous, "files": [item["key"] for item in files],
            "recovered": recovered, "orphans_removed": orphans, "probe": probe, "import_check": imported}


def cmd_releases(host, args):
    records = host.releases()
    for record in records:
        record.pop("dir", None)
    journal = read_json(os.path.join(host.state, hostlib.JOURNAL_FILE))
    return {"releases": records, "current": host.current(), "package": host.package,
            "interrupted": journal and journal["txid"], "lock_holder": hostlib.lock_holder(host.state)}


def cmd_rollback(host, args):
    """Undo active releases newer than `to` (None: the newest one; "pristine": all of them)."""
    with Lock(host.state, args["holder"]):
        refuse_while_deployed(host, args)
        recovered = recover(host)
        records = host.releases()
        active = [r for r in records if r.get("status") == "active"]
        to = args.get("to")
        if not active:
            raise Failure("nothing to roll back: no active release on this host", nothing=True)
        if to is None:
            undo = active[-1:]
        elif to == "pristine":
            undo = active
        else:
            ids = [r["id"] for r in active]
            if to not in ids:
                known = ", ".join(ids) or "none"
                raise Failure("release %s is not an active release here (active: %s)" % (to, known))
            undo = active[ids.index(to) + 1:]
            if not undo:
                return {"rolled_back": [], "current": host.current(), "recovered": recovered, "files": []}
        # Per file: the newest undone release must still own it; it goes back to what the
        # oldest undone release found there.
        wanted, drifted = {}, []
        for record in reversed(undo):
            for key, change in record["files"].items():
                wanted[key] = (record, change)
        for key in sorted(wanted):
            newest = next(r for r in reversed(undo) if key in r["files"])
            target = host.path(key)
            now = sha256_file(target) if os.path.lexists(target) else None
            if now != newest["files"][key]["after"]:
                drifted.append({"key": key, "sha256": now, "expected": newest["files"][key]["after"]})
        if drifted and not args.get("force"):
            raise Failure("files changed since release %s was installed; refusing to roll back "
                          "(--force overrides, the changed files are kept in the rollback's backup): %s"
                          % (undo[-1]["id"], ", ".join(d["key"] for d in drifted)), drifted=drifted)
        rb_id = args["id"]
        rb_dir = os.path.join(host.state, hostlib.ROLLBACKS_DIR, rb_id)
        os.makedirs(rb_dir)
        changes = []
        for key in sorted(wanted):
            record, change = wanted[key]
            source = None if change["before"] is None else os.path.join(record["dir"], "backup", key)
            changes.append((key, source))
        tx = Transaction(host, rb_id, rb_dir, args.get("pace_s", 0.0))
        tx.prepare(changes)
        try:
            tx.apply()
        except Exception:
            tx.undo()
            raise
        rollback = {"id": rb_id, "time": time.time(), "committed": True, "undid": [r["id"] for r in undo],
                    "controller": args["holder"], "drifted_kept": drifted}
        write_json_atomic(os.path.join(rb_dir, "rollback.json"), rollback)
        new_current = mark_rolled_back(host, rollback)
        tx.finish()
    return {"rolled_back": [r["id"] for r in undo], "current": new_current, "recovered": recovered,
            "files": [key for key, _ in changes], "drifted_kept": drifted}


def command(function):
    """A command of this script: (args, stream) -> JSON value, on the host named by args."""
    return lambda args, stream: function(Host(args), args, stream)


COMMANDS = {
    "inspect": command(lambda host, args, stream: cmd_inspect(host, args)),
    "apply": command(cmd_apply),
    "releases": command(lambda host, args, stream: cmd_releases(host, args)),
    "index": command(lambda host, args, stream: cmd_index(host, args)),
    "rollback": command(lambda host, args, stream: cmd_rollback(host, args)),
}

if __name__ == "__main__":
    sys.exit(hostlib.main(COMMANDS))
