"""remote/server.py on this machine, in temp dirs (no lab): the supervisor's log rotation and
drain/SIGKILL, port holders, the deploy lease, and the controller's restart decision."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time

import pytest

from orchestrator.errors import RemoteError
from orchestrator.fleet.remote_call import script_bytes
from orchestrator.remote import hostlib, server
from orchestrator.stages.deploy import clashes, restart_reasons

HOLDER = {"user": "me", "controller": "here", "command": "sglfleet deploy x p"}


def base_args(tmp_path, deploy_id="d1", **extra):
    return {"profile": "p", "state_dir": str(tmp_path / "state"), "log_dir": str(tmp_path / "log"),
            "deploy_id": deploy_id, "holder": HOLDER, "stop_grace": 2,
            "programs": {"server.py": script_bytes("server.py").decode(),
                         "sglfleet_hostlib.py": script_bytes("hostlib.py").decode()}, **extra}


def lease(args, deploy_id, ttl=100):
    server.take_lease(dict(args, lease={"id": deploy_id, "holder": dict(HOLDER, command=f"deploy {deploy_id}"),
                                        "ttl": ttl}))


def launch(tmp_path, script, deploy_id="d1", **extra):
    args = base_args(tmp_path, deploy_id, **extra)
    lease(args, deploy_id)
    files = {"launch_script": "#!/bin/sh\n" + script, "env": "", "unit": ""}
    launched = server.cmd_launch(dict(args, files=files))
    server.cmd_finish(dict(args, record=None))  # drops the lease
    return args, launched


def wait(predicate, timeout=10.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.05)
    return predicate()


def test_supervisor_rotates_its_log_by_size_and_keeps_k(tmp_path):
    # ~40 KB of output through a 4 KB log keeping 2 rotations: <log>, <log>.1, <log>.2 only.
    args, launched = launch(tmp_path, "i=0; while [ $i -lt 400 ]; do echo line-$i-0123456789012345678901234567890123456789"
                                      "012345678901234567890123456789; i=$((i+1)); done\n",
                            log_max_bytes=4096, log_keep=2)
    paths = server.paths_for(args)
    assert wait(lambda: (server.read_json(paths["status"]) or {}).get("exit_code") == 0)
    logs = sorted(p.name for p in (tmp_path / "log").iterdir())
    assert logs == ["p.log", "p.log.1", "p.log.2"]
    for name in logs:
        assert os.path.getsize(tmp_path / "log" / name) <= 4096 + 200
    text = "".join((tmp_path / "log" / n).read_text() for n in ("p.log.2", "p.log.1", "p.log"))
    assert "line-399-" in text and "exited with code 0" in text
    numbers = [int(line.split("-")[1]) for line in text.splitlines() if line.startswith("line-")]
    assert numbers == sorted(numbers) and numbers[-1] == 399  # oldest first, nothing reordered


def test_stop_drains_then_sigkills_after_the_grace(tmp_path):
    # A server that ignores SIGTERM (a drain stuck on a request): SIGKILL after the grace.
    args, launched = launch(tmp_path, "trap 'echo Gracefully exiting... Remaining number of requests 1' TERM\n"
                                      "while true; do sleep 0.1; done\n")
    pid = launched["pid"]
    assert server.alive(pid)
    started = time.monotonic()
    answer = server.cmd_stop(dict(args, stop_grace=1))["stopped"]["p"]
    assert answer["was_running"] and answer["pid"] == pid and answer["killed"]
    assert answer["exit_code"] == 137 and 1 <= time.monotonic() - started < 10
    assert "Remaining number of requests 1" in answer["drain"]
    assert not server.alive(pid)


def test_the_supervisor_and_server_outlive_the_launching_process(tmp_path):
    # launch from a child process that then exits: the server keeps running (own session).
    code = ("import sys, json; sys.path.insert(0, %r); from orchestrator.remote import server; "
            "args = json.loads(sys.argv[1]); server.take_lease(dict(args, lease={'id': 'd1', 'holder': {}, 'ttl': 99}));"
            "print(json.dumps(server.cmd_launch(args))); server.cmd_finish(dict(args, record=None))" % os.getcwd())
    args = dict(base_args(tmp_path), files={"launch_script": "#!/bin/sh\nexec sleep 300\n", "env": "", "unit": ""})
    proc = subprocess.run([sys.executable, "-c", code, json.dumps(args)], capture_output=True, text=True, timeout=60)
    pid = json.loads(proc.stdout)["pid"]
    session = server.session_of(pid)
    # its own session, led by the supervisor (getsid(0) is 0 when our leader is outside the pid namespace)
    assert session and session != os.getsid(0) and server.session_of(session) == session
    assert server.alive(pid)
    server.cmd_stop(dict(base_args(tmp_path), stop_grace=1))
    assert not server.alive(pid)


def test_port_holders_name_the_foreign_process_and_skip_ours(tmp_path):
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen()
    port = sock.getsockname()[1]
    try:
        holders = server.port_holders("127.0.0.1", port)
        assert [(h["address"], h["pid"]) for h in holders] == [("127.0.0.1", os.getpid())]
        assert server.port_holders("127.0.0.2", port) == []  # another address: no clash
        assert server.port_holders(None, port)  # any address
        assert server.foreign_holders(holders, {"alive": True, "pid": os.getpid()}) == []
        assert server.foreign_holders(holders, {"alive": False, "pid": None}) == holders
        assert "pid %d" % os.getpid() in server.describe_holder(holders[0])
    finally:
        sock.close()
    assert clashes("0.0.0.0", "127.0.1.1") and clashes("127.0.1.1", "0.0.0.0") and not clashes("127.0.1.2", "127.0.1.1")


def test_a_second_deploy_is_refused_naming_the_first_until_the_lease_ends(tmp_path):
    args = base_args(tmp_path)
    lease(args, "first")
    with pytest.raises(hostlib.Failure) as info:
        lease(args, "second")
    assert "being deployed by another sglfleet run" in str(info.value) and "deploy first" in str(info.value)
    assert info.value.code == hostlib.EXIT_LOCKED
    server.cmd_unlease(dict(args, deploy_id="first"))
    lease(args, "second")  # free now
    # An expired lease is taken over; so is one the caller names as abandoned.
    path = server.lease_path(args)
    held = json.load(open(path))
    held["ttl"] = 0
    json.dump(held, open(path, "w"))
    lease(args, "third")
    with pytest.raises(hostlib.Failure):
        server.cmd_finish(dict(args, deploy_id="second", record=None))  # no longer holds it


def test_restart_reasons():
    running = {"alive": True, "record": {"release": "r1", "argv_hash": "a", "env_hash": "e", "files_hash": "f",
                                         "mode": "supervisor"}}
    same = {"release": "r1", "argv_hash": "a", "env_hash": "e", "files_hash": "f"}
    assert restart_reasons(running, same, 0, "supervisor") == []
    assert restart_reasons(running, dict(same, argv_hash="b"), 0, "supervisor") == ["launch command changed"]
    assert restart_reasons(running, same, 2, "supervisor") == ["release: 2 file(s) change"]
    assert restart_reasons(dict(running, alive=False, exit_code=1), same, 0, "supervisor") == \
        ["server not running (exited with code 1)"]
    assert restart_reasons({"alive": False, "record": None}, same, 0, "supervisor") == \
        ["nothing deployed by sglfleet yet"]


def test_lease_refusal_reaches_the_controller_as_a_locked_remote_error(tmp_path):
    from orchestrator.fleet.inventory import Host
    from orchestrator.fleet.local import LocalConnection
    from orchestrator.fleet.remote_call import call

    args = base_args(tmp_path)
    lease(args, "first")
    conn = LocalConnection(Host(name="local", address="127.0.0.1", python=sys.executable))
    with pytest.raises(RemoteError) as info:
        call(conn, "server.py", "plan", dict(args, lease={"id": "second", "holder": HOLDER, "ttl": 9}))
    assert info.value.exit_status == hostlib.EXIT_LOCKED and info.value.detail["lease"]["id"] == "first"


def test_plan_asks_about_the_model_draft_and_port_the_host_runs(monkeypatch, tmp_path):
    """deploy's plan round trip asks for the facts of the model and draft, and the holders of the
    port, of the profile as this host runs it (its sglfleet_profile_overrides applied, as render
    applies them). Before, it asked about the profile file's: an override moving the model or the
    port was rendered, but its facts and port holders were the file's."""
    from types import SimpleNamespace

    from orchestrator.fleet.inventory import Host
    from orchestrator.spec.profile import load_profile
    from orchestrator.stages import deploy, sglang_options

    # a controller cache of its own, knowing one fingerprint: the facts ask says so (known_options)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    monkeypatch.setattr(sglang_options, "_known", None)
    known = "0123456789abcdef01234567"
    sglang_options.store(known, {"options": ["--port"], "undocumented": []})
    path = tmp_path / "p.yaml"
    path.write_text("name: p\nmodel: {path: /m}\nspeculative: {algorithm: DFLASH, draft_model: /d}\n"
                    "server: {port: 30000}\n")
    asked = []
    monkeypatch.setattr(deploy.remote_call, "call", lambda conn, script, command, args, **kw: asked.append(args) or {})
    overrides = {"p": {"model": {"path": "/m2"}, "speculative": {"draft_model": "/d2"}, "server": {"port": 31001}}}
    host = Host(name="h", address="127.0.0.1", vars={"sglfleet_profile_overrides": overrides})
    deploy.plan_call(SimpleNamespace(host=host), load_profile(str(path)), None, {})
    assert asked[-1]["facts"] == {"model": "/m2", "draft": "/d2", "known_options": [known]}
    assert asked[-1]["port"] == 31001
    # Another host, no overrides: the file's values. Overrides of the wrong shape are render's error.
    for vars_ in ({}, {"sglfleet_profile_overrides": "nonsense"}):
        deploy.plan_call(SimpleNamespace(host=Host(name="g", address="127.0.0.1", vars=vars_)),
                         load_profile(str(path)), None, {})
        assert asked[-1]["facts"] == {"model": "/m", "draft": "/d", "known_options": [known]}
        assert asked[-1]["port"] == 30000
