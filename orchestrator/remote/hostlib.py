"""The host-side library: what every remote script needs, written once.

The controller's `fleet.remote_call.call` sends this file ahead of each script on the same stdin
(see `serve` for the layout), registers it as the module `sglfleet_hostlib`, and the script
imports it from there; on the controller (tests, `smoke --local` bookkeeping) it is the
ordinary module `orchestrator.remote.hostlib`. One fact, one function: the package location and
its dist-info version, the GPU listing, the durable writes, the host lock, the state paths.

`serve` is the one call convention's host half: it runs `COMMANDS[command](args, stream)` of the
script and prints ONE JSON envelope on the original stdout:
    {"ok": true, "value": ...}
    {"ok": false, "error": {"type", "message", "traceback", "detail"}}
Anything else the script (or SGLang) prints goes to stderr, so it can never corrupt the envelope.
Stdlib only; runs on Python 3.8+ (hosts bring their own interpreter). It runs on every host for
every call, so it imports only what every call uses; shutil and traceback (3-4 ms of a host's CPU
per call together) are imported where they are needed, as is hashlib (files are hashed with it; the
code cache's few KB with the interpreter's own sha256).
"""

import fcntl
import json
import marshal
import os
import stat
import sys
import time

try:  # the interpreter's own sha256 for the code cache's few KB: importing hashlib loads OpenSSL, ~3 ms of
    # a host's CPU per call, more than it saves on them (files are hashed by sha256_file, with hashlib)
    from _sha256 import sha256  # Python <= 3.11
except ImportError:
    try:
        from _sha2 import sha256  # Python >= 3.12
    except ImportError:
        from hashlib import sha256

# The one place the host's state directory is spelled out (controller and host alike).
STATE_DIR = "/var/lib/sglfleet"
LOCK_FILE = "lock"
JOURNAL_FILE = "journal.json"
CURRENT_FILE = "current"
RELEASES_DIR = "releases"
ROLLBACKS_DIR = "rollbacks"
CACHE_DIR = "cache"
LOG_DIR = "/var/log/sglfleet"

EXIT_FAILED = 1
EXIT_LOCKED = 3

# One nvidia-smi query answers every GPU question (the lab pre-renders exactly this query).
GPU_QUERY = ["--query-gpu=index,name,memory.total,driver_version,compute_cap", "--format=csv,noheader,nounits"]

# Set by `serve` when the configured interpreter was missing and python3 runs us instead.
INTERPRETER_MISSING = False


class Failure(Exception):
    """A refusal or failure a script explains; `detail` carries extra JSON fields and `code`
    is the process's exit status."""

    def __init__(self, message, code=EXIT_FAILED, **detail):
        super().__init__(message)
        self.code = code
        self.detail = detail


def log(message):
    sys.stderr.write("sglfleet-remote: %s\n" % message)
    sys.stderr.flush()


def server_paths(profile):
    """Where the server of one profile lives on a host: its launch script and env file, the
    detached supervisor's pidfile, the deployment record, its log (journald on systemd hosts:
    the unit's), and its systemd unit. `profile` is a profile name (a safe slug, checked when the
    profile is loaded)."""
    base = "%s/servers/%s" % (STATE_DIR, profile)
    unit = "sglfleet-%s.service" % profile
    return {"dir": base, "launch_script": base + "/launch.sh", "env_file": base + "/sglang.env",
            "pidfile": base + "/server.pid", "record": base + "/deployment.json",
            "log": "%s/%s.log" % (LOG_DIR, profile), "unit": unit, "unit_file": "/etc/systemd/system/" + unit}


# ---------------------------------------------------------------- files


def sha256_file(path):
    import hashlib  # OpenSSL's sha256: 3.5x the interpreter's own on a release's large files

    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def fsync_dir(path):
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_bytes_atomic(path, data, mode=None):
    """`path` holds either its old bytes or `data`, whatever happens: temp file beside it,
    fsync, rename, fsync the directory."""
    directory = os.path.dirname(path) or "."
    os.makedirs(directory, exist_ok=True)
    tmp = os.path.join(directory, ".%s.tmp-%d" % (os.path.basename(path), os.getpid()))
    # Created with its mode, not chmod'ed after: an owner-only file never exists readable by others.
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o666 if mode is None else mode & 0o777)
    with os.fdopen(fd, "wb") as fh:
        fh.write(data)
        fh.flush()
        os.fsync(fh.fileno())
    if mode is not None:
        os.chmod(tmp, mode)
    os.replace(tmp, path)
    fsync_dir(directory)


