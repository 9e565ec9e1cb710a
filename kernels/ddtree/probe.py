"""Per-op GPU times for tuning (device only), as CUDA-graph replays (bench.graph_us).

    DDTREE_EXT_DIR=build/ddtree python3 -m kernels.ddtree.probe
"""

from __future__ import annotations

import torch

from . import load
from .bench import graph_us


def main() -> None:
    ext = load()
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


if __name__ == "__main__":
    main()
