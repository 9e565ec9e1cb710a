"""The host side of releases (remote/release.py + hostlib) as plain functions on temp dirs.

No SSH and no lab: a fake site-packages with a package `pkg`, a state dir, and the same
commands push and rollback run on a host (`cmd_apply`, `cmd_rollback`), fed a real tar stream.
The lab tests (test_push.py) check the same code end to end through sshd, with kills.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import tarfile

import pytest

from orchestrator.remote import hostlib, release

HOLDER = {"user": "test", "controller": "here", "command": "pytest"}


def sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


@pytest.fixture
def host(tmp_path):
    site = tmp_path / "site"
    (site / "pkg").mkdir(parents=True)
    (site / "pkg" / "__init__.py").write_text("")
    (site / "pkg" / "m.py").write_bytes(b"V = 0\n")
    h = release.Host.__new__(release.Host)  # the package is ours, not found on sys.path
    h.state = str(tmp_path / "state")
    h.package = {"name": "pkg", "root": str(site / "pkg"), "site": str(site), "version": "1.0"}
    h.roots = {"pkg": h.package["root"], "purelib": h.package["site"]}
    return h


def tar_of(files: dict[str, bytes]) -> io.BytesIO:
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w|") as tar:
        for key, data in files.items():
            info = tarfile.TarInfo(key)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    buffer.seek(0)
    return buffer


def apply(host, release_id: str, files: dict[str, bytes], befores: dict[str, bytes | None],
          claimed: dict[str, str] | None = None):
    args = {"id": release_id, "holder": HOLDER, "artifacts": [], "import_check": [],
            "files": [{"key": k, "before": None if befores[k] is None else sha(befores[k]),
                       "after": (claimed or {}).get(k, sha(v))} for k, v in files.items()]}
    return release.cmd_apply(host, args, tar_of(files))


def read(host, key: str) -> bytes | None:
    path = host.path(key)
    return open(path, "rb").read() if os.path.exists(path) else None


def test_three_releases_roll_back_in_order_to_a_middle_one_and_to_pristine(host):
    versions = [b"V = 0\n", b"V = 1\n", b"V = 2\n", b"V = 3\n"]
    for n in (1, 2, 3):
        apply(host, f"r{n}", {"pkg/m.py": versions[n], "pkg/new.py": b"N = %d\n" % n},
              {"pkg/m.py": versions[n - 1], "pkg/new.py": None if n == 1 else b"N = %d\n" % (n - 1)})
    assert read(host, "pkg/m.py") == versions[3] and host.current() == "r3"

    back = release.cmd_rollback(host, {"to": "r1", "id": "rb1", "holder": HOLDER})
    assert back["rolled_back"] == ["r2", "r3"] and back["current"] == "r1"
    assert read(host, "pkg/m.py") == versions[1] and read(host, "pkg/new.py") == b"N = 1\n"

    back = release.cmd_rollback(host, {"to": "pristine", "id": "rb2", "holder": HOLDER})
    assert back["rolled_back"] == ["r1"] and back["current"] is None
    assert read(host, "pkg/m.py") == versions[0] and read(host, "pkg/new.py") is None
    statuses = {r["id"]: r["status"] for r in host.releases()}
    assert statuses == {"r1": "rolled_back", "r2": "rolled_back", "r3": "rolled_back"}


def test_staged_bytes_that_do_not_match_their_hash_change_nothing(host):
    with pytest.raises(hostlib.Failure) as info:
        apply(host, "bad", {"pkg/m.py": b"V = 9\n"}, {"pkg/m.py": b"V = 0\n"}, claimed={"pkg/m.py": sha(b"other")})
    assert info.value.detail["phase"] == "verify" and "does not match its sha256" in str(info.value)
    assert read(host, "pkg/m.py") == b"V = 0\n"
    assert not os.path.exists(os.path.join(host.state, "releases", "bad"))
    assert not os.path.exists(os.path.join(host.state, hostlib.JOURNAL_FILE))


def test_swap_replaces_the_file_by_rename_never_in_place(host, tmp_path):
    target = host.path("pkg/m.py")
    before = os.stat(target).st_ino
    reader = open(target, "rb")  # a process that had the old file open keeps reading the old bytes
    source = tmp_path / "new"
    source.write_bytes(b"V = 5\n")
    hostlib.swap_in(str(source), target, "tx")
    assert os.stat(target).st_ino != before and open(target, "rb").read() == b"V = 5\n"
    assert reader.read() == b"V = 0\n"
    assert [n for n in os.listdir(os.path.dirname(target)) if "sglfleet" in n] == []  # no temp left


def test_an_interrupted_swap_is_undone_to_all_old_by_recover(host, tmp_path, monkeypatch):
    (tmp_path / "a").write_bytes(b"V = 7\n")
    (tmp_path / "b").write_bytes(b"W = 7\n")
    tx = release.Transaction(host, "tx1", str(tmp_path / "txdir"))
    tx.prepare([("pkg/m.py", str(tmp_path / "a")), ("pkg/w.py", str(tmp_path / "b"))])
    calls = []
    real = release.swap_in

    def killed_after_one(source, target, txid):
        if calls:
            raise KeyboardInterrupt  # the process dies between two renames
        calls.append(target)
        real(source, target, txid)

    monkeypatch.setattr(release, "swap_in", killed_after_one)
    with pytest.raises(KeyboardInterrupt):
        tx.apply()
    monkeypatch.setattr(release, "swap_in", real)
    assert read(host, "pkg/m.py") == b"V = 7\n"  # half-swapped: exactly what the journal is for
    recovered = release.recover(host)
    assert recovered == {"txid": "tx1", "undone": True, "files": ["pkg/m.py", "pkg/w.py"]}
    assert read(host, "pkg/m.py") == b"V = 0\n" and read(host, "pkg/w.py") is None
    assert release.recover(host) is None  # the journal is gone: recovery runs once


def test_a_committed_release_survives_recovery(host):
    apply(host, "r1", {"pkg/m.py": b"V = 1\n"}, {"pkg/m.py": b"V = 0\n"})
    record = json.load(open(os.path.join(host.state, "releases", "r1", "release.json")))
    # As if killed after the record was committed but before the journal was removed.
    hostlib.write_json_atomic(os.path.join(host.state, hostlib.JOURNAL_FILE),
                              {"txid": "r1", "dir": os.path.join(host.state, "releases", "r1"), "ops": [
                                  {"key": "pkg/m.py", "target": host.path("pkg/m.py"), "new": "x", "old": None,
                                   "tmp": host.path("pkg/.m.py.sglfleet-r1")}]})
    assert record["committed"] and release.recover(host)["undone"] is False
    assert read(host, "pkg/m.py") == b"V = 1\n"


def test_pristine_bytes_are_found_under_a_chain_of_releases(host):
    apply(host, "r1", {"pkg/m.py": b"V = 1\n"}, {"pkg/m.py": b"V = 0\n"})
    apply(host, "r2", {"pkg/m.py": b"V = 2\n"}, {"pkg/m.py": b"V = 1\n"})
    source, pristine = host.pristine_source("pkg/m.py", sha(b"V = 2\n"), host.releases())
    assert pristine == sha(b"V = 0\n") and open(source, "rb").read() == b"V = 0\n"
    # Hand-edited after r2: the bytes under our change are still r1's backup.
    open(host.path("pkg/m.py"), "wb").write(b"V = 'edited'\n")
    source, pristine = host.pristine_source("pkg/m.py", sha(b"V = 'edited'\n"), host.releases())
    assert pristine == sha(b"V = 0\n") and open(source, "rb").read() == b"V = 0\n"


def test_the_lock_refuses_a_second_holder_and_names_the_first(host):
    with hostlib.Lock(host.state, HOLDER):
        with pytest.raises(hostlib.Failure) as info:
            with hostlib.Lock(host.state, {"user": "bob", "controller": "there", "command": "x"}):
                pass
    assert info.value.code == hostlib.EXIT_LOCKED
    assert "test@here running `pytest`" in str(info.value) and info.value.detail["holder"]["user"] == "test"


# ---------------------------------------------------------------- a deploy's lease and push

DEPLOYER = {"user": "dana", "controller": "ops1", "command": "sglfleet deploy all p", "controller_pid": 4242}


def take_lease(host, deploy_id="dep1", ttl=600.0):
    """The lease as remote/server.py takes it for a deploy (the same function, not a copy)."""
    from orchestrator.remote import server

    server.take_lease({"state_dir": host.state, "lease": {"id": deploy_id, "holder": DEPLOYER, "ttl": ttl}})


def assert_refused_naming_the_deploy(info, deploy_id="dep1"):
    assert info.value.code == hostlib.EXIT_LOCKED
    message = str(info.value)
    assert "being deployed by another sglfleet run" in message and f"deploy {deploy_id}" in message
    assert "dana@ops1 running `sglfleet deploy all p`" in message and "nothing was changed" in message
    assert info.value.detail["lease"]["id"] == deploy_id and info.value.detail["holder"] == DEPLOYER


def nothing_changed(host):
    assert read(host, "pkg/m.py") == b"V = 1\n" and host.current() == "r1"
    assert [r["id"] for r in host.releases()] == ["r1"] and [r["status"] for r in host.releases()] == ["active"]
    assert not os.path.exists(os.path.join(host.state, hostlib.JOURNAL_FILE))


def test_a_push_is_refused_naming_the_deploy_that_holds_the_lease(host):
    apply(host, "r1", {"pkg/m.py": b"V = 1\n"}, {"pkg/m.py": b"V = 0\n"})
    take_lease(host)
    with pytest.raises(hostlib.Failure) as info:  # push's first round trip, before any byte is sent
        release.cmd_inspect(host, {"targets": [], "recover": True, "refuse_while_deployed": True, "holder": HOLDER})
    assert_refused_naming_the_deploy(info)
    with pytest.raises(hostlib.Failure) as info:  # and its apply, should the lease come in between
        apply(host, "r2", {"pkg/m.py": b"V = 2\n"}, {"pkg/m.py": b"V = 1\n"})
    assert_refused_naming_the_deploy(info)
    with pytest.raises(hostlib.Failure) as info:
        release.cmd_rollback(host, {"to": "pristine", "id": "rb1", "holder": HOLDER})
    assert_refused_naming_the_deploy(info)
    nothing_changed(host)
    assert not os.path.exists(os.path.join(host.state, "releases", "r2"))
    # Reading is not changing: `plan` (inspect without recovery) still answers.
    assert release.cmd_inspect(host, {"targets": [], "holder": HOLDER})["current"] == "r1"


def test_the_deploys_own_apply_and_rollback_go_through_its_lease(host):
    apply(host, "r1", {"pkg/m.py": b"V = 1\n"}, {"pkg/m.py": b"V = 0\n"})
    take_lease(host)
    args = {"id": "r2", "holder": DEPLOYER, "artifacts": [], "import_check": [],
            "files": [{"key": "pkg/m.py", "before": sha(b"V = 1\n"), "after": sha(b"V = 2\n")}]}
    assert release.cmd_apply(host, args, tar_of({"pkg/m.py": b"V = 2\n"}))["release"] == "r2"
    assert release.cmd_rollback(host, {"to": "r1", "id": "rb1", "holder": DEPLOYER})["current"] == "r1"
    # Another process of the same user, machine and command line is another run.
    other = dict(DEPLOYER, controller_pid=4243)
    with pytest.raises(hostlib.Failure) as info:
        release.cmd_rollback(host, {"to": "pristine", "id": "rb2", "holder": other})
    assert_refused_naming_the_deploy(info)
    assert read(host, "pkg/m.py") == b"V = 1\n" and host.current() == "r1"
    assert not os.path.exists(os.path.join(host.state, hostlib.ROLLBACKS_DIR, "rb2"))


def test_a_push_goes_through_once_the_lease_is_dropped_or_expired(host):
    from orchestrator.remote import server

    apply(host, "r1", {"pkg/m.py": b"V = 1\n"}, {"pkg/m.py": b"V = 0\n"})
    take_lease(host)
    server.drop_lease({"state_dir": host.state, "deploy_id": "dep1"})
    apply(host, "r2", {"pkg/m.py": b"V = 2\n"}, {"pkg/m.py": b"V = 1\n"})
    take_lease(host, "dep2", ttl=0.2)
    with pytest.raises(hostlib.Failure):
        apply(host, "r3", {"pkg/m.py": b"V = 3\n"}, {"pkg/m.py": b"V = 2\n"})
    import time

    time.sleep(0.3)  # its deploy died without dropping it: past the ttl it binds nobody
    apply(host, "r3", {"pkg/m.py": b"V = 3\n"}, {"pkg/m.py": b"V = 2\n"})
    assert read(host, "pkg/m.py") == b"V = 3\n" and host.current() == "r3"


class FakeProbe:
    """smoke_probe.py as a deploy's apply calls it (a companion): records what it was asked and
    what `pkg.m` held when it ran, answers `ok`."""

    def __init__(self, ok: bool):
        self.ok, self.requests, self.seen = ok, [], None

    def probe(self, request):
        import pkg.m  # noqa: the swapped-in module, imported by the import check just before

        self.requests.append(request)
        self.seen = pkg.m.V
        if self.ok:
            return {"ok": True, "phase": None, "fields": {"tp_size": 1}, "timings": {"total_s": 0.1}}
        return {"ok": False, "phase": "validate", "exception": {"type": "ValueError", "message": "bad argv\nmore"},
                "traceback": "Traceback (most recent call last):\n...\nValueError: bad argv", "timings": {}}


@pytest.fixture
def importable(host, monkeypatch):
    """`pkg` importable by name (the import check imports by name), forgotten afterwards."""
    import sys

    monkeypatch.syspath_prepend(host.package["site"])
    yield
    for name in [n for n in sys.modules if n == "pkg" or n.startswith("pkg.")]:
        del sys.modules[name]


def apply_with_smoke(host, probe, monkeypatch, version: bytes):
    monkeypatch.setitem(hostlib.COMPANIONS, "smoke_probe.py", probe)
    args = {"id": "r1", "holder": HOLDER, "artifacts": [], "import_check": ["pkg.m"],
            "smoke": {"argv": ["--model-path", "/m"], "simulate": "h200"},
            "files": [{"key": "pkg/m.py", "before": sha(b"V = 0\n"), "after": sha(version)}]}
    return release.cmd_apply(host, args, tar_of({"pkg/m.py": version}))


def test_a_deploys_smoke_runs_in_the_push_on_the_swapped_files_and_its_document_comes_back(
        host, importable, monkeypatch):
    probe = FakeProbe(ok=True)
    done = apply_with_smoke(host, probe, monkeypatch, b"V = 1\n")
    assert probe.seen == 1  # the new file, imported once, after the swap
    assert probe.requests == [{"argv": ["--model-path", "/m"], "simulate": "h200", "state_dir": host.state}]
    assert done["probe"]["ok"] and done["probe"]["timings"]["import_check_s"] >= 0
    assert host.current() == "r1" and read(host, "pkg/m.py") == b"V = 1\n"


def test_a_failing_smoke_inside_the_push_undoes_the_swap_and_commits_nothing(host, importable, monkeypatch):
    probe = FakeProbe(ok=False)
    with pytest.raises(hostlib.Failure) as info:
        apply_with_smoke(host, probe, monkeypatch, b"V = 2\n")
    assert probe.seen == 2  # it validated against the new files
    assert info.value.detail["phase"] == "smoke" and info.value.detail["restored"] is True
    assert info.value.detail["probe"]["traceback"].endswith("ValueError: bad argv")
    assert str(info.value) == "smoke failed (validate): ValueError: bad argv"
    assert read(host, "pkg/m.py") == b"V = 0\n" and host.current() is None
    assert not os.path.exists(os.path.join(host.state, "releases", "r1"))
    assert not os.path.exists(os.path.join(host.state, hostlib.JOURNAL_FILE))


def test_an_import_check_failure_inside_the_push_is_reported_whole_before_any_smoke(
        host, importable, monkeypatch):
    probe = FakeProbe(ok=True)
    with pytest.raises(hostlib.Failure) as info:
        apply_with_smoke(host, probe, monkeypatch, b"raise ImportError('patched module is broken')\n")
    assert info.value.detail["phase"] == "import" and probe.requests == []
    assert "import check failed (pkg.m)" in str(info.value) and "patched module is broken" in str(info.value)
    assert read(host, "pkg/m.py") == b"V = 0\n" and host.current() is None


def apply_importing(host, release_id: str, version: bytes, before: bytes, recheck: bool = False):
    args = {"id": release_id, "holder": HOLDER, "artifacts": [], "import_check": ["pkg.m"], "recheck": recheck,
            "files": [{"key": "pkg/m.py", "before": sha(before), "after": sha(version)}]}
    return release.cmd_apply(host, args, tar_of({"pkg/m.py": version}))


def test_a_passed_import_check_is_reused_only_while_everything_it_read_is_the_same(host, monkeypatch):
    # The fresh interpreter finds `pkg` through PYTHONPATH (which is part of the key as well).
    monkeypatch.setenv("PYTHONPATH", host.package["site"])
    site = host.package["site"]
    assert apply_importing(host, "r1", b"V = 1\n", b"V = 0\n")["import_check"] == "passed"
    records = os.listdir(os.path.join(host.state, hostlib.CACHE_DIR))
    assert len(records) == 1 and records[0].startswith("import-ok-")
    release.cmd_rollback(host, {"holder": HOLDER, "id": "b1", "to": "pristine"})
    # The same bytes again (as after a rollback, or a recovery after a killed push): not rerun.
    assert apply_importing(host, "r2", b"V = 1\n", b"V = 0\n")["import_check"] == "cached"
    assert apply_importing(host, "r3", b"V = 3\n", b"V = 1\n")["import_check"] == "passed"  # new content
    release.cmd_rollback(host, {"holder": HOLDER, "id": "b2", "to": "pristine"})

    # A file the push does not touch, edited by hand so the import fails: the key changes, the
    # check runs and fails, and the swap is undone, though these bytes of m.py passed before.
    init = os.path.join(host.package["root"], "__init__.py")
    with open(init, "w") as fh:
        fh.write("raise ImportError('hand edit outside the patchset')\n")
    with pytest.raises(hostlib.Failure) as info:
        apply_importing(host, "r4", b"V = 1\n", b"V = 0\n")
    assert info.value.detail["phase"] == "import" and "hand edit outside the patchset" in str(info.value)
    assert read(host, "pkg/m.py") == b"V = 0\n" and host.current() is None
    with open(init, "w") as fh:
        fh.write("")

    # What sits at the top of site-packages is in the key too: its files by content (a .pth runs
    # at startup, an extension module is a file there), its directories by name (a dist-info
    # names the version pip installed); pkg's __pycache__ is not (imports write it).
    key = release.import_check_key(host, ["pkg.m"])
    for name, body in (("zz.pth", "import os\n"), ("dep-2.0.dist-info", None)):
        path = os.path.join(site, name)
        os.mkdir(path) if body is None else open(path, "w").write(body)
        assert release.import_check_key(host, ["pkg.m"]) != key, name
        os.rmdir(path) if body is None else os.unlink(path)
    os.makedirs(os.path.join(host.package["root"], "__pycache__"), exist_ok=True)
    open(os.path.join(host.package["root"], "__pycache__", "m.cpython-311.pyc"), "wb").write(b"x")
    assert release.import_check_key(host, ["pkg.m"]) == key
    assert release.import_check_key(host, ["pkg"]) != key  # other modules, another key

    # Back as it was: the record answers again; `recheck` runs the import regardless.
    assert apply_importing(host, "r6", b"V = 1\n", b"V = 0\n")["import_check"] == "cached"
    release.cmd_rollback(host, {"holder": HOLDER, "id": "b3", "to": "pristine"})
    assert apply_importing(host, "r7", b"V = 1\n", b"V = 0\n", recheck=True)["import_check"] == "passed"
    # Failures are never recorded: the two records are the two contents that passed.
    assert len(os.listdir(os.path.join(host.state, hostlib.CACHE_DIR))) == 2


def test_import_check_records_are_pruned_to_the_newest(host, monkeypatch):
    monkeypatch.setattr(release, "IMPORT_RECORDS", 2)
    monkeypatch.setenv("PYTHONPATH", host.package["site"])
    before = b"V = 0\n"
    for n in range(1, 5):
        version = b"V = %d\n" % n
        assert apply_importing(host, f"r{n}", version, before)["import_check"] == "passed"
        before = version
    assert len(os.listdir(os.path.join(host.state, hostlib.CACHE_DIR))) == 2
