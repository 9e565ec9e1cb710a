"""The lab's SGLang stand-in (sglfleet-sim-server) on a lab host: the real SGLang validates the
argv in a process that exits (a fork of the host's warm validator, or with SGLFLEET_SIM_WARM_S=0 a
fresh child), so the serving process stays small; refusals look as before in both ways. The warm
validator is reused while nothing it imported changed, and replaced when a file or the
environment did, and it goes away when idle.

Started by hand on the host (as test_lab_image.py does), not through deploy: these are the
stand-in's own promises. Deploy's use of it is in test_deploy*.py.
"""

from __future__ import annotations

import json
import re
import shlex
import uuid

import pytest

from orchestrator.fleet.hostkeys import KnownHosts
from orchestrator.fleet.transport import Connection

from .private_lab import lab_fixture
from .polling import http, wait_for

pytestmark = [pytest.mark.lab, pytest.mark.slow]
lab = lab_fixture("sim-server", 21, hosts=2)  # ct130: a second host, for the shared records
M = "/root/models"
# Plain DFlash on a dense target: needs no patchset on the host.
DFLASH = [f"--model-path={M}/Qwen3-8B", "--speculative-algorithm", "DFLASH",
          f"--speculative-draft-model-path={M}/Qwen3.6-27B-DFlash", "--speculative-dflash-block-size", "16"]
SERVER = "^/root/ml-env/bin/python3 /usr/local/bin/sglfleet-sim-server"
VALIDATOR = "^/root/ml-env/bin/python3 -X sglfleet_warm_validator /usr/local/bin/sglfleet-sim-server"
RSS_LIMIT_MB = 100
# How each test starts the stand-in: through the host's warm validator (the default) or a fresh
# validation child per start.
MODES = {"fresh": "SGLFLEET_SIM_WARM_S=0", "warm": ""}


@pytest.fixture
def conn(inventory):
    c = Connection(inventory.hosts["ct129"], KnownHosts(inventory.known_hosts_path))
    yield c
    c.run(f"pkill -KILL -f '{SERVER}'; true")  # the warm validator stays for the next test, as for a deploy
    c.close()


def no_validator(conn):
    conn.run(f"pkill -KILL -f '{VALIDATOR}'; true")
    assert wait_for(lambda: validator(conn) is None, timeout=10)


def start(conn, argv, env="SGLFLEET_SIM_LOAD_DELAY=0", records=False, shared=False):
    """The stand-in, detached, its output in /tmp/sim.log and its exit status in /tmp/sim.rc. These
    tests are about how each start validates, so none answers from a validation record unless
    `records` (the tests of the records), and then only from its own host's unless `shared`."""
    q = " ".join(shlex.quote(a) for a in argv)
    env = env if records else f"SGLFLEET_SIM_VALIDATION_RECORDS=0 {env}"
    env = env if shared else f"SGLFLEET_SIM_SHARED_RECORDS=0 {env}"
    conn.run(f"rm -f /tmp/sim.rc; setsid nohup sh -c '{env} sglfleet-sim-server {q}; echo $? > /tmp/sim.rc'"
             f" > /tmp/sim.log 2>&1 < /dev/null &")






def exit_status(conn, timeout=120):
    text = wait_for(lambda: conn.run("cat /tmp/sim.rc 2>/dev/null").stdout_text.strip(), timeout=timeout)
    assert text, conn.run("cat /tmp/sim.log").stdout_text[-3000:]
    return int(text)


def validator(conn):
    """The pid of the host's warm validator (None: there is none)."""
    out = conn.run(f"pgrep -o -f '{VALIDATOR}'").stdout_text.split()
    return int(out[0]) if out else None


def validation_children(conn, pid):
    return [int(p) for p in conn.run(f"pgrep -P {pid}").stdout_text.split()]


def validator_log(conn):
    return conn.run("cat /var/lib/sglfleet-lab/validator.log").stdout_text


def validated_by(conn):
    """The warm validator's pid as the stand-in's log names it (None: validated otherwise)."""
    log = conn.run("cat /tmp/sim.log").stdout_text
    found = re.findall(r"in a fork of this host's warm validator \(pid (\d+)\)", log)
    return int(found[-1]) if found else None


def stand_ins(conn):
    """pid -> resident MiB of every sglfleet-sim-server process on the host."""
    out = conn.run(f"for p in $(pgrep -f '{SERVER}'); do echo $p $(awk '/^VmRSS:/ {{print $2}}' /proc/$p/status); "
                   "done").stdout_text.split()
    return {int(out[i]): int(out[i + 1]) / 1024 for i in range(0, len(out) - 1, 2)}