def write_json_atomic(path, document, mode=None):
    write_bytes_atomic(path, json.dumps(document, indent=1, sort_keys=True).encode(), mode)


def read_json(path, default=None):
    try:
        with open(path) as fh:
            return json.load(fh)
    except (OSError, ValueError):
        return default


def copy_durable(source, dest):
    """Copy bytes and mode, fsync'd, creating parent dirs."""
    import shutil

    os.makedirs(os.path.dirname(dest), exist_ok=True)
    shutil.copyfile(source, dest)
    shutil.copymode(source, dest)
    with open(dest, "rb+") as fh:
        os.fsync(fh.fileno())


def temp_name(target, txid):
    head, tail = os.path.split(target)
    return os.path.join(head, ".%s.sglfleet-%s" % (tail, txid))


def swap_in(source, target, txid):
    """Make `target` hold `source`'s bytes atomically: a temp file in the target's own
    directory (same filesystem), fsync, rename over the target, fsync the directory."""
    tmp = temp_name(target, txid)
    copy_durable(source, tmp)
    os.replace(tmp, target)
    fsync_dir(os.path.dirname(target))


# ---------------------------------------------------------------- packages


def _normalize(name):
    return name.lower().replace("-", "_").replace(".", "_")


def dist_version(directory, package):
    """The version in `<package>-<version>.dist-info` inside `directory`, read from the folder
    name (importlib.metadata would cost imports on every host of every call)."""
    wanted = _normalize(package)
    try:
        listing = os.listdir(directory or ".")
    except OSError:
        return None
    for item in listing:
        if item.endswith(".dist-info"):
            name, _, rest = item[: -len(".dist-info")].partition("-")
            if _normalize(name) == wanted:
                return rest
    return None


def distributions(*names):
    """Installed versions of `names` on sys.path (None: not installed)."""
    found = dict.fromkeys(names)
    for entry in sys.path:
        for name in names:
            if found[name] is None:
                found[name] = dist_version(entry, name)
    return found


def locate_package(package):
    """Package dir, version and site-packages, without importing the package (seconds)."""
    import importlib.util

    try:
        spec = importlib.util.find_spec(package)
    except (ImportError, ValueError):  # not a module name, or a parent package that is missing
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    root = list(spec.submodule_search_locations)[0]
    site = os.path.dirname(root)
    return {"name": package, "root": root, "site": site, "version": dist_version(site, package)}


def torch_build(site):
    """torch's version and CUDA version, read from torch/version.py (importing torch takes seconds)."""
    found = {"version": None, "cuda": None}
    try:
        with open(os.path.join(site, "torch", "version.py")) as fh:
            text = fh.read()
    except OSError:
        return found
    for line in text.splitlines():
        key, _, value = line.partition("=")
        key = key.split(":")[0].strip()
        value = value.strip().strip("'\"")
        if key == "__version__":
            found["version"] = value
        elif key == "cuda":
            found["cuda"] = None if value in ("None", "") else value
    return found


# ---------------------------------------------------------------- processes and GPUs


