"""DDTree kernels: a compiled extension (CUDA + CPU) and the reference it must match.

    from ddtree import load, ops
    ext = load()                      # the built module (PYTHONPATH=kernels python -m ddtree.build)
    tree = ops.draft_tree(ext, logits, budget=64)

`ops.py` wraps the raw ops into one call per DDTree step.
"""

from __future__ import annotations

import importlib.util
import json
import os
from pathlib import Path

from .build import DEFAULT_OUT, EXT_NAME


def artifact_dir() -> Path:
    return Path(os.environ.get("DDTREE_EXT_DIR", DEFAULT_OUT))


def load(path: Path | None = None):
    """Import the built extension from its artifact dir (raises ImportError if not built)."""
    import torch  # noqa: F401 - the extension links against libtorch; load it first

    directory = Path(path or artifact_dir())
    meta_file = directory / "metadata.json"
    if not meta_file.exists():
        raise ImportError(f"no DDTree extension built in {directory}; run `PYTHONPATH=kernels python -m ddtree.build`")
    module_file = directory / json.loads(meta_file.read_text())["module"]
    spec = importlib.util.spec_from_file_location(EXT_NAME, module_file)
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot load {module_file}")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
