"""Releases on lab hosts with the real SGLang: push, rerun, drift, rollback, lock, fingerprint, kills.

Each test owns one lab host, so they do not depend on each other's order.
"""

from __future__ import annotations

import json
import random
import shlex
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from orchestrator.fleet.hostkeys import KnownHosts
from orchestrator.spec.patchset import load_patchset
from orchestrator.spec.profile import load_profile
from orchestrator.stages.release import inspect
from orchestrator.fleet.transport import Connection

from .conftest import ROOT, fenced_env, sglfleet
from .direct import run_python

pytestmark = [pytest.mark.lab, pytest.mark.slow]
PROFILE = "qwen36-ddtree"
STATE = "/var/lib/sglfleet"
M = "/root/models"
DDTREE = [f"--model-path={M}/Qwen3.6-27B", "--speculative-algorithm", "DDTREE",
          f"--speculative-draft-model-path={M}/Qwen3.6-27B-DFlash", "--speculative-dflash-block-size", "16",
          "--speculative-ddtree-budget", "64", "--speculative-ddtree-topk-cap", "64",
          "--speculative-ddtree-shadow-linear"]
HYBRID_FLAGS = ["--mamba-radix-cache-strategy", "extra_buffer", "--mamba-full-memory-ratio", "0.5",
                "--speculative-ddtree-allow-hybrid-unsafe"]


def connect(inventory, name):
    return Connection(inventory.hosts[name], KnownHosts(inventory.known_hosts_path))


def cli(lab, *args, env=None):
    proc = sglfleet(*args, "-i", str(lab.inventory_path), env=env)
    return proc


def push_json(lab, host, *extra, env=None):
    proc = cli(lab, "push", host, PROFILE, "--json", *extra, env=env)
    assert proc.stdout, proc.stderr
    return proc.returncode, json.loads(proc.stdout)["hosts"][host]


class Files:
    """The patchset's target files on one host: hashes in one round trip, old/new per file."""

    def __init__(self, conn):
        artifacts = load_profile(PROFILE).artifacts()
        self.conn = conn
        self.patchset = artifacts.patchset
        self.root = inspect(conn, artifacts)["package"]["root"]
        self.paths = {t: f"{self.root}/{t}" for t in self.patchset.targets()}

    def hashes(self) -> dict[str, str | None]:
        script = "; ".join(f"if [ -e {shlex.quote(p)} ]; then sha256sum {shlex.quote(p)}; "
                           f"else echo absent {shlex.quote(p)}; fi" for p in self.paths.values())
        out = self.conn.run(script).stdout_text.split()
        by_path = {out[i + 1]: (None if out[i] == "absent" else out[i]) for i in range(0, len(out), 2)}
        return {t: by_path[p] for t, p in self.paths.items()}

    def temp_files(self) -> str:
        dirs = " ".join(sorted({shlex.quote(str(Path(p).parent)) for p in self.paths.values()}))
        return self.conn.run(f"ls -a {dirs} | grep -F .sglfleet- || true").stdout_text.strip()


def expected_new(files: Files, pristine: dict[str, str | None]) -> dict[str, str]:
    from orchestrator.spec.patchset import sha256
    bases = {}
    for t in files.patchset.targets():
        if pristine[t] is not None:
            bases[t] = files.conn.run(f"cat {shlex.quote(files.paths[t])}").stdout
    return {t: sha256(b) for t, b in files.patchset.render(bases).items()}


def validate(conn, cases):
    result = run_python(conn, Path(__file__).parent / "remote" / "direct_validate.py", [json.dumps(cases)],
                        timeout=600)
    assert result.ok, result.stderr_text
    return json.loads(result.stdout)


