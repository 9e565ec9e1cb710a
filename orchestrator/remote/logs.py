"""Host side of `logs`, `logs --bundle` and `metrics`: read a profile's server log, bundle a host's
diagnostics, scrape the server's /metrics.

Commands (each ONE exec round trip through the call convention, fleet/remote_call.py):

    read     one page of the server log as [[epoch, line], ...] plus a cursor to continue from:
             journald (`journalctl -u UNIT -o json`, cursors) when the profile runs as a systemd
             unit, else the detached supervisor's log file and its size-rotated copies
             (<log>.K oldest ... <log>.1, <log>). Filters: since/until (epoch seconds), grep (a
             regex), tail N (the last N matching lines). A page holds at most `max_bytes` of
             lines (`more` says there is more); with `wait` the host waits up to that many
             seconds for a new line first (long-poll, what `logs -f` repeats). A file cursor is
             (inode, offset): rotation moves the inode to <log>.1, so nothing is read twice or
             skipped; a truncated or rotated-away file is reported as a gap.
    bundle   a tar.gz of the host's diagnostics, written and compressed HERE, streamed from the
             files (a 1 GB log never sits in memory): server logs, launch script, env file
             (secret-looking values redacted), units, deployment and release records, the last
             smoke result (sent by the controller in args), nvidia-smi, pip freeze of the server's
             interpreter, disk, memory, dmesg tail; each item in MANIFEST.json with ok/missing/error.
             Answers the path, size and sha256; the controller fetches it in bounded chunks and
             calls `bundle_done`, which deletes it.
    scrape   GET /metrics of the profile's running server (port from its deployment record), as
             text; the controller parses it (prometheus_client).

Timestamps: SGLang's `[YYYY-MM-DD HH:MM:SS(.mmm)( DPn TPn ...)]` line prefix in the host's local
time, and the supervisor's start marker; a line without one (a traceback's) takes the previous
stamped line's. Stdlib + hostlib only, Python 3.8+; importable for unit tests.
"""

import calendar
import collections
import io
import json
import os
import re
import shlex
import socket
import subprocess
import sys
import tarfile
import time

try:  # on the host: sent ahead of this file by the call convention (fleet/remote_call.py)
    import sglfleet_hostlib as hostlib
except ImportError:  # on the controller (unit tests)
    from orchestrator.remote import hostlib

Failure = hostlib.Failure


def redaction():
    """remote/redact.py: the companion script sent with the bundle call; imported on the controller."""
    if "redact.py" in hostlib.COMPANIONS:
        return hostlib.companion("redact.py")
    from orchestrator.remote import redact

    return redact

DEFAULT_PAGE_BYTES = 4 << 20
ROTATIONS_LOOKED_AT = 20  # <log>.1 ... <log>.20: more than any keep setting deploy uses
BLOCK = 1 << 16
# A line longer than this keeps its first MAX_LINE_BYTES, then " … [N bytes cut]": one line of
# many MB (a client's prompt echoed) costs neither the host's memory nor the answer's size.
MAX_LINE_BYTES = 64 << 10
CUT_MARK = " \u2026 [%d bytes cut]"
HEAD_BYTES = 256
STAMP = re.compile(rb"^\[(\d{4}-\d{2}-\d{2}) (\d{2}:\d{2}:\d{2})(\.\d+)?(?: [^\]]*)?\]")
MARKER_STAMP = re.compile(rb"^==== sglfleet supervisor: start \S+ (\d{4}-\d{2}-\d{2})T(\d{2}:\d{2}:\d{2})([+-]\d{4})?")
BUNDLE_DIR = "/var/tmp/sglfleet-bundles"
SCRAPE_LIMIT = 8 << 20
DMESG_LINES = 300


# ---------------------------------------------------------------- where the log is


def paths_for(args):
    """hostlib.server_paths of the profile, moved under args' log/state dirs when tests give them."""
    paths = dict(hostlib.server_paths(args["profile"]))
    if args.get("log_dir"):
        paths["log"] = os.path.join(args["log_dir"], os.path.basename(paths["log"]))
    if args.get("state_dir"):
        for key in ("dir", "launch_script", "env_file", "pidfile", "record"):
            paths[key] = args["state_dir"] + paths[key][len(hostlib.STATE_DIR):]
    return paths


