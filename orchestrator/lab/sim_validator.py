"""LAB SIMULATION: the warm validator of a lab host's SGLang stand-in (sim_server.py), installed
beside it as /usr/local/bin/sglfleet_sim_validator.py. Stdlib only; Python 3.9+ (the host's venv).

A stand-in validates its argv with the real SGLang in another process (importing SGLang and
torch costs ~0.85 GB resident, which the serving process must not keep). Importing them anew for
each start costs ~4.5-9 s of CPU on top of the validation (~1.5 s): the lab's tests start the
stand-in ~100 times. So each lab host keeps at most one warm validator: the stand-in file run as
`python3 -X sglfleet_warm_validator /usr/local/bin/sglfleet-sim-server` (a command line no stand-in
server has), listening on /var/lib/sglfleet-lab/validator.sock (the host's own layer).

A start (validate below) connects; finding none it starts one and waits for it. The validator
imports SGLang as a fresh validation child would (before any validation, outside any platform
override), then for each start forks a child that takes the stand-in's stdout/stderr (passed
over the socket), environment and working directory, validates, sends the summary back and
exits. The validator itself never validates, so no validation leaves state behind for the next.
It is never stale:
 * before each fork it stats every file of every module it imported, their directories and
   sys.path's directories (a push renames new files in: new inode, new directory mtime; a hand
   edit changes mtime/size); anything changed and it answers "stale", gives up its socket and
   lock, and exits; the stand-in starts the next one, which imports what is on disk now. Modules
   the validation imports lazily (under the platform override) are imported by each child, from
   disk, every time;
 * it records which environment names the import read (IMPORT_ENV_PREFIXES covers the reads a
   record of os.environ cannot see): a start whose environment differs in one of those replaces
   it too. A child's environment is what a fresh child's would be after that import.
Memory stays bounded: one per host (a lock file), ~0.45 GB of its own (torch's libraries are
shared pages), gone after SGLFLEET_SIM_WARM_S idle seconds (the latest start's; default 180),
never started while the machine has less than MIN_AVAILABLE_GB available (a fresh child per
start then, as before). A stand-in stopped while validating closes its socket: the validator kills
that child at once. /var/lib/sglfleet-lab/validator.log says why each validator came and went.

VALIDATION RECORDS (below the validator): an accepted start's summary is kept in the host's
/var/lib/sglfleet-lab/validated/<key>.json (the newest RECORDS_KEPT), the key made of all the
validation could read that a test, a push or a hand edit changes (validation_key: the argv, the
GPU, the working directory, the environment but the stand-in's own knobs, the interpreter, the
content of every file of the sglang package and of the top of site-packages, and of the
directories the argv names, such as the model's). A later start with the same key (a deploy's
revert to what it ran before, a restart, the next test's deploy of the same profile) takes the
summary from the record and says so in its log, instead of importing SGLang anew after a push
or rollback replaced the validator (~3-6 s of CPU) and validating (~1.5 s). SGLang's own log
lines from that validation are not written again. A refusal is never recorded: it validates,
and SGLang writes its traceback, every time. SGLFLEET_SIM_VALIDATION_RECORDS=0 validates every
start (the tests of the validator itself do).

SHARED RECORDS: the key is the same on every lab host of this machine for the same start, so a
record made on one host answers the others. Hosts share one network namespace, so each binds its
own address (`--host 127.0.N.M` in the argv); the key takes that value as a placeholder, and the
record keeps the placeholder wherever a value equals it and is given the starting host's address
back (SGLang 0.5.23's validation reads --host only to format URLs, and passes it through). A
summary that holds the address inside another value (a URL, a dist-init address), or an argv that
names it elsewhere too, is kept on its own host only. `lab up` names the machine-wide directory
in /var/lib/sglfleet-lab/shared-records (beside the lab's base layer, newest SHARED_RECORDS_KEPT);
a host without that file, or a start with SGLFLEET_SIM_SHARED_RECORDS=0, keeps its records to
itself. In the lab tests, where every
module brings up hosts of its own, 41 of the 76 validations hosts made anew were of a start
another host had validated (each an import of SGLang and torch in a validator, ~4.5 s of CPU, and
~1.5 s of validation); with sharing, the suite's validators spent 234 s of CPU instead of 339 s.
"""

