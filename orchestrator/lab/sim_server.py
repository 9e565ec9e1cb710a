#!/root/ml-env/bin/python3
"""LAB SIMULATION of an SGLang server: no GPU, no weights. Installed on lab hosts as
/usr/local/bin/sglfleet-sim-server and invoked with exactly the argv of
`python -m sglang.launch_server`.

1. It parses and validates the argv with the REAL SGLang on the host (prepare_server_args,
   then resolve_once) inside SGLang's own platform override for the GPU the host declares
   (/var/lib/sglfleet-lab/gpu). A config SGLang would reject on that GPU is rejected here with
   SGLang's own traceback on stderr and exit code 1 (argparse errors: exit code 2, as SGLang).
   As on a real GPU host, where SGLang finds CUDA itself, `--device cuda` is implied.
   The validation runs in another process that sends what serving needs back and exits: importing
   SGLang (and torch with it) costs ~0.85 GB resident, which the long-lived serving process would
   otherwise keep for nothing (a 32-host lab would not fit in memory). Its stdout/stderr are the
   server's, so the log is as before.
   By default that process is a fork of the host's WARM VALIDATOR (sim_validator.py, installed
   beside this file), which imported SGLang once and is replaced whenever a file it imported or
   the environment SGLang's import read changed: a start costs the validation (~1.5 s of CPU), not
   a fresh import of SGLang and torch on top (~4.5-9 s). SGLFLEET_SIM_WARM_S=0 gives a fresh child
   per start (this same file, marked by SGLFLEET_SIM_RESULT_FD), as before the warm validator.
2. Otherwise, after a model-load delay, it serves SGLang's HTTP API on --host/--port with
   deterministic answers; /server_info says it is a lab simulation and echoes the resolved args.
3. It logs like SGLang, including periodic `Decode batch, ...` lines with accept len / rate
   when speculative decoding is configured, and drains on SIGTERM like SGLang.

4. Multi-node (`--nnodes N`, N > 1): the ranks meet as torch.distributed's TCP store does.
   Rank 0 listens on --dist-init-addr; every other rank connects to it (retrying) and says its
   --node-rank. Rank 0 is healthy only once all N-1 ranks joined and loaded; only then does each
   other rank serve what SGLang's non-zero ranks serve on --host/--port (a dummy health server:
   /ping, /health, /health_generate, and /metrics with --enable-metrics; nothing else). A rank
   that cannot connect within SGLFLEET_SIM_DIST_TIMEOUT (s, default 60), and a rank 0 whose
   ranks did not all join by then, exit 1 with torch's kind of error. The connections stay open
   as NCCL's do: when any rank exits without rank 0's shutdown (killed, crashed), the others
   log an NCCL-style error naming it and exit 1. SIGTERM on rank 0 drains, then broadcasts the
   shutdown, and the other ranks exit 0; SIGTERM on another rank is logged and ignored, as
   SGLang does (its schedulers stop on rank 0's ShutdownReq only).

Knobs (environment): SGLFLEET_SIM_LOAD_DELAY (s, default 3), SGLFLEET_SIM_DECODE_LOG_S
(default 5), SGLFLEET_SIM_DRAIN_LOG_S (default 5), SGLFLEET_SIM_DIST_TIMEOUT (s, default 60),
SGLFLEET_SIM_VALIDATE_ONLY=1 (exit after validation, as a start validates, printing a JSON summary),
SGLFLEET_SIM_WARM_S (s, default 180: how long the host's warm validator waits idle after this start for
the next; 0: no warm validator), SGLFLEET_SIM_VALIDATION_RECORDS (default 1; 0: validate every start,
never answer from the host's record of an accepted start with the same argv, environment and files:
sim_validator.py, VALIDATION RECORDS), SGLFLEET_SIM_SHARED_RECORDS (default 1; 0: this host's records
only), SGLFLEET_SIM_LOAD_UNTIL=PATH (the load also lasts until PATH exists on the host: a test's
event). Faults: SGLFLEET_SIM_CRASH_AFTER (s; on a rank of a multi-node server, from when it
joined), SGLFLEET_SIM_HANG_LOAD=1, SGLFLEET_SIM_HEALTH_FAIL=1
(/health 503), SGLFLEET_SIM_EMPTY_GENERATE=1 (/generate answers 200 with no text and no tokens),
SGLFLEET_SIM_SLOW_MS (per request), SGLFLEET_SIM_ERROR_RATE (this share of the generation requests
answered 500, spread evenly).

SIMULATED speculative decoding (a model, not a measurement; it exists so that a canary analysis
has something that follows from what is deployed). Nothing is drafted or verified here:
  accept length (tokens per forward, bonus token included), from SGLang's resolved args:
      DFLASH 3.4; DDTREE 2.6 + 0.55 x log2(budget / 8) (a bigger tree accepts more, with
      diminishing returns: budget 64 -> 4.25, 16 -> 3.15, 8 or less -> 2.6); a DDTree top-k cap
      below 4 keeps the tree narrow: x (0.7 + 0.075 x cap); then x SGLFLEET_SIM_ACCEPT_SCALE (default
      1: a stand-in for a weaker or stronger draft model); at least 1, at most the draft tokens.
  accept rate = (accept length - 1) / (draft tokens - 1).
  generation throughput (token/s while decoding) = SGLFLEET_SIM_FORWARDS_PER_S (default 95) x
      accept length x SGLFLEET_SIM_THROUGHPUT_SCALE (default 1): fewer tokens per forward is a slower
      server, as on a GPU. A request of N new tokens takes N / that throughput (plus SLOW_MS).
/metrics (with --enable-metrics) exports the figures as SGLang does, with SGLang's counters
(sglang:generation_tokens_total, sglang:num_requests_total, sglang:http_responses_total per
endpoint and status), which move only when requests are served: an idle server's gauges stand
still, as SGLang's do between decode log lines.
"""

