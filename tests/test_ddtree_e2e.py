"""The DDTree decode loop with a real `transformers` model (kernels/ddtree/e2e.py), tiny and on the
CPU: lossless against the target's own greedy decode, and with the target as its own drafter every
step accepts the whole greedy chain the tree holds. Skipped where transformers is not installed
(it is not a project dependency); the H200 run uses the full-size configuration."""

from __future__ import annotations

import json

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from ddtree import e2e  # noqa: E402
from tests.test_ddtree_kernels import ext  # noqa: E402,F401


def test_tiny_decode_is_lossless(ext, tmp_path, monkeypatch):  # noqa: F811
    monkeypatch.setattr(e2e, "load", lambda: ext)
    out = tmp_path / "e2e.json"
    rc = e2e.main(["--device", "cpu", "--dtype", "float32", "--vocab", "1000", "--hidden", "64", "--layers", "2",
                   "--draft-hidden", "64", "--draft-layers", "1", "--prompts", "2", "--new-tokens", "12",
                   "--budgets", "4", "16", "--depth", "4", "--drafters", "self", "noisy", "random",
                   "--json", str(out)])
    results = json.loads(out.read_text())["results"]
    assert rc == 0
    assert all(r["lossless"] for r in results), results
    selfs = [r for r in results if r["drafter"] == "self"]
    assert selfs and all(r["self_accepts_full_chain"] for r in selfs)
    assert all(r["tokens_per_target_forward"] > 1.5 for r in selfs)  # the chain is accepted