def test_push_makes_ddtree_real_and_rerun_sends_nothing(lab, inventory):
    code, host = push_json(lab, "ct129")
    assert code == 0, host
    value = host["value"]
    assert value["release"] and value["content_bytes"] > 10_000
    assert {f["status"] for f in value["files"]} == {"add", "change"}
    with connect(inventory, "ct129") as conn:
        outcomes = validate(conn, [DDTREE, DDTREE + HYBRID_FLAGS,
                                   DDTREE + HYBRID_FLAGS + ["--speculative-ddtree-topk-cap", "65"],
                                   DDTREE + HYBRID_FLAGS + ["--speculative-ddtree-budget", "0"],
                                   [f"--model-path={M}/Qwen3-8B", "--speculative-algorithm", "DDTREE"]])
    hybrid_rejected, accepted, cap, budget, no_draft = outcomes
    assert hybrid_rejected["exit"] == 1 and hybrid_rejected["type"] == "ValueError"
    assert "cannot branch across tree siblings" in hybrid_rejected["message"]
    assert "--speculative-ddtree-allow-hybrid-unsafe" in hybrid_rejected["message"]
    assert accepted == {"exit": 0, "fields": {
        "speculative_algorithm": "DDTREE", "speculative_num_draft_tokens": 16, "speculative_ddtree_budget": 64,
        "speculative_ddtree_topk_cap": 64, "speculative_ddtree_shadow_linear": True,
        "mamba_radix_cache_strategy": "extra_buffer", "max_running_requests": 48}}
    assert "topk-cap must be in [1" in cap["message"] and "budget must be >= 1" in budget["message"]
    assert "requires setting --speculative-draft-model-path" in no_draft["message"]

    code, again = push_json(lab, "ct129")
    assert code == 0
    assert again["value"]["release"] is None and again["value"]["content_bytes"] == 0
    assert {f["status"] for f in again["value"]["files"]} == {"current"}
    listing = json.loads(cli(lab, "releases", "ct129", "--json").stdout)["hosts"]["ct129"]["value"]
    assert [r["id"] for r in listing["releases"]] == [value["release"]] == [listing["current"]]
    assert value["import_check_result"] == "passed"


def test_an_import_check_passed_with_the_same_files_is_not_rerun_and_a_hand_edit_elsewhere_reruns_it(
        lab, inventory):
    code, first = push_json(lab, "ct131")
    assert code == 0 and first["value"]["import_check_result"] == "passed", first
    assert cli(lab, "rollback", "ct131", "--to", "pristine").returncode == 0
    code, again = push_json(lab, "ct131")  # the same bytes on the same install: answered from the record
    assert code == 0 and again["value"]["import_check_result"] == "cached", again
    assert again["value"]["release"] != first["value"]["release"]
    assert cli(lab, "rollback", "ct131", "--to", "pristine").returncode == 0

    # A file of SGLang no patch touches, broken by hand: the pushed files' bytes passed before,
    # but the host's record no longer matches, so the import runs, fails, and the swap is undone.
    with connect(inventory, "ct131") as conn:
        files = Files(conn)
        pristine = files.hashes()
        init = shlex.quote(f"{files.root}/srt/speculative/__init__.py")
        original = conn.run(f"cat {init}").stdout
        assert conn.run(f"echo \"raise ImportError('hand edit outside the patchset')\" >> {init}").ok
        code, broken = push_json(lab, "ct131")
        assert code != 0 and "hand edit outside the patchset" in broken["error"], broken
        assert files.hashes() == pristine
        assert conn.run(f"cat > {init}", stdin=original).ok
    code, rechecked = push_json(lab, "ct131", "--recheck")  # runs it although the record matches
    assert code == 0 and rechecked["value"]["import_check_result"] == "passed", rechecked
    assert cli(lab, "rollback", "ct131", "--to", "pristine").returncode == 0


def test_drift_is_refused_force_overrides_and_rollback_restores_bytes(lab, inventory):
    with connect(inventory, "ct130") as conn:
        files = Files(conn)
        pristine = files.hashes()
        new = expected_new(files, pristine)
        assert push_json(lab, "ct130")[0] == 0
        assert files.hashes() == new
        edited = files.paths["srt/speculative/spec_info.py"]
        conn.run(f"echo '# a hand edit' >> {shlex.quote(edited)}")
        drifted = files.hashes()["srt/speculative/spec_info.py"]

        plan = json.loads(cli(lab, "plan", "ct130", PROFILE, "--json").stdout)["hosts"]["ct130"]
        assert not plan["ok"] and "drifted" in plan["error"] and "spec_info.py" in plan["error"]
        code, refused = push_json(lab, "ct130")
        assert code == 1 and "drifted" in refused["error"]
        assert files.hashes()["srt/speculative/spec_info.py"] == drifted  # untouched

        code, forced = push_json(lab, "ct130", "--force")
        assert code == 0, forced
        assert [f["key"] for f in forced["value"]["files"] if f["status"] == "forced"] == \
            ["pkg/srt/speculative/spec_info.py"]
        assert files.hashes() == new

        # Undo the forced release: the hand-edited bytes come back. The first release no longer
        # owns that file, so going on to pristine needs --force.
        assert cli(lab, "rollback", "ct130").returncode == 0
        assert files.hashes()["srt/speculative/spec_info.py"] == drifted
        proc = cli(lab, "rollback", "ct130", "--to", "pristine")
        assert proc.returncode == 1 and "changed since release" in proc.stdout
        assert cli(lab, "rollback", "ct130", "--to", "pristine", "--force").returncode == 0
        assert files.hashes() == pristine
        assert files.temp_files() == ""
        # After that history (a forced release over a hand edit, both rolled back), a push still
        # renders the anchored edits on the pristine bytes, not on the hand-edited backup.
        assert push_json(lab, "ct130")[0] == 0
        assert files.hashes() == new
        assert cli(lab, "rollback", "ct130").returncode == 0