def run_command(argv, timeout=20):
    """Run argv with stdout/stderr captured, via posix_spawnp and pipes: the subprocess module
    costs ~8 ms of imports, paid on every host of every facts call."""
    import select

    started = time.monotonic()
    path = os.environ.get("PATH", "/usr/bin:/bin").split(os.pathsep)
    if "/" not in argv[0] and not any(os.access(os.path.join(d, argv[0]), os.X_OK) for d in path):
        return {"rc": 127, "stdout": "", "stderr": "%s: command not found" % argv[0], "seconds": 0.0}
    out_r, out_w = os.pipe()
    err_r, err_w = os.pipe()
    actions = [(os.POSIX_SPAWN_DUP2, out_w, 1), (os.POSIX_SPAWN_DUP2, err_w, 2),
               (os.POSIX_SPAWN_CLOSE, out_r), (os.POSIX_SPAWN_CLOSE, err_r)]
    pid = os.posix_spawnp(argv[0], argv, os.environ, file_actions=actions)
    os.close(out_w)
    os.close(err_w)
    chunks = {out_r: [], err_r: []}
    open_fds = [out_r, err_r]
    while open_fds:
        left = timeout - (time.monotonic() - started)
        ready = select.select(open_fds, [], [], max(0.0, left))[0] if left > 0 else []
        if not ready:
            os.kill(pid, 9)
            break
        for fd in ready:
            data = os.read(fd, 65536)
            if data:
                chunks[fd].append(data)
            else:
                open_fds.remove(fd)
    for fd in (out_r, err_r):
        os.close(fd)
    status = os.waitpid(pid, 0)[1]
    timed_out = bool(open_fds)
    rc = None if timed_out else (os.WEXITSTATUS(status) if os.WIFEXITED(status) else -os.WTERMSIG(status))
    return {"rc": rc, "stdout": b"".join(chunks[out_r]).decode("utf-8", "surrogateescape"),
            "stderr": ("timed out after %ss" % timeout) if timed_out else
            b"".join(chunks[err_r]).decode("utf-8", "surrogateescape"),
            "seconds": time.monotonic() - started}


def parse_gpus(stdout):
    """Rows of GPU_QUERY's CSV. Lines that are not rows (a banner, a warning) are skipped."""
    gpus = []
    for line in stdout.splitlines():
        cells = [c.strip() for c in line.split(",")]
        if len(cells) != 5 or not cells[0].isdigit():
            continue
        cap = cells[4]
        gpus.append({"index": int(cells[0]), "name": cells[1],
                     "memory_mib": int(cells[2]) if cells[2].isdigit() else None, "driver": cells[3],
                     "compute_cap": cap, "arch": "sm_" + cap.replace(".", "") if cap.replace(".", "").isdigit()
                     else None})
    return gpus


def gpus():
    """The host's NVIDIA GPUs: [] when there is no nvidia-smi, [{"error": ...}] when it fails."""
    result = run_command(["nvidia-smi"] + GPU_QUERY)
    if result["rc"] == 127:
        return []
    if result["rc"] != 0:
        return [{"error": (result["stderr"] or "nvidia-smi failed").strip()}]
    return parse_gpus(result["stdout"])


def systemd_is_pid1():
    """Whether this host's init is systemd (its units, not a detached supervisor, run servers)."""
    try:
        with open("/proc/1/comm") as fh:
            return fh.read().strip() == "systemd"
    except OSError:
        return False


# ---------------------------------------------------------------- the host lock


class Lock:
    """flock on <state>/lock; the file holds the holder's description for whoever is refused.

    A holder that lets go within `wait_s` is waited for: another run's short step under the lock
    (a deploy's plan checking its lease) must not fail a run that is already under way; a run
    that holds the host longer (a push, a swap) is refused, naming it."""

    def __init__(self, state, holder, wait_s=5.0):
        os.makedirs(state, exist_ok=True)
        self.path = os.path.join(state, LOCK_FILE)
        self.holder = holder
        self.wait_s = wait_s
        self.fd = None

    def _acquire(self, fd):
        deadline = time.monotonic() + self.wait_s
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                return
            except OSError:
                if time.monotonic() >= deadline:
                    raise
                time.sleep(0.05)

    def __enter__(self):
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            self._acquire(fd)
        except OSError:
            with os.fdopen(os.dup(fd)) as fh:
                holder = read_holder(fh.read())
            os.close(fd)
            raise Failure("host is locked by another sglfleet run: %s" % describe_holder(holder), EXIT_LOCKED,
                          holder=holder)
        holder = dict(self.holder, pid=os.getpid(), since=time.time())
        os.ftruncate(fd, 0)
        os.pwrite(fd, json.dumps(holder).encode(), 0)
        self.fd = fd
        return self

    def __exit__(self, *exc):
        os.ftruncate(self.fd, 0)
        os.close(self.fd)  # closing releases the flock


def read_holder(text):
    try:
        return json.loads(text)
    except ValueError:
        return {}


def lock_holder(state):
    """Who holds the lock now, as its file says (None: nobody wrote one)."""
    try:
        with open(os.path.join(state, LOCK_FILE)) as fh:
            text = fh.read()
    except OSError:
        return None
    return read_holder(text) if text else None


