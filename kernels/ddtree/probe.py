"""Stage timings for tuning (device only): top-K variants that skip one stage each, and the build.

    DDTREE_EXT_DIR=build/ddtree python3 -m kernels.ddtree.probe
Each variant runs in a fresh process (the knob is read once per process).
"""

from __future__ import annotations

import os
import subprocess
import sys

import torch

from . import load
from .bench import cuda_median_us


def one(variant: int) -> None:
    ext = load()
    for bs in (1, 64):
        bufs = [(torch.randn(bs, 15, 151936, device="cuda") * 3).to(torch.bfloat16) for _ in range(8)]
        turn = [0]

        def nxt():
            turn[0] = (turn[0] + 1) % len(bufs)
            return bufs[turn[0]]

        us = cuda_median_us(lambda: ext.topk_lse(nxt(), 64), 50)
        print(f"topk variant={variant:2d} bs={bs:2d} K=64: {us:8.1f} us", flush=True)
        if variant == 0:
            for budget in (64, 256):
                ids, lp, _ = ext.topk_lse(bufs[0], budget)
                b_us = cuda_median_us(lambda: ext.build_tree(ids, lp, budget), 50)
                t = ext.build_tree(ids, lp, budget)
                m_us = cuda_median_us(lambda: ext.build_mask(t[4], t[0]), 50)
                print(f"build bs={bs:2d} B={budget}: {b_us:8.1f} us   mask: {m_us:6.1f} us", flush=True)


if __name__ == "__main__":
    if len(sys.argv) > 1:
        one(int(sys.argv[1]))
    else:
        for variant in (0, 1, 2, 4, 8, 15):
            subprocess.run([sys.executable, "-m", "kernels.ddtree.probe", str(variant)],
                           env={**os.environ, "DDTREE_TOPK_VARIANT": str(variant)}, check=False)
