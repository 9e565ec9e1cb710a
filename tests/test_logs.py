"""`sglfleet logs`: the host-side reader on temp dirs (rotation, truncation, since/until/tail/grep,
pages, journald from recorded `journalctl -o json` output through a stand-in journalctl), run
through the real call convention on a LocalConnection; then on lab hosts (real sshd): a deployed
stand-in server's log, follow mode across 4 hosts through an sshd restart, bundles, a 1 GB log."""

from __future__ import annotations

import json
import os
import shlex
import sys
import time
from pathlib import Path

import pytest

from orchestrator.errors import ConfigError
from orchestrator.fleet.inventory import Host
from orchestrator.fleet.local import LocalConnection
from orchestrator.remote import logs as remote_logs
from orchestrator.stages import logs as stage

from .private_lab import deploy_profile, lab_fixture

# The deployed servers of these tests stay on a lab of their own (the shared lab's tests expect
# pristine hosts).
lab = lab_fixture("logs", 8)

FIXTURES = Path(__file__).parent / "fixtures" / "logs"
BASE = 1796290200  # 2026-12-03 09:30:00 UTC


def local() -> LocalConnection:
    return LocalConnection(Host(name="local", address="127.0.0.1", python=sys.executable))


def stamp(epoch: float) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(epoch))


def line(epoch: float, text: str) -> str:
    return f"[{stamp(epoch)}] {text}\n"


def query(tmp_path: Path, **kw) -> stage.Query:
    return stage.Query(profile="p", extra={"log_dir": str(tmp_path), "state_dir": str(tmp_path / "state"),
                                           "source": kw.pop("source", "file")}, **kw)


def read_all(tmp_path: Path, cursor=None, **kw) -> tuple[list[str], stage.HostRead]:
    merged, states = stage.read_merged([local()], query(tmp_path, **kw), {"local": cursor})
    texts = [x.text for x in merged]
    return texts, states["local"]


def write(path: Path, text: str, mode: str = "a") -> None:
    with open(path, mode) as fh:
        fh.write(text)


# ---------------------------------------------------------------- files


def test_rotation_between_reads_loses_and_repeats_nothing(tmp_path):
    log = tmp_path / "p.log"
    write(log, "".join(line(BASE + i, f"first {i}") for i in range(5)))
    texts, state = read_all(tmp_path)
    assert texts == [f"[{stamp(BASE + i)}] first {i}" for i in range(5)]
    cursor = state.cursor
    write(log, line(BASE + 5, "before rotation"))
    os.replace(log, str(log) + ".1")  # what the supervisor's RotatingLog does
    write(log, line(BASE + 6, "after rotation"))
    texts, state = read_all(tmp_path, cursor)
    assert texts == [f"[{stamp(BASE + 5)}] before rotation", f"[{stamp(BASE + 6)}] after rotation"]
    assert state.gaps == []
    texts, _ = read_all(tmp_path, state.cursor)
    assert texts == []  # nothing new: nothing twice


def test_a_rotated_away_or_truncated_file_is_reported_as_a_gap(tmp_path):
    log = tmp_path / "p.log"
    write(log, line(BASE, "one"))
    _, state = read_all(tmp_path)
    os.unlink(log)
    write(log, line(BASE + 1, "two"))
    texts, later = read_all(tmp_path, state.cursor)
    assert texts == [f"[{stamp(BASE + 1)}] two"] and "gone" in later.gaps[0]
    write(log, "", "w")
    write(log, line(BASE + 2, "3"))
    texts, again = read_all(tmp_path, later.cursor)
    assert texts == [f"[{stamp(BASE + 2)}] 3"] and "truncated" in again.gaps[0]


def test_a_line_still_being_written_waits_until_whole(tmp_path):
    log = tmp_path / "p.log"
    write(log, line(BASE, "done") + "[half a li")
    texts, state = read_all(tmp_path)
    assert texts == [f"[{stamp(BASE)}] done"]
    write(log, "ne]\n")
    texts, _ = read_all(tmp_path, state.cursor)
    assert texts == ["[half a line]"]