def test_two_concurrent_pushes_one_is_refused_by_the_lock(lab, inventory):
    # The first holds the lock through a paced transfer and swap (~12 s): long enough for the
    # second's start and inspect even on a loaded machine, whether or not its import check is
    # answered from the host's record (which took ~6 s more when it always imported).
    started = subprocess.Popen([sys.executable, "-m", "orchestrator.cli", "push", "ct131", PROFILE, "--json",
                                "--bwlimit", "20", "-i", str(lab.inventory_path)], cwd=ROOT,
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                               env=fenced_env({"SGLFLEET_SWAP_PACE_S": "2"}))
    with connect(inventory, "ct131") as conn:
        deadline = time.monotonic() + 30
        while conn.run(f"test -s {STATE}/lock").exit_code != 0:  # the holder writes itself into the lock
            assert time.monotonic() < deadline and started.poll() is None
            time.sleep(0.05)
        code, second = push_json(lab, "ct131")
        first_out, _ = started.communicate(timeout=120)
        first = json.loads(first_out)["hosts"]["ct131"]
        assert started.returncode == 0 and first["ok"] and first["value"]["release"]
        assert code == 1 and "locked by another sglfleet run" in second["error"]
        assert "sglfleet push ct131 qwen36-ddtree" in second["error"] and "remote pid" in second["error"]
        assert cli(lab, "rollback", "ct131", "--to", "pristine").returncode == 0


def test_extension_installed_only_where_the_fingerprint_matches(lab, inventory, tmp_path):
    facts = inspect(connect(inventory, "ct131"), load_profile(PROFILE).artifacts())
    fingerprint = {"python_tag": facts["python"]["tag"], "torch_version": facts["torch"]["version"].split("+")[0],
                   "cuda_version": facts["torch"]["cuda"], "arch_list": ["sm_90"]}
    for name, fp in {"match": fingerprint, "other": {**fingerprint, "torch_version": "2.13.0", "cuda_version": None,
                                                      "arch_list": []}}.items():
        art = tmp_path / name
        art.mkdir()
        (art / "sglfleet_lab_ext.py").write_text(f"BUILD = {name!r}\n")
        (art / "metadata.json").write_text(json.dumps({"name": f"lab-ext-{name}", "module": "sglfleet_lab_ext.py",
                                                       "fingerprint": fp}))
        (tmp_path / f"{name}.yaml").write_text(f"name: {name}\nartifacts:\n  extension:\n    path: {name}\n")
    proc = cli(lab, "push", "ct131", str(tmp_path / "other.yaml"), "--json")
    other = json.loads(proc.stdout)["hosts"]["ct131"]["value"]
    assert proc.returncode == 0 and other["release"] is None and other["files"] == []
    assert any("lab-ext-other skipped: host has torch 2.14.1 (built for 2.13.0)" in n for n in other["notes"])
    proc = cli(lab, "push", "ct131", str(tmp_path / "match.yaml"), "--json")
    matched = json.loads(proc.stdout)["hosts"]["ct131"]["value"]
    assert proc.returncode == 0 and [f["key"] for f in matched["files"]] == ["purelib/sglfleet_lab_ext.py"]
    assert "torch" in matched["import_check"] and "sglfleet_lab_ext" in matched["import_check"]
    with connect(inventory, "ct131") as conn:
        assert conn.run(f"cd / && {facts['python']['executable']} -c 'import sglfleet_lab_ext as m; "
                        "assert m.BUILD == \"match\"'").ok
    assert cli(lab, "rollback", "ct131").returncode == 0