import fcntl
import hashlib
import importlib
import importlib.util
import json
import logging
import os
import selectors
import signal
import socket
import stat
import struct
import subprocess
import sys
import threading
import time

# Its -X option, its directory (a host's own /var/lib layer; SGLFLEET_SIM_VALIDATOR_DIR elsewhere),
# its idle knob, and the memory it needs free.
XOPTION = "sglfleet_warm_validator"
DIRECTORY = "/var/lib/sglfleet-lab"
DIRECTORY_ENV = "SGLFLEET_SIM_VALIDATOR_DIR"
WARM_ENV = "SGLFLEET_SIM_WARM_S"
# 180 s: in the lab tests' runs, a host's next start came 68-150 s after its previous one (a test's
# deploys with other hosts' work between them); at 60 s, 9 of 20 validators exited idle and the
# next start imported SGLang again. The memory it holds meanwhile is bounded by MIN_AVAILABLE_GB.
WARM_DEFAULT_S = 180.0
MIN_AVAILABLE_GB = 4.0
# What of a start's environment must agree with the warm validator's own (before its import):
# every name the import looked up in os.environ (recorded), and the names it reads where that
# record cannot see them: its scans of the whole environment (SGLang's SGL_ -> SGLANG_ rewrite,
# tqdm's TQDM_ settings; a scan from anywhere else makes every name count) and getenv() in C
# (torch, CUDA, OpenMP, the loader, the interpreter). Other names (a profile's own settings, the
# stand-in's SGLFLEET_SIM_* knobs) are the start's alone: its validation child gets them. Never
# compared: the session's, the shell's and the service manager's per-process noise.
IMPORT_ENV_PREFIXES = ("SGL_", "SGLANG_", "TQDM_", "PYTHON", "LD_", "TORCH", "PYTORCH_", "CUDA", "NVIDIA_",
                       "OMP_", "MKL_", "KMP_", "OPENBLAS_", "GOMP_", "MALLOC_", "GLIBC_", "TRITON_", "NCCL_")
KNOWN_ENV_SCANS = ("sglang/srt/environ.py", "tqdm/utils.py")
NOISE_ENV_PREFIXES = ("SSH_", "SGLFLEET_SIM_")
NOISE_ENV = ("_", "SHLVL", "OLDPWD", "MOTD_SHOWN", "INVOCATION_ID", "JOURNAL_STREAM", "SYSTEMD_EXEC_PID",
             "MANAGERPID", "NOTIFY_SOCKET", "LISTEN_PID", "LISTEN_FDS", "LISTEN_FDNAMES", "WATCHDOG_PID",
             "WATCHDOG_USEC", "RUNTIME_DIRECTORY")


def validator_paths():
    directory = os.environ.get(DIRECTORY_ENV) or DIRECTORY
    return os.path.join(directory, "validator.sock"), os.path.join(directory, "validator.lock")


def validator_note(text):
    """A line in the host's validator.log (beside its socket): why each validator came and went."""
    path = os.path.join(os.path.dirname(validator_paths()[0]), "validator.log")
    try:
        with open(path, "a") as fh:
            fh.write("%s pid %d: %s\n" % (time.strftime("%Y-%m-%d %H:%M:%S"), os.getpid(), text))
    except OSError:
        pass


class RecordingEnviron(os._Environ):
    """os.environ while the warm validator imports SGLang: it notes each name looked up and where
    the whole environment was scanned from."""

    looked_up = set()
    scans = []

    def __getitem__(self, key):
        # A read made while a known scan iterates (`os.environ.items()` in sglang/srt/environ.py
        # reads every name present) is that scan's, which IMPORT_ENV_PREFIXES covers: recorded as
        # a lookup, every name of the environment counted, and a profile's own variable (a
        # release's ROLL_RELEASE) made each start re-import SGLang.
        frame, iterating = caller(sys._getframe(1))
        if not (iterating and frame is not None and frame.f_code.co_filename.endswith(KNOWN_ENV_SCANS)):
            RecordingEnviron.looked_up.add(key)
        return super().__getitem__(key)

    def __iter__(self):
        frame, _ = caller(sys._getframe(1))
        RecordingEnviron.scans.append(frame.f_code.co_filename if frame is not None else "?")
        return super().__iter__()


