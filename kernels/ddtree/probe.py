"""Per-op GPU times for tuning (device only), as CUDA-graph replays (bench.graph_us), then where a
fused launch spends its time (phase timestamps the kernel records when asked: ext._set_timeline).

    DDTREE_EXT_DIR=build/ddtree PYTHONPATH=kernels python3 -m ddtree.probe [--phases | --topk | --inputs]
"""

from __future__ import annotations

import statistics
import sys

import torch

from . import load, ops
from .bench import graph_us

SM_GHZ = 1.98  # H200 SM clock under load (Nsight reports 1.98): cycles -> us for the in-CTA phases
PHASES = [  # (label, slot, kind): "ns" slots are globaltimer times from the first CTA start, "n" counts
    ("last CTA start", 1, "ns"), ("first chunk done", 10, "ns"), ("last chunk done", 2, "ns"),
    ("top-K done", 3, "ns"), ("kernel end", 4, "ns"), ("rank rows", 5, "cyc"),
    ("counter: load rows", 6, "cyc"), ("tree build", 7, "cyc"), ("tree write", 8, "cyc"), ("mask write", 9, "cyc"),
    ("  comb", 11, "cyc"), ("  comb select", 12, "cyc"), ("  gather E", 13, "cyc"), ("  rank+records", 14, "cyc"),
    ("| chunk scan", 15, "cyc"), ("chunk bound+exchange", 16, "cyc"), ("counter: select+candidates", 17, "cyc"),
    ("| rows redone exactly", 18, "n"), ("most candidates in a row", 19, "n"),
]


def timeline(ext, x, k: int, budget: int, runs: int = 40) -> dict[str, float]:
    """Median phase times (us) of eager fused launches on logits x."""
    slots = torch.zeros(20, dtype=torch.int64, device="cuda")
    samples: dict[str, list[float]] = {label: [] for label, _, _ in PHASES}
    ext._set_timeline(slots)
    try:
        for i in range(runs + 5):
            slots.zero_()
            slots[0] = slots[10] = -1  # all ones: the minimum slots
            ext.draft_tree(x, budget, k, True, "fused")
            torch.cuda.synchronize()
            v = slots.tolist()
            if i < 5:
                continue
            for label, slot, kind in PHASES:
                samples[label].append((v[slot] - v[0]) / 1e3 if kind == "ns" else v[slot] if kind == "n"
                                      else v[slot] / (SM_GHZ * 1e3))
    finally:
        ext._set_timeline(None)
    return {label: statistics.median(vals) for label, vals in samples.items()}


def topk_only(ext) -> None:
    """Top-K graph times for the many-row path (the kernel's DDTREE_TOPK / DDTREE_STREAM_SPLITS
    environment picks the variant, read once per process)."""
    for bs in (32, 64):
        x = (torch.randn(bs, 15, 151936, device="cuda") * 3).to(torch.bfloat16)
        for k in (64, 256):
            t = graph_us(lambda: ext.topk_lse(x, k), 100)
            print(f"topk bs={bs:2d} K={k:4d}: {t:7.1f} us", flush=True)


def phases(ext, budget: int = 64) -> None:
    print(f"fused launch phases, K=B={budget}, median of 40 eager launches (us; times from the first CTA start,"
          " durations inside the CTA that ran them):")
    for bs in (1, 8, 64):
        x = (torch.randn(bs, 15, 151936, device="cuda") * 3).to(torch.bfloat16)
        got = timeline(ext, x, budget, budget)
        print(f"  bs={bs:2d}: " + "  ".join(f"{label} {us:.1f}" for label, us in got.items()), flush=True)


def inputs(ext) -> None:
    """bs=1, K=B=64 as graph replays on ten inputs seeded like bench.py's (seed 1 is the bench's):
    the tree's shape, which the input decides, sets the build's cost."""
    for seed in range(1, 11):
        gen = torch.Generator(device="cuda").manual_seed(seed)
        x = (torch.randn(1, 15, 151936, device="cuda", generator=gen) * 3).to(torch.bfloat16)
        t = graph_us(lambda: ops.draft_tree(ext, x, 64), 100)
        tree = ops.draft_tree(ext, x, 64)
        print(f"seed {seed}: {t:.2f} us, {int(tree.num_nodes[0])} nodes, {int(tree.depths.max())} deep", flush=True)


def main() -> None:
    """--topk: the many-row top-K only; --phases [--budget B]: the fused launch's phases only (K = B,
    64 unless given); --inputs: bs=1 over ten seeded inputs."""
    ext = load()
    if "--inputs" in sys.argv:
        inputs(ext)
        return
    if "--topk" in sys.argv:
        topk_only(ext)
        return
    if "--phases" in sys.argv:  # --phases [--budget B]: K = B (64 unless given)
        phases(ext, int(sys.argv[sys.argv.index("--budget") + 1]) if "--budget" in sys.argv else 64)
        return
    for bs in (1, 8, 32, 64):
        x = (torch.randn(bs, 15, 151936, device="cuda") * 3).to(torch.bfloat16)
        for k in (64, 256):
            ids, lp, _ = ext.topk_lse(x, k)
            tree = ext.build_tree(ids, lp, k)
            t_topk = graph_us(lambda: ext.topk_lse(x, k), 100)
            t_build = graph_us(lambda: ext.build_tree(ids, lp, k), 100)
            t_mask = graph_us(lambda: ext.build_mask(tree[4], tree[0]), 100)
            t_fused = graph_us(lambda: ext.draft_tree(x, k, k, True, "fused"), 100)
            print(f"bs={bs:2d} K=B={k:4d}: topk {t_topk:7.1f}  "
                  f"build {t_build:7.1f}  mask {t_mask:6.1f}  fused draft_tree {t_fused:7.1f} us", flush=True)
    phases(ext)


if __name__ == "__main__":
    main()
