"""The lab's SGLang stand-in (sglfleet-sim-server) on a lab host: the real SGLang validates the
argv in a child process that exits, so the serving process stays small; refusals look as before.

Started by hand on the host (as test_lab_image.py does), not through deploy: these are the
stand-in's own promises. Deploy's use of it is in test_deploy*.py.
"""

from __future__ import annotations

import json
import re
import shlex

import pytest

from orchestrator.fleet.hostkeys import KnownHosts
from orchestrator.fleet.transport import Connection

from .private_lab import lab_fixture
from .polling import http, wait_for

pytestmark = [pytest.mark.lab, pytest.mark.slow]
lab = lab_fixture("sim-server", 21, hosts=1)
M = "/root/models"
# Plain DFlash on a dense target: needs no patchset on the host.
DFLASH = [f"--model-path={M}/Qwen3-8B", "--speculative-algorithm", "DFLASH",
          f"--speculative-draft-model-path={M}/Qwen3.6-27B-DFlash", "--speculative-dflash-block-size", "16"]
SERVER = "^/root/ml-env/bin/python3 /usr/local/bin/sglfleet-sim-server"
RSS_LIMIT_MB = 100


@pytest.fixture
def conn(inventory):
    c = Connection(inventory.hosts["ct129"], KnownHosts(inventory.known_hosts_path))
    yield c
    c.run(f"pkill -KILL -f '{SERVER}'; true")
    c.close()


def start(conn, argv, env="SGLFLEET_SIM_LOAD_DELAY=0"):
    """The stand-in, detached, its output in /tmp/sim.log and its exit status in /tmp/sim.rc."""
    q = " ".join(shlex.quote(a) for a in argv)
    conn.run(f"rm -f /tmp/sim.rc; setsid nohup sh -c '{env} sglfleet-sim-server {q}; echo $? > /tmp/sim.rc'"
             f" > /tmp/sim.log 2>&1 < /dev/null &")






def exit_status(conn, timeout=120):
    text = wait_for(lambda: conn.run("cat /tmp/sim.rc 2>/dev/null").stdout_text.strip(), timeout=timeout)
    assert text, conn.run("cat /tmp/sim.log").stdout_text[-3000:]
    return int(text)


def stand_ins(conn):
    """pid -> resident MiB of every sglfleet-sim-server process on the host."""
    out = conn.run(f"for p in $(pgrep -f '{SERVER}'); do echo $p $(awk '/^VmRSS:/ {{print $2}}' /proc/$p/status); "
                   "done").stdout_text.split()
    return {int(out[i]): int(out[i + 1]) / 1024 for i in range(0, len(out) - 1, 2)}


def test_serving_process_stays_small_and_answers_with_sglangs_resolved_args(conn):
    url = f"http://{conn.host.address}:30000"
    start(conn, DFLASH + ["--host", conn.host.address, "--port", "30000", "--enable-metrics"],
          "SGLFLEET_SIM_LOAD_DELAY=0 SGLFLEET_SIM_DECODE_LOG_S=0.5")
    assert wait_for(lambda: http(url + "/health")[0] == 200, timeout=120), conn.run("cat /tmp/sim.log").stdout_text[-3000:]
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


def test_a_config_sglang_refuses_exits_with_its_traceback_and_leaves_nothing(conn):
    start(conn, DFLASH[:3] + ["--host", conn.host.address, "--port", "30000"])  # no draft model
    assert exit_status(conn) == 1
    log = conn.run("cat /tmp/sim.log").stdout_text
    assert "Traceback (most recent call last)" in log and "sglang/srt/server_args.py" in log, log[-3000:]
    assert log.strip().splitlines()[-1].startswith("ValueError:") and "draft-model-path" in log, log[-3000:]
    assert "Uvicorn running" not in log and stand_ins(conn) == {}

    start(conn, DFLASH + ["--no-such-flag"])  # argparse: SGLang's usage message, exit 2
    assert exit_status(conn) == 2
    assert "unrecognized arguments: --no-such-flag" in conn.run("cat /tmp/sim.log").stdout_text
    assert stand_ins(conn) == {}


def test_sigterm_while_validating_ends_the_validation_too(conn):
    start(conn, DFLASH + ["--host", conn.host.address, "--port", "30000"])
    # The serving process and its validation child (which imports SGLang for seconds).
    both = wait_for(lambda: (lambda p: p if len(p) == 2 else None)(stand_ins(conn)), timeout=30, step=0.05)
    assert both, "the validation never ran in a child process"
    conn.run(f"kill -TERM $(pgrep -o -f '{SERVER}')")  # the oldest: the serving process
    assert exit_status(conn, timeout=30) == 128 + 15
    assert wait_for(lambda: stand_ins(conn) == {}, timeout=10), stand_ins(conn)