def caller(frame):
    """(the first frame outside os.py and frozen modules such as _collections_abc, whether one of
    the frames passed over was an iteration: a view's __iter__)."""
    iterating = False
    while frame is not None and (frame.f_code.co_filename.startswith("<") or
                                 frame.f_code.co_filename == os.__file__):
        iterating = iterating or frame.f_code.co_name == "__iter__"
        frame = frame.f_back
    return frame, iterating


def watched_paths():
    """Every imported module's file, its directory, and sys.path's directories: what a push or a
    hand edit changes."""
    paths = set(p for p in sys.path if p)
    for module in list(sys.modules.values()):
        path = getattr(module, "__file__", None)
        if isinstance(path, str):
            paths.update((path, os.path.dirname(path)))
    return paths


def files_state(paths):
    """path -> (device, inode, mtime, size), None where it is gone. A directory's size is left
    out: overlayfs reports another one once the host's layer holds a copy (as after an edit of any
    file below it), though nothing in it changed."""
    state = {}
    for path in paths:
        try:
            st = os.stat(path)
            state[path] = (st.st_dev, st.st_ino, st.st_mtime_ns, None if stat.S_ISDIR(st.st_mode) else st.st_size)
        except OSError:
            state[path] = None
    return state


def memory_available_gb():
    try:
        with open("/proc/meminfo") as fh:
            for line in fh:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) / 2.0 ** 20
    except (OSError, ValueError, IndexError):
        pass
    return 0.0


def send_message(sock, obj, fds=()):
    data = json.dumps(obj).encode()
    header = struct.pack("!I", len(data))
    if fds:
        socket.send_fds(sock, [header], list(fds))
    else:
        sock.sendall(header)
    sock.sendall(data)


def recv_exact(sock, size):
    chunks = []
    while size:
        chunk = sock.recv(size)
        if not chunk:
            raise EOFError("the peer closed the connection")
        chunks.append(chunk)
        size -= len(chunk)
    return b"".join(chunks)


def recv_message(sock, max_fds=0):
    """(object, fds); raises EOFError when the peer has gone."""
    if max_fds:
        header, fds, _flags, _addr = socket.recv_fds(sock, 4, max_fds)
        if not header:
            raise EOFError("the peer closed the connection")
        header += recv_exact(sock, 4 - len(header))
    else:
        header, fds = recv_exact(sock, 4), []
    (size,) = struct.unpack("!I", header)
    return json.loads(recv_exact(sock, size)), list(fds)


def validate(argv, gpu, idle_s, stand_in, fresh):
    """(summary, None) once SGLang accepted the argv, or (None, exit code) after its refusal
    (written to our stdout/stderr), as `fresh(argv, gpu)` (a fresh validation child) gives them,
    through the host's warm validator: started from `stand_in` (this host's stand-in file) when
    there is none, replaced when it answers stale, `fresh` itself when none can run here. A
    summary validated warm names the validator's pid ("validator")."""
    sock_path, lock_path = validator_paths()
    for _attempt in range(3):
        sock = connect_validator(sock_path)
        if sock is None:
            if memory_available_gb() < MIN_AVAILABLE_GB:
                break
            sock = start_validator(sock_path, lock_path, idle_s, stand_in)
            if sock is None:
                break
        with sock:
            answer = ask_validator(sock, argv, gpu, idle_s)
        if answer is not None:
            return answer
    return fresh(argv, gpu)


def connect_validator(sock_path):
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.connect(sock_path)
        return sock
    except OSError:
        sock.close()
        return None


def lock_held(lock_path):
    try:
        fd = os.open(lock_path, os.O_RDWR | os.O_CREAT, 0o600)
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return False
    except OSError:
        return True
    finally:
        os.close(fd)  # releases the lock if we took it


def start_validator(sock_path, lock_path, idle_s, stand_in, timeout=300.0):
    """Start the host's warm validator and connect to it once it listens; None if it (or the one
    another stand-in started at the same moment) is not there after all."""
    read_fd, write_fd = os.pipe()
    env = dict(os.environ, **{WARM_ENV: str(idle_s)})
    null = os.open(os.devnull, os.O_RDWR)
    try:
        proc = subprocess.Popen([sys.executable, "-X", XOPTION, stand_in, str(write_fd)],
                                env=env, stdin=null, stdout=null, stderr=null, pass_fds=(write_fd,),
                                start_new_session=True, cwd="/")
    finally:
        os.close(null)
        os.close(write_fd)
    with os.fdopen(read_fd, "rb") as pipe:
        said = pipe.read()  # b"R": it listens; b"B": another one holds the lock; b"": it failed
    threading.Thread(target=proc.wait, daemon=True).start()  # reaped when it exits
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        sock = connect_validator(sock_path)
        if sock is not None or said != b"B" or not lock_held(lock_path):
            return sock
        time.sleep(0.05)
    return None