def test_sigterm_while_validating_ends_the_validation_too(conn):
    no_validator(conn)
    start(conn, DFLASH + ["--host", conn.host.address, "--port", "30000"], MODES["fresh"])
    # The serving process and its validation child (which imports SGLang for seconds).
    both = wait_for(lambda: (lambda p: p if len(p) == 2 else None)(stand_ins(conn)), timeout=30, step=0.05)
    assert both, "the validation never ran in a child process"
    conn.run(f"kill -TERM $(pgrep -o -f '{SERVER}')")  # the oldest: the serving process
    assert exit_status(conn, timeout=30) == 128 + 15
    assert wait_for(lambda: stand_ins(conn) == {}, timeout=10), stand_ins(conn)


@pytest.mark.parametrize("mode", MODES)
def test_serving_process_stays_small_and_answers_with_sglangs_resolved_args(conn, mode):
    url = f"http://{conn.host.address}:30000"
    if mode == "fresh":
        no_validator(conn)  # and none is started
    start(conn, DFLASH + ["--host", conn.host.address, "--port", "30000", "--enable-metrics"],
          f"SGLFLEET_SIM_LOAD_DELAY=0 SGLFLEET_SIM_DECODE_LOG_S=0.5 {MODES[mode]}")
    assert wait_for(lambda: http(url + "/health")[0] == 200, timeout=120), conn.run("cat /tmp/sim.log").stdout_text[-3000:]
    # Validated where the mode says: a fork of the warm validator, which stays; or a fresh child.
    if mode == "warm":
        assert validated_by(conn) == validator(conn) is not None
    else:
        assert validated_by(conn) is None and validator(conn) is None
    # One process left (the validation child has exited), and it is small.
    processes = wait_for(lambda: (lambda p: p if len(p) == 1 else None)(stand_ins(conn)), timeout=10)
    assert processes and len(processes) == 1, stand_ins(conn)
    (pid, rss_mb), = processes.items()
    assert rss_mb < RSS_LIMIT_MB, f"the serving stand-in holds {rss_mb:.0f} MiB resident"
    assert conn.run(f"grep -q site-packages/torch/ /proc/{pid}/maps").exit_code == 1  # torch never loaded here
    # What SGLang resolved still reaches /server_info, /metrics and the log.
    status, body = http(url + "/server_info")
    info = json.loads(body)
    assert status == 200 and info["lab_simulation"] is True and info["version"] == "0.5.23"
    assert info["server_args"]["speculative_algorithm"] == "DFLASH"
    assert info["server_args"]["speculative_num_draft_tokens"] == 16  # resolved from the block size
    assert info["server_args"]["model_path"] == f"{M}/Qwen3-8B" and info["argv"][:1] == DFLASH[:1]
    assert b"sglang:spec_accept_length 3.40" in http(url + "/metrics")[1]
    assert json.loads(http(url + "/v1/models")[1])["data"][0]["root"] == f"{M}/Qwen3-8B"
    assert wait_for(lambda: "accept len: 3.40" in conn.run("cat /tmp/sim.log").stdout_text, timeout=10)
    # the access log line as uvicorn writes it: the request line quoted once
    assert re.search(r' - "GET /v1/models HTTP/1.1" 200', conn.run("cat /tmp/sim.log").stdout_text)
    conn.run(f"kill -TERM {pid}")
    assert exit_status(conn, timeout=30) == 0


@pytest.mark.parametrize("mode", MODES)
def test_a_config_sglang_refuses_exits_with_its_traceback_and_leaves_nothing(conn, mode):
    start(conn, DFLASH[:3] + ["--host", conn.host.address, "--port", "30000"], MODES[mode])  # no draft model
    assert exit_status(conn) == 1
    log = conn.run("cat /tmp/sim.log").stdout_text
    assert "Traceback (most recent call last)" in log and "sglang/srt/server_args.py" in log, log[-3000:]
    assert log.strip().splitlines()[-1].startswith("ValueError:") and "draft-model-path" in log, log[-3000:]
    assert "Uvicorn running" not in log and stand_ins(conn) == {}

    start(conn, DFLASH + ["--no-such-flag"], MODES[mode])  # argparse: SGLang's usage message, exit 2
    assert exit_status(conn) == 2
    assert "unrecognized arguments: --no-such-flag" in conn.run("cat /tmp/sim.log").stdout_text
    assert stand_ins(conn) == {}


