"""Sent over stdin to a lab host by test_push.py: flip bytes of a staged file mid-transfer.

argv: STATE_DIR READY_FILE. Notes the release dirs that exist, creates READY_FILE, then waits for a
new release dir. Its files/ fill in tar order, one file at a time, so once a second file appears
the first is complete: append to it, so it no longer matches the sha256 the controller sent,
before apply verifies it. Prints {"corrupted": key} (exit 0), or exits 1 after 120 s.
"""

import json
import os
import sys
import time

state, ready = sys.argv[1:3]
releases = os.path.join(state, "releases")
before = set(os.listdir(releases)) if os.path.isdir(releases) else set()
open(ready, "w").close()
seen = []
deadline = time.monotonic() + 120
while time.monotonic() < deadline:
    new = sorted(set(os.listdir(releases)) - before) if os.path.isdir(releases) else []
    if new:
        staging = os.path.join(releases, new[0], "files")
        for directory, _, names in os.walk(staging):
            for name in names:
                path = os.path.join(directory, name)
                if path not in seen:
                    seen.append(path)
        if len(seen) >= 2:
            with open(seen[0], "ab") as fh:
                fh.write(b"\n# flipped in staging by test_push\n")
            print(json.dumps({"corrupted": os.path.relpath(seen[0], staging)}))
            sys.exit(0)
    time.sleep(0.002)
sys.exit(1)