def crashed_log(tmp_path: Path) -> list[str]:
    """Two rotated files and the current one; a traceback without stamps at the end."""
    lines = [line(BASE + i, f"old {i}") for i in range(6)]
    write(tmp_path / "p.log.2", "".join(lines[:3]))
    write(tmp_path / "p.log.1", "".join(lines[3:]))
    current = [line(BASE + 10 + i, f"new {i}") for i in range(4)] + [
        "Scheduler hit an exception: Traceback (most recent call last):\n", '  File "/x.py", line 3, in run\n',
        "RuntimeError: CUDA error: an illegal memory access was encountered\n"]
    write(tmp_path / "p.log", "".join(current))
    for name, mtime in (("p.log.2", BASE + 2), ("p.log.1", BASE + 5), ("p.log", BASE + 14)):
        os.utime(tmp_path / name, (mtime, mtime))
    return [x.rstrip("\n") for x in lines + current]


def test_whole_log_in_order_across_rotations(tmp_path):
    expected = crashed_log(tmp_path)
    texts, state = read_all(tmp_path)
    assert texts == expected and state.complete and state.bytes_read == sum(len(x) + 1 for x in expected)


def test_since_until_exact(tmp_path):
    expected = crashed_log(tmp_path)
    texts, _ = read_all(tmp_path, since=BASE + 4, until=BASE + 11)
    assert texts == [expected[4], expected[5], expected[6], expected[7]]
    texts, _ = read_all(tmp_path, since=BASE + 13)  # the traceback carries its stamped line's time
    assert texts == expected[-4:]


def test_tail_exact_reads_backwards_and_keeps_a_traceback_whole(tmp_path):
    expected = crashed_log(tmp_path)
    for n in (1, 3, 4, 9, 13, 50):
        texts, _ = read_all(tmp_path, tail=n)
        assert texts == expected[-n:], n
    texts, _ = read_all(tmp_path, tail=2, grep="old")
    assert texts == expected[4:6]
    texts, _ = read_all(tmp_path, tail=0)
    assert texts == []