import json
import logging
import math
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import traceback
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from types import SimpleNamespace

try:  # on a lab host: installed beside this file (lab/base.py install_tools)
    import sglfleet_sim_validator as warm
except ImportError:  # in the checkout
    from orchestrator.lab import sim_validator as warm

# What SGLang's platform probes would report on each declarable GPU.
GPU_FACTS = {
    "h200": {"is_cuda": True, "is_sm90": True, "device_capability": (9, 0), "is_hopper_with_cuda_12_3": True},
    "h100": {"is_cuda": True, "is_sm90": True, "device_capability": (9, 0), "is_hopper_with_cuda_12_3": True},
    "a100": {"is_cuda": True, "is_sm90": False, "device_capability": (8, 0), "is_hopper_with_cuda_12_3": False},
    "l40s": {"is_cuda": True, "is_sm90": False, "device_capability": (8, 9), "is_hopper_with_cuda_12_3": False},
}
GPU_FILE = "/var/lib/sglfleet-lab/gpu"
# Set in the validation child's environment: the fd of the pipe its result goes to.
RESULT_FD_ENV = "SGLFLEET_SIM_RESULT_FD"
VALIDATE_ONLY_ENV = "SGLFLEET_SIM_VALIDATE_ONLY"
# The fields of SGLang's ServerArgs the serving process reads (as getattr gives them).
SERVING_FIELDS = ("model_path", "served_model_name", "host", "port", "enable_metrics", "nnodes", "node_rank",
                  "dist_init_addr")
log = logging.getLogger("sglang")


def env_float(name, default):
    try:
        return float(os.environ.get(name, default))
    except ValueError:
        return default


def declared_gpu():
    value = os.environ.get("SGLFLEET_LAB_GPU")
    if not value:
        try:
            value = open(GPU_FILE).read().split()[0]
        except (OSError, IndexError):
            value = "h200"
    return value.lower() if value.lower() in GPU_FACTS else "h200"


def with_device(argv):
    if any(a == "--device" or a.startswith("--device=") for a in argv):
        return list(argv)
    return list(argv) + ["--device", "cuda"]


def validate(argv, gpu):
    """The real SGLang: parse, then the version's full validation, as if on `gpu`."""
    from sglang.srt.runtime_context import override_platform
    from sglang.srt.server_args import prepare_server_args

    with override_platform(**GPU_FACTS[gpu]):
        args = prepare_server_args(with_device(argv))
        resolve = getattr(args, "resolve_once", None)
        if resolve is not None:  # 0.5.23; older versions validated in __post_init__
            resolve()
            args.check_server_args()  # what launch_server checks next (parallel sizes over --nnodes, ...)
    return args


def resolved_view(args):
    # 0.5.23's ServerArgs keeps its fields in __slots__; older versions in the instance dict.
    names = set(getattr(type(args), "__slots__", ())) | set(getattr(args, "__dict__", {}))
    # The values validation resolved (e.g. the draft token count) where SGLang keeps them apart.
    resolved = args.resolved_dict() if hasattr(args, "resolved_dict") else {}
    names |= set(resolved)
    out = {}
    for key in sorted(names):
        if key.startswith("_"):
            continue
        value = resolved[key] if key in resolved else getattr(args, key, None)
        try:
            json.dumps(value)
            out[key] = value
        except (TypeError, ValueError):
            out[key] = repr(value)
    return out


