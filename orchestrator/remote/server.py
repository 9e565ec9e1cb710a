"""Host side of `deploy`, `status` and `stop`: what runs, launch/stop, health, records, supervision.

Commands (each ONE exec round trip through the call convention, fleet/remote_call.py):

    plan     everything a deploy decides on, in one round trip: the server facts and the release
             inspection (server_facts.py and release.py are sent with the call as companions,
             hostlib.companion, and run in this same process), with `doctor` doctor.py's facts
             (doctor.py and gather_facts.py companions too), what runs now (record, pid alive,
             start time, argv hash), who holds the port, systemd or not; with `lease`, it takes
             the host's deploy lease.
    launch   (lease) refuse a foreign port holder; keep the current generation in previous/;
             stop the running server (SIGTERM, drain, SIGKILL after the grace); write the env
             file, launch script and unit; start it (systemd, or the detached supervisor).
    health   one health stage, polled here on the host until it passes, times out, or the
             process exits (then: its exit code and its whole log since it started); a definite
             wrong answer (/generate 200 without text) fails at once; `min_ready`: alive and
             /health 200 for the whole window.
    finish   (lease) write the deployment record; drop the lease.
    revert   (lease) stop the failed server; restore previous/ and start it (or leave it stopped).
    status   per managed profile: record, process, uptime, a quick /health and accept length.
    stop     (host lock) stop managed servers: SIGTERM, drain, SIGKILL after the grace.
    unlease  drop this deploy's lease (a deploy that ends early).

`python3 server.py supervise CONFIG.json` (on the host, from bin/ under the state dir) is the
detached supervisor used where PID 1 is not systemd: its own session, the server's output to
<log> with size-based rotation (<log>.1 newest ... <log>.K), SIGTERM forwarded to the server
only (as systemd's KillMode=mixed), SIGKILL to the server's process group after the grace,
status in supervisor.json.

The deploy lease (deploy-lease.json in the state dir) spans one deploy's round trips; it is
taken and dropped under the host lock (hostlib.Lock, the one `push` takes), so a second deploy
is refused naming the holder. Stdlib + hostlib only, Python 3.8+; importable for unit tests.
"""

import hashlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time

try:  # on the host: sent ahead of this file by the call convention (fleet/remote_call.py)
    import sglfleet_hostlib as hostlib
except ImportError:  # on the controller (unit tests), or the supervisor started from bin/
    try:
        from orchestrator.remote import hostlib
    except ImportError:
        sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
        import sglfleet_hostlib as hostlib  # noqa: F811 - the copy written beside us in bin/

Failure, log, read_json = hostlib.Failure, hostlib.log, hostlib.read_json

LEASE_FILE = hostlib.DEPLOY_LEASE_FILE
SUPERVISOR_STATUS = "supervisor.json"
PREVIOUS_DIR = "previous"
BIN_DIR = "bin"
MARKER = "==== sglfleet supervisor:"
DEFAULT_LOG_MAX_BYTES = 32 << 20
DEFAULT_LOG_KEEP = 5
DRAIN_MARK = "Gracefully exiting... Remaining number of requests"
WILDCARDS = ("0.0.0.0", "::", "")


def state_dir(args):
    return args.get("state_dir") or hostlib.STATE_DIR


def paths_for(args, profile=None):
    """hostlib.server_paths, moved under args' state dir / log dir when tests give them."""
    paths = dict(hostlib.server_paths(profile or args["profile"]))
    state, logs = args.get("state_dir"), args.get("log_dir")
    if state:
        for key in ("dir", "launch_script", "env_file", "pidfile", "record"):
            paths[key] = state + paths[key][len(hostlib.STATE_DIR):]
    if logs:
        paths["log"] = os.path.join(logs, os.path.basename(paths["log"]))
    if args.get("unit_dir"):
        paths["unit_file"] = os.path.join(args["unit_dir"], paths["unit"])
    paths["status"] = os.path.join(paths["dir"], SUPERVISOR_STATUS)
    paths["previous"] = os.path.join(paths["dir"], PREVIOUS_DIR)
    return paths


def sha256_text(text):
    return hashlib.sha256(text.encode("utf-8", "surrogateescape")).hexdigest()


# ---------------------------------------------------------------- processes


def proc_start_ticks(pid):
    """Field 22 of /proc/PID/stat: when the process started (pid reuse cannot fake it)."""
    try:
        with open("/proc/%d/stat" % pid) as fh:
            fields = fh.read().rsplit(")", 1)[1].split()
    except (OSError, IndexError, TypeError):
        return None
    if fields[0] == "Z":  # a zombie has exited
        return None
    return int(fields[19])


def alive(pid, ticks=None):
    if not pid:
        return False
    now = proc_start_ticks(pid)
    return now is not None and (ticks is None or now == ticks)


def cmdline(pid):
    try:
        with open("/proc/%d/cmdline" % pid, "rb") as fh:
            return [a.decode("utf-8", "replace") for a in fh.read().split(b"\0") if a]
    except OSError:
        return None


def session_of(pid):
    try:
        with open("/proc/%d/stat" % pid) as fh:
            # after the ")" closing comm: state ppid pgrp session ...
            return int(fh.read().rsplit(")", 1)[1].split()[3])
    except (OSError, IndexError, ValueError):
        return None


