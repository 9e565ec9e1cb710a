"""Stage timings for tuning (device only): top-K and the build/mask, at bs=1 and bs=64.

    DDTREE_EXT_DIR=build/ddtree python3 -m kernels.ddtree.probe
"""

from __future__ import annotations

import torch

from . import load
from .bench import cuda_median_us


def main() -> None:
    ext = load()
    for bs in (1, 64):
        bufs = [(torch.randn(bs, 15, 151936, device="cuda") * 3).to(torch.bfloat16) for _ in range(8)]
        turn = [0]

        def nxt():
            turn[0] = (turn[0] + 1) % len(bufs)
            return bufs[turn[0]]

        for k in (64, 256):
            us = cuda_median_us(lambda: ext.topk_lse(nxt(), k), 100)
            ids, lp, _ = ext.topk_lse(bufs[0], k)
            b_us = cuda_median_us(lambda: ext.build_tree(ids, lp, k), 100)
            t = ext.build_tree(ids, lp, k)
            m_us = cuda_median_us(lambda: ext.build_mask(t[4], t[0]), 100)
            print(f"bs={bs:2d} K=B={k:4d}: topk {us:8.1f} us  build {b_us:8.1f} us  mask {m_us:6.1f} us", flush=True)


if __name__ == "__main__":
    main()