def test_pages_are_bounded_and_add_up_to_the_whole(tmp_path):
    lines = [line(BASE + i // 10, f"request {i} " + "x" * 50) for i in range(2000)]
    write(tmp_path / "p.log", "".join(lines))
    texts, state = read_all(tmp_path, page_bytes=10_000)
    assert texts == [x.rstrip("\n") for x in lines]
    assert state.calls >= len("".join(lines)) // 10_000


def test_grep_is_applied_on_the_host(tmp_path):
    write(tmp_path / "p.log", "".join(line(BASE + i, "Decode batch" if i % 2 else "other") for i in range(10)))
    texts, state = read_all(tmp_path, grep="Decode")
    assert len(texts) == 5 and all("Decode" in t for t in texts)
    assert state.answer_bytes < 1500


def test_no_server_on_the_host_is_one_clear_error(tmp_path):
    merged, states = stage.read_merged([local()], stage.Query(extra={"log_dir": str(tmp_path / "none"),
                                                                     "state_dir": str(tmp_path / "none")}), {})
    assert list(merged) == []
    assert "no sglfleet server on this host" in str(states["local"].error)


def test_a_profile_the_host_does_not_run_is_named_with_the_ones_it_does(tmp_path):
    write(tmp_path / "p.log", line(BASE, "one"))
    extra = {"log_dir": str(tmp_path), "state_dir": str(tmp_path / "state")}
    merged, states = stage.read_merged([local()], stage.Query(profile="typo", extra=extra), {})
    assert list(merged) == []
    assert "no server of profile typo on this host" in str(states["local"].error)
    assert "(this host has: p)" in str(states["local"].error)


def test_supervisor_marker_time_is_read_with_its_offset():
    stamps = remote_logs.Stamps()
    assert stamps.of(b"==== sglfleet supervisor: start abc 2026-12-03T10:30:00+0100: /x\n") == BASE
    assert stamps.of(b"no stamp here\n") == BASE


def test_env_file_secrets_are_redacted():
    text = "HF_TOKEN=hf_abcdef\nexport OPENAI_API_KEY='sk-1'\nSGLANG_HEALTH_CHECK_TIMEOUT=20\n"
    out = remote_logs.redact_env(text)
    assert "hf_abcdef" not in out and "sk-1" not in out
    assert "SGLANG_HEALTH_CHECK_TIMEOUT=20" in out and out.count("redacted") == 2


def test_times_given_as_durations_or_iso():
    assert stage.parse_time("10m", "--since", now=1000.0) == 400.0
    assert stage.parse_time("2h", "--since", now=10000.0) == 2800.0
    assert stage.parse_time("2026-12-03T09:30:00+00:00", "--since") == BASE
    with pytest.raises(ConfigError, match="--since 'yesterday'"):
        stage.parse_time("yesterday", "--since")


def test_kept_cursors_belong_to_the_host_target(tmp_path):
    store = stage.CursorStore(tmp_path, "p")
    a = Host(name="ct129", address="127.0.0.1")
    state = stage.HostRead("ct129", cursor={"kind": "file", "inode": 5, "offset": 10}, complete=True)
    store.save([a], {"ct129": state})
    assert store.cursors([a]) == {"ct129": {"kind": "file", "inode": 5, "offset": 10}}
    moved = Host(name="ct129", address="127.0.0.9")
    assert store.cursors([moved]) == {"ct129": None}


def test_bundle_fetched_in_chunks_is_byte_identical_and_cleaned_up(tmp_path):
    import hashlib
    import tarfile
    import threading

    log = tmp_path / "p.log"
    data = os.urandom(5 * (1 << 20) + 12345)  # 3 chunks of 2 MiB, the last one short
    log.write_bytes(data)
    (tmp_path / "state" / "servers" / "p").mkdir(parents=True)
    (tmp_path / "state" / "servers" / "p" / "sglang.env").write_text("HF_TOKEN=secret\nA=1\n")
    out = tmp_path / "out"
    out.mkdir()
    result = stage.bundle_host(local(), query(tmp_path), out, tmp_path / "runs", threading.Semaphore(1),
                               chunk=2 << 20)
    archive = out / "local.tar.gz"
    assert result["bytes"] == archive.stat().st_size and result["sha256"] == hashlib.sha256(
        archive.read_bytes()).hexdigest()
    with tarfile.open(archive) as tar:
        assert tar.extractfile("logs/p.log").read() == data
        assert tar.extractfile("server/sglang.env").read() == b"HF_TOKEN=<redacted by sglfleet: 6 characters>\nA=1\n"
        manifest = json.loads(tar.extractfile("MANIFEST.json").read())
    assert {i["name"]: i["status"] for i in manifest["items"]}["server/launch.sh"] == "missing"
    assert "smoke/last.json" in result["not_collected"]
    assert not [p for p in Path(remote_logs.BUNDLE_DIR).glob("p-*.tar.gz")]  # deleted on the host after the fetch


# ---------------------------------------------------------------- journald


FAKE_JOURNALCTL = """#!{python}
import json, sys
argv = sys.argv[1:]
open({log!r}, "a").write(json.dumps(argv) + "\\n")
entries = [json.loads(x) for x in open({fixture!r})]
if "--after-cursor" in argv:
    after = argv[argv.index("--after-cursor") + 1]
    entries = entries[[e["__CURSOR"] for e in entries].index(after) + 1:]
if "--since" in argv:
    since = float(argv[argv.index("--since") + 1].lstrip("@"))
    entries = [e for e in entries if int(e["__REALTIME_TIMESTAMP"]) / 1e6 >= since]
if "-n" in argv:
    entries = entries[-int(argv[argv.index("-n") + 1]):]
for e in entries:
    print(json.dumps(e))
"""


@pytest.fixture
def journal(tmp_path, monkeypatch):
    """A stand-in journalctl on PATH that answers from recorded `journalctl -o json` output and
    records its argv."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    calls = tmp_path / "journalctl-calls.jsonl"
    fake = bin_dir / "journalctl"
    fake.write_text(FAKE_JOURNALCTL.format(python=sys.executable, log=str(calls), fixture=str(FIXTURES / "journal.json")))
    fake.chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}:{os.environ['PATH']}")
    return calls


def test_journald_entries_cursor_and_incremental_read(tmp_path, journal):
    texts, state = read_all(tmp_path, source="journald")
    assert texts == ["[2026-12-03 09:30:00] The server is fired up and ready to roll!",
                     "[2026-12-03 09:30:10] Decode batch, #running-req: 4, #token: 1280, token usage: 0.01, accept len: "
                     "3.41, accept rate: 0.81, cuda graph: True, gen throughput (token/s): 312.55, #queue-req: 0",
                     "bad \udcff byte",  # MESSAGE as a byte array (not UTF-8): kept, shown as \xff
                     "Traceback (most recent call last):", '  File "/x.py", line 1, in <module>',
                     "RuntimeError: CUDA error: an illegal memory access was encountered", ""]
    assert state.source == "journald" and state.cursor == {"kind": "journald", "cursor": "s=abc;i=5;b=x;m=5;t=5;x=5"}
    argv = json.loads(journal.read_text().splitlines()[0])
    assert argv == ["--no-pager", "-o", "json", "-u", "sglfleet-p.service"]
    cursor = {"kind": "journald", "cursor": "s=abc;i=3;b=x;m=3;t=3;x=3"}
    texts, _ = read_all(tmp_path, cursor, source="journald")
    assert texts[0] == "Traceback (most recent call last):" and len(texts) == 4
    assert json.loads(journal.read_text().splitlines()[-1])[-2:] == ["--after-cursor", cursor["cursor"]]


def test_journald_since_and_tail(tmp_path, journal):
    texts, _ = read_all(tmp_path, source="journald", since=BASE + 10)
    assert texts[0].startswith("[2026-12-03 09:30:10] Decode batch") and len(texts) == 6
    assert json.loads(journal.read_text().splitlines()[-1])[-2:] == ["--since", f"@{BASE + 10}"]
    texts, _ = read_all(tmp_path, source="journald", tail=1)
    assert texts == [""]
    texts, _ = read_all(tmp_path, source="journald", tail=2, grep="Traceback|RuntimeError")
    assert texts == ["Traceback (most recent call last):",
                     "RuntimeError: CUDA error: an illegal memory access was encountered"]


def test_a_systemd_deployment_is_read_from_journald(tmp_path, journal):
    (tmp_path / "state" / "servers" / "p").mkdir(parents=True)
    (tmp_path / "state" / "servers" / "p" / "deployment.json").write_text(json.dumps({"mode": "systemd"}))
    texts, state = read_all(tmp_path, source=None)
    assert state.source == "journald" and len(texts) == 7


# The live journald test (a systemd lab host, real journald): tests/test_systemd_lab.py.


# ---------------------------------------------------------------- lab hosts (real sshd)

SERVER_LOG = "/var/log/sglfleet/qwen36-ddtree.log"
TRACEBACK_START = "Scheduler hit an exception: Traceback (most recent call last):"
CUDA_ERROR = "RuntimeError: CUDA error: an illegal memory access was encountered"


def lab_conn(inventory, name):
    from orchestrator.fleet.hostkeys import KnownHosts
    from orchestrator.fleet.transport import Connection

    return Connection(inventory.hosts[name], KnownHosts(inventory.known_hosts_path))


def on_host(inventory, name, command, stdin=None, timeout=300):
    with lab_conn(inventory, name) as conn:
        result = conn.run(command, stdin=stdin, timeout=timeout)
    assert result.ok, result.stderr_text
    return result.stdout_text


def cli(lab, *args, runs=None):
    from .conftest import sglfleet

    extra = ["--runs-dir", str(runs)] if runs else []
    return sglfleet(*args, "-i", str(lab.inventory_path), *extra)


# Linux carries a process's peak RSS across fork and exec (ru_maxrss), so a CLI forked straight
# from this test process would report at least the test process's own size (the whole suite's:
# torch and transformers are imported by then). A small wrapper forks the CLI instead and reports
# the CLI's figure from wait4.
MEASURE = ("import os, subprocess, sys, types\n"
           "proc = subprocess.Popen(sys.argv[2:])\n"
           "_, status, usage = os.wait4(proc.pid, 0)\n"
           "open(sys.argv[1], 'w').write('%d %d' % (os.waitstatus_to_exitcode(status), usage.ru_maxrss))\n")


def cli_measured(lab, *args):
    """The CLI in a subprocess; (exit code, stdout, stderr, wall s, its rusage-like figures:
    ru_maxrss is the CLI's own peak RSS in KiB, see MEASURE)."""
    import subprocess
    import tempfile
    import types

    from .conftest import ROOT, fenced_env

    with tempfile.NamedTemporaryFile("r", suffix=".rusage") as figures:
        started = time.monotonic()
        proc = subprocess.run([sys.executable, "-c", MEASURE, figures.name, sys.executable, "-m", "orchestrator.cli",
                               *args, "-i", str(lab.inventory_path)], capture_output=True, env=fenced_env(), cwd=ROOT)
        wall = time.monotonic() - started
        code, maxrss = (int(x) for x in open(figures.name).read().split())
    return code, proc.stdout.decode(), proc.stderr.decode(), wall, types.SimpleNamespace(ru_maxrss=maxrss)


@pytest.fixture(scope="module")
def deployed(lab, tmp_path_factory):
    """ct129 runs the stand-in server through `sglfleet deploy`; then a deploy whose server
    crashes (the stand-in's crash knob) fails and is reverted: the log holds both runs."""
    from orchestrator.fleet.inventory import load_inventory

    tmp = tmp_path_factory.mktemp("deployed")
    runs = tmp / "runs"
    good = deploy_profile(tmp, "good")
    proc = cli(lab, "deploy", "ct129", good, "--json", runs=runs)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    crash = deploy_profile(tmp, "crash", env={"SGLFLEET_SIM_CRASH_AFTER": "1"},
                           replace={'SGLFLEET_SIM_LOAD_DELAY: "0.5"': 'SGLFLEET_SIM_LOAD_DELAY: "30"'})
    proc = cli(lab, "deploy", "ct129", crash, "--json", runs=runs)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    return {"runs": runs, "inventory": load_inventory(lab.inventory_path)}


@pytest.mark.lab
@pytest.mark.slow
def test_a_deployed_servers_log_whole_prefixed_with_the_crash_traceback_intact(lab, deployed):
    on_disk = on_host(deployed["inventory"], "ct129", f"cat {SERVER_LOG}.[0-9] {SERVER_LOG} 2>/dev/null; true")
    expected = on_disk.splitlines()
    proc = cli(lab, "logs", "ct129", "--no-color")
    assert proc.returncode == 0, proc.stderr
    shown = proc.stdout.splitlines()
    assert all(x.startswith("ct129 | ") for x in shown)
    texts = [x[len("ct129 | "):] for x in shown]
    assert len(texts) >= len(expected) > 20
    assert texts[:len(expected)] == expected  # whole, in order (the server kept logging meanwhile)
    # SGLang's `[time] Scheduler hit an exception: Traceback ...`, then the frames, unstamped
    start = next(i for i, x in enumerate(texts) if x.endswith(TRACEBACK_START))
    end = next(i for i, x in enumerate(texts) if i > start and x.startswith(CUDA_ERROR))
    assert end - start >= 3 and all(x.startswith("  ") for x in texts[start + 1:end])
    assert texts[start:end + 1] == expected[start:end + 1]
    assert sum(x.startswith("==== sglfleet supervisor: start ") for x in texts) == 3  # good, crash, revert
    proc = cli(lab, "logs", "ct129", "--json")
    document = json.loads(proc.stdout)
    assert [x["line"] for x in document["lines"]][:len(expected)] == expected
    assert document["hosts"]["ct129"]["source"] == "file" and document["exit_code"] == 0


@pytest.mark.lab
@pytest.mark.slow
def test_bundle_of_a_deployed_host_has_every_item_and_a_true_index(lab, deployed, tmp_path):
    import hashlib
    import tarfile

    proc = cli(lab, "logs", "--bundle", "ct129", "--json", runs=deployed["runs"])
    assert proc.returncode == 0, proc.stdout + proc.stderr
    document = json.loads(proc.stdout)
    run_dir = Path(document["run_dir"])
    index = json.loads((run_dir / "index.json").read_text())
    assert index["hosts"] == document["hosts"]
    entry = index["hosts"]["ct129"]
    archive = run_dir / "ct129.tar.gz"
    assert entry["file"] == str(archive) and entry["bytes"] == archive.stat().st_size
    assert entry["sha256"] == hashlib.sha256(archive.read_bytes()).hexdigest()
    with tarfile.open(archive) as tar:
        members = {m.name: tar.extractfile(m).read() for m in tar.getmembers()}
    manifest = json.loads(members["MANIFEST.json"])
    assert [i["name"] for i in manifest["items"]] == [i["name"] for i in entry["items"]][:len(manifest["items"])]
    required = ["logs/qwen36-ddtree.log", "server/launch.sh", "server/sglang.env", "server/unit.service",
                "server/deployment.json", "releases/current", "smoke/last.json", "system/nvidia-smi.txt",
                "system/pip-freeze.txt", "system/disk.json", "system/meminfo.txt", "system/dmesg-tail.txt"]
    status = {i["name"]: i["status"] for i in entry["items"]}
    for name in required:
        assert name in members and status[name] in ("ok", "error"), name
    assert all(status[n] == "ok" for n in required if n != "system/dmesg-tail.txt")
    assert any(n.startswith("releases/") and n.endswith("/release.json") for n in members)
    for item in entry["items"]:  # the index's sizes are the archive's
        if item["status"] == "ok" and item["name"] in members:
            assert len(members[item["name"]]) == item["bytes"], item["name"]
    assert TRACEBACK_START.encode() in members["logs/qwen36-ddtree.log"]
    record = json.loads(members["server/deployment.json"])
    assert b"sglfleet-sim-server" in members["server/launch.sh"] and record["pid"]
    assert b"hf_do_not_leak_me" not in members["server/sglang.env"] and b"HF_TOKEN=" in members["server/sglang.env"]
    assert json.loads(members["smoke/last.json"])["ok"] is True
    assert b"sglang==" in members["system/pip-freeze.txt"].lower() and b"MemTotal" in members["system/meminfo.txt"]
    assert b"lab simulation" in members["system/nvidia-smi.txt"].lower()
    assert on_host(deployed["inventory"], "ct129", "ls /var/tmp/sglfleet-bundles | wc -l").strip() == "0"


def exact_log(inventory, host, profile="exact"):
    """A log with known stamps on the host: one rotated file and the current one."""
    lines = [line(BASE + i, f"event {i}") for i in range(40)]
    on_host(inventory, host, f"mkdir -p /var/log/sglfleet && cat > /var/log/sglfleet/{profile}.log.1",
            stdin="".join(lines[:25]))
    on_host(inventory, host, f"cat > /var/log/sglfleet/{profile}.log", stdin="".join(lines[25:]))
    return [x.rstrip("\n") for x in lines]


@pytest.mark.lab
@pytest.mark.slow
def test_since_until_tail_exact_and_since_last_moves_only_new_bytes(lab, inventory, tmp_path):
    expected = exact_log(inventory, "ct130")

    def texts(*args):
        proc = cli(lab, "logs", "ct130", "exact", "--json", *args, runs=tmp_path / "runs")
        assert proc.returncode == 0, proc.stderr
        document = json.loads(proc.stdout)
        return [x["line"] for x in document["lines"]], document["hosts"]["ct130"]

    since, until = stamp(BASE + 20).replace(" ", "T"), stamp(BASE + 29).replace(" ", "T")
    assert texts("--since", since, "--until", until)[0] == expected[20:30]  # across the rotation
    assert texts("--tail", "7")[0] == expected[-7:]
    assert texts("--tail", "3", "--grep", r"event 1\d$")[0] == expected[17:20]
    whole, first = texts()
    assert whole == expected and first["bytes_read"] == sum(len(x) + 1 for x in expected)
    added = [line(BASE + 100 + i, f"new {i}") for i in range(3)]
    on_host(inventory, "ct130", "cat >> /var/log/sglfleet/exact.log", stdin="".join(added))
    new, state = texts("--since", "last")
    assert new == [x.rstrip("\n") for x in added]
    assert state["bytes_read"] == sum(len(x) for x in added) and state["answer_bytes"] < 1500
    assert texts("--since", "last")[0] == []
    print(f"\nincremental logs --since last: {state['bytes_read']} log bytes read, {state['answer_bytes']} answer "
          f"bytes (whole log: {first['bytes_read']} / {first['answer_bytes']})")


def session_sshd_pids(lab, name):
    """The per-connection sshd processes of a lab host (its listener already stopped)."""
    wanted = lab.namespaces(name)["pid"]
    pids = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            if os.readlink(f"/proc/{entry}/ns/pid") != wanted:
                continue
            comm = Path(f"/proc/{entry}/comm").read_text().strip()
        except OSError:
            continue
        if comm.startswith("sshd"):
            pids.append(int(entry))
    return pids


@pytest.mark.lab
@pytest.mark.slow
def test_follow_four_hosts_within_two_seconds_through_an_sshd_restart(lab, inventory, tmp_path):
    import signal
    import subprocess
    import threading

    from .conftest import ROOT, fenced_env

    hosts = ["ct131", "ct132", "ct133", "ct134"]
    for host in hosts:
        on_host(inventory, host, "mkdir -p /var/log/sglfleet && cat > /var/log/sglfleet/follow.log",
                stdin=line(time.time(), f"{host} before"))
    proc = subprocess.Popen([sys.executable, "-m", "orchestrator.cli", "logs", ",".join(hosts), "follow", "-f",
                             "--no-color", "-i", str(lab.inventory_path), "--runs-dir", str(tmp_path / "runs")],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=ROOT, text=True,
                            env=fenced_env({"PYTHONFAULTHANDLER": "1"}),  # SIGABRT dumps its threads
                            # Ctrl-C at a terminal: a suite started in the background by a script
                            # (`cmd &`) ignores SIGINT, and the CLI would inherit that and never stop.
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    seen: list[tuple[float, str]] = []
    errors: list[str] = []
    readers = [threading.Thread(target=lambda: [seen.append((time.monotonic(), x.rstrip("\n"))) for x in proc.stdout],
                                daemon=True),
               threading.Thread(target=lambda: [errors.append(x) for x in proc.stderr], daemon=True)]
    for reader in readers:
        reader.start()

    def wait_for(text, timeout):
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for when, shown in seen:
                if shown.endswith(text):
                    return when
            time.sleep(0.02)
        raise AssertionError(f"{text!r} not shown within {timeout}s; shown: {[s for _, s in seen][-10:]}; "
                             f"stderr: {''.join(errors)}")

    conns = {h: lab_conn(inventory, h) for h in hosts}
    try:
        for host in hosts:
            wait_for(f"{host} before", 30)
        for host in hosts:  # a new line on each host shows within 2 s
            written = time.monotonic()
            assert conns[host].run(f"echo '[{stamp(time.time())}] {host} live' >> /var/log/sglfleet/follow.log").ok
            assert wait_for(f"{host} live", 5) - written < 2.0, host
        # ct132 keeps logging while its sshd is stopped and its connections are cut
        writer = ("i=0; while [ $i -lt 30 ]; do echo \"[$(date '+%Y-%m-%d %H:%M:%S')] ct132 tick $i\" "
                  ">> /var/log/sglfleet/follow.log; i=$((i+1)); sleep 0.2; done")
        assert conns["ct132"].run(f"setsid sh -c {shlex.quote(writer)} >/dev/null 2>&1 </dev/null &").ok
        conns["ct132"].close()
        wait_for("ct132 tick 0", 5)
        lab.stop_sshd("ct132")
        for pid in session_sshd_pids(lab, "ct132"):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:  # it ended on its own between the listing and the kill
                pass
        written = time.monotonic()
        assert conns["ct131"].run(f"echo '[{stamp(time.time())}] ct131 during' >> /var/log/sglfleet/follow.log").ok
        assert wait_for("ct131 during", 5) - written < 2.0  # the other hosts are not held up
        time.sleep(2)
        lab.start_sshd("ct132")
        wait_for("ct132 tick 29", 30)
        ticks = [s for _, s in seen if "ct132 tick" in s]
        assert ticks == [f"ct132 | [{x.split('[', 1)[1]}" for x in ticks]  # prefixed
        assert [int(s.rsplit(" ", 1)[1]) for s in ticks] == list(range(30))  # each once, in order
        assert any("ct132: lost" in e for e in errors) and any("ct132: reconnected" in e for e in errors)
        written = time.monotonic()
        assert conns["ct132"].run(f"echo '[{stamp(time.time())}] ct132 after' >> /var/log/sglfleet/follow.log").ok
        assert wait_for("ct132 after", 5) - written < 2.0
    finally:
        interrupted = time.monotonic()
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(20)
        except subprocess.TimeoutExpired:  # hung: its threads' stacks (faulthandler) go in the failure
            proc.send_signal(signal.SIGABRT)
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        exited = time.monotonic() - interrupted
        for reader in readers:  # all of its output, not what the readers had got to
            reader.join(10)
        for conn in conns.values():
            conn.close()
        try:
            lab.start_sshd("ct132")
        except Exception:  # noqa: BLE001 - already running
            pass
    assert proc.returncode == 0, f"exit {proc.returncode} {exited:.1f}s after SIGINT; stderr:\n" + "".join(errors)
    # Ctrl-C ends a follow within seconds (the long-poll reads are cut, not waited out)
    assert exited < 10, f"{exited:.1f}s from SIGINT to exit"


@pytest.mark.lab
@pytest.mark.slow
def test_bundle_of_a_1gb_log_keeps_the_controller_small(lab, inventory, tmp_path):
    import hashlib
    import tarfile

    host = "ct136"
    make = ("import os,time\n"
            "t=time.strftime('%Y-%m-%d %H:%M:%S')\n"
            "os.makedirs('/var/log/sglfleet',exist_ok=True)\n"
            "with open('/var/log/sglfleet/big.log','wb') as f:\n"
            "  n=0\n"
            "  while n < 1<<30:\n"
            "    rows=[('[%s] Decode batch, #running-req: 7, #token: 9216, token usage: 0.02, accept len: 3.41, "
            "accept rate: 0.81, cuda graph: True, gen throughput (token/s): 312.55, #queue-req: 0, rid=%s\\n' "
            "% (t, os.urandom(16).hex())).encode() for _ in range(4096)]\n"
            "    b=b''.join(rows); f.write(b); n+=len(b)\n")
    on_host(inventory, host, f"{inventory.hosts[host].python} -", stdin=make, timeout=600)
    size, digest = on_host(inventory, host, "stat -c %s /var/log/sglfleet/big.log; "
                                            "sha256sum /var/log/sglfleet/big.log | cut -d' ' -f1").split()
    assert int(size) >= 1 << 30
    code, out, err, wall, usage = cli_measured(lab, "logs", "--bundle", host, "big", "--json", "--runs-dir",
                                               str(tmp_path / "runs"))
    assert code == 0, out + err
    rss_mib = usage.ru_maxrss / 1024
    print(f"\nbundle of a {int(size) / 2**30:.2f} GiB log: {wall:.1f}s, controller peak RSS {rss_mib:.0f} MiB")
    assert rss_mib < 200
    archive = Path(json.loads(out)["run_dir"]) / f"{host}.tar.gz"
    with tarfile.open(archive, "r|gz") as tar:  # streamed: the test stays small too
        for member in tar:
            if member.name == "logs/big.log":
                assert member.size == int(size)
                h = hashlib.sha256()
                fh = tar.extractfile(member)
                while chunk := fh.read(1 << 20):
                    h.update(chunk)
                assert h.hexdigest() == digest
                break
        else:
            raise AssertionError("logs/big.log not in the bundle")
    on_host(inventory, host, "rm -f /var/log/sglfleet/big.log")


@pytest.mark.lab
@pytest.mark.slow
def test_metrics_across_hosts_flags_the_low_accept_host_and_writes_csv_and_pngs(lab, inventory, tmp_path):
    import csv

    accept = {"ct133": 6.1, "ct134": 5.9, "ct135": 2.3}
    for host, value in accept.items():
        rows = "".join(line(BASE + 10 * i, f"Decode batch, #running-req: 4, #token: 1280, token usage: 0.01, accept len: "
                                           f"{value + 0.01 * (i % 5):.2f}, accept rate: 0.30, cuda graph: True, gen "
                                           f"throughput (token/s): {90 * value:.2f}, #queue-req: 0")
                       + line(BASE + 10 * i + 1, "INFO: 127.0.0.1 - \"POST /generate HTTP/1.1\" 200 OK")
                       for i in range(25))
        on_host(inventory, host, "mkdir -p /var/log/sglfleet && cat > /var/log/sglfleet/metrics.log", stdin=rows)
    proc = cli(lab, "metrics", "ct133,ct134,ct135", "metrics", "--json", "--csv", str(tmp_path / "m.csv"),
               "--plot", str(tmp_path / "plots"))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    document = json.loads(proc.stdout)
    assert document["summary"]["flagged"] == ["ct135"]
    assert {h: v["lines"] for h, v in document["summary"]["hosts"].items()} == {h: 25 for h in accept}
    assert document["summary"]["hosts"]["ct133"]["accept_len"]["median"] == pytest.approx(6.12)
    with open(tmp_path / "m.csv") as fh:
        assert len(list(csv.DictReader(fh))) == 75 == document["csv"]["rows"]
    for png in ("accept_len.png", "gen_throughput.png"):
        assert (tmp_path / "plots" / png).stat().st_size > 20_000
    proc = cli(lab, "metrics", "ct133,ct134,ct135", "metrics", "--fail-on-outlier")
    assert proc.returncode == 1 and "ct135" in proc.stdout and "LOW" in proc.stdout


@pytest.mark.lab
@pytest.mark.slow
def test_live_metrics_scraped_from_the_running_server(lab, deployed):
    proc = cli(lab, "metrics", "ct129", "--live", "--json")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    value = json.loads(proc.stdout)["hosts"]["ct129"]["value"]
    assert value["url"].endswith(":30000/metrics") and value["figures"]["accept_len"] > 1.0
    logged = json.loads(cli(lab, "metrics", "ct129", "--json").stdout)["summary"]["hosts"]["ct129"]
    assert logged["accept_len"]["median"] == pytest.approx(value["figures"]["accept_len"], abs=0.01)