def systemctl(*argv, timeout=120):
    return hostlib.run_command(["systemctl"] + list(argv), timeout=timeout)


def unit_state(unit):
    result = systemctl("show", unit, "-p", "MainPID", "-p", "ActiveState", "-p", "SubState", "-p",
                       "ExecMainStatus", "-p", "InvocationID", "-p", "ExecMainStartTimestampMonotonic")
    values = dict(line.split("=", 1) for line in result["stdout"].splitlines() if "=" in line)
    pid = int(values.get("MainPID") or 0)
    return {"pid": pid or None, "active": values.get("ActiveState"), "sub": values.get("SubState"),
            "exit_code": int(values["ExecMainStatus"]) if values.get("ExecMainStatus", "").isdigit() else None,
            "invocation": values.get("InvocationID") or None}


# ---------------------------------------------------------------- the port


def _hex_address(text):
    """An address of /proc/net/tcp{,6} in its text form."""
    if len(text) == 8:
        return socket.inet_ntop(socket.AF_INET, bytes.fromhex(text)[::-1])
    raw = bytes.fromhex(text)
    words = b"".join(raw[i:i + 4][::-1] for i in range(0, 16, 4))
    address = socket.inet_ntop(socket.AF_INET6, words)
    return address[7:] if address.startswith("::ffff:") and "." in address else address


def listeners(port):
    """[(address, inode)] of the sockets listening on `port` in this network namespace."""
    found = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            with open(table) as fh:
                rows = fh.read().splitlines()[1:]
        except OSError:
            continue
        for row in rows:
            cells = row.split()
            if len(cells) < 10 or cells[3] != "0A":  # 0A: LISTEN
                continue
            address, _, hex_port = cells[1].rpartition(":")
            if int(hex_port, 16) == port:
                found.append((_hex_address(address), int(cells[9])))
    return found


def socket_owners(inodes):
    """inode -> pid of a process (visible from here) holding that socket."""
    wanted = {"socket:[%d]" % i: i for i in inodes}
    owners = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or len(owners) == len(wanted):
            continue
        fd_dir = "/proc/%s/fd" % entry
        try:
            for fd in os.listdir(fd_dir):
                try:
                    target = os.readlink(os.path.join(fd_dir, fd))
                except OSError:
                    continue
                if target in wanted:
                    owners.setdefault(wanted[target], int(entry))
        except OSError:
            continue
    return owners


def clashes(address, bind):
    """Whether a listener on `address` keeps a server from binding `bind` (same port)."""
    return bind in WILDCARDS or address in WILDCARDS or address == bind


def port_holders(bind, port):
    """Who listens where our server would bind (bind None: on any address of the port):
    [{address, pid, cmdline}] (pid None: a process this host cannot see, e.g. in another pid
    namespace)."""
    clash = [(a, i) for a, i in listeners(port) if bind is None or clashes(a, bind)]
    owners = socket_owners([i for _, i in clash])
    holders = []
    for address, inode in clash:
        pid = owners.get(inode)
        holders.append({"address": address, "pid": pid, "cmdline": cmdline(pid) if pid else None,
                        "session": session_of(pid) if pid else None})
    return holders


def foreign_holders(holders, running):
    """The holders that are not our managed server (its process or a child in its session)."""
    ours = set()
    if running and running.get("alive") and running.get("pid"):
        ours.add(running["pid"])
    foreign = []
    for h in holders:
        if h["pid"] in ours or (h["session"] is not None and h["session"] in ours):
            continue
        if running and running.get("mode") == "systemd" and h["pid"] and _in_unit(h["pid"], running.get("unit")):
            continue
        foreign.append(h)
    return foreign


def _in_unit(pid, unit):
    try:
        with open("/proc/%d/cgroup" % pid) as fh:
            return unit is not None and ("/%s" % unit) in fh.read()
    except OSError:
        return False


def describe_holder(h):
    if h.get("profile"):
        return "profile %s's server (pid %s, deployed by sglfleet on %s) is listening on %s" % (
            h["profile"], h["pid"], time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(h.get("deployed") or 0)),
            h["address"])
    who = "pid %s (%s)" % (h["pid"], " ".join(h["cmdline"] or ["?"])) if h["pid"] else \
        "a process this host cannot see (another pid namespace or container)"
    return "%s is listening on %s" % (who, h["address"])


def name_profiles(args, holders):
    """Marks the holders that are another sglfleet profile's server here (its process, or one in
    its session or unit): `profile` and `deployed` (when its record was written)."""
    others = {}
    for profile in profiles_here(args) if holders else []:
        if profile != args.get("profile"):
            running = running_state(paths_for(args, profile))
            if running.get("alive") and running.get("pid"):
                others[profile] = running
    for h in holders:
        for profile, running in others.items():
            if h["pid"] and (h["pid"] == running["pid"] or h.get("session") == running["pid"] or
                             (running.get("mode") == "systemd" and _in_unit(h["pid"], running.get("unit")))):
                record = running.get("record") or {}
                h.update(profile=profile, deployed=record.get("recorded") or record.get("started"))
    return holders


