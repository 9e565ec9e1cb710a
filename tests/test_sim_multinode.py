"""The stand-in's multi-node rendezvous (issue 29), without a lab: the serving part of
sglfleet-sim-server run here as two processes on loopback (SGLang's validation, which the lab
tests exercise, is skipped: the validated fields are given).

Rank 0 is healthy only once every rank joined and loaded; a non-zero rank serves health only;
a rank that dies takes the others down with an NCCL-style error; rank 0's SIGTERM drains and
stops the others cleanly; a non-zero rank ignores SIGTERM once ready (as SGLang does); a rank that
finds no rank 0, and a rank 0 whose ranks never come, exit 1 with torch's kind of error.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time

import pytest

from .conftest import ROOT
from .polling import wait_for

RUN = """
import json, logging, sys
sys.path.insert(0, sys.argv[1])
from orchestrator.lab import sim_server
logging.basicConfig(level=logging.INFO, stream=sys.stdout, format="%(message)s")
validated = {"fields": json.loads(sys.argv[2]), "server_args": {}, "spec": None, "hybrid": False, "version": "lab"}
sys.exit(sim_server.SimServer(validated, "h200", []).serve())
"""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Rank:
    def __init__(self, tmp_path, rank, nnodes, dist, env=None):
        self.port = free_port()
        self.address = f"127.0.0.{rank + 1}"
        fields = {"model_path": "/m", "served_model_name": None, "host": self.address, "port": self.port,
                  "enable_metrics": False, "nnodes": nnodes, "node_rank": rank, "dist_init_addr": dist}
        self.log = tmp_path / f"rank{rank}.log"
        self.proc = subprocess.Popen([sys.executable, "-c", RUN, str(ROOT), json.dumps(fields)],
                                     stdout=open(self.log, "w"), stderr=subprocess.STDOUT,
                                     env={**os.environ, "SGLFLEET_SIM_LOAD_DELAY": "0.3", "SGLFLEET_SIM_DIST_TIMEOUT": "3",
                                          "SGLFLEET_SIM_DECODE_LOG_S": "60", **(env or {})})

    def get(self, path):
        import http.client

        conn = http.client.HTTPConnection(self.address, self.port, timeout=2)
        try:
            conn.request("GET", path)
            return conn.getresponse().status
        except OSError:
            return None
        finally:
            conn.close()

    def text(self):
        return self.log.read_text()

    def wait(self, timeout=15):
        return self.proc.wait(timeout)

    def stop(self):
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


@pytest.fixture
def ranks(tmp_path):
    started = []

    def start(rank, nnodes=2, dist=None, env=None):
        r = Rank(tmp_path, rank, nnodes, dist or started_dist[0], env)
        started.append(r)
        return r

    started_dist = [f"127.0.0.1:{free_port()}"]
    yield start
    for r in started:
        r.stop()


def test_rank_0_is_healthy_only_once_every_rank_joined_and_a_non_zero_rank_serves_health_only(ranks):
    r0 = ranks(0)
    # loaded, listening, but alone (event waits: a fixed sleep fell short on a busy CI machine)
    assert wait_for(lambda: "Load weight end" in r0.text() and r0.get("/health") is not None, timeout=15), r0.text()
    assert r0.get("/health") == 503 and r0.proc.poll() is None
    r1 = ranks(1)
    assert wait_for(lambda: r0.get("/health") == 200, timeout=10), r0.text()
    # rank 1 hears that every rank is ready from rank 0, a moment after rank 0 itself is
    assert wait_for(lambda: r1.get("/health") == 200, timeout=10), r1.text()
    assert r1.get("/health_generate") == 200
    assert r1.get("/server_info") == 404 and r1.get("/v1/models") == 404  # no API on a non-zero rank
    assert "node rank 1 joined" in r0.text() and "all 2 node ranks joined" in r0.text()


def test_a_killed_non_zero_rank_takes_rank_0_down_with_an_nccl_error(ranks):
    r0, r1 = ranks(0), ranks(1)
    wait_for(lambda: r0.get("/health") == 200, timeout=10)
    r1.proc.send_signal(signal.SIGKILL)
    assert r0.wait() == 1
    assert "NCCL error: remote process exited or there was a network error: node rank 1 closed its connection" \
        in r0.text(), r0.text()


def test_rank_0_s_sigterm_drains_and_stops_the_others_cleanly_and_theirs_is_ignored(ranks):
    r0, r1 = ranks(0), ranks(1)
    assert wait_for(lambda: r1.get("/health") == 200, timeout=10), r1.text()
    r1.proc.send_signal(signal.SIGTERM)
    # handled (logged), then given a moment in which an exit would show
    assert wait_for(lambda: "SIGTERM received on node_rank 1; waiting for the rank-0 ShutdownReq" in r1.text(),
                    timeout=10), r1.text()
    time.sleep(0.5)
    assert r1.proc.poll() is None and r0.get("/health") == 200
    r0.proc.send_signal(signal.SIGTERM)
    assert r0.wait() == 0 and r1.wait() == 0
    assert "Received ShutdownReq from node rank 0" in r1.text()


def test_a_rank_with_no_rank_0_and_a_rank_0_alone_time_out_with_torch_s_errors(ranks):
    r1 = ranks(1)
    assert r1.wait() == 1
    assert "DistNetworkError: The client socket has timed out after 3000ms while trying to connect" in r1.text()
    r0 = ranks(0, dist=f"127.0.0.1:{free_port()}")
    assert r0.wait() == 1
    assert "DistStoreError: Timed out after 3 seconds waiting for clients. 0/1 clients joined." in r0.text()


def test_a_rank_out_of_range_is_refused_by_rank_0(ranks):
    r0 = ranks(0)
    bad = ranks(2)  # nnodes 2: ranks are 0 and 1
    assert bad.wait() == 1
    assert "rank 0 refused node rank 2: node rank 2 is not in 1..1" in bad.text(), bad.text()
    assert r0.proc.poll() is None


def test_a_rank_loaded_before_rank_0_listens_still_makes_the_group_healthy(ranks):
    # in the lab a non-zero rank answered from a validation record is loaded seconds before rank 0
    # (still validating) listens; its greeting and "loaded" then arrive in one read at rank 0
    r1 = ranks(1, env={"SGLFLEET_SIM_DIST_TIMEOUT": "10"})
    assert wait_for(lambda: "Load weight end" in r1.text(), timeout=10), r1.text()
    assert "connected to rank 0" not in r1.text()
    r0 = ranks(0)
    assert wait_for(lambda: r0.get("/health") == 200, timeout=10), r0.text()
    assert wait_for(lambda: r1.get("/health") == 200, timeout=10), r1.text()


def test_a_rank_s_crash_comes_after_it_joined_however_late_rank_0_listens(ranks):
    r1 = ranks(1, env={"SGLFLEET_SIM_DIST_TIMEOUT": "10", "SGLFLEET_SIM_CRASH_AFTER": "0.5"})
    assert wait_for(lambda: "Load weight end" in r1.text(), timeout=10), r1.text()
    time.sleep(1.0)  # twice the crash delay, still alone: a forward pass needs the group
    assert r1.proc.poll() is None, r1.text()
    r0 = ranks(0)
    assert r0.wait() == 1 and r1.wait() == 1
    assert "node rank 1 closed its connection" in r0.text(), r0.text()
    assert "illegal memory access" in r1.text(), r1.text()