def profiles_here(args):
    """Profiles with a server on this host: a state dir under servers/, or a log file."""
    found = set()
    state = args.get("state_dir") or hostlib.STATE_DIR
    log_dir = args.get("log_dir") or hostlib.LOG_DIR
    for directory, suffix in ((os.path.join(state, "servers"), ""), (log_dir, ".log")):
        try:
            names = os.listdir(directory)
        except OSError:
            continue
        for name in names:
            if suffix and name.endswith(suffix):
                found.add(name[: -len(suffix)])
            elif not suffix and os.path.isdir(os.path.join(directory, name)):
                found.add(name)
    return sorted(found)


def resolve_profile(args):
    """args with "profile" set: the one given, else the only one on the host."""
    if args.get("profile"):
        return args
    found = profiles_here(args)
    if len(found) == 1:
        return dict(args, profile=found[0])
    if not found:
        raise Failure("no sglfleet server on this host (nothing under %s/servers or %s)"
                      % (args.get("state_dir") or hostlib.STATE_DIR, args.get("log_dir") or hostlib.LOG_DIR))
    raise Failure("several servers on this host (%s): name the profile" % ", ".join(found), profiles=found)


def source_of(args, paths):
    """"journald" when the profile runs as a systemd unit, else "file" (the supervisor's log)."""
    if args.get("source") in ("journald", "file"):
        return args["source"]
    record = hostlib.read_json(paths["record"]) or {}
    if record.get("mode") == "systemd":
        return "journald"
    if record.get("mode") is None and hostlib.systemd_is_pid1() and os.path.exists(paths["unit_file"]):
        return "journald"
    return "file"


# ---------------------------------------------------------------- timestamps


class Stamps:
    """Line -> epoch seconds (host local time), the previous stamp for unstamped lines.
    strptime+mktime cost ~15 us; lines of one second share one conversion."""

    def __init__(self, last=None):
        self.last = last
        self._key = None
        self._value = None

    def of(self, raw):
        match = STAMP.match(raw)
        if match:
            key = match.group(1) + b" " + match.group(2)
            if key != self._key:
                self._key = key
                self._value = time.mktime(time.strptime(key.decode(), "%Y-%m-%d %H:%M:%S"))
            frac = match.group(3)
            self.last = self._value + (float(frac) if frac else 0.0)
            return self.last
        match = MARKER_STAMP.match(raw)
        if match:
            clock = time.strptime((match.group(1) + b" " + match.group(2)).decode(), "%Y-%m-%d %H:%M:%S")
            zone = match.group(3)
            if zone:  # an explicit UTC offset: exact, whatever this host's zone is
                offset = (int(zone[1:3]) * 3600 + int(zone[3:5]) * 60) * (1 if zone[:1] == b"+" else -1)
                self.last = calendar.timegm(clock) - offset
            else:
                self.last = time.mktime(clock)
            return self.last
        return self.last


class Filter:
    """since/until (epoch seconds) and grep (a regex on the line's text)."""

    def __init__(self, args):
        self.since = args.get("since")
        self.until = args.get("until")
        self.grep = re.compile(args["grep"]) if args.get("grep") else None

    def keeps(self, ts, text):
        if self.since is not None and (ts is None or ts < self.since):
            return False
        if self.until is not None and ts is not None and ts > self.until:
            return False
        return self.grep is None or self.grep.search(text) is not None

    def past_until(self, ts):
        return self.until is not None and ts is not None and ts > self.until


# ---------------------------------------------------------------- the supervisor's log files


def log_files(log):
    """[(path, inode, size, mtime)] oldest first: <log>.K ... <log>.1, <log>."""
    names = ["%s.%d" % (log, i) for i in range(ROTATIONS_LOOKED_AT, 0, -1)] + [log]
    files = []
    for name in names:
        try:
            st = os.stat(name)
        except OSError:
            continue
        files.append((name, st.st_ino, st.st_size, st.st_mtime))
    return files


def head_of(name, length):
    """A fingerprint of a file's first bytes: an inode number alone can be reused by a new file."""
    import hashlib

    try:
        with open(name, "rb") as fh:
            return hashlib.sha1(fh.read(min(length, HEAD_BYTES))).hexdigest()[:16]
    except OSError:
        return None