# ---------------------------------------------------------------- what runs


def running_state(paths, unit_mode=None):
    """The managed server of one profile as the host sees it now."""
    record = read_json(paths["record"])
    status = read_json(paths["status"])
    mode = (record or {}).get("mode") or unit_mode
    if mode == "systemd" and shutil.which("systemctl") and hostlib.systemd_is_pid1():
        unit = unit_state(paths["unit"])
        pid = unit["pid"]
        return {"mode": "systemd", "unit": paths["unit"], "pid": pid, "alive": unit["active"] == "active" and
                bool(pid), "active": unit["active"], "exit_code": unit["exit_code"], "record": record,
                "invocation": unit["invocation"], "started": (record or {}).get("started")}
    status = status or {}
    pid, ticks = status.get("server_pid"), status.get("server_ticks")
    supervisor = status.get("supervisor_pid")
    return {"mode": "supervisor", "pid": pid, "alive": alive(pid, ticks), "record": record,
            "supervisor_pid": supervisor, "supervisor_alive": alive(supervisor, status.get("supervisor_ticks")),
            "exit_code": status.get("exit_code"), "started": status.get("started"),
            "start_id": status.get("start_id")}


# ---------------------------------------------------------------- the deploy lease


def lease_path(args):
    return os.path.join(state_dir(args), LEASE_FILE)


def take_lease(args):
    """Under the host lock: the lease is ours, or the deploy holding it is named."""
    lease = args["lease"]
    path = lease_path(args)
    with hostlib.Lock(state_dir(args), lease["holder"]):
        held = read_json(path)
        if held and held.get("id") != lease["id"]:
            age = time.time() - held.get("since", 0)
            stale = age > held.get("ttl", 0) or held.get("id") == lease.get("take_over")
            if not stale:
                raise Failure("host is being deployed by another sglfleet run: %s (deploy %s, %.0fs ago); "
                              "it holds the host until it ends or its lease expires in %.0fs"
                              % (hostlib.describe_holder(held.get("holder")), held.get("id"), age,
                                 held.get("ttl", 0) - age), hostlib.EXIT_LOCKED, holder=held.get("holder"),
                              lease=held)
            why = "its lease expired %.0fs ago" % (age - held.get("ttl", 0)) if age > held.get("ttl", 0) else \
                "its controller process is gone"
            log("taking over the lease of deploy %s (%s)" % (held.get("id"), why))
            took_over = {"id": held.get("id"), "why": why, "holder": held.get("holder"), "step": held.get("step")}
        else:
            took_over = None
        # `profile` and `step` let `status` name a deploy that was interrupted (its lease left behind)
        hostlib.write_json_atomic(path, {"id": lease["id"], "holder": lease["holder"], "since": time.time(),
                                         "ttl": lease.get("ttl", 1800), "profile": args.get("profile"),
                                         "step": "plan"})
    return took_over


def lease_step(args, step, **extra):
    """(Under the host lock, lease checked) the deploy reached `step`: recorded in its lease, whose
    time-to-live starts again with what this step and the ones after it may take (`lease_ttl`)."""
    path = lease_path(args)
    held = read_json(path) or {}
    if held.get("id") == args["deploy_id"]:
        held.update(extra, step=step, step_since=time.time())
        if args.get("lease_ttl"):
            held.update(since=time.time(), ttl=float(args["lease_ttl"]))
        hostlib.write_json_atomic(path, held)


def check_lease(args):
    held = read_json(lease_path(args))
    if not held or held.get("id") != args["deploy_id"]:
        raise Failure("deploy %s no longer holds this host's lease (now: %s); rerun the deploy"
                      % (args["deploy_id"], hostlib.describe_holder((held or {}).get("holder"))
                         if held else "nobody"), hostlib.EXIT_LOCKED, lease=held)


def drop_lease(args):
    path = lease_path(args)
    held = read_json(path)
    if held and held.get("id") == args["deploy_id"]:
        os.unlink(path)
        hostlib.fsync_dir(os.path.dirname(path))
        return True
    return False


class LeasedLock:
    """The host lock for one mutating step of a deploy that holds the lease."""

    def __init__(self, args):
        self.args = args
        self.lock = hostlib.Lock(state_dir(args), args["holder"])

    def __enter__(self):
        self.lock.__enter__()
        try:
            check_lease(self.args)
        except Failure:
            self.lock.__exit__(None, None, None)
            raise
        return self

    def __exit__(self, *exc):
        self.lock.__exit__(*exc)


# ---------------------------------------------------------------- plan