def test_sigterm_while_validating_in_the_warm_validator_ends_that_validation(conn):
    start(conn, DFLASH + ["--host", conn.host.address, "--port", "30000"])
    # The serving process, and the warm validator's child validating for it.
    forked = wait_for(lambda: (lambda z: z and validation_children(conn, z) and (z, validation_children(conn, z)))(
        validator(conn)), timeout=120, step=0.05)
    assert forked, "the validation never ran in a fork of the warm validator"
    (warm, (child,)) = forked
    assert list(stand_ins(conn)) and child not in stand_ins(conn)
    conn.run(f"kill -TERM $(pgrep -o -f '{SERVER}')")
    assert exit_status(conn, timeout=30) == 128 + 15
    assert wait_for(lambda: stand_ins(conn) == {} and validation_children(conn, warm) == [], timeout=10), \
        (stand_ins(conn), validation_children(conn, warm))
    assert validator(conn) == warm  # the validator itself stays, for the next start


def serve_and_stop(conn, env="", records=False, shared=False):
    """One start of the stand-in through to /health 200, then SIGTERM; the warm validator's pid that
    validated it."""
    url = f"http://{conn.host.address}:30000"
    start(conn, DFLASH + ["--host", conn.host.address, "--port", "30000"], f"SGLFLEET_SIM_LOAD_DELAY=0 {env}",
          records, shared)
    assert wait_for(lambda: http(url + "/health")[0] == 200, timeout=120), conn.run("cat /tmp/sim.log").stdout_text[-3000:]
    conn.run(f"kill -TERM $(pgrep -o -f '{SERVER}')")
    assert exit_status(conn, timeout=30) == 0
    return validated_by(conn)


def test_the_warm_validator_is_reused_until_a_file_it_imported_or_the_environment_changes(conn):
    """Reused across starts that differ only in the stand-in's own knobs; a file the validation
    imports lazily is read from disk at each start; a file the validator imported, edited on the
    host (as a push or a hand edit would), replaces it at the next start, which sees the new bytes;
    so does an environment that differs in what SGLang's import reads, and only that. Without the
    check of its files it would validate with the old module (exit 0) where a fresh SGLang fails."""
    first = serve_and_stop(conn)
    assert first is not None and validator(conn) == first
    # the stand-in's knobs and a setting SGLang never reads at import: the same validator
    assert serve_and_stop(conn, "SGLFLEET_SIM_DECODE_LOG_S=1 ROLL_RELEASE=b") == first, validator_log(conn)

    root = "/root/ml-env/lib/python3.11/site-packages/sglang/srt"
    marker = "raise RuntimeError('sglfleet test: %s edited on the host')"
    argv = DFLASH + ["--host", conn.host.address, "--port", "30000"]  # the argv that served above
    edited = {"configs/model_config.py": False, "server_args.py": True}  # name: imported by the validator
    originals = {}  # written back in place (a copy beside the file would change its directory)
    try:
        for name, imported in edited.items():
            originals[name] = conn.run(f"cat {root}/{name}").stdout
            assert conn.run(f"echo {shlex.quote(marker % name)} >> {root}/{name}").ok
            start(conn, argv)
            assert exit_status(conn) == 1  # only the edit can fail it
            log = conn.run("cat /tmp/sim.log").stdout_text
            assert f"RuntimeError: sglfleet test: {name} edited on the host" in log, log[-3000:]
            # a lazily imported file needs no new validator; an imported one replaced it
            assert (validator(conn) == first) is not imported, (name, validator(conn), first, validator_log(conn))
            assert conn.run(f"cat > {root}/{name}", stdin=originals.pop(name)).ok
    finally:
        for name, data in originals.items():
            conn.run(f"cat > {root}/{name}", stdin=data)
    second = serve_and_stop(conn)
    assert second is not None and second != first, validator_log(conn)
    third = serve_and_stop(conn, "SGLANG_SGLFLEET_TEST_SETTING=1 ROLL_RELEASE=a")  # SGLang's import could read it
    assert third is not None and third != second, validator_log(conn)
    assert "stale (another environment (SGLANG_SGLFLEET_TEST_SETTING)): exiting" in validator_log(conn)
    # a profile's own variable present at the import, which SGLang's scan of the environment (its
    # SGL_ -> SGLANG_ rewrite) read along with every other name: still not one SGLang's import uses
    assert serve_and_stop(conn, "SGLANG_SGLFLEET_TEST_SETTING=1 ROLL_RELEASE=b") == third, validator_log(conn)