def start_position(files, cursor, since):
    """(index into files, offset, gap) to read from."""
    if cursor:
        for i, (name, inode, size, _) in enumerate(files):
            if inode == cursor["inode"] and (cursor.get("head") is None or size < cursor["offset"]
                                             or head_of(name, cursor["offset"]) == cursor["head"]):
                if size < cursor["offset"]:
                    return i, 0, "%s was truncated (now %d bytes, was read to %d)" % (name, size, cursor["offset"])
                return i, cursor["offset"], None
        return 0, 0, ("the log file last read (inode %d) is gone: rotated away or deleted since; "
                      "lines in between are lost" % cursor["inode"]) if files else None
    start = 0
    if since is not None:  # a rotated file last written before `since` holds nothing newer
        while start < len(files) - 1 and files[start][3] < since:
            start += 1
    return start, 0, None


def read_files(paths, args, cursor):
    """Forward read from the cursor (or the start): one page."""
    files = log_files(paths["log"])
    limit = int(args.get("max_bytes") or DEFAULT_PAGE_BYTES)
    keep = Filter(args)
    index, offset, gap = start_position(files, cursor, keep.since)
    stamps = Stamps((cursor or {}).get("ts"))
    lines, size, bytes_read, more, done = [], 0, 0, False, False
    position = (files[index][1], offset) if files else None
    while index < len(files) and not more and not done:
        name, inode, _, _ = files[index]
        newest = index == len(files) - 1
        try:
            fh = open(name, "rb")
        except OSError:  # rotated under us between stat and open: the next call finds it by inode
            break
        with fh:
            if os.fstat(fh.fileno()).st_ino != inode:
                break
            fh.seek(offset)
            while True:
                raw, length = read_line(fh, newest)
                if not length:
                    break  # the end, or a line still being written: the next read takes it whole
                bytes_read += length
                offset += length
                ts = stamps.of(raw)
                if keep.past_until(ts):
                    done = True
                    break
                text = line_text(raw, length)
                position = (inode, offset)
                if keep.keeps(ts, text):
                    lines.append([ts, text])
                    size += len(raw)
                    if size >= limit:
                        more = True
                        break
        if not more and not done:
            position = (inode, offset)
            index += 1
            offset = 0
    cursor_out = cursor
    if position:
        named = [f[0] for f in files if f[1] == position[0]]
        cursor_out = {"kind": "file", "inode": position[0], "offset": position[1], "ts": stamps.last,
                      "head": head_of(named[0], position[1]) if named else None}
    return {"source": "file", "lines": lines, "cursor": cursor_out, "more": more, "gap": gap,
            "bytes_read": bytes_read, "files": [f[0] for f in files]}


def read_line(fh, newest):
    """(head, length) of the line at fh's position: its first MAX_LINE_BYTES (with its newline
    when whole) and its length in the file. (b"", 0) at the end, and in the newest file before a
    line still being written (fh is then left where the line starts)."""
    start = fh.tell()
    head = fh.readline(MAX_LINE_BYTES)
    length, ended = len(head), head.endswith(b"\n")
    if length == MAX_LINE_BYTES and not ended:  # a long line: the rest is counted, not kept
        while True:
            more = fh.readline(BLOCK)
            if not more:
                break
            length += len(more)
            if more.endswith(b"\n"):
                ended = True
                break
    if length and not ended and newest:
        fh.seek(start)
        return b"", 0
    return head, length


def line_text(head, length):
    """A line's text: UTF-8, with bytes that are not UTF-8 kept as surrogates (the controller
    shows them as \\xNN, never as U+FFFD); a line cut to its head ends with CUT_MARK."""
    body = head.rstrip(b"\r\n")
    if length <= len(head):
        return body.decode("utf-8", "surrogateescape")
    whole = len(body)  # back off a character the cut split in two
    for back in range(1, min(4, whole) + 1):
        byte = body[whole - back]
        if byte < 0x80:
            break
        if byte >= 0xC0:
            needed = 2 if byte < 0xE0 else 3 if byte < 0xF0 else 4
            if back < needed:
                whole -= back
            break
    body = body[:whole]
    return body.decode("utf-8", "surrogateescape") + CUT_MARK % (length - len(body) - 1)