def spec_figures(args, scale=1.0):
    """The simulated accept length / rate for the configured speculation (the module docstring's
    model); `scale` is SGLFLEET_SIM_ACCEPT_SCALE."""
    algorithm = getattr(args, "speculative_algorithm", None)
    if not algorithm:
        return None
    draft = getattr(args, "speculative_num_draft_tokens", None) or getattr(args, "speculative_dflash_block_size",
                                                                           None) or 16
    budget = getattr(args, "speculative_ddtree_budget", None)
    cap = getattr(args, "speculative_ddtree_topk_cap", None)
    accept = 3.4 if str(algorithm).upper() == "DFLASH" else 2.6
    if budget:  # a bigger tree accepts more, with diminishing returns
        accept += 0.55 * math.log2(max(1.0, budget / 8.0))
    if cap and cap < 4:  # a narrow tree
        accept *= 0.7 + 0.075 * cap
    accept = max(1.0, min(accept * scale, float(draft)))
    rate = (accept - 1.0) / max(1.0, float(draft) - 1.0)
    return round(accept, 2), round(rate, 2)


def is_hybrid(args):
    try:
        config = json.load(open(os.path.join(args.model_path, "config.json")))
    except (OSError, ValueError, TypeError):
        return False
    text = config.get("text_config", config)
    return "linear_attention" in (text.get("layer_types") or [])


def simulated_scheduler_step(delay):
    """Raises as a CUDA fault in a forward pass would (lab simulation: SGLFLEET_SIM_CRASH_AFTER)."""
    raise RuntimeError("CUDA error: an illegal memory access was encountered "
                       "(lab simulation: crash after %.1fs, as asked)" % delay)


def validated_summary(args):
    """What the serving process needs from SGLang's validated args, as JSON (no SGLang object
    crosses the pipe: the serving process never imports SGLang)."""
    import sglang

    spec = spec_figures(args, env_float("SGLFLEET_SIM_ACCEPT_SCALE", 1.0))
    return {"fields": {name: getattr(args, name, None) for name in SERVING_FIELDS},
            "server_args": resolved_view(args), "spec": list(spec) if spec else None, "hybrid": is_hybrid(args),
            "version": sglang.__version__}


def fatal(message, *args):
    """Log an error as a rank whose collective failed does, then end the process at once."""
    log.error(message, *args)
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(1)


