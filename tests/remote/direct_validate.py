"""Sent over stdin to a lab host's /root/ml-env/bin/python3 by test_lab_image.py.

Calls the real SGLang directly — prepare_server_args, then resolve_once — under SGLang's own
platform override for an H200, for each argv case in argv[1] (JSON), and prints one JSON list
of outcomes: {"exit": 0, "fields": {...}} | {"exit": 1, "type": ExceptionName, "message": str} |
{"exit": 2} (argparse). `fields` are the resolved speculative fields that exist in this build.
Written independently of the server stand-in, so the test compares two separate paths.
"""

import contextlib
import io
import json
import sys

from sglang.srt.runtime_context import override_platform
from sglang.srt.server_args import prepare_server_args

H200 = {"is_cuda": True, "is_sm90": True, "device_capability": (9, 0), "is_hopper_with_cuda_12_3": True}
FIELDS = ("speculative_algorithm", "speculative_num_draft_tokens", "speculative_ddtree_budget",
          "speculative_ddtree_topk_cap", "speculative_ddtree_shadow_linear", "mamba_radix_cache_strategy",
          "max_running_requests")
outcomes = []
for argv in json.loads(sys.argv[1]):
    try:
        with override_platform(**H200), contextlib.redirect_stderr(io.StringIO()):
            args = prepare_server_args(argv + ["--device", "cuda"])
            args.resolve_once()
        resolved = args.resolved_dict()
        fields = {name: resolved[name] for name in FIELDS if name in resolved}
        outcomes.append({"exit": 0, "fields": fields})
    except SystemExit as exc:
        outcomes.append({"exit": exc.code})
    except Exception as exc:
        outcomes.append({"exit": 1, "type": type(exc).__name__, "message": str(exc)})
print(json.dumps(outcomes))