def reverse_lines(name, end):
    """Lines of `name` before byte `end`, last first, as (head, length): the line's first
    MAX_LINE_BYTES (with its newline, if any) and its whole length. The file is scanned in
    BLOCKs and at most BLOCK + MAX_LINE_BYTES of it held, however long a line is."""
    with open(name, "rb") as fh:
        buf_start, buf, stop = end, b"", end
        while stop > 0:
            limit = stop - 1  # byte stop-1 is this line's own newline (or its last byte)
            while True:  # the newline before it, reading backwards as far as needed
                found = buf.rfind(b"\n", 0, max(0, limit - buf_start))
                if found >= 0 or buf_start == 0:
                    break
                step = min(BLOCK, buf_start)
                buf_start -= step
                fh.seek(buf_start)
                buf = fh.read(step) + buf[:MAX_LINE_BYTES]
            start = buf_start + found + 1 if found >= 0 else 0
            length = stop - start
            if length <= MAX_LINE_BYTES and stop <= buf_start + len(buf):
                head = buf[start - buf_start:stop - buf_start]
            else:
                fh.seek(start)
                head = fh.read(min(length, MAX_LINE_BYTES))
            yield head, length
            stop = start


def tail_files(paths, args):
    """The last N lines that pass the filters, read backwards from the end (never the whole
    log); the cursor is the end of the log, for `-f` to continue from."""
    want = int(args["tail"])
    keep = Filter(args)
    files = log_files(paths["log"])
    found = collections.deque()
    bytes_read = 0
    if not files:
        return {"source": "file", "lines": [], "cursor": None, "more": False, "gap": None, "bytes_read": 0,
                "files": []}
    name, inode, size, _ = files[-1]
    with open(name, "rb") as fh:  # the end: the newest complete line
        fh.seek(0, 2)
        end = fh.tell()
        while end > 0:
            fh.seek(max(0, end - BLOCK))
            block = fh.read(end - max(0, end - BLOCK))
            cut = block.rfind(b"\n")
            if cut >= 0:
                end = max(0, end - BLOCK) + cut + 1
                break
            end = max(0, end - BLOCK)
    ends = [f[2] for f in files[:-1]] + [end]
    # Walk back line by line; an unstamped line (a traceback's) belongs to the stamped line above
    # it, so it is held until that line is reached and its stamp known.
    pending = []
    finished = False
    for (fname, _, _, mtime), fend in zip(reversed(files), reversed(ends)):
        if finished or want == 0:
            break
        if keep.since is not None and mtime < keep.since:
            break
        for raw, length in reverse_lines(fname, fend):
            bytes_read += length
            stamp = Stamps().of(raw)
            pending.append((raw, length))
            if stamp is None:
                continue
            group, pending = pending, []
            if keep.since is not None and stamp < keep.since:
                finished = True
                break
            for member in group:  # newest first
                text = line_text(*member)
                if keep.keeps(stamp, text):
                    found.appendleft([stamp, text])
                    if len(found) >= want:
                        finished = True
                        break
            if finished:
                break
    if not finished and keep.since is None:  # lines above the first stamp of the log
        for member in pending:
            text = line_text(*member)
            if len(found) < want and keep.keeps(None, text):
                found.appendleft([None, text])
    cursor = {"kind": "file", "inode": inode, "offset": end, "ts": found[-1][0] if found else None,
              "head": head_of(name, end)}
    return {"source": "file", "lines": list(found), "cursor": cursor, "more": False, "gap": None,
            "bytes_read": bytes_read, "files": [f[0] for f in files]}


# ---------------------------------------------------------------- journald


def journal_argv(paths, args, cursor):
    argv = ["journalctl", "--no-pager", "-o", "json", "-u", paths["unit"]]
    if cursor and cursor.get("cursor"):
        argv += ["--after-cursor", cursor["cursor"]]
    if args.get("since") is not None and not (cursor and cursor.get("cursor")):
        argv += ["--since", "@%d" % int(args["since"])]  # journalctl takes whole seconds; re-checked below
    if args.get("until") is not None:
        argv += ["--until", "@%d" % (int(args["until"]) + 1)]
    if args.get("tail") is not None and not args.get("grep"):
        argv += ["-n", str(int(args["tail"]))]
    return argv