class Rendezvous:
    """The ranks of one multi-node server meeting and staying connected (lab simulation of
    torch.distributed's TCP store and NCCL's liveness; see the module docstring, item 4)."""

    def __init__(self, nnodes, rank, address, on_ready):
        self.nnodes, self.rank, self.on_ready = nnodes, rank, on_ready
        host, _, port = (address or "").rpartition(":")
        if not host or not port.isdigit():
            fatal("ValueError: --dist-init-addr %r is not HOST:PORT (needed with --nnodes %d)", address, nnodes)
        self.address = (host.strip("[]"), int(port))
        self.timeout = env_float("SGLFLEET_SIM_DIST_TIMEOUT", 60.0)
        self.lock = threading.Lock()
        self.peers = {}          # rank 0: node rank -> its connection
        self.loaded = set()      # rank 0: the ranks whose load is done (its own included)
        self.leaving = False     # this process is ending on purpose: a closed connection is no error
        self.conn = None         # another rank: its connection to rank 0
        self.joined = threading.Event()  # this rank is in the group (rank 0: every rank joined)

    def start(self):
        target = self._host if self.rank == 0 else self._join
        threading.Thread(target=target, daemon=True).start()

    # ------------------------------------------------------------ rank 0
    def _host(self):
        listener = socket.socket(socket.AF_INET6 if ":" in self.address[0] else socket.AF_INET)
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            listener.bind(self.address)
        except OSError as exc:
            fatal("torch.distributed.DistNetworkError: The server socket has failed to listen on %s:%d: %s",
                  self.address[0], self.address[1], exc)
        listener.listen(self.nnodes)
        listener.settimeout(0.5)
        log.info("[dist] node rank 0 of %d: waiting for %d rank(s) on %s:%d (lab simulation of "
                 "torch.distributed's TCP store)", self.nnodes, self.nnodes - 1, *self.address)
        deadline = time.monotonic() + self.timeout
        while len(self.peers) < self.nnodes - 1:
            if time.monotonic() > deadline:
                fatal("torch.distributed.DistStoreError: Timed out after %d seconds waiting for clients. %d/%d "
                      "clients joined.", self.timeout, len(self.peers), self.nnodes - 1)
            try:
                conn, peer = listener.accept()
            except socket.timeout:
                continue
            conn.settimeout(10)
            # one reader for the connection's life: a rank that is loaded before it connects sends
            # "join" and "loaded" together, and a reader made for the greeting alone would swallow
            # the second line in its buffer
            reader = conn.makefile("r")
            try:
                line = reader.readline().split()
            except OSError:
                line = []
            conn.settimeout(None)
            rank = int(line[1]) if len(line) == 2 and line[0] == "join" and line[1].isdigit() else None
            why = ("not a rank's greeting" if rank is None else
                   "node rank %d is not in 1..%d" % (rank, self.nnodes - 1) if not 0 < rank < self.nnodes else
                   "node rank %d joined twice" % rank if rank in self.peers else None)
            if why:
                log.error("[dist] refused a connection from %s: %s", peer[0], why)
                try:
                    conn.sendall(("error %s\n" % why).encode())
                finally:
                    conn.close()
                continue
            with self.lock:
                self.peers[rank] = conn
            log.info("[dist] node rank %d joined from %s (%d/%d)", rank, peer[0], len(self.peers), self.nnodes - 1)
            threading.Thread(target=self._watch_peer, args=(rank, reader), daemon=True).start()
        listener.close()
        log.info("[dist] all %d node ranks joined: NCCL communicator initialized (lab simulation)", self.nnodes)
        self.joined.set()
        self._check_ready()

    def _watch_peer(self, rank, reader):
        for line in reader:
            if line.strip() == "loaded":
                with self.lock:
                    self.loaded.add(rank)
                self._check_ready()
        if not self.leaving:
            fatal("[rank0]: torch.distributed.DistBackendError: NCCL error: remote process exited or there was a "
                  "network error: node rank %d closed its connection (lab simulation of ncclRemoteError); the "
                  "collective cannot complete, exiting", rank)

    def _check_ready(self):
        with self.lock:
            ready = len(self.peers) == self.nnodes - 1 and len(self.loaded) == self.nnodes
            peers = list(self.peers.values()) if ready else []
        for conn in peers:
            conn.sendall(b"ready\n")
        if ready:
            self.on_ready()

    def loaded_here(self):
        """This rank's own load is done."""
        if self.rank == 0:
            with self.lock:
                self.loaded.add(0)
            self._check_ready()
        else:
            with self.lock:  # sent now, or by _join once connected (exactly once either way)
                self.loaded.add(self.rank)
                if self.conn is not None:
                    self.conn.sendall(b"loaded\n")

    def shutdown(self):
        """Rank 0 ends on purpose (after its drain): the other ranks stop on its ShutdownReq."""
        self.leaving = True
        with self.lock:
            peers = dict(self.peers)
        for rank, conn in peers.items():
            try:
                conn.sendall(b"shutdown\n")
                conn.close()
            except OSError:
                pass
        if peers:
            log.info("[dist] ShutdownReq sent to node rank(s) %s", ", ".join(str(r) for r in sorted(peers)))

    # ------------------------------------------------------------ the other ranks
    def _join(self):
        deadline = time.monotonic() + self.timeout
        while True:
            try:
                conn = socket.create_connection(self.address, timeout=2)
                break
            except OSError as exc:
                if time.monotonic() > deadline:
                    fatal("torch.distributed.DistNetworkError: The client socket has timed out after %dms while "
                          "trying to connect to (%s, %d): %s", self.timeout * 1000, self.address[0],
                          self.address[1], exc)
                time.sleep(0.25)
        conn.settimeout(None)
        conn.sendall(("join %d\n" % self.rank).encode())
        with self.lock:
            self.conn = conn
            if self.rank in self.loaded:
                conn.sendall(b"loaded\n")
        log.info("[dist] node rank %d of %d: connected to rank 0 at %s:%d", self.rank, self.nnodes, *self.address)
        self.joined.set()
        for line in conn.makefile("r"):
            word = line.strip()
            if word == "ready":
                self.on_ready()
            elif word == "shutdown":
                self.leaving = True
                log.info("Received ShutdownReq from node rank 0: the schedulers stop; exiting")
                logging.shutdown()
                sys.stdout.flush()
                os._exit(0)
            elif word.startswith("error"):
                fatal("torch.distributed.DistStoreError: rank 0 refused node rank %d: %s", self.rank, word[6:])
        if not self.leaving:
            fatal("[rank%d]: torch.distributed.DistBackendError: NCCL error: remote process exited or there was a "
                  "network error: node rank 0 closed its connection (lab simulation of ncclRemoteError); the "
                  "collective cannot complete, exiting", self.rank)