def ask_validator(sock, argv, gpu, idle_s):
    """(summary, None) or (None, exit code) as `validate`; None when the validator was stale (it
    has exited: the caller starts another)."""
    try:
        send_message(sock, {"argv": list(argv), "gpu": gpu, "env": dict(os.environ), "cwd": os.getcwd(),
                            "idle_s": idle_s},
                     fds=(sys.stdout.fileno(), sys.stderr.fileno()))
        while True:
            message, _ = recv_message(sock)
            if message.get("stale"):
                return None
            if "exit" in message:
                if message["exit"] == 0 and message.get("summary") is not None:
                    return dict(message["summary"], validator=message.get("validator")), None
                return None, message["exit"] or 1
            if "signal" in message:
                print("lab simulation: the SGLang validation process died by signal %d" % message["signal"],
                      file=sys.stderr)
                return None, 1
    except (OSError, EOFError, ValueError) as exc:
        print("lab simulation: the warm validator went away (%s); validating again" % exc, file=sys.stderr)
        return None


class WarmValidator:
    """The warm validator's life (see the module docstring): take the host's lock, import, listen,
    fork a child per start; retire (socket and lock given up first, so a stand-in arriving now
    starts the next one at once) when idle or stale."""

    def __init__(self, ready_fd, outcome):
        self.sock_path, self.lock_path = validator_paths()
        self.outcome = outcome  # (argv, gpu) -> (summary, 0) | (None, exit code): what each child runs
        try:
            self.idle_s = float(os.environ.get(WARM_ENV, WARM_DEFAULT_S))
        except ValueError:
            self.idle_s = WARM_DEFAULT_S
        self.ready = os.fdopen(ready_fd, "wb", buffering=0)
        self.lock = None
        self.listener = None
        self.start_env = dict(os.environ)  # before the import
        self.looked_up, self.every_name_counts = set(), False
        self.files = {}
        self.children = {}  # pidfd -> (pid, connection to its stand-in)
        self.selector = selectors.DefaultSelector()

    def run(self):
        lock = os.open(self.lock_path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            self.ready.write(b"B")  # another validator is starting or serving
            return 0
        self.lock = lock
        started = time.monotonic()
        # What a fresh validation child imports before it validates, and nothing more: the modules
        # validation imports lazily (under the platform override) stay for each child to import.
        os.environ.__class__ = RecordingEnviron
        try:
            from sglang.srt.runtime_context import override_platform  # noqa: F401
            from sglang.srt.server_args import prepare_server_args  # noqa: F401
            import sglang  # noqa: F401
        except BaseException as exc:
            validator_note("importing SGLang failed (%s: %s): the stand-in validates in a fresh child"
                           % (type(exc).__name__, exc))
            return 1
        finally:
            os.environ.__class__ = os._Environ
        self.looked_up = set(RecordingEnviron.looked_up)
        unknown = sorted(set(f for f in RecordingEnviron.scans if not f.endswith(KNOWN_ENV_SCANS)))
        self.every_name_counts = bool(unknown)
        self.files = files_state(watched_paths())
        validator_note("imported SGLang in %.1f s, %d files watched, %d environment names looked up%s; idle exit "
                       "after %.0f s" % (time.monotonic() - started, len(self.files), len(self.looked_up),
                                         " (every name counts: the environment was scanned in %s)"
                                         % ", ".join(unknown) if unknown else "", self.idle_s))
        try:
            os.unlink(self.sock_path)  # a dead validator's (we hold the lock)
        except OSError:
            pass
        self.listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.listener.bind(self.sock_path)
        os.chmod(self.sock_path, 0o600)
        self.listener.listen(64)
        self.ready.write(b"R")
        self.ready.close()
        self.selector.register(self.listener, selectors.EVENT_READ, ("accept", None))
        try:
            self.serve()
        finally:
            self.retire()
        return 0

    def serve(self):
        idle_since = time.monotonic()
        while True:
            idle = time.monotonic() - idle_since
            if not self.children and idle >= self.idle_s:
                validator_note("idle for %.0f s: exiting" % self.idle_s)
                return
            for selected, _ in self.selector.select(timeout=max(0.05, self.idle_s - idle)):
                what, pidfd = selected.data
                if what == "accept":
                    conn, _ = self.listener.accept()
                    if not self.serve_one(conn):
                        return  # stale: the stand-in starts another validator
                elif what == "client":  # the stand-in closed its end: stopped while validating
                    pid, conn = self.children[pidfd]
                    self.selector.unregister(conn)
                    try:
                        os.kill(pid, signal.SIGKILL)
                    except OSError:
                        pass
                else:  # "child": a validation child exited
                    self.reap(pidfd)
                    idle_since = time.monotonic()

    def reap(self, pidfd):
        pid, conn = self.children.pop(pidfd)
        self.selector.unregister(pidfd)
        os.close(pidfd)
        _, status = os.waitpid(pid, 0)
        if os.WIFSIGNALED(status):
            try:
                send_message(conn, {"signal": os.WTERMSIG(status)})
            except OSError:
                pass
        try:
            self.selector.unregister(conn)
        except (KeyError, ValueError):
            pass
        conn.close()

    def counts(self, name):
        """Whether a start must agree with this validator on the environment variable `name`."""
        if name in NOISE_ENV or name.startswith(NOISE_ENV_PREFIXES):
            return False
        return self.every_name_counts or name in self.looked_up or name.startswith(IMPORT_ENV_PREFIXES)

    def stale(self, request):
        """Why this validator must not validate `request` (None: it may)."""
        now = files_state(self.files)
        changed = sorted(path for path in self.files if now[path] != self.files[path])
        if changed:
            return "changed: %s" % ", ".join("%s %s -> %s" % (path, self.files[path], now[path])
                                             for path in changed[:5])
        theirs, ours = request["env"], self.start_env
        other = sorted(name for name in set(theirs) | set(ours)
                       if self.counts(name) and theirs.get(name) != ours.get(name))
        return "another environment (%s)" % ", ".join(other) if other else None

    def child_environment(self, env):
        """What a fresh validation child started with `env` would have after its import: ours
        after the import (it may have added names), with what `env` differs in from ours before."""
        out = dict(os.environ)
        for name in set(env) | set(self.start_env):
            if env.get(name) != self.start_env.get(name):
                if name in env:
                    out[name] = env[name]
                else:
                    out.pop(name, None)
        return out

    def serve_one(self, conn):
        """One start: the checks, then a validation child; False when this validator is stale."""
        try:
            conn.settimeout(30)
            request, fds = recv_message(conn, max_fds=2)
            conn.settimeout(None)
        except (OSError, EOFError, ValueError):
            conn.close()
            return True
        why = self.stale(request)
        if why:
            validator_note("stale (%s): exiting" % why)
            self.retire()
            try:
                send_message(conn, {"stale": True})
            except OSError:
                pass
            conn.close()
            for fd in fds:
                os.close(fd)
            return False
        self.idle_s = request.get("idle_s", self.idle_s)  # the latest start says how long to wait
        request["env"] = self.child_environment(request["env"])
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            try:
                self.listener.close()
                os.close(self.lock)
                for _pid, other in self.children.values():
                    other.close()
                os.dup2(fds[0], 1)
                os.dup2(fds[1], 2)
                for fd in fds:
                    os.close(fd)
                validation_in_fork(conn, request, self.outcome)
            finally:
                os._exit(1)
        for fd in fds:
            os.close(fd)
        pidfd = os.pidfd_open(pid)
        self.children[pidfd] = (pid, conn)
        self.selector.register(pidfd, selectors.EVENT_READ, ("child", pidfd))
        self.selector.register(conn, selectors.EVENT_READ, ("client", pidfd))
        return True

    def retire(self):
        """Give up the socket path and the lock (idempotent)."""
        if self.listener is not None:
            try:
                if os.stat(self.sock_path).st_ino == os.fstat(self.listener.fileno()).st_ino:
                    os.unlink(self.sock_path)
            except OSError:
                pass
            self.selector.unregister(self.listener)
            self.listener.close()
            self.listener = None
        if self.lock is not None:
            os.close(self.lock)
            self.lock = None


def validation_in_fork(conn, request, outcome):
    """A validation child of the warm validator: the start's environment and working directory,
    its stdout/stderr already on fds 1 and 2; the answer goes back over `conn`."""
    os.environ.clear()
    os.environ.update(request["env"])
    os.chdir(request["cwd"])
    importlib.invalidate_caches()
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    summary, code = outcome(request["argv"], request["gpu"])
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    send_message(conn, {"exit": code, "summary": summary, "validator": os.getppid()})
    conn.close()
    os._exit(code)


# ---------------------------------------------------------------- validation records

RECORDS_ENV = "SGLFLEET_SIM_VALIDATION_RECORDS"
RECORDS_KEPT = 64
SHARED_RECORDS_ENV = "SGLFLEET_SIM_SHARED_RECORDS"
SHARED_RECORDS_FILE = "shared-records"  # beside the validator: the machine-wide directory's path
SHARED_RECORDS_KEPT = 512
BIND_PLACEHOLDER = "<the starting host's --host>"
RECORD_FILE_BYTES = 4 << 20  # files the argv names: above this, by size and mtime (weights), not content


def records_enabled():
    return os.environ.get(RECORDS_ENV, "1") != "0"


def records_dir():
    return os.path.join(os.path.dirname(validator_paths()[0]), "validated")


def shared_records_dir():
    """The machine-wide records directory `lab up` named for this host, or None (not named, or
    SGLFLEET_SIM_SHARED_RECORDS=0)."""
    if os.environ.get(SHARED_RECORDS_ENV, "1") == "0":
        return None
    try:
        with open(os.path.join(os.path.dirname(validator_paths()[0]), SHARED_RECORDS_FILE)) as fh:
            path = fh.read().strip()
    except OSError:
        return None
    return path if os.path.isabs(path) else None


def bind_address(argv):
    """The address the argv binds (its last --host), or None."""
    found = None
    for index, value in enumerate(argv):
        if value == "--host" and index + 1 < len(argv):
            found = argv[index + 1]
        elif value.startswith("--host="):
            found = value.split("=", 1)[1]
    return found


def keyed_argv(argv):
    """The argv as the key sees it: every --host value is the placeholder."""
    out = []
    for index, value in enumerate(argv):
        if index > 0 and argv[index - 1] == "--host":
            value = BIND_PLACEHOLDER
        elif value.startswith("--host="):
            value = "--host=" + BIND_PLACEHOLDER
        out.append(value)
    return out


def rebind(value, old, new):
    """`value` (a summary) with every string equal to `old` made `new`."""
    if isinstance(value, dict):
        return {k: rebind(v, old, new) for k, v in value.items()}
    if isinstance(value, list):
        return [rebind(v, old, new) for v in value]
    return new if isinstance(value, str) and value == old else value


def holds_inside(value, text):
    """Whether a string in `value` contains `text` without being it (a URL with the address)."""
    if isinstance(value, dict):
        return any(holds_inside(v, text) for v in value.values())
    if isinstance(value, list):
        return any(holds_inside(v, text) for v in value)
    return isinstance(value, str) and text in value and value != text


def noise(name):
    """An environment variable no validation reads: the session's, or the stand-in's own knob
    (the accept-length scale is the stand-in's too, but its summary depends on it)."""
    if name == "SGLFLEET_SIM_ACCEPT_SCALE":
        return False
    return name in NOISE_ENV or name.startswith(NOISE_ENV_PREFIXES)


def tree_digest(add, root, by_content=lambda size: True):
    """Every file below `root` (__pycache__ aside: written by imports) into the digest."""
    for directory, dirs, names in os.walk(root):
        dirs[:] = sorted(d for d in dirs if d != "__pycache__")
        for name in sorted(names):
            path = os.path.join(directory, name)
            try:
                st = os.stat(path)
            except OSError:
                continue
            if not stat.S_ISREG(st.st_mode):
                continue
            if by_content(st.st_size):
                add(os.path.relpath(path, root), file_sha256(path))
            else:
                add(os.path.relpath(path, root), st.st_size, st.st_mtime_ns)


def file_sha256(path):
    with open(path, "rb") as fh:  # whole: sources, configs and .pth files are small
        return hashlib.sha256(fh.read()).hexdigest()


def validation_key(argv, gpu):
    """What this start's validation can depend on, hashed (see VALIDATION RECORDS above); None
    where the sglang package cannot be found without importing it."""
    spec = importlib.util.find_spec("sglang")  # locates the package; imports nothing
    if spec is None or not spec.submodule_search_locations:
        return None
    root = list(spec.submodule_search_locations)[0]
    site = os.path.dirname(root)
    digest = hashlib.sha256()

    def add(*parts):
        for part in parts:
            digest.update(str(part).encode("utf-8", "surrogateescape") + b"\0")

    add("sim-validation-v2", sys.executable, sys.version, gpu, os.getcwd(), len(argv), *keyed_argv(argv))
    add("|env", *("%s=%s" % (n, os.environ[n]) for n in sorted(os.environ) if not noise(n)))
    add("|sglang")
    tree_digest(add, root)
    add("|site")
    for name in sorted(os.listdir(site)):
        path = os.path.join(site, name)
        add(name, file_sha256(path) if os.path.isfile(path) else "dir")
    for value in argv:  # the model, the draft model, a tokenizer: what validation reads from disk
        path = value.split("=", 1)[1] if value.startswith("--") and "=" in value else value
        if os.path.isabs(path) and os.path.exists(path):
            add("|path", path)
            if os.path.isdir(path):
                tree_digest(add, path, lambda size: size <= RECORD_FILE_BYTES)
            else:
                add(file_sha256(path) if os.path.getsize(path) <= RECORD_FILE_BYTES else os.path.getsize(path))
    return digest.hexdigest()[:32]


def recorded_validation(key, argv):
    """The record an earlier accepted start with this key left, on this host or (shared) on
    another, its summary bound to this argv's address; None if there is none."""
    for directory in (records_dir(), shared_records_dir()):
        if directory is None:
            continue
        path = os.path.join(directory, key + ".json")
        try:
            with open(path) as fh:
                record = json.load(fh)
            os.utime(path)  # the newest used are the ones kept
        except (OSError, ValueError):
            continue
        if isinstance(record, dict) and isinstance(record.get("summary"), dict):
            address = bind_address(argv)
            if address is not None:
                record["summary"] = rebind(record["summary"], BIND_PLACEHOLDER, address)
            return record
    return None


def record_validation(key, summary, argv):
    """Kept readable by the host's user only: the resolved args carry what the argv did, an
    --api-key included. On this host; and in the shared directory unless the bind address is
    also elsewhere in the argv, or inside another value of the summary: a value equal to it would
    then not surely be the bind address, and could not be given another host's."""
    address = bind_address(argv)
    shared = shared_records_dir()
    if address is not None:
        if holds_inside(summary, address) or any(address in value for value in keyed_argv(argv)):
            shared = None
        summary = rebind(summary, address, BIND_PLACEHOLDER)
    # hosts of two labs may share a name: the address tells them apart in the log
    record = {"time": time.time(), "host": socket.gethostname(), "address": address, "summary": summary}
    for directory, kept in ((records_dir(), RECORDS_KEPT), (shared, SHARED_RECORDS_KEPT)):
        if directory is not None:
            write_record(directory, key, record, kept)


def write_record(directory, key, record, kept):
    try:
        os.makedirs(directory, mode=0o700, exist_ok=True)
        # hosts of two labs may share a name and a pid (each has its own pid namespace)
        temp = os.path.join(directory, ".%s.%s.tmp" % (key, os.urandom(8).hex()))
        with os.fdopen(os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600), "w") as fh:
            json.dump(record, fh)
        os.replace(temp, os.path.join(directory, key + ".json"))
        records = []
        for name in os.listdir(directory):
            if name.endswith(".json"):
                try:  # another host may prune the same directory meanwhile
                    records.append((os.stat(os.path.join(directory, name)).st_mtime, name))
                except OSError:
                    pass
        for _mtime, name in sorted(records)[:-kept]:
            try:
                os.unlink(os.path.join(directory, name))
            except OSError:
                pass
    except OSError:
        pass  # a start that cannot record validates again next time: nothing is wrong with it