def journal_text(entry):
    """MESSAGE is a string, a list of byte values (not UTF-8), or null."""
    message = entry.get("MESSAGE")
    if isinstance(message, list):  # journald's form for bytes that are not UTF-8
        raw = bytes(message)
        return line_text(raw[:MAX_LINE_BYTES], len(raw))
    text = "" if message is None else str(message)
    if len(text) > MAX_LINE_BYTES:
        raw = text.encode("utf-8", "surrogateescape")
        return line_text(raw[:MAX_LINE_BYTES], len(raw))
    return text


def parse_journal(stream, keep, limit, want_tail=None):
    """Entries of `journalctl -o json` (one JSON object a line) -> (lines, last cursor, more,
    bytes)."""
    lines = collections.deque(maxlen=want_tail) if want_tail else []
    last_cursor, size, bytes_read, more = None, 0, 0, False
    for raw in stream:
        bytes_read += len(raw)
        try:
            entry = json.loads(raw)
        except ValueError:
            continue
        last_cursor = entry.get("__CURSOR", last_cursor)
        ts = int(entry["__REALTIME_TIMESTAMP"]) / 1e6 if entry.get("__REALTIME_TIMESTAMP") else None
        for text in journal_text(entry).splitlines() or [""]:
            if keep.keeps(ts, text):
                lines.append([ts, text])
                size += len(text) + 1
        if not want_tail and size >= limit:
            more = True
            break
    return list(lines), last_cursor, more, bytes_read