class SimServer:
    def __init__(self, validated, gpu, argv):
        self.args = SimpleNamespace(**validated["fields"])
        self.server_args = validated["server_args"]
        self.version = validated["version"]
        self.gpu = gpu
        self.argv = argv
        self.ready = False
        self.draining = False
        self.in_flight = 0
        self.served = 0
        self.tokens = 0           # sglang:generation_tokens_total
        self.responses = {}       # (endpoint, status) -> count: sglang:http_responses_total
        self.lock = threading.Lock()
        self.spec = tuple(validated["spec"]) if validated["spec"] else None
        self.hybrid = validated["hybrid"]
        self.httpd = None
        self.nnodes = int(getattr(self.args, "nnodes", 1) or 1)
        self.rank = int(getattr(self.args, "node_rank", 0) or 0)
        self.rendezvous = Rendezvous(self.nnodes, self.rank, getattr(self.args, "dist_init_addr", None),
                                     self.become_ready) if self.nnodes > 1 else None
        self.ready_event = threading.Event()

    # ------------------------------------------------------------------ lifecycle
    def load(self):
        if os.environ.get("SGLFLEET_SIM_HANG_LOAD") == "1":
            log.info("Load weight begin. (lab simulation: hanging during load, as asked)")
            return
        log.info("Load weight begin. avail mem=139.00 GB (lab simulation)")
        time.sleep(env_float("SGLFLEET_SIM_LOAD_DELAY", 3.0))
        gate = os.environ.get("SGLFLEET_SIM_LOAD_UNTIL")
        while gate and not os.path.exists(gate):  # a test's event: the load ends when it says so
            time.sleep(0.1)
        log.info("Load weight end. type=%s, dtype=torch.bfloat16, avail mem=85.10 GB, mem usage=53.90 GB.",
                 self.args.model_path)
        if self.rendezvous is not None:
            self.rendezvous.loaded_here()  # ready once every rank is (Rendezvous calls become_ready)
        else:
            self.become_ready()

    def become_ready(self):
        with self.lock:
            if self.ready:
                return
            self.ready = True
        self.ready_event.set()
        if self.rank == 0:
            log.info("The server is fired up and ready to roll!")
        else:
            log.info("node rank %d: schedulers ready; dummy health check server on %s:%s (non-zero ranks serve no "
                     "API)", self.rank, self.args.host, self.args.port)

    def crash_timer(self):
        delay = env_float("SGLFLEET_SIM_CRASH_AFTER", 0.0)
        if delay > 0:
            if self.rendezvous is not None:
                # a rank's forward pass needs the group's communicator: the fault comes after it
                # joined, however long rank 0 took to listen (a rank answered from a validation
                # record starts seconds before a rank 0 that validates)
                self.rendezvous.joined.wait()
            time.sleep(delay)
            try:
                simulated_scheduler_step(delay)
            except RuntimeError:
                # SGLang's scheduler logs this, then SIGQUITs its parent, which ends the tree.
                log.error("Scheduler hit an exception: %s", traceback.format_exc())
            log.error("Received sigquit from a child process. It usually means the child failed.")
            logging.shutdown()
            sys.stdout.flush()
            os._exit(1)

    def decode_logger(self):
        interval = env_float("SGLFLEET_SIM_DECODE_LOG_S", 5.0)
        while True:
            time.sleep(interval)
            with self.lock:
                if not self.ready or self.draining:
                    continue
                running = self.in_flight
            tokens = 1024 + 64 * running
            if self.hybrid:
                part = "#full token: %d, full token usage: %.2f, mamba num: %d, mamba usage: %.2f" % (
                    tokens, tokens / 400000.0, max(1, running), max(1, running) / 48.0)
            else:
                part = "#token: %d, token usage: %.2f" % (tokens, tokens / 400000.0)
            spec = ""
            if self.spec:
                spec = ", accept len: %.2f, accept rate: %.2f" % self.spec
            log.info("Decode batch, #running-req: %d, %s%s, cuda graph: True, gen throughput (token/s): %.2f, "
                     "#queue-req: 0", running, part, spec, self.throughput())

    def on_sigterm(self, signum, frame):
        if self.rank > 0 and not self.ready:  # SGLang installs its handler once the schedulers are ready
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
            os.kill(os.getpid(), signal.SIGTERM)
            return
        if self.rank > 0:  # as SGLang: only rank 0's ShutdownReq stops a non-zero rank's schedulers
            log.warning("SIGTERM received on node_rank %d; waiting for the rank-0 ShutdownReq broadcast to stop "
                        "the schedulers.", self.rank)
            return
        with self.lock:
            self.draining = True
        threading.Thread(target=self.drain, daemon=True).start()

    def drain(self):
        interval = env_float("SGLFLEET_SIM_DRAIN_LOG_S", 5.0)
        while True:
            with self.lock:
                remaining = self.in_flight
            if remaining == 0:
                break
            log.info("Gracefully exiting... Remaining number of requests %d", remaining)
            time.sleep(interval)
        log.info("Gracefully exiting... Remaining number of requests 0")
        if self.rendezvous is not None:
            self.rendezvous.shutdown()
        self.httpd.shutdown()

    def serve(self):
        host = getattr(self.args, "host", "127.0.0.1") or "127.0.0.1"
        port = int(getattr(self.args, "port", 30000) or 30000)
        server = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, fmt, *a):
                log.info('%s - %s', self.address_string(), fmt % a)

            def do_GET(self):
                server.handle(self, "GET")

            def do_POST(self):
                server.handle(self, "POST")

        signal.signal(signal.SIGTERM, self.on_sigterm)
        if self.rendezvous is not None:
            self.rendezvous.start()
        if self.rank > 0:  # a non-zero rank listens only once the group is up, and serves health only
            for target in (self.load, self.crash_timer):
                threading.Thread(target=target, daemon=True).start()
            self.ready_event.wait()
            self.httpd = ThreadingHTTPServer((host, port), Handler)
            self.httpd.daemon_threads = True
            log.info("Dummy health check server started at %s:%d (lab simulation, node rank %d)", host, port,
                     self.rank)
            self.httpd.serve_forever()
            return 0
        self.httpd = ThreadingHTTPServer((host, port), Handler)
        self.httpd.daemon_threads = True
        for target in (self.load, self.crash_timer, self.decode_logger):
            threading.Thread(target=target, daemon=True).start()
        log.info("Uvicorn running on http://%s:%d (lab simulation of SGLang, GPU %s)", host, port, self.gpu)
        self.httpd.serve_forever()
        return 0

    # ------------------------------------------------------------------ HTTP
    def healthy(self):
        with self.lock:
            return self.ready and not self.draining and os.environ.get("SGLFLEET_SIM_HEALTH_FAIL") != "1"

    def handle(self, request, method):
        path = request.path.split("?", 1)[0]
        length = int(request.headers.get("Content-Length") or 0)
        body = request.rfile.read(length) if length else b""
        try:
            payload = json.loads(body) if body else {}
        except ValueError:
            return self.reply(request, 400, {"error": "invalid JSON body"})
        routes = {
            ("GET", "/health"): self.health, ("GET", "/health_generate"): self.health,
            ("GET", "/ready"): self.ready_route, ("GET", "/ping"): lambda p: (200, "pong"),
            ("GET", "/server_info"): self.server_info, ("GET", "/get_server_info"): self.server_info,
            ("GET", "/model_info"): self.model_info, ("GET", "/v1/models"): self.models,
            ("GET", "/v1/loads"): self.loads, ("GET", "/metrics"): self.metrics,
            ("POST", "/generate"): self.generate, ("POST", "/v1/chat/completions"): self.chat,
        }
        if self.rank > 0:  # SGLang's dummy health check server on a non-zero rank
            routes = {("GET", "/ping"): lambda p: (200, ""), ("GET", "/health"): lambda p: (200, ""),
                      ("GET", "/health_generate"): lambda p: (200, "")}
            if getattr(self.args, "enable_metrics", False):
                routes[("GET", "/metrics")] = lambda p: (200, "# lab simulation: node rank %d\n" % self.rank)
        route = routes.get((method, path))
        if route is None:
            return self.reply(request, 404, {"error": "not found: %s %s" % (method, path)})
        status, answer = route(payload)
        return self.reply(request, status, answer)

    def reply(self, request, status, answer):
        if isinstance(answer, str):
            data, kind = answer.encode(), "text/plain; version=0.0.4"
        else:
            data, kind = json.dumps(answer).encode(), "application/json"
        request.send_response(status)
        request.send_header("Content-Type", kind)
        request.send_header("Content-Length", str(len(data)))
        request.end_headers()
        request.wfile.write(data)

    def health(self, payload):
        return (200, "") if self.healthy() else (503, "")

    def ready_route(self, payload):
        with self.lock:
            ok = self.ready and not self.draining
        return (200, {"status": "ready"}) if ok else (503, {"status": "not ready"})

    def server_info(self, payload):
        return 200, {"lab_simulation": True, "simulated_gpu": self.gpu, "version": self.version,
                     "argv": self.argv, "server_args": self.server_args}

    def model_info(self, payload):
        return 200, {"model_path": self.args.model_path, "tokenizer_path": self.args.model_path,
                     "is_generation": True, "weight_version": "default", "lab_simulation": True}

    def models(self, payload):
        name = getattr(self.args, "served_model_name", None) or self.args.model_path
        return 200, {"object": "list", "data": [{"id": name, "object": "model", "owned_by": "sglang",
                                                 "root": self.args.model_path}]}

    def loads(self, payload):
        with self.lock:
            return 200, {"num_running_reqs": self.in_flight, "num_waiting_reqs": 0, "num_served": self.served}

    def throughput(self):
        """Generated tokens per second while decoding (the module docstring's model)."""
        return env_float("SGLFLEET_SIM_FORWARDS_PER_S", 95.0) * (self.spec[0] if self.spec else 1.0) * \
            env_float("SGLFLEET_SIM_THROUGHPUT_SCALE", 1.0)

    def metrics(self, payload):
        if not getattr(self.args, "enable_metrics", False):
            return 404, {"error": "metrics are off; start with --enable-metrics"}
        with self.lock:
            running, served, tokens = self.in_flight, self.served, self.tokens
            responses = sorted(self.responses.items())
        accept, rate = self.spec or (1.0, 0.0)
        lines = ["# lab simulation of SGLang metrics",
                 "# TYPE sglang:num_running_reqs gauge", "sglang:num_running_reqs %d" % running,
                 "# TYPE sglang:spec_accept_length gauge", "sglang:spec_accept_length %.2f" % accept,
                 "# TYPE sglang:spec_accept_rate gauge", "sglang:spec_accept_rate %.2f" % rate,
                 "# TYPE sglang:gen_throughput gauge", "sglang:gen_throughput %.2f" % self.throughput(),
                 "# TYPE sglang:num_requests_total counter", "sglang:num_requests_total %d" % served,
                 "# TYPE sglang:generation_tokens_total counter", "sglang:generation_tokens_total %d" % tokens,
                 "# TYPE sglang:http_responses_total counter"]
        lines += ['sglang:http_responses_total{endpoint="%s",method="POST",status_code="%d"} %d' % (endpoint, status, n)
                  for (endpoint, status), n in responses]
        return 200, "\n".join(lines) + "\n"

    def answered(self, endpoint, status):
        with self.lock:
            self.responses[(endpoint, status)] = self.responses.get((endpoint, status), 0) + 1

    def fails_next(self):
        """SGLFLEET_SIM_ERROR_RATE: this share of the generation requests fails, spread evenly."""
        share = env_float("SGLFLEET_SIM_ERROR_RATE", 0.0)
        with self.lock:
            n = sum(self.responses.values()) + 1
        return share > 0 and int(n * share) > int((n - 1) * share)

    def _complete(self, prompt, max_new_tokens):
        with self.lock:
            if not self.ready or self.draining:
                return None
            self.in_flight += 1
        try:
            time.sleep(env_float("SGLFLEET_SIM_SLOW_MS", 0.0) / 1000.0 + max_new_tokens / self.throughput())
            words = (prompt or "lab").split() or ["lab"]
            text = " ".join(words[i % len(words)] for i in range(max_new_tokens))
            return text
        finally:
            with self.lock:
                self.in_flight -= 1
                self.served += 1
                self.tokens += max_new_tokens

    def _meta(self, prompt, n):
        accept, rate = self.spec or (1.0, 0.0)
        meta = {"prompt_tokens": len((prompt or "").split()), "completion_tokens": n,
                "finish_reason": {"type": "length", "length": n}}
        if self.spec:
            meta.update(spec_accept_length=accept, spec_accept_rate=rate,
                        spec_verify_ct=max(1, int(math.ceil(n / accept))))
        return meta

    def generate(self, payload):
        status, answer = self._generate(payload)
        self.answered("/generate", status)
        return status, answer

    def _generate(self, payload):
        prompt = payload.get("text", "")
        n = int((payload.get("sampling_params") or {}).get("max_new_tokens", 16))
        if self.fails_next():
            return 500, {"error": "lab simulation: a failed request (SGLFLEET_SIM_ERROR_RATE)"}
        text = self._complete(prompt, n)
        if text is None:
            return 503, {"error": "server is not ready"}
        if os.environ.get("SGLFLEET_SIM_EMPTY_GENERATE") == "1":  # fault: 200 with nothing generated
            return 200, {"text": "", "meta_info": self._meta(prompt, 0)}
        return 200, {"text": text, "meta_info": self._meta(prompt, n)}

    def chat(self, payload):
        status, answer = self._chat(payload)
        self.answered("/v1/chat/completions", status)
        return status, answer

    def _chat(self, payload):
        messages = payload.get("messages") or []
        prompt = " ".join(str(m.get("content", "")) for m in messages if isinstance(m, dict))
        n = int(payload.get("max_tokens") or 16)
        if self.fails_next():
            return 500, {"error": "lab simulation: a failed request (SGLFLEET_SIM_ERROR_RATE)"}
        text = self._complete(prompt, n)
        if text is None:
            return 503, {"error": "server is not ready"}
        return 200, {"id": "chatcmpl-lab", "object": "chat.completion", "model": self.args.model_path,
                     "choices": [{"index": 0, "message": {"role": "assistant", "content": text},
                                  "finish_reason": "length"}],
                     "usage": {"prompt_tokens": len(prompt.split()), "completion_tokens": n,
                               "total_tokens": len(prompt.split()) + n}}


