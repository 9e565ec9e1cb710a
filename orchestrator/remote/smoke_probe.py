"""The smoke probe: SGLang's own prepare_server_args AND its full validation, on the host.

Command `probe`, args {"argv": [...], "simulate": null | "h200" | ...}, through the call
convention (fleet/remote_call.py) on the host, or in a local process for `smoke --local`. Its
value is ONE document: ok, phase that failed (import | parse | validate), exception type and
message, the FULL traceback (never cut), SGLang's log lines emitted meanwhile, key resolved
fields, timings. A failing validation is a successful probe whose document says ok: false.
With SGLang imported, it also lists its option strings (options_listed; server_facts.py, sent
as a companion, keeps them on the host): a plan after a push then finds them cached.

Validation: on SGLang with `ServerArgs.resolve_once` (0.5.23+) parsing only parses and
resolve_once validates, then `check_server_args` (which the launch runs next: the parallel sizes
over --nnodes, multi-node data parallelism, ...); older versions validate inside
ServerArgs.__post_init__, i.e. during prepare_server_args, which is then reported as the validate
phase unless argparse itself exited.

--simulate validates inside SGLang's platform override as if on that GPU (SGLang's
runtime_context.override_platform), adding `--device cuda` as auto-detection on a GPU host would.
"""

import contextlib
import io
import logging
import sys
import time
import traceback

try:  # on the host: sent ahead of this file by the call convention (fleet/remote_call.py)
    import sglfleet_hostlib as hostlib
except ImportError:  # on the controller: unit tests import this file
    from orchestrator.remote import hostlib

PLATFORMS = {  # GPU -> SGLang override_platform keywords
    "h200": {"is_cuda": True, "is_sm90": True, "device_capability": (9, 0), "is_hopper_with_cuda_12_3": True},
    "h100": {"is_cuda": True, "is_sm90": True, "device_capability": (9, 0), "is_hopper_with_cuda_12_3": True},
    "a100": {"is_cuda": True, "is_sm90": False, "device_capability": (8, 0)},
    "l40s": {"is_cuda": True, "is_sm90": False, "device_capability": (8, 9)},
}
FIELDS = ("speculative_algorithm", "speculative_num_draft_tokens", "speculative_dflash_block_size",
          "speculative_ddtree_budget", "speculative_ddtree_topk_cap", "speculative_ddtree_shadow_linear",
          "speculative_ddtree_allow_hybrid_unsafe", "mamba_radix_cache_strategy", "mamba_scheduler_strategy",
          "mamba_full_memory_ratio", "max_running_requests", "device", "tp_size", "mem_fraction_static",
          "pp_size", "nnodes", "node_rank", "dist_init_addr")


class Collect(logging.Handler):
    def __init__(self):
        super().__init__(logging.DEBUG)
        self.lines = []
        self.setFormatter(logging.Formatter("[%(asctime)s] %(levelname)s %(name)s: %(message)s"))

    def emit(self, record):
        self.lines.append(self.format(record))


def probe(request, stream=None):
    argv = list(request["argv"])
    simulate = request.get("simulate")
    out = {"ok": False, "phase": None, "python": sys.executable, "argv": argv, "simulate": simulate,
           "timings": {}, "log": [], "fields": {}}
    collect = Collect()
    stderr = io.StringIO()
    started = time.monotonic()
    phase = "import"
    try:
        with contextlib.redirect_stderr(stderr):
            import sglang.srt.server_args as server_args_module  # noqa: F401 (the import phase)
            from sglang.srt.server_args import prepare_server_args
            out["timings"]["import_s"] = round(time.monotonic() - started, 3)
            context = contextlib.nullcontext()
            if simulate:
                if simulate not in PLATFORMS:
                    raise ValueError("--simulate %s: known GPUs are %s" % (simulate, ", ".join(sorted(PLATFORMS))))
                from sglang.srt.runtime_context import override_platform

                context = override_platform(**PLATFORMS[simulate])
                if "--device" not in argv and not any(a.startswith("--device=") for a in argv):
                    argv.append("--device")
                    argv.append("cuda")
            logging.getLogger().addHandler(collect)
            with context:
                separate = hasattr(server_args_module.ServerArgs, "resolve_once")
                phase = "parse" if separate else "validate"
                t = time.monotonic()
                try:
                    args = prepare_server_args(argv)
                except SystemExit as exc:
                    phase = "parse"  # argparse: unknown flag, bad value
                    raise RuntimeError("argparse exited with status %s" % exc.code) from exc
                finally:
                    logging.getLogger().addHandler(collect)  # prepare_server_args resets logging
                out["timings"]["parse_s"] = round(time.monotonic() - t, 3)
                if separate:
                    phase = "validate"
                    t = time.monotonic()
                    args.resolve_once()
                    # what launch_server checks next (the parallel sizes over --nnodes among them)
                    check = getattr(args, "check_server_args", None)
                    if check is not None:
                        check()
                    out["timings"]["validate_s"] = round(time.monotonic() - t, 3)
                resolved = args.resolved_dict() if hasattr(args, "resolved_dict") else vars(args)
                out["fields"] = {k: resolved[k] for k in FIELDS if k in resolved}
        out["ok"], out["phase"] = True, None
    except BaseException as exc:  # noqa: BLE001 - everything is reported, whole
        out["phase"] = phase
        cause = exc.__cause__ if isinstance(exc, RuntimeError) and isinstance(exc.__cause__, SystemExit) else exc
        out["exception"] = {"type": type(cause).__name__, "message": str(exc) if cause is exc else str(exc)}
        out["traceback"] = traceback.format_exc()
    finally:
        logging.getLogger().removeHandler(collect)
    out["timings"]["total_s"] = round(time.monotonic() - started, 3)
    if "import_s" in out["timings"]:
        t = time.monotonic()
        out["options_listed"] = listed_options(request)
        out["timings"]["options_s"] = round(time.monotonic() - t, 3)
    out["log"] = collect.lines
    out["stderr"] = stderr.getvalue()
    return out


def listed_options(request):
    """The option strings of the SGLang this probe imported, kept in the host's cache and sent to
    the controller's (server_facts.remember_options): the next plan's facts need no import of
    their own. Milliseconds here; never the probe's outcome (None when it cannot)."""
    try:
        from sglang.srt.server_args import ServerArgs

        return hostlib.companion("server_facts.py").remember_options(ServerArgs, request.get("state_dir"))
    except Exception:  # noqa: BLE001 - an old SGLang without add_cli_args, a read-only state dir
        return None


COMMANDS = {"probe": probe}

if __name__ == "__main__":
    sys.exit(hostlib.main(COMMANDS))
