"""The call convention's code cache (remote_call.call, hostlib.serve): hosts keep each remote
script's compiled code by the sha256 of its source, a call sends the hash, and the body only
when the host lacks it (one more round trip, nothing run before it). Run through a
LocalConnection: the same shell, stdin and bootstrap a host gets."""

from __future__ import annotations

import io
import os
import stat
import sys
from pathlib import Path

import pytest

from orchestrator.fleet import remote_call
from orchestrator.fleet.inventory import Host
from orchestrator.fleet.local import LocalConnection
from orchestrator.fleet.transport import feed
from orchestrator.remote import hostlib

SCRIPT = ("import os\n"
          "def probe(args, stream):\n"
          "    with open(args['ran'], 'a') as fh:\n"
          "        fh.write('ran\\n')\n"
          "    return {'version': VERSION, 'payload': stream.read().decode()}\n"
          "COMMANDS = {'probe': probe}\n")


class Recording(LocalConnection):
    """A LocalConnection that keeps every round trip's stdin bytes."""

    def __init__(self) -> None:
        super().__init__(Host(name="local", address="127.0.0.1", python=sys.executable))
        self.sent: list[bytes] = []

    def run(self, command, stdin=None, timeout=None):
        buffer = io.BytesIO()
        feed(buffer, stdin)
        self.sent.append(buffer.getvalue())
        return super().run(command, stdin=buffer.getvalue(), timeout=timeout)


@pytest.fixture
def cache(tmp_path, monkeypatch) -> Path:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    monkeypatch.setattr(remote_call, "_SEND_BODIES", set())
    return tmp_path / "xdg" / hostlib.CODE_CACHE_DIR


def next_command() -> None:
    """What a new controller process starts with: no host known to lack code."""
    remote_call._SEND_BODIES.clear()


def write_script(tmp_path: Path, version: str) -> str:
    path = tmp_path / "probe.py"
    path.write_text(f"VERSION = {version!r}\n" + SCRIPT)
    remote_call.script_bytes.cache_clear()  # a controller reads each script once per process
    remote_call.script_digest.cache_clear()
    return str(path)


def probe(conn: Recording, script: str, tmp_path: Path, payload: remote_call.Payload = None) -> dict:
    return remote_call.call(conn, script, "probe", {"ran": str(tmp_path / "ran.log")}, payload=payload)


def test_a_host_is_sent_a_script_once_then_only_its_hash(tmp_path, cache):
    script, conn = write_script(tmp_path, "v1"), Recording()
    source = Path(script).read_bytes()
    assert probe(conn, script, tmp_path) == {"version": "v1", "payload": ""}
    # first contact: the host named what it lacked, then got the body in one more round trip
    assert len(conn.sent) == 2 and source not in conn.sent[0] and source in conn.sent[1]
    next_command()
    assert probe(conn, script, tmp_path) == {"version": "v1", "payload": ""}
    assert len(conn.sent) == 3 and source not in conn.sent[2]
    assert remote_call.script_digest(script).encode() in conn.sent[2]
    assert len(conn.sent[2]) < len(conn.sent[1]) - len(source) + 1


def test_a_call_with_a_payload_sends_its_code_and_never_streams_the_payload_twice(tmp_path, cache):
    script, conn = write_script(tmp_path, "v1"), Recording()
    source = Path(script).read_bytes()
    streamed = []

    def payload(writer) -> None:
        streamed.append(1)
        writer.write(b"tar")

    assert probe(conn, script, tmp_path, payload) == {"version": "v1", "payload": "tar"}
    assert len(conn.sent) == 1 and source in conn.sent[0] and streamed == [1]
    assert probe(conn, script, tmp_path) == {"version": "v1", "payload": ""}  # kept by the host
    assert len(conn.sent) == 2 and source not in conn.sent[1]


def test_a_miss_runs_nothing_before_the_body_arrives(tmp_path, cache):
    script, conn = write_script(tmp_path, "v1"), Recording()
    probe(conn, script, tmp_path)
    assert len(conn.sent) == 2 and (tmp_path / "ran.log").read_text() == "ran\n"  # once, not twice