def describe_holder(holder):
    if not holder:
        return "holder unknown"
    since = holder.get("since")
    age = " for %.0fs" % (time.time() - since) if since else ""
    return "%s@%s running `%s` (remote pid %s)%s" % (holder.get("user", "?"), holder.get("controller", "?"),
                                                    holder.get("command", "?"), holder.get("pid", "?"), age)


# ---------------------------------------------------------------- the deploy lease

# A deploy spans several round trips; between them its lease (taken under the lock by
# remote/server.py) says the host is being deployed. Written and dropped only by server.py.
DEPLOY_LEASE_FILE = "deploy-lease.json"


def deploy_lease_conflict(state, deploy_id=None):
    """The live lease of a deploy other than `deploy_id` on this host (None: no such lease), for
    any command that changes the host while a deploy may be between its steps."""
    held = read_json(os.path.join(state, DEPLOY_LEASE_FILE))
    if not held or held.get("id") == deploy_id:
        return None
    if time.time() - held.get("since", 0) > held.get("ttl", 0):
        return None  # expired: its deploy died without dropping it
    return held


# ---------------------------------------------------------------- the call convention


# Companion scripts sent with this call (name -> module), for a command that needs another
# script's functions in the same process (e.g. server.py's plan runs server_facts.py's facts).
COMPANIONS = {}


def companion(name):
    """The companion script `name` sent with this call, as a module (KeyError: it was not sent)."""
    if name not in COMPANIONS:
        raise Failure("this call was not sent the companion script %s" % name)
    return COMPANIONS[name]


def serve(stream, sizes, script_name, command):
    """Run one command of the script that follows this library on `stream` (stdin).

    stdin: `<hostlib size> <script code> <args size> [<companion> <code>]...\\n`, this file, the
    script, the args JSON, each companion script, then the command's own payload (e.g. a tar
    stream), which the command reads from `stream`. `sizes` is that header line without the
    first number. A script's code token says where its code comes from (`_code_token`): `N`, its
    N bytes follow; `N@SHA`, they follow and are kept in this user's code cache as SHA (their
    sha256); `@SHA`, nothing follows: the cached code of SHA runs. When one is not cached, nothing
    is read or run and the answer is a Failure (EXIT_CODE_MISSING) naming the missing scripts,
    for the controller to send again with the bodies."""
    envelope = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)  # stray prints (SGLang's, a script's) go to stderr, never into the envelope
    sys.stdout = sys.stderr
    code = 0
    try:
        names = [script_name] + [_text(name) for name in sizes[2::2]]
        tokens = [_text(sizes[0])] + [_text(token) for token in sizes[3::2]]
        args_size = int(sizes[1])
        cache = code_cache_dir()
        cached = {}
        for name, token in zip(names, tokens):
            size, digest = _code_token(token)
            if size is None:
                cached[name] = cached_code(cache, name, digest)
        missing = [name for name, found in cached.items() if found is None]
        if missing:
            raise Failure("not in this host's code cache: %s" % ", ".join(missing), EXIT_CODE_MISSING,
                          code_missing=missing)
        module = load_module(stream, script_name, tokens[0], "sglfleet_script", cache, cached.get(script_name))
        args = json.loads(stream.read(args_size).decode("utf-8")) if args_size else {}
        for name, token in zip(names[1:], tokens[1:]):
            name = os.path.basename(name)
            COMPANIONS[name] = load_module(stream, name, token, "sglfleet_companion_" + name.split(".")[0], cache,
                                           cached.get(name))
        commands = module.__dict__.get("COMMANDS", {})
        if command not in commands:
            raise Failure("%s has no command %r (it has: %s)" % (script_name, command, ", ".join(sorted(commands))))
        document = {"ok": True, "value": commands[command](args, stream)}
    except Failure as exc:
        code = exc.code
        document = {"ok": False, "error": {"type": "Failure", "message": str(exc), "traceback": None,
                                           "detail": exc.detail}}
    except BaseException as exc:  # noqa: BLE001 - reported whole, with its traceback
        import traceback

        code = EXIT_FAILED
        document = {"ok": False, "error": {"type": type(exc).__name__, "message": str(exc),
                                           "traceback": traceback.format_exc(), "detail": {}}}
    envelope.write(json.dumps(document, default=str))
    envelope.flush()
    return code


def _text(value):
    return value.decode("utf-8") if isinstance(value, bytes) else value


