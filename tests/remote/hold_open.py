"""Sent over stdin to a lab host by test_push.py: a reader that watches files while they are swapped.

argv: READY_FILE DONE_FILE PATH... Opens every PATH that exists and keeps the descriptor (what
a running interpreter that has the old module open holds), creates READY_FILE, then rereads
every PATH by name in a loop until DONE_FILE exists, noting each distinct sha256 it saw (None:
absent). Prints one JSON document per PATH: the inode and sha256 it opened, what the old
descriptor reads at the end, the inode and sha256 the name has at the end, and every sha256 seen.
A swap by temp file + rename gives the name a new inode and leaves the old descriptor's bytes
whole; writing the target in place keeps the inode and changes what the old descriptor reads.
"""

import hashlib
import json
import os
import sys
import time


def digest(data):
    return hashlib.sha256(data).hexdigest()


def read_name(path):
    try:
        with open(path, "rb") as fh:
            return digest(fh.read())
    except FileNotFoundError:
        return None


ready, done, paths = sys.argv[1], sys.argv[2], sys.argv[3:]
held = {}
for path in paths:
    if os.path.exists(path):
        fh = open(path, "rb")
        held[path] = (fh, os.fstat(fh.fileno()).st_ino, digest(fh.read()))
seen = {path: set() for path in paths}
open(ready, "w").close()
reads = 0
while not os.path.exists(done):
    for path in paths:
        seen[path].add(read_name(path))
    reads += 1
    time.sleep(0.001)
out = {}
for path in paths:
    entry = {"seen": sorted(seen[path], key=str), "reads": reads, "sha256": read_name(path),
             "inode": os.stat(path).st_ino if os.path.exists(path) else None}
    if path in held:
        fh, inode, sha = held[path]
        fh.seek(0)
        entry.update(held_inode=inode, held_sha256=sha, held_reads_now=digest(fh.read()))
    out[path] = entry
print(json.dumps(out))