def test_a_host_new_to_this_version_costs_one_round_trip_per_command_not_per_script(tmp_path, cache):
    first, conn = write_script(tmp_path, "v1"), Recording()
    second = tmp_path / "other.py"
    second.write_text("VERSION = 'other'\n" + SCRIPT)
    probe(conn, first, tmp_path)
    assert remote_call.call(conn, str(second), "probe", {"ran": str(tmp_path / "ran.log")})["version"] == "other"
    assert len(conn.sent) == 3  # the one miss, then each call with its body (kept by the host)
    next_command()
    probe(conn, first, tmp_path)
    remote_call.call(conn, str(second), "probe", {"ran": str(tmp_path / "ran.log")})
    assert len(conn.sent) == 5 and all(Path(p).read_bytes() not in conn.sent[-1] for p in (first, second))


def test_a_changed_script_runs_its_new_code_never_the_cached_one(tmp_path, cache):
    conn = Recording()
    assert probe(conn, write_script(tmp_path, "v1"), tmp_path)["version"] == "v1"
    next_command()
    assert probe(conn, write_script(tmp_path, "v2"), tmp_path)["version"] == "v2"
    assert len(conn.sent) == 4  # v2 is another hash: a miss, then its body
    next_command()
    assert probe(conn, write_script(tmp_path, "v1"), tmp_path)["version"] == "v1"
    assert len(conn.sent) == 5  # v1 is still kept under its own hash


def test_a_damaged_entry_is_detected_dropped_and_sent_again(tmp_path, cache):
    script, conn = write_script(tmp_path, "v1"), Recording()
    probe(conn, script, tmp_path)
    [entry] = [p for p in cache.iterdir() if p.name.startswith("probe-")]
    data = bytearray(entry.read_bytes())
    data[-1] ^= 0xFF  # one flipped bit of code would still unmarshal: the entry's own hash catches it
    entry.write_bytes(bytes(data))
    next_command()
    assert probe(conn, script, tmp_path) == {"version": "v1", "payload": ""}
    assert len(conn.sent) == 4  # the damaged entry counted as missing: its body was sent again
    assert hostlib.cached_code(str(cache), "probe.py", remote_call.script_digest(script)) is not None
    entry.write_bytes(b"not an entry")
    assert hostlib.cached_code(str(cache), "probe.py", remote_call.script_digest(script)) is None
    assert not entry.exists()


def test_the_cache_is_this_users_alone(tmp_path, cache):
    script, conn = write_script(tmp_path, "v1"), Recording()
    probe(conn, script, tmp_path)
    assert stat.S_IMODE(cache.stat().st_mode) == 0o700
    assert {stat.S_IMODE(p.stat().st_mode) for p in cache.iterdir()} == {0o600}
    assert all(p.stat().st_uid == os.geteuid() for p in cache.iterdir())


def test_a_cache_open_to_others_is_not_used_and_costs_one_round_trip_per_command(tmp_path, cache):
    cache.mkdir(parents=True)
    cache.chmod(0o777)  # anyone could plant code here: never read from, never written to
    script, conn = write_script(tmp_path, "v1"), Recording()
    source = Path(script).read_bytes()
    assert probe(conn, script, tmp_path)["version"] == "v1"
    assert probe(conn, script, tmp_path)["version"] == "v1"
    assert len(conn.sent) == 3 and source in conn.sent[2]  # the miss once; then the body every call
    next_command()
    assert probe(conn, script, tmp_path)["version"] == "v1"
    assert len(conn.sent) == 5 and list(cache.iterdir()) == []


def test_entries_in_a_directory_open_to_others_are_never_run(tmp_path, cache):
    script, conn = write_script(tmp_path, "v1"), Recording()
    probe(conn, script, tmp_path)
    planted = compile("VERSION = 'planted'\n" + SCRIPT, "probe.py", "exec")
    hostlib.keep_code(str(cache), "probe.py", remote_call.script_digest(script), planted)
    cache.chmod(0o755)  # readable by others is already not "ours alone"
    next_command()
    assert probe(conn, script, tmp_path)["version"] == "v1"