def _code_token(token):
    """(bytes that follow or None, sha256 hex or None) of a header's code token."""
    size, _, digest = token.partition("@")
    return (int(size) if size else None), (digest or None)


def load_module(stream, name, token, module_name, cache=None, code=None):
    """A script run as a module named `module_name` (file name `name`): `code` (from the cache),
    or the bytes that follow on `stream` as `token` says, kept in `cache` when it names a hash."""
    if code is None:
        size, digest = _code_token(token)
        source = stream.read(size)
        if digest is not None and sha256(source).hexdigest() != digest:
            raise Failure("%s arrived damaged: its sha256 is not the %s the controller sent" % (name, digest))
        code = compile(source, name, "exec")
        if digest is not None and cache is not None:
            keep_code(cache, name, digest, code)
    module = type(sys)(module_name)
    module.__file__ = name
    exec(code, module.__dict__)
    return module


# The code cache: each remote script's compiled code, kept per user by the sha256 of its source, so
# a call sends the hash instead of the script (its body only when the host lacks it) and the host
# does not compile it again. A changed script has another hash, so no stale copy can run; an
# entry is checked against its own sha256 before it is used (a damaged one is dropped, and counts
# as missing); the directory is used only while it is this user's alone (0700, owned by us).
CODE_CACHE_DIR = os.path.join("sglfleet", "remote-code")  # under $XDG_CACHE_HOME or ~/.cache
CODE_MAGIC = b"sglfleet-code-1\n"
EXIT_CODE_MISSING = 4


def code_cache_dir():
    """This user's code cache directory, made if need be; None when it cannot be made or trusted
    (not a directory of ours, or open to others), and then nothing is cached."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    path = os.path.join(base, CODE_CACHE_DIR)
    try:
        os.makedirs(path, mode=0o700, exist_ok=True)
        info = os.lstat(path)
    except OSError:
        return None
    if not stat.S_ISDIR(info.st_mode) or info.st_uid != os.geteuid() or info.st_mode & 0o077:
        log("code cache %s is not this user's alone (mode %o, uid %d): not used" % (
            path, stat.S_IMODE(info.st_mode), info.st_uid))
        return None
    return path


def _code_path(cache, name, digest):
    stem = os.path.basename(name).rsplit(".", 1)[0]
    return os.path.join(cache, "%s-%s.%s" % (stem, digest, sys.implementation.cache_tag))


def cached_code(cache, name, digest):
    """The cached code of script `name` with source sha256 `digest`, or None (a damaged entry is
    removed)."""
    if cache is None:
        return None
    path = _code_path(cache, name, digest)
    try:
        with open(path, "rb") as fh:
            data = fh.read()
    except OSError:
        return None
    head = len(CODE_MAGIC) + 32
    if data[:len(CODE_MAGIC)] == CODE_MAGIC and sha256(data[head:]).digest() == data[len(CODE_MAGIC):head]:
        try:
            return marshal.loads(data[head:])
        except (EOFError, ValueError, TypeError):
            pass
    log("code cache entry %s is damaged: dropped" % path)
    try:
        os.unlink(path)
    except OSError:
        pass
    return None


def keep_code(cache, name, digest, code):
    """Keep `code` as script `name`'s cached code (0600, written whole then renamed into place);
    a cache that cannot be written is only a slower next call."""
    data = marshal.dumps(code)
    path = _code_path(cache, name, digest)
    tmp = "%s.%d.tmp" % (path, os.getpid())
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "wb") as fh:
            fh.write(CODE_MAGIC + sha256(data).digest() + data)
        os.replace(tmp, path)
    except OSError as exc:
        log("code cache: cannot keep %s (%s)" % (path, exc))
        try:
            os.unlink(tmp)
        except OSError:
            pass


def main(commands):
    """`python -m orchestrator.remote.SCRIPT COMMAND ARGS_JSON` on a controller or host, for
    debugging a script by hand: the same commands, the value printed as JSON."""
    command, args = sys.argv[1], json.loads(sys.argv[2]) if len(sys.argv) > 2 else {}
    try:
        value = commands[command](args, sys.stdin.buffer)
    except Failure as exc:
        sys.stdout.write(json.dumps({"error": str(exc), "detail": exc.detail}) + "\n")
        return exc.code
    sys.stdout.write(json.dumps(value, default=str) + "\n")
    return 0
