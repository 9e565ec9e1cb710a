"""Sent over stdin to a lab host's /root/ml-env/bin/python3 by test_smoke.py.

The traceback a user gets from SGLang itself: prepare_server_args, then resolve_once, for the argv
in argv[1] (JSON), under SGLang's own platform override for an H200 with `--device cuda` added
(what `sglfleet smoke --simulate h200` does), with no sglfleet code in the process. Prints one
JSON document: {"traceback": the whole text traceback.format_exc() gives, or null if it validated}.
Written independently of remote/smoke_probe.py, so the test compares two separate paths.
"""

import contextlib
import io
import json
import sys
import traceback

from sglang.srt.runtime_context import override_platform
from sglang.srt.server_args import prepare_server_args

H200 = {"is_cuda": True, "is_sm90": True, "device_capability": (9, 0), "is_hopper_with_cuda_12_3": True}
argv = json.loads(sys.argv[1]) + ["--device", "cuda"]
try:
    with override_platform(**H200), contextlib.redirect_stderr(io.StringIO()):
        prepare_server_args(argv).resolve_once()
except BaseException:  # argparse's SystemExit too
    print(json.dumps({"traceback": traceback.format_exc()}))
else:
    print(json.dumps({"traceback": None}))