def exit_code(exc):
    """The status a SystemExit would end the process with (as the interpreter computes it)."""
    if exc.code is None:
        return 0
    if isinstance(exc.code, int):
        return exc.code
    print(exc.code, file=sys.stderr)
    return 1


def validation_outcome(argv, gpu):
    """(summary, 0) once SGLang accepted the argv, or (None, exit code) after its refusal, which
    is on stderr as SGLang writes it (argparse: its usage message and exit code 2)."""
    try:
        return validated_summary(validate(argv, gpu)), 0
    except SystemExit as exc:
        return None, exit_code(exc)
    except Exception:
        traceback.print_exc()
        return None, 1


def validation_child(argv, gpu, result_fd):
    """The child's whole life: validate, send the summary down the pipe, exit. It ends with
    os._exit after flushing, so nothing SGLang's imports started can keep it alive."""
    summary, code = validation_outcome(argv, gpu)
    if summary is not None:
        with os.fdopen(result_fd, "w") as pipe:
            pipe.write(json.dumps(summary))
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def validate_in_child(argv, gpu):
    """(summary, None) once SGLang accepted the argv, or (None, exit code) after its refusal,
    which the child has already written to our stdout/stderr."""
    read_fd, write_fd = os.pipe()
    child = subprocess.Popen([sys.executable, os.path.abspath(__file__)] + list(argv),
                             env=dict(os.environ, **{RESULT_FD_ENV: str(write_fd)}), pass_fds=(write_fd,))
    os.close(write_fd)

    def on_sigterm(signum, frame):
        # Stopped while validating: the child goes too, then we end as SIGTERM would end us.
        child.terminate()
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGTERM)

    previous = signal.signal(signal.SIGTERM, on_sigterm)
    try:
        with os.fdopen(read_fd) as pipe:
            text = pipe.read()
        code = child.wait()
    finally:
        signal.signal(signal.SIGTERM, previous)
    if code < 0:
        print("lab simulation: the SGLang validation process died by signal %d" % -code, file=sys.stderr)
        return None, 1
    if code != 0:
        return None, code
    try:
        return json.loads(text), None
    except ValueError:
        print("lab simulation: the SGLang validation process exited 0 without its result", file=sys.stderr)
        return None, 1