def test_the_warm_validator_goes_away_when_idle(conn):
    # the idle time is the latest start's: this one may reuse the validator of the tests before
    assert serve_and_stop(conn, "SGLANG_SGLFLEET_TEST_SETTING=1 SGLFLEET_SIM_WARM_S=2") is not None
    assert wait_for(lambda: validator(conn) is None, timeout=20), "the warm validator outlived its idle time"


RECORDED = re.compile(r"SGLang accepted this argv at .* with the same environment and files \(validation record "
                      r"([0-9a-f]{12})\); not validated again")


def recorded(conn):
    """The validation record the last start answered from (None: it validated)."""
    found = RECORDED.findall(conn.run("cat /tmp/sim.log").stdout_text)
    return found[-1] if found else None


def test_an_accepted_start_is_recorded_and_the_same_start_on_the_same_files_is_not_validated_again(conn):
    """A start whose argv, environment (the stand-in's own knobs aside) and files are those of an
    accepted start before it takes that start's summary from the host's record; any file of the
    sglang package edited, or a setting SGLang may read, and it validates again (a refusal is
    never recorded, so the edit below fails every time); the same bytes back, and the record
    answers again."""
    conn.run("rm -rf /var/lib/sglfleet-lab/validated")
    argv = DFLASH + ["--host", conn.host.address, "--port", "30000"]
    served = serve_and_stop(conn, records=True)
    assert served is not None and recorded(conn) is None  # validated, then recorded
    assert serve_and_stop(conn, "SGLFLEET_SIM_DECODE_LOG_S=1", records=True) is None
    key = recorded(conn)
    assert key is not None, conn.run("cat /tmp/sim.log").stdout_text[-2000:]
    # private to the host's user: the resolved args would carry an --api-key
    modes = conn.run("stat -c %a /var/lib/sglfleet-lab/validated /var/lib/sglfleet-lab/validated/*.json")
    assert modes.stdout_text.split() == ["700", "600"], modes.stdout_text
    # The record holds what serving needs: the resolved args come back as SGLang resolved them.
    start(conn, argv, "SGLFLEET_SIM_LOAD_DELAY=0 SGLFLEET_SIM_DECODE_LOG_S=0.5", records=True)
    url = f"http://{conn.host.address}:30000"
    assert wait_for(lambda: http(url + "/health")[0] == 200, timeout=60)
    info = json.loads(http(url + "/server_info")[1])
    assert info["lab_simulation"] is True and info["version"] == "0.5.23", info
    assert info["server_args"]["speculative_algorithm"] == "DFLASH"
    assert info["server_args"]["speculative_num_draft_tokens"] == 16  # resolved from the block size
    assert wait_for(lambda: "accept len: 3.40" in conn.run("cat /tmp/sim.log").stdout_text, timeout=20)
    conn.run(f"kill -TERM $(pgrep -o -f '{SERVER}')")
    assert exit_status(conn, timeout=30) == 0 and recorded(conn) == key

    root = "/root/ml-env/lib/python3.11/site-packages/sglang/srt"
    name = "configs/model_config.py"  # read by the validation, not at import
    original = conn.run(f"cat {root}/{name}").stdout
    try:
        assert conn.run(f"echo \"raise RuntimeError('sglfleet test: {name} edited')\" >> {root}/{name}").ok
        for _ in range(2):
            start(conn, argv, records=True)
            assert exit_status(conn) == 1 and recorded(conn) is None
            assert f"RuntimeError: sglfleet test: {name} edited" in conn.run("cat /tmp/sim.log").stdout_text
    finally:
        assert conn.run(f"cat > {root}/{name}", stdin=original).ok
    assert serve_and_stop(conn, records=True) is None and recorded(conn) == key  # the same bytes again
    assert serve_and_stop(conn, "SGLANG_SGLFLEET_TEST_SETTING=1", records=True) is not None  # validated
    assert recorded(conn) is None


@pytest.fixture
def other(inventory):
    """ct130: the second host, whose own address differs from ct129's."""
    c = Connection(inventory.hosts["ct130"], KnownHosts(inventory.known_hosts_path))
    yield c
    c.run(f"pkill -KILL -f '{SERVER}'; true")
    c.close()


