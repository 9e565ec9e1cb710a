"""`sglfleet smoke`: run SGLang's own parse + validation of the rendered argv on each host.

Per host (`smoke_host`): server facts + render (one round trip), then the probe
(`remote/smoke_probe.py`'s `probe`, one round trip); both through fleet/remote_call.py, on a
LocalConnection for --local. Results are stored whole under runs/<time>-smoke/: <host>.json and,
on failure, <host>.traceback.txt. Known failures get a concrete fix (`diagnose`).
"""

from __future__ import annotations

import re
import time
from pathlib import Path
from typing import Any

from ..errors import RemoteError
from ..fleet.remote_call import call
from ..spec.profile import Profile
from . import runs, sglang_options
from .render import HYBRID_MEMORY_RATIO, RENAMED, Rendered, RenderError, mamba_strategy_flag, render, server_facts
from .units import Placement

PROBE = "smoke_probe.py"


# What the probe calls in its process: server_facts lists and keeps the options of the SGLang it imported.
PROBE_COMPANIONS = ("server_facts.py",)


def probe_request(rendered: Rendered, simulate: str | None) -> dict[str, Any]:
    return {"argv": rendered.argv, "simulate": simulate}


def received(probed: dict[str, Any]) -> dict[str, Any]:
    """A probe's document as the controller keeps it: the option list it sent goes to the
    controller's cache (stages/sglang_options.py), not into the stored result."""
    listed = probed.pop("options_listed", None) or {}
    sglang_options.store(listed.get("fingerprint"), listed)
    return probed


def run_probe(conn: Any, rendered: Rendered, simulate: str | None) -> dict[str, Any]:
    try:
        return received(call(conn, PROBE, "probe", probe_request(rendered, simulate), companions=PROBE_COMPANIONS))
    except RemoteError as exc:  # the probe itself died (killed, interpreter gone): its output, whole
        return {"ok": False, "phase": "probe", "exception": {"type": "ProbeError", "message": "no answer from the "
                "probe"}, "traceback": exc.remote_traceback or str(exc), "log": [], "fields": {}, "timings": {}}


def diagnose(result: dict[str, Any], rendered: Rendered | None) -> list[str]:
    """Known failures -> the concrete fix, one line each."""
    if result.get("ok"):
        return []
    text = (result.get("exception") or {}).get("message", "") + "\n" + (result.get("traceback") or "") + \
        "\n" + (result.get("stderr") or "")
    argv = rendered.argv if rendered else []
    fixes = []
    if "cannot branch across tree siblings" in text or "hybrid target" in text:
        strategy = mamba_strategy_flag(rendered.facts["sglang"] if rendered else {})
        companions = [[strategy, "extra_buffer"], ["--mamba-full-memory-ratio", HYBRID_MEMORY_RATIO],
                      ["--speculative-ddtree-allow-hybrid-unsafe"]]
        missing = " ".join(" ".join(c) for c in companions if c[0] not in argv)
        fixes.append(f"the target model is hybrid (linear-attention layers) and needs the companion flags "
                     f"{missing or ' '.join(' '.join(c) for c in companions)}: set `hybrid: auto` in the profile "
                     "(it renders them for hybrid models)")
    if re.search(r"Unknown speculative algorithm name: DDTREE|unrecognized arguments:.*--speculative-ddtree", text):
        fixes.append("this SGLang does not know DDTREE: push the DDTree patchset first "
                     "(sglfleet push HOST PROFILE)")
    for old, (new, _what) in RENAMED.items():
        if f"unrecognized arguments: {old}" in text or (old in text and "unrecognized arguments" in text):
            fixes.append(f"{old} was renamed to {new} in this SGLang")
    if re.search(r"block[_-]size", text) and ("differ" in text or "draft tokens were asked for" in text):
        block = (rendered.facts.get("draft") or {}).get("block_size") if rendered else None
        fixes.append("DFlash block size mismatch: set speculative.block_size to the draft's block_size"
                     + (f" ({block})" if block else "") + " or leave it out"
                     + (", and drop --speculative-num-draft-tokens from server.extra_args (the draft tokens follow "
                        "the block size)" if "--speculative-num-draft-tokens" in argv else ""))
    if re.search(r"(does not exist|not a valid model|No such file|Can't load the configuration)", text):
        fixes.append("a model path is missing on the host: copy the model there or fix model.path / "
                     "speculative.draft_model")
    return fixes


def store(directory: Path, host: str, document: dict[str, Any]) -> None:
    runs.write_json(directory / f"{host}.json", document)
    probe = document.get("probe") or {}
    if probe.get("traceback"):
        runs.write_text(directory / f"{host}.traceback.txt", probe["traceback"], like=document)


def smoke_host(conn: Any, profile: Profile, inventory_path: str, simulate: str | None,
               placement: Placement | None = None) -> dict[str, Any]:
    """Render, then probe, one host (a LocalConnection for --local): the stored document. A rank
    of a multi-node server is probed with its own flags (`placement`: --node-rank and the rest)."""
    started = time.monotonic()
    try:
        rendered = render(conn.host, profile, server_facts(conn, profile), inventory_path, placement=placement)
    except RenderError as exc:
        return {"ok": False, "phase": "render", "summary": str(exc), "diagnosis": [], "probe": None}
    probe = run_probe(conn, rendered, simulate)
    document = {"ok": probe["ok"], "phase": probe.get("phase"), "simulate": simulate,
                "command_line": rendered.to_json()["command_line"], "render": rendered.to_json(), "probe": probe,
                "diagnosis": diagnose(probe, rendered), "seconds": round(time.monotonic() - started, 3)}
    exc = probe.get("exception") or {}
    first_line = (exc.get("message") or "").splitlines()[0] if exc.get("message") else ""
    document["summary"] = "ok" if probe["ok"] else f"{probe.get('phase')} failed: {exc.get('type')}: {first_line}"
    return document


def simulate_for(host: Any, simulate: str | None) -> str | None:
    """--simulate wins; lab hosts validate as their declared GPU (sglfleet_lab_gpu) by default."""
    return simulate or host.vars.get("sglfleet_lab_gpu")
