"""The controller's cache of the option strings an SGLang install accepts, by fingerprint.

Listing them means importing SGLang on the host (4-9 s of the host's CPU: torch, transformers).
A host keeps its own list (remote/server_facts.py, under its state dir) keyed by the fingerprint
of the files that define SGLang's arguments; this cache keeps the same lists on the controller,
keyed the same way, so a host that is new to sglfleet (or whose patched SGLang another host has
already listed) is spared the import: the facts call sends the fingerprints known here, a host
whose own cache lacks its fingerprint but finds it among them answers with the fingerprint alone,
and `complete` fills the list in from here. No extra round trip either way.

Lists come from a facts call that listed (a cache miss on the host) and from the smoke probe,
which has SGLang imported anyway and lists it then (remote/smoke_probe.py): after a push, the
next plan of every host with those files finds the list here or in its own cache.

Files: $XDG_CACHE_HOME/sglfleet/sglang-options/<fingerprint>.json (default ~/.cache), the
newest KEEP kept. Unreadable or unwritable: no caching, nothing else changes.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Any

KEEP = 32
FINGERPRINT = re.compile(r"[0-9a-f]{24}")


def cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "sglfleet" / "sglang-options"


_known: list[str] | None = None  # read once per process (a fan-out's plans would each list the dir)


def known() -> list[str]:
    """The fingerprints this controller has lists for (sent with each facts call)."""
    global _known
    if _known is None:
        try:
            _known = sorted(p.stem for p in cache_dir().glob("*.json") if FINGERPRINT.fullmatch(p.stem))
        except OSError:
            _known = []
    return _known


def _valid(listed: Any) -> bool:
    return (isinstance(listed, dict) and all(isinstance(listed.get(k), list) and
                                             all(isinstance(s, str) for s in listed[k])
                                             for k in ("options", "undocumented")))


def store(fingerprint: Any, listed: Any) -> None:
    """Keep one host's list (atomically: a reader never sees half a file); drop the oldest past KEEP."""
    if not isinstance(fingerprint, str) or not FINGERPRINT.fullmatch(fingerprint) or not _valid(listed):
        return
    directory = cache_dir()
    target = directory / f"{fingerprint}.json"
    try:
        if target.is_file():
            return
        directory.mkdir(parents=True, exist_ok=True, mode=0o700)
        temp = directory / f".{fingerprint}.{os.getpid()}.tmp"
        temp.write_text(json.dumps({"options": listed["options"], "undocumented": listed["undocumented"]}))
        os.replace(temp, target)
        _forget_known()
        kept = sorted(directory.glob("*.json"), key=lambda p: p.stat().st_mtime, reverse=True)
        for old in kept[KEEP:]:
            old.unlink(missing_ok=True)
    except OSError:
        pass  # no cache: the next new host lists its options itself, as it would without one


def _forget_known() -> None:
    global _known
    _known = None


def load(fingerprint: str) -> dict[str, Any] | None:
    try:
        listed = json.loads((cache_dir() / f"{fingerprint}.json").read_text())
    except (OSError, ValueError):
        return None
    return listed if _valid(listed) else None


def complete(facts: dict[str, Any]) -> dict[str, Any]:
    """A facts answer with its option list whole: filled in from here where the host answered
    with a fingerprint this cache knows, kept here where the host listed it."""
    sglang = facts.get("sglang") if isinstance(facts, dict) else None
    if not isinstance(sglang, dict) or not sglang.get("installed"):
        return facts
    fingerprint = sglang.get("options_fingerprint")
    if sglang.get("options_cached") == "controller":
        listed = load(fingerprint)
        if listed is None:  # pruned or removed since the call was sent: say so, the rerun lists
            sglang["options_error"] = (f"the controller's option cache ({cache_dir()}) lost the list for "
                                       f"fingerprint {fingerprint} during this run; run the command again")
        else:
            sglang.update(options=listed["options"], undocumented=listed["undocumented"])
    elif sglang.get("options") is not None:
        store(fingerprint, {"options": sglang["options"], "undocumented": sglang.get("undocumented") or []})
    return facts