def cmd_plan(args, stream):
    """Facts, release inspection and what runs, in one round trip (see the module docstring)."""
    out = {"systemd": hostlib.systemd_is_pid1() and bool(shutil.which("systemctl")), "time": time.time()}
    if args.get("doctor") is not None:  # first: it reads the host's clock, against the call's send time
        out["doctor"] = hostlib.companion("doctor.py").collect(args["doctor"])
    if args.get("facts") is not None:
        out["facts"] = hostlib.companion("server_facts.py").facts(args["facts"])
    if args.get("inspect"):
        release = hostlib.companion("release.py")
        try:
            out["inspect"] = release.cmd_inspect(release.Host(args["inspect"]), args["inspect"])
        except Failure as exc:
            out["inspect_error"] = {"message": str(exc), "detail": exc.detail}
    paths = paths_for(args)
    running = running_state(paths)
    out["running"] = running
    out["log_tail"] = None
    if not running.get("alive") and running.get("record"):
        out["log_tail"] = log_since(paths, running, limit=4000)
    if args.get("port"):
        # Every address: the controller knows the bind address only once it has rendered.
        holders = port_holders(args.get("bind"), int(args["port"]))
        out["port_holders"] = holders
        out["foreign"] = name_profiles(args, foreign_holders(holders, running))
    out["lease_holder"] = read_json(lease_path(args))
    out["previous"] = read_json(os.path.join(paths["previous"], "deployment.json"))
    if args.get("lease"):
        out["lease_took_over"] = take_lease(args)
        out["lease"] = args["lease"]["id"]
    return out


# ---------------------------------------------------------------- logs


def rotated(path, keep):
    """The log and its rotations, oldest first."""
    files = ["%s.%d" % (path, i) for i in range(keep, 0, -1)] + [path]
    return [f for f in files if os.path.exists(f)]


def log_since(paths, running, limit=None, keep=DEFAULT_LOG_KEEP):
    """The server's log from its last start on: journald's invocation on systemd hosts, the
    supervisor's log (with its rotations) otherwise. Whole unless `limit` (characters, the end)."""
    if running.get("mode") == "systemd":
        if not running.get("invocation"):
            return ""
        text = hostlib.run_command(["journalctl", "--no-pager", "-o", "cat",
                                    "_SYSTEMD_INVOCATION_ID=" + running["invocation"]], timeout=60)["stdout"]
    else:
        start_id = running.get("start_id")
        chunks = []
        for name in rotated(paths["log"], keep):
            try:
                with open(name, "rb") as fh:
                    chunks.append(fh.read().decode("utf-8", "surrogateescape"))  # shown as \\xNN, not U+FFFD
            except OSError:
                pass
        text = "".join(chunks)
        marker = "%s start %s " % (MARKER, start_id)
        at = text.rfind(marker) if start_id else -1
        if at >= 0:
            text = text[at:]
    return text[-limit:] if limit and len(text) > limit else text


# ---------------------------------------------------------------- stop and start


def wait_gone(pid, ticks, seconds):
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if not alive(pid, ticks):
            return True
        time.sleep(0.1)
    return not alive(pid, ticks)


def last_drain_line(paths, running):
    text = log_since(paths, running, limit=20000)
    lines = [line for line in text.splitlines() if DRAIN_MARK in line]
    return lines[-1] if lines else None


def stop_server(paths, grace, mode=None):
    """Stop the managed server of one profile: SIGTERM to the server, wait for its drain (no
    timeout of its own in SGLang), SIGKILL its process group after `grace` seconds."""
    running = running_state(paths, mode)
    started = time.monotonic()
    out = {"was_running": bool(running.get("alive")), "pid": running.get("pid"), "killed": False}
    if running["mode"] == "systemd":
        if running.get("alive") or running.get("active") not in ("inactive", None):
            systemctl("stop", paths["unit"], timeout=grace + 30)
            after = unit_state(paths["unit"])
            out.update(exit_code=after["exit_code"], active=after["active"])
        out["seconds"] = round(time.monotonic() - started, 3)
        out["drain"] = last_drain_line(paths, running)
        return out
    status = read_json(paths["status"]) or {}
    supervisor, sticks = status.get("supervisor_pid"), status.get("supervisor_ticks")
    server, ticks = status.get("server_pid"), status.get("server_ticks")
    if alive(supervisor, sticks):
        os.kill(supervisor, signal.SIGTERM)  # it forwards SIGTERM, and SIGKILLs after its grace
        if not wait_gone(supervisor, sticks, grace + 10):
            os.kill(supervisor, signal.SIGKILL)
    if alive(server, ticks):  # the supervisor was gone (killed): do its job
        os.kill(server, signal.SIGTERM)
        if not wait_gone(server, ticks, grace):
            _kill_group(server)
            out["killed"] = True
            wait_gone(server, ticks, 5)
    status = read_json(paths["status"]) or {}
    out.update(exit_code=status.get("exit_code"), killed=out["killed"] or bool(status.get("killed")),
               seconds=round(time.monotonic() - started, 3), drain=last_drain_line(paths, running))
    return out


def _kill_group(pid):
    try:
        os.killpg(pid, signal.SIGKILL)
    except OSError:
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:
            pass


def install_programs(args):
    """This script and hostlib, written to bin/ under the state dir for the supervisor (only
    when their bytes changed). Returns the path of the supervisor script."""
    bin_dir = os.path.join(state_dir(args), BIN_DIR)
    for name, text in (args.get("programs") or {}).items():
        if "/" in name or name.startswith("."):
            raise Failure("bad program name %r" % name)
        target = os.path.join(bin_dir, name)
        data = text.encode("utf-8")
        if not os.path.exists(target) or hostlib.sha256_file(target) != hashlib.sha256(data).hexdigest():
            hostlib.write_bytes_atomic(target, data, 0o644)
    return os.path.join(bin_dir, "server.py")