def main(argv):
    logging.basicConfig(level=logging.INFO, stream=sys.stdout, format="[%(asctime)s] %(message)s",
                        datefmt="%Y-%m-%d %H:%M:%S")
    if warm.XOPTION in sys._xoptions:  # this file run as the host's warm validator
        return warm.WarmValidator(int(argv[0]), validation_outcome).run()
    gpu = declared_gpu()
    if os.environ.get(RESULT_FD_ENV):
        validation_child(argv, gpu, int(os.environ[RESULT_FD_ENV]))
    key = warm.validation_key(argv, gpu) if warm.records_enabled() else None
    record = warm.recorded_validation(key, argv) if key else None
    if record is not None:
        validated = record["summary"]
    else:
        idle_s = env_float(warm.WARM_ENV, warm.WARM_DEFAULT_S)
        if idle_s > 0:
            validated, code = warm.validate(argv, gpu, idle_s, os.path.abspath(__file__), validate_in_child)
        else:
            validated, code = validate_in_child(argv, gpu)
        if validated is None:
            return code
        if key:
            warm.record_validation(key, {k: v for k, v in validated.items() if k != "validator"}, argv)
    if os.environ.get(VALIDATE_ONLY_ENV) == "1":  # a check, not a start: the summary, no server
        print(json.dumps({"ok": True, "gpu": gpu,
                          "speculative_algorithm": validated["server_args"].get("speculative_algorithm")}))
        return 0
    if record is not None:
        origin = (record.get("host"), record.get("address"))
        elsewhere = origin[0] and origin != (socket.gethostname(), warm.bind_address(argv))
        log.info("lab simulation: SGLang accepted this argv at %s%s with the same environment and files "
                 "(validation record %s); not validated again",
                 time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(record.get("time", 0))),
                 " on lab host %s (%s)" % origin if elsewhere else "", key[:12])
    elif validated.get("validator"):
        log.info("lab simulation: SGLang validated the argv in a fork of this host's warm validator (pid %s)",
                 validated["validator"])
    return SimServer(validated, gpu, argv).serve()


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