# ---------------------------------------------------------------- kill trials

TRIALS = 20


def _kill_trials(lab, inventory, host: str, phase: str, seed: int, report: dict) -> None:
    """Kill a push `TRIALS` times in `phase` ("transfer" or "swap"), checking the host each time."""
    rng = random.Random(seed)
    with connect(inventory, host) as conn:
        files = Files(conn)
        pristine = files.hashes()
        new = expected_new(files, pristine)
        imports: dict[tuple, bool] = {}
        for trial in range(TRIALS):
            env = {"SGLFLEET_SWAP_PACE_S": "0.25"} if phase == "swap" else None
            extra = ["--bwlimit", "24"] if phase == "transfer" else []
            proc = subprocess.Popen([sys.executable, "-m", "orchestrator.cli", "push", host, PROFILE, "--json", *extra,
                                     "-i", str(lab.inventory_path)], cwd=ROOT, stdout=subprocess.DEVNULL,
                                    stderr=subprocess.DEVNULL, env=fenced_env(env))
            # The transfer has begun when a new release dir exists; the swap when the journal does.
            count = f"ls -d {STATE}/releases/*/ 2>/dev/null | wc -l"
            before = int(conn.run(count).stdout_text.strip())
            probe = f"test $({count}) -gt {before}" if phase == "transfer" else f"test -e {STATE}/journal.json"
            deadline = time.monotonic() + 60
            while conn.run(probe).exit_code != 0:
                assert proc.poll() is None and time.monotonic() < deadline, f"{phase} trial {trial}: never started"
                time.sleep(0.02)
            time.sleep(rng.uniform(0.0, 1.2))
            hard = phase == "swap" and trial % 2 == 0  # also SIGKILL the remote helper, mid-swap
            if hard:
                conn.run(f"kill -9 $(python3 -c 'import json;print(json.load(open(\"{STATE}/lock\"))[\"pid\"])')")
            proc.send_signal(signal.SIGKILL)
            proc.wait()
            # Wait for the remote side to finish or die (it holds the lock while it works).
            while conn.run(f"flock -n {STATE}/lock true").exit_code != 0:
                time.sleep(0.1)
            now = files.hashes()
            state = tuple(("new" if now[t] == new[t] else "old" if now[t] == pristine[t] else "MIXED")
                          for t in files.patchset.targets())
            assert "MIXED" not in state, (phase, trial, now)
            report.setdefault("states", []).append(state)
            if state not in imports:  # importing depends only on which files are new
                check = conn.run(f"cd / && {conn.host.python} -c 'import sglang.srt.speculative.spec_info'",
                                 timeout=300)
                imports[state] = check.ok
                assert check.ok, (phase, trial, state, check.stdout_text[-3000:])
            if phase == "transfer":
                assert set(state) == {"old"}, (trial, state)  # nothing changes before the swap
            code, after = push_json(lab, host)
            assert code == 0, (phase, trial, after)
            assert files.hashes() == new and files.temp_files() == ""
            assert cli(lab, "rollback", host, "--to", "pristine").returncode == 0
            assert files.hashes() == pristine
        report["imports"] = len(imports)