def start_supervised(args, paths, start_id):
    program = install_programs(args)
    config = {"launch_script": paths["launch_script"], "log": paths["log"], "status": paths["status"],
              "start_id": start_id, "grace": float(args.get("stop_grace", 120)),
              "max_bytes": int(args.get("log_max_bytes") or DEFAULT_LOG_MAX_BYTES),
              "keep": int(args.get("log_keep") or DEFAULT_LOG_KEEP)}
    config_path = os.path.join(paths["dir"], "supervisor-config.json")
    hostlib.write_json_atomic(config_path, config)
    try:
        os.unlink(paths["status"])
    except OSError:
        pass
    os.makedirs(os.path.dirname(paths["log"]), exist_ok=True)
    null = os.open(os.devnull, os.O_RDWR)
    try:
        # Its own session: it outlives this SSH session and the controller; no fd of ours leaks in
        # (an inherited stdout would keep the SSH channel open).
        subprocess.Popen([sys.executable, program, "supervise", config_path], stdin=null, stdout=null,
                         stderr=null, close_fds=True, start_new_session=True, cwd="/")
    finally:
        os.close(null)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        status = read_json(paths["status"])
        if status and status.get("start_id") == start_id and status.get("server_pid"):
            return status
        time.sleep(0.05)
    raise Failure("the supervisor did not start the server within 30s (see %s)" % paths["log"])


def start_systemd(args, paths):
    if systemctl("daemon-reload")["rc"] != 0:
        raise Failure("systemctl daemon-reload failed")
    systemctl("enable", paths["unit"])  # started again at boot, as it runs now
    result = systemctl("restart", paths["unit"], timeout=120)
    if result["rc"] != 0:
        raise Failure("systemctl restart %s failed: %s" % (paths["unit"], result["stderr"].strip()))
    state = unit_state(paths["unit"])
    return {"server_pid": state["pid"], "invocation": state["invocation"], "started": time.time()}


def write_generation(paths, files):
    """The env file, launch script and unit of one deployment, each swapped in atomically."""
    hostlib.write_bytes_atomic(paths["env_file"], files["env"].encode("utf-8"), 0o600)
    # Owner-only, as the env file: the argv it carries may hold a secret (an --api-key value).
    hostlib.write_bytes_atomic(paths["launch_script"], files["launch_script"].encode("utf-8"), 0o700)
    if files.get("unit") is not None:
        hostlib.write_bytes_atomic(paths["dir"] + "/unit.service", files["unit"].encode("utf-8"), 0o644)


def keep_previous(paths):
    """The deployment now recorded (if any) moves to previous/, for `revert`."""
    record = read_json(paths["record"])
    if not record:
        return False
    prev = paths["previous"]
    os.makedirs(prev, exist_ok=True)
    for name, source in (("launch.sh", paths["launch_script"]), ("sglang.env", paths["env_file"]),
                         ("unit.service", paths["dir"] + "/unit.service"), ("deployment.json", paths["record"])):
        if os.path.exists(source):
            hostlib.copy_durable(source, os.path.join(prev, name))
    os.unlink(paths["record"])  # the record describes what runs; nothing does until finish
    return True


def start(args, paths, start_id):
    mode = args.get("mode") or "supervisor"
    if mode == "systemd":
        unit_file = paths["unit_file"]
        hostlib.copy_durable(paths["dir"] + "/unit.service", unit_file)
        status = start_systemd(args, paths)
    else:
        status = start_supervised(args, paths, start_id)
    return {"mode": mode, "pid": status.get("server_pid"), "ticks": status.get("server_ticks"),
            "started": status.get("started"), "start_id": start_id, "invocation": status.get("invocation")}


def cmd_launch(args, stream=None):
    paths = paths_for(args)
    with LeasedLock(args):
        running = running_state(paths)
        if args.get("port"):
            foreign = foreign_holders(port_holders(args.get("bind") or "0.0.0.0", int(args["port"])), running)
            if foreign:
                name_profiles(args, foreign)
                raise Failure("port %s is taken: %s; %s (nothing was changed)" % (
                    args["port"], "; ".join(describe_holder(h) for h in foreign),
                    "stop that profile or give this profile another port" if any(h.get("profile") for h in foreign)
                    else "sglfleet did not start it and will not stop it"), port_taken=foreign)
        os.makedirs(paths["dir"], exist_ok=True)
        lease_step(args, "launch", release=args.get("release"))
        stopped = stop_server(paths, float(args.get("stop_grace", 120)), running.get("mode"))
        kept = keep_previous(paths)
        write_generation(paths, args["files"])
        launched = start(args, paths, args["deploy_id"])
        lease_step(args, "health", pid=launched.get("pid"))
    launched.update(stopped=stopped, kept_previous=kept)
    return launched