def read_journal(paths, args, cursor):
    keep = Filter(args)
    tail = int(args["tail"]) if args.get("tail") is not None else None
    proc = subprocess.Popen(journal_argv(paths, args, cursor), stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        lines, last, more, bytes_read = parse_journal(proc.stdout, keep,
                                                      int(args.get("max_bytes") or DEFAULT_PAGE_BYTES), tail)
    finally:
        if proc.poll() is None:
            proc.kill()
        err = proc.stderr.read().decode("utf-8", "surrogateescape")
        code = proc.wait()
    if code not in (0, -9) and not lines:
        raise Failure("journalctl failed (exit %s): %s" % (code, err.strip()[-2000:]))
    new_cursor = {"kind": "journald", "cursor": last or (cursor or {}).get("cursor")}
    return {"source": "journald", "lines": lines, "cursor": new_cursor, "more": more, "gap": None,
            "bytes_read": bytes_read, "unit": paths["unit"]}


# ---------------------------------------------------------------- read: one page, or a long-poll


def changed_since(paths, cursor):
    """Whether the log has bytes past a file cursor (or a new file)."""
    if not cursor:
        return bool(log_files(paths["log"]))
    try:
        st = os.stat(paths["log"])
    except OSError:
        return False
    return st.st_ino != cursor["inode"] or st.st_size > cursor["offset"]


def cmd_read(args, stream=None):
    args = resolve_profile(args)
    paths = paths_for(args)
    source = source_of(args, paths)
    if source == "file" and not log_files(paths["log"]) and not os.path.isdir(paths["dir"]):
        others = profiles_here(args)
        raise Failure("no server of profile %s on this host: no %s and no %s%s" % (
            args["profile"], paths["log"], paths["dir"], " (this host has: %s)" % ", ".join(others) if others else ""))
    cursor = args.get("cursor")
    if cursor and cursor.get("kind") != ("journald" if source == "journald" else "file"):
        cursor = None  # the server moved between supervisor and systemd: start over
    wait = float(args.get("wait") or 0)
    deadline = time.monotonic() + wait
    while True:
        if source == "journald":
            page = read_journal(paths, args, cursor)
        elif args.get("tail") is not None and not cursor:
            page = tail_files(paths, args)
        else:
            page = read_files(paths, args, cursor)
        if page["lines"] or page["more"] or time.monotonic() >= deadline:
            break
        cursor = page["cursor"] or cursor
        # Long-poll: sleep until the file grows (journald: until the next poll), then read again.
        while time.monotonic() < deadline:
            time.sleep(0.1 if source == "file" else 0.25)
            if source == "journald" or changed_since(paths, cursor):
                time.sleep(0.05)  # let a burst of lines land in one answer
                break
        args = dict(args, tail=None)
    page.update(profile=args["profile"], log=paths["log"] if source == "file" else None, now=time.time())
    return page


# ---------------------------------------------------------------- bundle


class Masked:
    """A file read through redact.StreamMask: the same bytes, secrets masked in place."""

    def __init__(self, fh, mask):
        self.fh, self.mask, self.out = fh, mask, b""

    def read(self, size=-1):
        while size < 0 or len(self.out) < size:
            chunk = self.fh.read(BLOCK)
            self.out += self.mask.feed(chunk) if chunk else self.mask.finish()
            if not chunk:
                break
        data, self.out = (self.out, b"") if size < 0 else (self.out[:size], self.out[size:])
        return data


class Bundle:
    """A tar.gz written here, item by item; MANIFEST.json records what each item is. Every item
    goes through the redaction policy (remote/redact.py) with the deployment's secret values:
    small files and command output as text, logs streamed with the secrets masked in place."""

    def __init__(self, path, secrets=()):
        self.path = path
        self.tar = tarfile.open(path, "w:gz", compresslevel=3, format=tarfile.PAX_FORMAT)
        self.items = []
        self.redact = redaction()
        self.secrets = list(secrets)

    def add_bytes(self, name, data, what, status="ok", **extra):
        data = self.redact.text(data.decode("utf-8", "surrogateescape"), self.secrets).encode("utf-8", "surrogateescape")
        info = tarfile.TarInfo(name)
        info.size, info.mtime, info.mode = len(data), int(time.time()), 0o644

        self.tar.addfile(info, io.BytesIO(data))
        self.items.append(dict(name=name, what=what, status=status, bytes=len(data), **extra))

    def add_file(self, name, source, what, redact=False):
        """A file streamed into the tar with secrets masked (never read whole; `redact`: an
        env file, read whole, each secret-named value replaced)."""
        try:
            st = os.stat(source)
            if st.st_size == 0 and source.startswith("/proc/"):  # procfs files say 0 bytes; they are small
                with open(source, "rb") as fh:
                    data = fh.read(1 << 20)
                self.add_bytes(name, data, what, source=source)
                return
            if redact:
                with open(source, "rb") as fh:
                    data = self.redact.env_text(fh.read().decode("utf-8", "surrogateescape"))
                self.add_bytes(name, data.encode("utf-8", "surrogateescape"), what, source=source, redacted=True)
                return
            info = tarfile.TarInfo(name)
            info.size, info.mtime, info.mode = st.st_size, int(st.st_mtime), 0o644
            with open(source, "rb") as fh:  # copies exactly st_size bytes: a growing log is cut there
                self.tar.addfile(info, Masked(fh, self.redact.StreamMask(self.secrets)))
            self.items.append({"name": name, "what": what, "status": "ok", "bytes": st.st_size, "source": source})
        except FileNotFoundError:
            self.items.append({"name": name, "what": what, "status": "missing", "source": source})
        except OSError as exc:
            self.items.append({"name": name, "what": what, "status": "error", "source": source,
                               "error": "%s: %s" % (type(exc).__name__, exc)})

    def add_command(self, name, argv, what, timeout=60, last_lines=None):
        result = hostlib.run_command(argv, timeout=timeout)
        if last_lines:
            result["stdout"] = "".join(result["stdout"].splitlines(True)[-last_lines:])
        if result["rc"] == 127:
            self.items.append({"name": name, "what": what, "status": "missing",
                               "error": "%s: command not found" % argv[0], "command": argv})
            return
        text = result["stdout"]
        if result["stderr"].strip():
            text += "\n--- stderr ---\n" + result["stderr"]
        status = "ok" if result["rc"] == 0 else "error"
        self.add_bytes(name, text.encode("utf-8", "surrogateescape"), what, status, command=argv, rc=result["rc"])

    def close(self, document):
        self.add_bytes("MANIFEST.json", json.dumps(dict(document, items=self.items), indent=1, default=str).encode(),
                       "this list")
        self.tar.close()


def redact_env(text):
    """An env file's text as a bundle holds it (redact.env_text)."""
    return redaction().env_text(text)


def deployment_secrets(paths):
    """The secret values of the deployment on this host: its argv (the record's, and the launch
    script's exec line) and its env file; what no item of a bundle may show."""
    redact = redaction()
    argv = list((hostlib.read_json(paths["record"]) or {}).get("argv") or [])
    environment = {}
    for path, parse in ((paths["launch_script"], None), (paths["env_file"], redact.env_file_values)):
        try:
            with open(path, "rb") as fh:
                text = fh.read().decode("utf-8", "surrogateescape")
        except OSError:
            continue
        if parse is not None:
            environment.update(parse(text))
            continue
        for line in text.splitlines():
            if line.startswith("exec "):
                try:
                    argv += shlex.split(line[len("exec "):])
                except ValueError:
                    pass
    return redact.secret_values(argv, environment)


def server_python(paths, args):
    """The interpreter the server runs with: the launch script's `exec PYTHON -m sglang...`,
    else the one the controller names (the inventory's `python`)."""
    try:
        with open(paths["launch_script"]) as fh:
            text = fh.read()
    except OSError:
        text = ""
    match = re.search(r"^\s*exec\s+(\S+)\s+-m\s+sglang", text, re.M)
    if match:
        return match.group(1).strip("'\"")
    return args.get("python") or sys.executable


def disk_usage(paths):
    out = {}
    for path in ("/", hostlib.STATE_DIR, hostlib.LOG_DIR, "/root/models", "/tmp", "/var/tmp"):
        try:
            st = os.statvfs(path)
        except OSError:
            continue
        out[path] = {"total_bytes": st.f_blocks * st.f_frsize, "free_bytes": st.f_bavail * st.f_frsize}
    return out


def release_records(state):
    """(name, path) of every release record and the `current` pointer."""
    found = [("releases/current", os.path.join(state, hostlib.CURRENT_FILE))]
    releases = os.path.join(state, hostlib.RELEASES_DIR)
    try:
        names = sorted(os.listdir(releases))
    except OSError:
        names = []
    for name in names:
        found.append(("releases/%s/release.json" % name, os.path.join(releases, name, "release.json")))
    return found


def cmd_bundle(args, stream=None):
    """Write the host's bundle; answer where it is (the controller fetches it, then bundle_done)."""
    args = resolve_profile(args)
    paths = paths_for(args)
    source = source_of(args, paths)
    state = args.get("state_dir") or hostlib.STATE_DIR
    os.makedirs(BUNDLE_DIR, mode=0o700, exist_ok=True)
    # A random part: pids repeat across hosts (containers, pid namespaces) that may share /var/tmp.
    path = os.path.join(BUNDLE_DIR, "%s-%s-%s-%s.tar.gz" % (socket.gethostname(), args["profile"],
                                                           time.strftime("%Y%m%dT%H%M%S"), os.urandom(6).hex()))
    started = time.time()
    bundle = Bundle(path, deployment_secrets(paths))
    try:
        if source == "journald":
            spool = path + ".journal"
            with open(spool, "wb") as out:
                code = subprocess.call(["journalctl", "--no-pager", "-o", "short-iso-precise", "-u", paths["unit"]],
                                       stdout=out, stderr=subprocess.DEVNULL)
            bundle.add_file("logs/journal-%s.txt" % paths["unit"], spool, "server log (journald, unit %s, exit %d)"
                            % (paths["unit"], code))
            os.unlink(spool)
        for name, _, _, _ in log_files(paths["log"]):
            bundle.add_file("logs/" + os.path.basename(name), name, "server log (supervisor)")
        bundle.add_file("server/launch.sh", paths["launch_script"], "launch script (the server's argv)")
        bundle.add_file("server/sglang.env", paths["env_file"], "env file", redact=True)
        bundle.add_file("server/unit.service", paths["dir"] + "/unit.service", "systemd unit (as deployed)")
        bundle.add_file("server/" + paths["unit"], paths["unit_file"], "systemd unit (installed)")
        bundle.add_file("server/deployment.json", paths["record"], "deployment record")
        for extra in ("supervisor.json", "supervisor-config.json"):
            bundle.add_file("server/" + extra, os.path.join(paths["dir"], extra), "supervisor state")
        for name, record in release_records(state):
            bundle.add_file(name, record, "release record")
        smoke = args.get("smoke")
        if smoke is not None:
            bundle.add_bytes("smoke/last.json", json.dumps(smoke["document"], indent=1, default=str).encode(),
                             "last smoke result (from the controller's %s)" % smoke.get("from"))
        else:
            bundle.items.append({"name": "smoke/last.json", "what": "last smoke result", "status": "missing",
                                 "error": "no smoke result for this host on the controller"})
        bundle.add_command("system/nvidia-smi.txt", ["nvidia-smi"], "nvidia-smi")
        bundle.add_command("system/nvidia-smi-query.csv", ["nvidia-smi"] + hostlib.GPU_QUERY, "GPU listing")
        python = server_python(paths, args)
        bundle.add_command("system/pip-freeze.txt", [python, "-m", "pip", "freeze", "--all"],
                           "pip freeze of %s" % python, timeout=120)
        bundle.add_bytes("system/disk.json", json.dumps(disk_usage(paths), indent=1).encode(), "disk usage")
        bundle.add_file("system/meminfo.txt", "/proc/meminfo", "memory")
        bundle.add_file("system/loadavg.txt", "/proc/loadavg", "load")
        bundle.add_command("system/dmesg-tail.txt", ["dmesg", "-T"], "kernel log, last %d lines" % DMESG_LINES,
                           timeout=30, last_lines=DMESG_LINES)
        bundle.add_bytes("system/uname.txt", (" ".join(os.uname()) + "\n").encode(), "uname")
        bundle.close({"host": socket.gethostname(), "profile": args["profile"], "source": source,
                      "started": started, "finished": time.time(), "python": python})
    except BaseException:
        bundle.tar.close()
        os.unlink(path)
        raise
    size = os.path.getsize(path)
    return {"path": path, "size": size, "sha256": hostlib.sha256_file(path), "items": bundle.items,
            "source": source, "seconds": round(time.time() - started, 3)}


def cmd_bundle_done(args, stream=None):
    path = os.path.realpath(args["path"])
    if os.path.dirname(path) != BUNDLE_DIR or not path.endswith(".tar.gz"):
        raise Failure("refusing to delete %s: not a bundle of ours" % args["path"])
    try:
        os.unlink(path)
    except FileNotFoundError:
        return {"deleted": False}
    return {"deleted": True}


# ---------------------------------------------------------------- /metrics


def cmd_scrape(args, stream=None):
    """The running server's /metrics text (Prometheus exposition format)."""
    args = resolve_profile(args)
    paths = paths_for(args)
    record = hostlib.read_json(paths["record"]) or {}
    port = args.get("port") or record.get("port")
    if not port:
        raise Failure("no port to scrape: %s has no deployment record with a port" % args["profile"])
    host = args.get("host") or record.get("bind") or "127.0.0.1"
    if host in ("0.0.0.0", "::", ""):
        host = "127.0.0.1"
    import urllib.error
    import urllib.request

    url = "http://%s:%d/metrics" % (host, int(port))
    started = time.monotonic()
    try:
        with urllib.request.urlopen(url, timeout=float(args.get("timeout") or 10)) as response:
            text = response.read(SCRAPE_LIMIT).decode("utf-8", "replace")
    except urllib.error.HTTPError as exc:
        raise Failure("%s answered HTTP %d%s" % (url, exc.code, " (is the server started with --enable-metrics?)"
                                                  if exc.code == 404 else ""), status=exc.code)
    except (OSError, urllib.error.URLError) as exc:
        raise Failure("cannot reach %s: %s" % (url, getattr(exc, "reason", exc)))
    return {"url": url, "text": text, "now": time.time(), "seconds": round(time.monotonic() - started, 3)}


COMMANDS = {"read": cmd_read, "bundle": cmd_bundle, "bundle_done": cmd_bundle_done, "scrape": cmd_scrape}

if __name__ == "__main__":
    sys.exit(hostlib.main(COMMANDS))
