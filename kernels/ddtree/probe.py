"""Per-op GPU times for tuning (device only): each op captured in a CUDA graph and replayed, so
host overhead is excluded; eager times alongside.

    DDTREE_EXT_DIR=build/ddtree python3 -m kernels.ddtree.probe
"""

from __future__ import annotations

import torch

from . import load
from .bench import cuda_median_us


def graph_us(fn, iters: int = 200) -> float:
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return cuda_median_us(graph.replay, iters)


def main() -> None:
    ext = load()
    for bs in (1, 8, 64):
        x = (torch.randn(bs, 15, 151936, device="cuda") * 3).to(torch.bfloat16)
        for k in (64, 256):
            ids, lp, _ = ext.topk_lse(x, k)
            tree = ext.build_tree(ids, lp, k)
            t_topk = graph_us(lambda: ext.topk_lse(x, k))
            t_build = graph_us(lambda: ext.build_tree(ids, lp, k))
            t_mask = graph_us(lambda: ext.build_mask(tree[4], tree[0]))
            e_topk = cuda_median_us(lambda: ext.topk_lse(x, k), 100)
            print(f"bs={bs:2d} K=B={k:4d}  graph: topk {t_topk:7.1f}  build {t_build:7.1f}  mask {t_mask:6.1f} us"
                  f"   eager topk {e_topk:7.1f} us", flush=True)


if __name__ == "__main__":
    main()