def cmd_revert(args, stream=None):
    """Stop the failed server; put previous/ back and start it (or leave the host stopped).
    `relaunch_current`: this deploy's launch was refused here before it moved anything (a rank of
    a multi-node server whose group fails): what the record names is what ran, and starts again."""
    paths = paths_for(args)
    with LeasedLock(args):
        lease_step(args, "revert")
        stopped = stop_server(paths, float(args.get("stop_grace", 120)), args.get("mode"))
        current = read_json(paths["record"]) if args.get("relaunch_current") else None
        if current is not None:
            launched = start(dict(args, mode=current.get("mode") or "supervisor"), paths,
                             args["deploy_id"] + "-revert")
            launched.update(stopped=stopped, restored=current)
            return launched
        prev = paths["previous"]
        record = read_json(os.path.join(prev, "deployment.json"))
        if not record:
            for name in ("launch_script", "env_file", "record"):
                if os.path.exists(paths[name]):
                    os.unlink(paths[name])
            return {"stopped": stopped, "restored": None}
        for name, target in (("launch.sh", paths["launch_script"]), ("sglang.env", paths["env_file"]),
                             ("unit.service", paths["dir"] + "/unit.service")):
            if os.path.exists(os.path.join(prev, name)):
                hostlib.swap_in(os.path.join(prev, name), target, "revert")
        launched = start(dict(args, mode=record.get("mode") or "supervisor"), paths,
                         args["deploy_id"] + "-revert")
    launched.update(stopped=stopped, restored=record)
    return launched


# ---------------------------------------------------------------- health


def http(method, host, port, path, body=None, timeout=10.0):
    import http.client

    connection = http.client.HTTPConnection(host, port, timeout=timeout)
    try:
        headers = {"Content-Type": "application/json"} if body is not None else {}
        connection.request(method, path, json.dumps(body) if body is not None else None, headers)
        response = connection.getresponse()
        return response.status, response.read().decode("utf-8", "replace")
    finally:
        connection.close()


class Answered(Exception):
    """A health stage got a definite wrong answer: it fails now, without polling to its timeout."""


def probe_stage(stage, host, port, prompt):
    """One attempt at one stage: (passed, detail)."""
    if stage == "port":
        with socket.create_connection((host, port), timeout=2):
            return True, "listening"
    if stage in ("health", "health_generate"):
        status, _ = http("GET", host, port, "/" + stage, timeout=30)
        return status == 200, "HTTP %d" % status
    if stage == "generate":
        status, text = http("POST", host, port, "/generate", {"text": prompt, "sampling_params":
                                                               {"max_new_tokens": 8, "temperature": 0}}, timeout=60)
        if status != 200:
            return False, "HTTP %d: %s" % (status, text[:200])
        try:
            answer = json.loads(text)
        except ValueError:
            answer = None
        meta = (answer.get("meta_info") if isinstance(answer, dict) else None) or {}
        tokens = meta.get("completion_tokens") or 0
        if not isinstance(answer, dict) or not answer.get("text") or not tokens:
            # HTTP 200 is the server's answer, not "still starting": one without text or tokens fails now
            raise Answered("HTTP 200 without generated text or tokens: %s" % text[:200])
        return True, {"text": answer.get("text"), "completion_tokens": tokens,
                      "spec_accept_length": meta.get("spec_accept_length")}
    if stage == "server_info":
        for route in ("/server_info", "/get_server_info"):
            status, text = http("GET", host, port, route)
            if status == 200:
                info = json.loads(text)
                fields = dict(info.get("server_args") or {}, **{k: v for k, v in info.items() if k != "server_args"})
                keep = ("speculative_algorithm", "speculative_num_draft_tokens", "speculative_ddtree_budget",
                        "speculative_ddtree_topk_cap", "speculative_ddtree_shadow_linear", "model_path", "port",
                        "host", "lab_simulation", "version")
                return True, {k: fields.get(k) for k in keep}
        return False, "HTTP %d" % status
    raise Failure("unknown health stage %r" % stage)


def exiting(paths, mode, grace=1.0):
    """True when the server process is gone within `grace` seconds."""
    deadline = time.monotonic() + grace
    while running_state(paths, mode).get("alive"):
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.1)
    return True


def exited(stage, started, paths, args):
    """The answer of a stage whose server process is gone: its exit code and whole log."""
    time.sleep(0.2)  # let the supervisor record the exit code and flush the log
    running = running_state(paths, args.get("mode"))
    return {"ok": False, "stage": stage, "exited": True, "exit_code": running.get("exit_code"),
            "seconds": round(time.monotonic() - started, 3), "log": log_since(paths, running),
            "pid": running.get("pid")}


def cmd_health(args, stream=None):
    """Poll one stage until it passes, `timeout` passes, or the server process exits; `min_ready`:
    the server stays alive and healthy for `timeout` seconds straight."""
    paths = paths_for(args)
    stage, timeout = args["stage"], float(args["timeout"])
    host = args.get("bind") or "127.0.0.1"
    host = "127.0.0.1" if host in WILDCARDS else host
    port = int(args.get("port") or 0)
    if stage == "min_ready":
        return stay_healthy(args, paths, host, port, timeout)
    started = time.monotonic()
    last = None
    while True:
        running = running_state(paths, args.get("mode"))
        if not running.get("alive"):
            return exited(stage, started, paths, args)
        if stage == "alive":
            return {"ok": True, "stage": stage, "seconds": round(time.monotonic() - started, 3),
                    "detail": {"pid": running.get("pid")}}
        try:
            passed, detail = probe_stage(stage, host, port, args.get("prompt") or "The capital of France is")
        except Answered as exc:
            return {"ok": False, "stage": stage, "message": str(exc), "seconds": round(time.monotonic() - started, 3),
                    "log": log_since(paths, running), "pid": running.get("pid")}
        except (OSError, ValueError) as exc:
            passed, detail = False, "%s: %s" % (type(exc).__name__, exc)
        if passed:
            return {"ok": True, "stage": stage, "seconds": round(time.monotonic() - started, 3), "detail": detail}
        last = detail
        if time.monotonic() - started >= timeout:
            return {"ok": False, "stage": stage, "timed_out": True, "seconds": round(time.monotonic() - started, 3),
                    "last": last, "log": log_since(paths, running) if args.get("final", True) else None,
                    "pid": running.get("pid")}
        time.sleep(float(args.get("interval", 0.25)))


