"""The lab GPU-host image: real SGLang on lab hosts, model dirs, nvidia-smi and server stand-ins."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from orchestrator.fleet.hostkeys import KnownHosts
from orchestrator.fleet.transport import Connection

from .conftest import sglfleet
from .direct import run_python
from .polling import http, wait_for

pytestmark = [pytest.mark.lab, pytest.mark.slow]
M = "/root/models"
HYBRID = [f"--model-path={M}/Qwen3.6-27B", "--speculative-algorithm", "DFLASH",
          f"--speculative-draft-model-path={M}/Qwen3.6-27B-DFlash", "--speculative-dflash-block-size", "16"]
CASES = {  # name -> (argv, expected exit code)
    "dense": ([f"--model-path={M}/Qwen3-8B"], 0),
    "hybrid+extra_buffer": (HYBRID + ["--mamba-radix-cache-strategy", "extra_buffer",
                                      "--mamba-full-memory-ratio", "0.5"], 0),
    "hybrid without extra_buffer": (HYBRID, 0),
    "DFLASH without draft path": ([f"--model-path={M}/Qwen3-8B", "--speculative-algorithm", "DFLASH"], 1),
    "unknown flag": ([f"--model-path={M}/Qwen3-8B", "--no-such-flag"], 2),
    "renamed flag": ([f"--model-path={M}/Qwen3.6-27B", "--mamba-scheduler-strategy", "extra_buffer"], 2),
}


def connect(inventory, name):
    return Connection(inventory.hosts[name], KnownHosts(inventory.known_hosts_path))


def q(argv):
    import shlex
    return " ".join(shlex.quote(a) for a in argv)


def test_facts_show_sglang_and_the_gpu(lab):
    proc = sglfleet("facts", "ct129", "-i", str(lab.inventory_path), "--json")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    value = json.loads(proc.stdout)["hosts"]["ct129"]["value"]
    assert value["packages"]["sglang"] == "0.5.23"
    assert value["gpus"] == [{"index": 0, "name": "NVIDIA H200", "memory_mib": 143771, "driver": "580.159.04"}]


def test_stand_in_accepts_and_rejects_exactly_as_sglang(inventory):
    with connect(inventory, "ct129") as conn:
        assert conn.run(f"test -f {M}/Qwen3.6-27B/config.json && test -f {M}/Qwen3.6-27B-DFlash/config.json").ok
        direct = run_python(conn, Path(__file__).parent / "remote" / "direct_validate.py",
                            [json.dumps([argv for argv, _ in CASES.values()])], timeout=600)
        assert direct.ok, direct.stderr_text
        want = json.loads(direct.stdout)
        for (name, (argv, expected)), direct_outcome in zip(CASES.items(), want, strict=True):
            got = conn.run(f"SGLFLEET_SIM_VALIDATE_ONLY=1 sglfleet-sim-server {q(argv)}", timeout=300)
            assert got.exit_code == direct_outcome["exit"] == expected, (name, got.stderr_text[-2000:])
            if expected == 1:  # the stand-in shows SGLang's own traceback, ending in the same exception
                last = got.stderr_text.strip().splitlines()[-1]
                assert last.startswith(direct_outcome["type"] + ":"), (name, last)
                assert "Traceback (most recent call last)" in got.stderr_text
            if expected == 2:
                assert "unrecognized arguments" in got.stderr_text




def start_server(conn, port, env=""):
    argv = HYBRID + ["--mamba-radix-cache-strategy", "extra_buffer", "--mamba-full-memory-ratio", "0.5",
                     "--host", conn.host.address, "--port", str(port), "--enable-metrics"]
    conn.run(f"rm -f /tmp/sim.rc; setsid nohup sh -c '{env} sglfleet-sim-server {q(argv)}; echo $? > /tmp/sim.rc'"
             f" > /tmp/sim.log 2>&1 < /dev/null &")
    return f"http://{conn.host.address}:{port}"




def test_server_health_api_and_graceful_drain(inventory):
    with connect(inventory, "ct130") as conn:
        url = start_server(conn, 30000, "SGLFLEET_SIM_LOAD_DELAY=4 SGLFLEET_SIM_SLOW_MS=3000 "
                                        "SGLFLEET_SIM_DRAIN_LOG_S=1 SGLFLEET_SIM_DECODE_LOG_S=1")
        assert wait_for(lambda: http(url + "/health")[0] == 503), "no 503 while loading"
        assert wait_for(lambda: http(url + "/health")[0] == 200), conn.run("cat /tmp/sim.log").stdout_text
        decode = wait_for(lambda: [line for line in conn.run("cat /tmp/sim.log").stdout_text.splitlines()
                                   if "Decode batch, #running-req:" in line], timeout=10)
        # a hybrid target logs mamba usage instead of the token part, as SGLang does
        assert "accept len: 3.40, accept rate: 0.16" in decode[0] and "mamba num:" in decode[0], decode
        status, body = http(url + "/server_info")
        info = json.loads(body)
        assert status == 200 and info["lab_simulation"] is True and info["simulated_gpu"] == "h200"
        assert info["server_args"]["speculative_algorithm"] == "DFLASH"
        assert json.loads(http(url + "/v1/models")[1])["data"][0]["root"] == f"{M}/Qwen3.6-27B"
        assert b"sglang:spec_accept_length 3.40" in http(url + "/metrics")[1]
        for path in ("/ready", "/ping", "/model_info", "/get_server_info", "/v1/loads", "/health_generate"):
            assert http(url + path)[0] == 200, path
        # One slow request in flight, then SIGTERM: health turns 503, the request still finishes,
        # the drain is logged like SGLang's, and the process exits 0.
        import threading
        result = {}
        worker = threading.Thread(target=lambda: result.update(
            answer=http(url + "/generate", {"text": "a b", "sampling_params": {"max_new_tokens": 3}}, timeout=30)))
        worker.start()
        assert wait_for(lambda: json.loads(http(url + "/v1/loads")[1])["num_running_reqs"] == 1, timeout=5)
        assert conn.run("pkill -TERM -f '^/root/ml-env/bin/python3 /usr/local/bin/sglfleet-sim-server'").ok
        assert wait_for(lambda: http(url + "/health")[0] in (503, None), timeout=5)
        worker.join(30)
        status, body = result["answer"]
        assert status == 200 and json.loads(body)["text"] == "a b a"
        assert json.loads(body)["meta_info"]["spec_accept_length"] == 3.4
        assert wait_for(lambda: conn.run("cat /tmp/sim.rc").stdout_text.strip() == "0", timeout=15)
        logged = conn.run("cat /tmp/sim.log").stdout_text
        assert "Gracefully exiting... Remaining number of requests 1" in logged


def test_fault_knobs(inventory):
    conns = {name: connect(inventory, name) for name in ("ct129", "ct131", "ct132")}
    try:
        crash = start_server(conns["ct129"], 30001, "SGLFLEET_SIM_LOAD_DELAY=1 SGLFLEET_SIM_CRASH_AFTER=20")
        sick = start_server(conns["ct131"], 30002, "SGLFLEET_SIM_LOAD_DELAY=1 SGLFLEET_SIM_HEALTH_FAIL=1")
        hang = start_server(conns["ct132"], 30003, "SGLFLEET_SIM_LOAD_DELAY=1 SGLFLEET_SIM_HANG_LOAD=1")
        assert wait_for(lambda: http(crash + "/health")[0] == 200), "crash knob: never healthy first"
        assert wait_for(lambda: http(sick + "/ready")[0] == 200)
        assert http(sick + "/health")[0] == 503  # loaded and ready, but failing health checks
        # The hang host validates on its own clock (its stand-in may not be listening yet when the other
        # two are healthy): wait until it answers and has begun its load, then past its load delay.
        assert wait_for(lambda: "hanging during load" in conns["ct132"].run("cat /tmp/sim.log").stdout_text)
        assert wait_for(lambda: http(hang + "/health")[0] == 503)
        time.sleep(1.5)  # > SGLFLEET_SIM_LOAD_DELAY: a server that loads would be healthy by now
        assert http(hang + "/health")[0] == 503 and http(hang + "/ready")[0] == 503  # still "loading"
        assert wait_for(lambda: conns["ct129"].run("cat /tmp/sim.rc").stdout_text.strip() == "1", timeout=60)
        assert "illegal memory access" in conns["ct129"].run("cat /tmp/sim.log").stdout_text
        assert http(crash + "/health")[0] is None
    finally:
        for conn in conns.values():
            conn.run("pkill -KILL -f '[s]glfleet-sim-server'; true")
            conn.close()