def test_a_start_answered_on_one_host_answers_the_same_start_on_another_at_its_own_address(conn, other):
    """Plain lab hosts share their validation records (sim_validator.py, SHARED RECORDS): a start
    validated on ct129 answers the same start on ct130, whose argv differs only in the address it
    binds; ct130 serves its own address and port, and says whose record it took. With sharing off
    (a systemd host, or SGLFLEET_SIM_SHARED_RECORDS=0) ct130 validates for itself."""
    run = f"SGLFLEET_TEST_RUN={uuid.uuid4().hex}"  # a start no earlier run of the suite recorded
    assert serve_and_stop(conn, run, records=True, shared=True) is not None and recorded(conn) is None
    shared = conn.run("cat /var/lib/sglfleet-lab/shared-records").stdout_text.strip()
    assert shared.startswith("/") and shared == other.run("cat /var/lib/sglfleet-lab/shared-records").stdout_text.strip()

    url = f"http://{other.host.address}:30000"
    start(other, DFLASH + ["--host", other.host.address, "--port", "30000"], f"SGLFLEET_SIM_LOAD_DELAY=0 {run}",
          records=True, shared=True)
    assert wait_for(lambda: http(url + "/health")[0] == 200, timeout=60), other.run("cat /tmp/sim.log").stdout_text
    log = other.run("cat /tmp/sim.log").stdout_text
    key = recorded(other)
    assert key is not None and f" on lab host ct129 ({conn.host.address}) " in log, log[-2000:]
    (path,) = conn.run(f"ls {shared}/{key}*.json").stdout_text.split()
    assert json.loads(conn.run(f"cat {path}").stdout_text)["host"] == "ct129"
    modes = conn.run(f"stat -c %a {shared} {path}").stdout_text.split()
    assert modes == ["700", "600"], modes  # the resolved args would carry an --api-key
    info = json.loads(http(url + "/server_info")[1])
    assert info["server_args"]["host"] == other.host.address and info["server_args"]["port"] == 30000, info
    other.run(f"kill -TERM $(pgrep -o -f '{SERVER}')")
    assert exit_status(other, timeout=30) == 0

    # the same start with sharing off: ct130 has no record of its own, so it validates
    other.run("rm -rf /var/lib/sglfleet-lab/validated")
    assert serve_and_stop(other, run, records=True) is not None and recorded(other) is None


def test_a_summary_holding_the_address_inside_a_value_stays_on_its_host(tmp_path, monkeypatch):
    """The bind address is given back to the starting host only where a value IS the address; a
    record whose summary holds it inside another value (a URL), or whose argv names it elsewhere
    too, is never shared, and a shared one comes back bound to the reader's address."""
    from orchestrator.lab import sim_validator as warm

    (tmp_path / "host").mkdir()
    (tmp_path / "host" / warm.SHARED_RECORDS_FILE).write_text(f"{tmp_path / 'shared'}\n")
    monkeypatch.setenv(warm.DIRECTORY_ENV, str(tmp_path / "host"))
    argv_a = ["--model-path", "/m", "--host", "127.0.9.1", "--port", "30000"]
    argv_b = ["--model-path", "/m", "--host=127.0.9.2", "--port", "30000"]
    assert warm.keyed_argv(argv_a)[3] == warm.BIND_PLACEHOLDER and warm.bind_address(argv_b) == "127.0.9.2"
    plain = {"fields": {"host": "127.0.9.1", "port": 30000}, "server_args": {"host": "127.0.9.1", "n": [1]}}
    warm.record_validation("plain", plain, argv_a)
    with_url = {"fields": {"host": "127.0.9.1"}, "server_args": {"url": "http://127.0.9.1:30000"}}
    warm.record_validation("url", with_url, argv_a)
    # the address named by another flag too: a summary value equal to it may be that flag's
    warm.record_validation("named", plain, argv_a + ["--advertise-host", "127.0.9.1"])
    assert sorted(p.name for p in (tmp_path / "shared").iterdir()) == ["plain.json"]
    assert sorted(p.name for p in (tmp_path / "host" / "validated").iterdir()) == ["named.json", "plain.json",
                                                                                  "url.json"]
    # another host (no record of its own) reads the shared one at its own address
    monkeypatch.setenv(warm.DIRECTORY_ENV, str(tmp_path / "elsewhere"))
    (tmp_path / "elsewhere").mkdir()
    (tmp_path / "elsewhere" / warm.SHARED_RECORDS_FILE).write_text(f"{tmp_path / 'shared'}\n")
    found = warm.recorded_validation("plain", argv_b)
    assert found["summary"] == {"fields": {"host": "127.0.9.2", "port": 30000},
                                "server_args": {"host": "127.0.9.2", "n": [1]}}, found
    assert warm.recorded_validation("url", argv_b) is None
    monkeypatch.setenv(warm.SHARED_RECORDS_ENV, "0")
    assert warm.recorded_validation("plain", argv_b) is None