def stay_healthy(args, paths, host, port, seconds):
    """Alive and /health 200 for `seconds` straight, checked every `interval` and at the end."""
    started = time.monotonic()
    interval = float(args.get("interval", 0.25))
    while True:
        running = running_state(paths, args.get("mode"))
        if not running.get("alive"):
            return exited("min_ready", started, paths, args)
        try:
            passed, detail = probe_stage("health", host, port, None)
        except (OSError, ValueError) as exc:
            passed, detail = False, "%s: %s" % (type(exc).__name__, exc)
        elapsed = time.monotonic() - started
        if not passed and exiting(paths, args.get("mode")):
            # A crashing server closes its port before its process is gone: say it exited (code
            # and log), not "not healthy", when it goes within a second of the failed probe.
            return exited("min_ready", started, paths, args)
        if not passed:
            return {"ok": False, "stage": "min_ready", "seconds": round(elapsed, 3), "last": detail,
                    "message": "not healthy %.1fs after its staged health passed (/health: %s; it had to stay "
                               "healthy for %gs)" % (elapsed, detail, seconds),
                    "log": log_since(paths, running), "pid": running.get("pid")}
        if elapsed >= seconds:
            return {"ok": True, "stage": "min_ready", "seconds": round(elapsed, 3)}
        time.sleep(min(interval, seconds - elapsed))


# ---------------------------------------------------------------- records


def cmd_finish(args, stream=None):
    """Write the deployment record (None: none, e.g. a failed deploy with nothing before) and
    drop the lease."""
    paths = paths_for(args)
    with LeasedLock(args):
        if args.get("record") is not None:
            record = dict(args["record"])
            running = running_state(paths, record.get("mode"))
            record["ticks"] = proc_start_ticks(record["pid"]) if record.get("pid") else None
            record["recorded"] = time.time()
            if running.get("alive") and running.get("pid") != record.get("pid"):
                raise Failure("the running server is pid %s, not the deployed pid %s" % (running.get("pid"),
                                                                                        record.get("pid")))
            hostlib.write_json_atomic(paths["record"], record, 0o600)  # its argv may hold a secret
        drop_lease(args)
    return {"recorded": args.get("record") is not None}


def cmd_unlease(args, stream=None):
    with hostlib.Lock(state_dir(args), args["holder"]):
        return {"dropped": drop_lease(args)}


# ---------------------------------------------------------------- status and stop


def profiles_here(args):
    base = os.path.join(state_dir(args), "servers")
    return sorted(os.listdir(base)) if os.path.isdir(base) else []


def metrics_accept_length(host, port):
    try:
        status, text = http("GET", host, port, "/metrics", timeout=3)
    except OSError:
        return None
    if status != 200:
        return None
    for line in text.splitlines():
        if line.startswith("sglang:spec_accept_length"):
            try:
                return float(line.split()[-1])
            except ValueError:
                return None
    return None


def cmd_status(args, stream=None):
    wanted = [args["profile"]] if args.get("profile") else profiles_here(args)
    out = {}
    for profile in wanted:
        paths = paths_for(args, profile)
        running = running_state(paths)
        record = running.get("record") or {}
        entry = {"running": running, "record": record or None, "health": None, "accept_length": None,
                 "uptime_s": None}
        if running.get("alive") and record.get("port"):
            host = record.get("bind") or "127.0.0.1"
            host = "127.0.0.1" if host in WILDCARDS else host
            try:
                entry["health"] = http("GET", host, int(record["port"]), "/health", timeout=5)[0]
            except OSError as exc:
                entry["health"] = "%s: %s" % (type(exc).__name__, exc)
            entry["accept_length"] = metrics_accept_length(host, int(record["port"]))
            if record.get("started"):
                entry["uptime_s"] = round(time.time() - record["started"], 1)
        elif not running.get("alive") and record:
            entry["log_tail"] = log_since(paths, running, limit=3000)
        out[profile] = entry
    return {"profiles": out, "lease": read_json(lease_path(args)), "time": time.time()}