def test_kill_mid_transfer_and_mid_swap_20_trials_each(lab, inventory):
    reports: dict[str, dict] = {"transfer": {}, "swap": {}}
    errors: list[BaseException] = []

    def run(host, phase, seed):
        try:
            _kill_trials(lab, inventory, host, phase, seed, reports[phase])
        except BaseException as exc:  # noqa: BLE001 - re-raised below in the test thread
            errors.append(exc)

    threads = [threading.Thread(target=run, args=("ct132", "transfer", 1)),
               threading.Thread(target=run, args=("ct130", "swap", 2))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    assert len(reports["transfer"]["states"]) == len(reports["swap"]["states"]) == TRIALS
    # The swap kills must really land mid-swap: some trials leave a mix of old and new files.
    assert any(len(set(s)) == 2 for s in reports["swap"]["states"]), reports["swap"]["states"]


def test_patchset_init_from_hand_edited_files_then_push(lab, inventory, tmp_path):
    edited = tmp_path / "seed-edits"
    edited.mkdir()
    with connect(inventory, "ct133") as conn:
        root = inspect(conn, load_profile(PROFILE).artifacts())["package"]["root"]
        original = conn.run(f"cat {root}/srt/speculative/spec_info.py").stdout
        (edited / "spec_info.py").write_bytes(original + b"# seed edit\n")  # flat, found by name
        (edited / "ddtree_seed.py").write_text("SEED = 1\n")                # new: needs --new-under
        out = tmp_path / "patchset"
        proc = cli(lab, "patchset", "init", "--from", str(edited), "--against", "ct133", "--out", str(out))
        assert proc.returncode == 2 and "ddtree_seed.py is not in sglang on ct133" in " ".join(proc.stderr.split())
        assert not out.exists()  # refused before writing anything
        proc = cli(lab, "patchset", "init", "--from", str(edited), "--against", "ct133", "--out", str(out),
                   "--new-under", "srt/speculative")
        assert proc.returncode == 0, proc.stderr
        patchset = load_patchset(out)
        from orchestrator.spec.patchset import sha256
        assert {f.path: f.replaces for f in patchset.manifest.files} == {
            "srt/speculative/spec_info.py": sha256(original), "srt/speculative/ddtree_seed.py": "new"}
        assert patchset.manifest.versions == "==0.5.23"
        (tmp_path / "seed.yaml").write_text(f"name: seed\nartifacts:\n  patchset: {out}\n")
        proc = cli(lab, "push", "ct133", str(tmp_path / "seed.yaml"))
        assert proc.returncode == 0, proc.stdout + proc.stderr
        assert conn.run(f"cat {root}/srt/speculative/spec_info.py").stdout.endswith(b"# seed edit\n")
        assert cli(lab, "rollback", "ct133").returncode == 0
        assert conn.run(f"cat {root}/srt/speculative/spec_info.py").stdout == original

        # A rollback killed after committing rollback.json but before updating the release
        # records: files restored, journal still there, the record still "active". Rebuild
        # exactly that state; the next run's recovery must finish the records, not roll back again.
        listing = json.loads(cli(lab, "releases", "ct133", "--json").stdout)["hosts"]["ct133"]["value"]
        (release,) = listing["releases"]
        assert release["status"] == "rolled_back" and listing["current"] is None
        rb_id = release["rolled_back_by"]
        rewind = (
            "import json, sys\n"
            "state, rel, rb = sys.argv[1:]\n"
            "path = f'{state}/releases/{rel}/release.json'\n"
            "record = json.load(open(path))\n"
            "for key in ('rolled_back_by', 'rolled_back_at'): record.pop(key)\n"
            "record['status'] = 'active'\n"
            "json.dump(record, open(path, 'w'))\n"
            "open(f'{state}/current', 'w').write(rel + '\\n')\n"
            "json.dump({'txid': rb, 'dir': f'{state}/rollbacks/{rb}', 'ops': []}, open(f'{state}/journal.json', 'w'))\n")
        assert conn.run(f"python3 -c {shlex.quote(rewind)} {STATE} {release['id']} {rb_id}").ok
        proc = cli(lab, "rollback", "ct133")
        assert proc.returncode == 1 and "nothing to roll back" in proc.stdout, proc.stdout + proc.stderr
        listing = json.loads(cli(lab, "releases", "ct133", "--json").stdout)["hosts"]["ct133"]["value"]
        assert [(r["status"], r["rolled_back_by"]) for r in listing["releases"]] == [("rolled_back", rb_id)]
        assert listing["current"] is None and listing["interrupted"] is None
        assert conn.run(f"cat {root}/srt/speculative/spec_info.py").stdout == original


# ---------------------------------------------------------------- the host side of push, observed on the host


def host_script(conn, name: str, *args: str, timeout: float = 300):
    """tests/remote/`name` run by the host's python over stdin (no sglfleet code on the host side)."""
    return run_python(conn, Path(__file__).parent / "remote" / name, list(args), timeout=timeout)


class Background:
    """A host script running on its own connection while the test drives sglfleet."""

    def __init__(self, inventory, host: str, name: str, *args: str):
        self.result = None
        self.error: BaseException | None = None

        def run():
            try:
                with connect(inventory, host) as conn:
                    self.result = host_script(conn, name, *args)
            except BaseException as exc:  # noqa: BLE001 - re-raised by join()
                self.error = exc

        self.thread = threading.Thread(target=run, daemon=True)
        self.thread.start()

    def wait_for(self, conn, path: str, timeout: float = 60) -> None:
        deadline = time.monotonic() + timeout
        while conn.run(f"test -e {shlex.quote(path)}").exit_code != 0:
            assert self.thread.is_alive() and time.monotonic() < deadline, (self.error, self.result)
            time.sleep(0.05)

    def join(self, timeout: float = 300) -> dict:
        self.thread.join(timeout)
        if self.error is not None:
            raise self.error
        assert self.result is not None and self.result.ok, self.result and (self.result.stdout_text +
                                                                             self.result.stderr_text)
        return json.loads(self.result.stdout)


def from_pristine(lab, host: str) -> None:
    """Roll back whatever an earlier test (of any file: deploy pushes too) left active on `host`,
    so the test starts from the pristine package whatever ran before it."""
    proc = cli(lab, "rollback", host, "--to", "pristine", "--force", "--json")
    assert proc.returncode == 0 or "nothing to roll back" in proc.stdout, proc.stdout + proc.stderr


def release_dirs(conn) -> list[str]:
    return conn.run(f"ls {STATE}/releases 2>/dev/null || true").stdout_text.split()


def test_staged_file_changed_in_transit_is_refused_before_any_swap(lab, inventory):
    """apply hashes every staged file against the sha256 the controller sent: a staged file whose
    bytes changed after the transfer wrote them (here: appended to on the host, mid-transfer)
    stops the push before the first swap, and the release's staging is removed."""
    from_pristine(lab, "ct134")
    with connect(inventory, "ct134") as conn:
        files = Files(conn)
        pristine = files.hashes()
        new = expected_new(files, pristine)
        releases_before = release_dirs(conn)
        ready = "/tmp/test-push-corrupt.ready"
        conn.run(f"rm -f {ready}")
        flipper = Background(inventory, "ct134", "corrupt_staging.py", STATE, ready)
        flipper.wait_for(conn, ready)
        code, host = push_json(lab, "ct134", "--bwlimit", "16")
        corrupted = flipper.join()["corrupted"]
        assert code == 1, host
        assert f"staged {corrupted} does not match its sha256; nothing was changed" in host["error"], host
        assert files.hashes() == pristine and files.temp_files() == ""
        assert release_dirs(conn) == releases_before  # the staging went with the refused release
        assert conn.run(f"test -e {STATE}/journal.json").exit_code == 1
        # The same push without interference goes through: it was the flipped byte that stopped it.
        code, host = push_json(lab, "ct134")
        assert code == 0, host
        assert files.hashes() == new
        assert cli(lab, "rollback", "ct134", "--to", "pristine").returncode == 0
        assert files.hashes() == pristine


def test_swap_renames_a_new_inode_in_and_a_reader_never_sees_a_partial_file(lab, inventory):
    """A reader on the host during a paced push, then a rollback: every read by name gives the
    old or the new bytes, never anything else; each changed name gets a new inode (temp file +
    rename), and a descriptor opened before the swap still reads the old bytes whole."""
    env = {"SGLFLEET_SWAP_PACE_S": "0.2"}
    from_pristine(lab, "ct135")
    with connect(inventory, "ct135") as conn:
        files = Files(conn)
        pristine = files.hashes()
        new = expected_new(files, pristine)
        paths = list(files.paths.values())
        by_target = {t: files.paths[t] for t in files.patchset.targets()}
        for step, before, after in (("push", pristine, new), ("rollback", new, pristine)):
            ready, done = f"/tmp/test-push-{step}.ready", f"/tmp/test-push-{step}.done"
            conn.run(f"rm -f {ready} {done}")
            reader = Background(inventory, "ct135", "hold_open.py", ready, done, *paths)
            reader.wait_for(conn, ready)
            if step == "push":
                code, host = push_json(lab, "ct135", env=env)
                assert code == 0, host
            else:
                proc = cli(lab, "rollback", "ct135", "--to", "pristine", env=env)
                assert proc.returncode == 0, proc.stdout + proc.stderr
            conn.run(f"touch {done}")
            seen = reader.join()
            assert files.hashes() == after, step
            for target, path in by_target.items():
                entry = seen[path]
                assert entry["reads"] > 20, (step, entry)  # it really read throughout
                assert set(entry["seen"]) <= {before[target], after[target]}, (step, target, entry)
                if before[target] is not None and after[target] is not None and before[target] != after[target]:
                    assert entry["held_sha256"] == before[target], (step, target)
                    assert entry["held_reads_now"] == before[target], (step, target, "old descriptor changed")
                    assert entry["inode"] != entry["held_inode"], (step, target, "written in place")
        assert files.temp_files() == ""


CHAIN_FILE = "srt/speculative/spec_info.py"   # exists in the pristine package: an anchored edit
CHAIN_NEW = "srt/speculative/sglfleet_chain.py"  # absent in the pristine package: a whole new file


def chain_profiles(tmp_path, original: bytes, steps: int = 3) -> list[str]:
    """Profiles v1..vN, each a patchset that edits CHAIN_FILE and adds CHAIN_NEW with its own bytes."""
    from orchestrator.spec.patchset import sha256
    text = original.decode()
    anchor = next(line for line in text.splitlines()
                  if line.startswith(("import ", "from ", "class ")) and text.count(line) == 1)
    out = []
    for n in range(1, steps + 1):
        directory = tmp_path / f"chain-v{n}"
        (directory / "files").mkdir(parents=True)
        (directory / "files" / "sglfleet_chain.py").write_text(f"STEP = {n}\n")
        (directory / "patchset.yaml").write_text(
            f"name: chain-v{n}\npackage: sglang\nversions: \"==0.5.23\"\nfiles:\n"
            f"  - path: {CHAIN_NEW}\n    source: files/sglfleet_chain.py\n    replaces: new\n"
            f"edits:\n  - path: {CHAIN_FILE}\n    pristine_sha256: {sha256(original)}\n"
            f"    anchor: {json.dumps(anchor)}\n    where: before\n"
            f"    insert: {json.dumps(f'# sglfleet chain v{n}')}\n")
        profile = tmp_path / f"chain-v{n}.yaml"
        profile.write_text(f"name: chain-v{n}\nartifacts:\n  patchset: {directory}\n")
        out.append(str(profile))
    return out


def test_rollback_over_several_releases_restores_each_files_oldest_bytes(lab, inventory, tmp_path):
    """Three releases change the same two files. Rolling back all of them at once gives the
    pristine bytes (and no file where there was none); rolling back to the first gives the first
    release's bytes: per file, the backup of the OLDEST release undone wins, not the newest's."""
    host = "ct134"
    from_pristine(lab, host)
    with connect(inventory, host) as conn:
        root = inspect(conn, load_profile(PROFILE).artifacts())["package"]["root"]
        target, added_path = f"{root}/{CHAIN_FILE}", f"{root}/{CHAIN_NEW}"
        original = conn.run(f"cat {target}").stdout
        assert conn.run(f"test -e {added_path}").exit_code == 1
        profiles = chain_profiles(tmp_path, original)

        def state() -> tuple[bytes, bytes | None]:
            exists = conn.run(f"test -e {added_path}").exit_code == 0
            return conn.run(f"cat {target}").stdout, conn.run(f"cat {added_path}").stdout if exists else None

        def push_chain() -> list[tuple[str, tuple[bytes, bytes | None]]]:
            """(release id, the two files' bytes on the host right after it) per push."""
            pushed = []
            for n, profile in enumerate(profiles, 1):
                proc = cli(lab, "push", host, profile, "--json")
                value = json.loads(proc.stdout)["hosts"][host]["value"] if proc.stdout else None
                assert proc.returncode == 0 and value and value["release"], (n, proc.stdout + proc.stderr)
                now = state()
                assert f"# sglfleet chain v{n}\n".encode() in now[0] and now[1] == f"STEP = {n}\n".encode(), n
                pushed.append((value["release"], now))
            assert len({now for _, now in pushed}) == len(profiles)  # each release changed both files
            return pushed

        push_chain()
        proc = cli(lab, "rollback", host, "--to", "pristine", "--json")
        assert proc.returncode == 0, proc.stdout + proc.stderr
        assert len(json.loads(proc.stdout)["hosts"][host]["value"]["rolled_back"]) == 3
        assert state() == (original, None)

        (first, after_first), _, _ = push_chain()
        proc = cli(lab, "rollback", host, "--to", first, "--json")
        assert proc.returncode == 0, proc.stdout + proc.stderr
        assert len(json.loads(proc.stdout)["hosts"][host]["value"]["rolled_back"]) == 2
        assert state() == after_first
        listing = json.loads(cli(lab, "releases", host, "--json").stdout)["hosts"][host]["value"]
        assert listing["current"] == first
        assert cli(lab, "rollback", host).returncode == 0
        assert state() == (original, None)
