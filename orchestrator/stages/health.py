"""Staged health of a just-started server, each stage with its own timeout, elapsed time live.

    alive -> port -> /health -> /health_generate -> /generate (a fixed prompt returns tokens)
    -> /server_info (the running config is the deployed config: algorithm, draft tokens, budget)
    then (stays_healthy) min_ready: alive and /health 200 for the whole window

A /generate that answers HTTP 200 without text or tokens fails at once (a definite answer, not
a server still starting); /health 503 is "not yet" until the stage's timeout, as SGLang answers
503 during its warm-up.

Each stage is one `remote/server.py health` call that polls ON the host (the server may bind
an address only the host reaches) until the stage passes, its timeout passes, or the process
exits; a process that exits brings back its exit code and its whole log since it started.
These calls are the health polls (not counted as the deploy's round trips).
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable

from ..fleet.group import stopping
from ..fleet.remote_call import call

STAGES = ("alive", "port", "health", "health_generate", "generate", "server_info")
# A non-zero rank of a multi-node server serves no API: SGLang's dummy health server on its
# --host/--port answers /health once the whole group is up (rank 0 runs the stages above).
RANK_STAGES = ("alive", "port", "health")
# Per stage, seconds. `port` covers the model load (weights, KV cache, CUDA graphs): SGLang
# listens only once loaded, and its own warm-up timeout suggestion is 1800 s with DeepGEMM.
DEFAULT_TIMEOUTS = {"alive": 15.0, "port": 1800.0, "health": 300.0, "health_generate": 300.0, "generate": 120.0,
                    "server_info": 30.0}
PROMPT = "The capital of France is"
# /server_info field -> the smoke probe's resolved field it must equal.
CHECKED_FIELDS = ("speculative_algorithm", "speculative_num_draft_tokens", "speculative_ddtree_budget",
                  "speculative_ddtree_topk_cap")


@dataclass
class HealthResult:
    ok: bool
    stages: list[dict[str, Any]] = field(default_factory=list)
    failed: dict[str, Any] | None = None   # the failing stage's answer (exit code, log, last error)
    server_info: dict[str, Any] | None = None
    generated: dict[str, Any] | None = None

    @property
    def timings(self) -> dict[str, float]:
        return {s["stage"]: s["seconds"] for s in self.stages}

    def summary(self) -> str:
        if self.ok:
            return "healthy in %.1fs" % sum(self.timings.values())
        f = self.failed or {}
        if f.get("interrupted"):
            return f"health stage {f.get('stage')} {f.get('message')}"
        if f.get("exited"):
            return f"server exited with code {f.get('exit_code')} during {f.get('stage')}"
        if f.get("timed_out"):
            return f"health stage {f.get('stage')} timed out after {f.get('seconds')}s (last: {f.get('last')})"
        if f.get("stage") == "launch":
            return f"launch failed: {f.get('message')}"
        if f.get("stage") == "canary":  # healthy, but the canary analysis (or a human) rejected it
            return str(f.get("message"))
        return f"health stage {f.get('stage')} failed: {f.get('message') or f.get('last')}"


def config_mismatches(info: dict[str, Any], expected: dict[str, Any]) -> list[str]:
    """What /server_info says runs vs what the smoke probe resolved for the deployed argv."""
    out = []
    for key in CHECKED_FIELDS:
        if key in expected and expected[key] is not None and info.get(key) != expected[key]:
            out.append(f"{key}: running {info.get(key)!r}, deployed {expected[key]!r}")
    return out


def check(conn: Any, base_args: dict[str, Any], timeouts: dict[str, float], expected: dict[str, Any],
          note: Callable[[str], None] = lambda text: None, interruptible: bool = True,
          stages: tuple[str, ...] = STAGES, abort: Abort | None = None) -> HealthResult:
    """The staged health; `interruptible`: a Ctrl-C ends the wait (not for a revert's own health);
    `abort`: set when another rank of the same server failed, which ends this wait too."""
    result = HealthResult(ok=False)
    for stage in stages:
        timeout = float(timeouts.get(stage, DEFAULT_TIMEOUTS[stage]))
        answer = _timed(conn, dict(base_args, stage=stage, timeout=timeout, prompt=PROMPT), timeout, note,
                        interruptible, abort)
        if not answer.get("ok"):
            result.failed = answer
            return result
        result.stages.append({"stage": stage, "seconds": answer["seconds"]})
        if stage == "generate":
            result.generated = answer.get("detail")
        if stage == "server_info":
            result.server_info = answer.get("detail") or {}
            wrong = config_mismatches(result.server_info, expected)
            if wrong:
                result.failed = {"ok": False, "stage": stage, "message": "the running config is not the deployed "
                                 "config: " + "; ".join(wrong), "seconds": answer["seconds"]}
                return result
    result.ok = True
    return result


def stays_healthy(conn: Any, base_args: dict[str, Any], seconds: float, result: HealthResult,
                  note: Callable[[str], None] = lambda text: None, abort: Abort | None = None) -> HealthResult:
    """After the staged health passed: the server must stay alive and answer /health 200 for
    `seconds` straight (one call polling on the host, its last check at the window's end). A
    failure turns `result` into a failed one at stage `min_ready` (with the exit code and log)."""
    answer = _timed(conn, dict(base_args, stage="min_ready", timeout=seconds), seconds, note, True, abort)
    if answer.get("ok"):
        result.stages.append({"stage": "min_ready", "seconds": answer["seconds"]})
    else:
        result.ok, result.failed = False, answer
    return result


# One health call polls on the host for at most this long; between calls the controller sees a
# Ctrl-C, so an interrupted deploy stops waiting within seconds, not after the stage's timeout.
SLICE_S = 5.0


class Abort(threading.Event):
    """Set, with why, when the wait is over for another reason than this server's own answers
    (another rank of its multi-node server failed)."""

    why: str = ""

    def fire(self, why: str) -> None:
        if not self.is_set():
            self.why = why
            self.set()


def _timed(conn: Any, args: dict[str, Any], timeout: float, note: Callable[[str], None],
           interruptible: bool = True, abort: Abort | None = None) -> dict[str, Any]:
    """One stage, in calls of at most SLICE_S, with its elapsed time shown live. Between calls a
    stopping run (Ctrl-C) ends the wait: {"interrupted": True}, and so does `abort`: {"aborted":
    True}. `min_ready` must pass every slice."""
    stage, started, done = args["stage"], time.monotonic(), threading.Event()

    def tick() -> None:
        while not done.wait(0.5):
            note(f"health: {stage} {time.monotonic() - started:.1f}s / {timeout:.0f}s")

    ticker = threading.Thread(target=tick, daemon=True)
    ticker.start()
    try:
        while True:
            left = timeout - (time.monotonic() - started)
            piece = max(0.0, min(SLICE_S, left))
            # the log comes back only with the last slice of a stage that times out (it may be MBs)
            answer = call(conn, "server.py", "health", dict(args, timeout=piece, final=left <= SLICE_S),
                          timeout=piece + 120)
            answer["seconds"] = round(time.monotonic() - started, 3)
            last_piece = left <= SLICE_S
            if stage == "min_ready":
                if not answer.get("ok") or last_piece:
                    return answer
            elif answer.get("ok") or not answer.get("timed_out") or last_piece:
                return answer  # passed, failed for good (exited, a wrong answer), or out of time
            if interruptible and stopping():
                return {"ok": False, "stage": stage, "interrupted": True, "seconds": answer["seconds"],
                        "message": f"interrupted (Ctrl-C) after {answer['seconds']:.1f}s of waiting",
                        "last": answer.get("last"), "log": answer.get("log"), "pid": answer.get("pid")}
            if abort is not None and abort.is_set():
                return {"ok": False, "stage": stage, "aborted": True, "seconds": answer["seconds"],
                        "message": f"not waited for further: {abort.why}", "last": answer.get("last"),
                        "pid": answer.get("pid")}
    finally:
        done.set()
        ticker.join()