def cmd_stop(args, stream=None):
    here = profiles_here(args)
    if args.get("profile") and args["profile"] not in here:
        # Neither deployed here nor running: say so, and what this host does run (nothing to stop).
        return {"stopped": {}, "unknown_profile": args["profile"],
                "here": {p: bool(running_state(paths_for(args, p)).get("alive")) for p in here}}
    wanted = [args["profile"]] if args.get("profile") else here
    out = {}
    with hostlib.Lock(state_dir(args), args["holder"]):
        held = hostlib.deploy_lease_conflict(state_dir(args))
        if held:
            raise Failure("host is being deployed by another sglfleet run: %s (deploy %s)"
                          % (hostlib.describe_holder(held.get("holder")), held.get("id")), hostlib.EXIT_LOCKED,
                          holder=held.get("holder"))
        for profile in wanted:
            paths = paths_for(args, profile)
            stopped = stop_server(paths, float(args.get("stop_grace", 120)))
            record = read_json(paths["record"])
            if record:
                record["stopped"] = time.time()
                hostlib.write_json_atomic(paths["record"], record, 0o600)  # its argv may hold a secret
            out[profile] = stopped
    return {"stopped": out}


# ---------------------------------------------------------------- the detached supervisor


class RotatingLog:
    """Appends to `path`; past max_bytes it becomes path.1 (path.1 -> path.2 ... up to keep)."""

    def __init__(self, path, max_bytes, keep):
        self.path, self.max_bytes, self.keep = path, max_bytes, keep
        os.makedirs(os.path.dirname(path), exist_ok=True)
        self.fh = open(path, "ab")

    def write(self, data):
        """Whole lines where they fit: a file passes max_bytes only by a line longer than it."""
        while data:
            room = self.max_bytes - self.fh.tell()
            if len(data) <= room:
                self.fh.write(data)
                break
            cut = data.rfind(b"\n", 0, max(room, 0)) + 1
            if cut == 0 and self.fh.tell() == 0:
                cut = room  # one line longer than a whole file: split it
            self.fh.write(data[:cut])
            data = data[cut:]
            self.fh.flush()
            self.rotate()
        self.fh.flush()

    def rotate(self):
        self.fh.close()
        for i in range(self.keep - 1, 0, -1):
            if os.path.exists("%s.%d" % (self.path, i)):
                os.replace("%s.%d" % (self.path, i), "%s.%d" % (self.path, i + 1))
        if self.keep > 0:
            os.replace(self.path, self.path + ".1")
        else:
            os.unlink(self.path)
        self.fh = open(self.path, "ab")


def supervise(config_path):
    """Run the launch script, its output to the rotating log, until it exits; see the docstring."""
    with open(config_path) as fh:
        config = json.load(fh)
    out = RotatingLog(config["log"], config["max_bytes"], config["keep"])
    stamp = time.strftime("%Y-%m-%dT%H:%M:%S%z")
    out.write(("%s start %s %s: %s\n" % (MARKER, config["start_id"], stamp, config["launch_script"])).encode())
    read_fd, write_fd = os.pipe()
    child = subprocess.Popen([config["launch_script"]], stdin=subprocess.DEVNULL, stdout=write_fd,
                             stderr=write_fd, close_fds=True, start_new_session=True, cwd="/")
    os.close(write_fd)
    status = {"supervisor_pid": os.getpid(), "supervisor_ticks": proc_start_ticks(os.getpid()),
              "server_pid": child.pid, "server_ticks": proc_start_ticks(child.pid), "started": time.time(),
              "start_id": config["start_id"], "log": config["log"], "exit_code": None}
    hostlib.write_json_atomic(config["status"], status)
    state = {"term_at": None, "killed": False}

    def on_term(signum, frame):
        if state["term_at"] is None:
            state["term_at"] = time.monotonic()
            out.write(("%s SIGTERM sent to pid %d (drain; SIGKILL after %.0fs)\n"
                       % (MARKER, child.pid, config["grace"])).encode())
            try:
                child.send_signal(signal.SIGTERM)  # the server only: SGLang drains, then ends its own tree
            except OSError:
                pass

    signal.signal(signal.SIGTERM, on_term)
    signal.signal(signal.SIGHUP, signal.SIG_IGN)
    import select

    while True:
        if state["term_at"] is not None and not state["killed"] and \
                time.monotonic() - state["term_at"] > config["grace"]:
            state["killed"] = True
            out.write(("%s grace of %.0fs over: SIGKILL to process group %d\n"
                       % (MARKER, config["grace"], child.pid)).encode())
            _kill_group(child.pid)
        try:
            ready = select.select([read_fd], [], [], 0.5)[0]
        except InterruptedError:
            continue
        if ready:
            data = os.read(read_fd, 65536)
            if not data:
                break
            out.write(data)
        elif child.poll() is not None:
            break  # exited; a leftover grandchild may still hold the pipe open
    code = child.wait()
    exit_code = code if code >= 0 else 128 - code
    out.write(("%s server pid %d exited with code %d\n" % (MARKER, child.pid, exit_code)).encode())
    status.update(exit_code=exit_code, exited=time.time(), killed=state["killed"])
    hostlib.write_json_atomic(config["status"], status)
    return 0


COMMANDS = {"plan": cmd_plan, "launch": cmd_launch, "health": cmd_health, "finish": cmd_finish,
            "revert": cmd_revert, "status": cmd_status, "stop": cmd_stop, "unlease": cmd_unlease}

if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "supervise":
        sys.exit(supervise(sys.argv[2]))
    sys.exit(hostlib.main(COMMANDS))
