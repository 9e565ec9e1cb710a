"""Warm calls of one op at a given batch, for Nsight Compute on the device:

    ncu --clock-control none -k regex:topk_chunk --launch-skip 2 -c 1 --section SpeedOfLight ... \
        PYTHONPATH=kernels python3 -m ddtree.profile_topk --bs 32
    ncu ... -k regex:draft_kernel ... PYTHONPATH=kernels python3 -m ddtree.profile_topk --op draft --bs 1

--op topk: ext.topk_lse; draft: ext.draft_tree on the fused path; build: ext.build_tree.
"""

from __future__ import annotations

import argparse

import torch

from . import load


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--bs", type=int, default=32)
    parser.add_argument("--k", type=int, default=64)
    parser.add_argument("--op", choices=["topk", "draft", "build"], default="topk")
    parser.add_argument("--seed", type=int, default=None, help="the input bench.py times (seed 1) or another")
    args = parser.parse_args()
    ext = load()
    gen = None if args.seed is None else torch.Generator(device="cuda").manual_seed(args.seed)
    x = (torch.randn(args.bs, 15, 151936, device="cuda", generator=gen) * 3).to(torch.bfloat16)
    ids, lp, _ = ext.topk_lse(x, args.k)
    call = {"topk": lambda: ext.topk_lse(x, args.k),
            "draft": lambda: ext.draft_tree(x, args.k, args.k, True, "fused"),
            "build": lambda: ext.build_tree(ids, lp, args.k)}[args.op]
    for _ in range(3):  # warm-up launches are profiled too unless -c / --launch-skip say otherwise
        call()
    torch.cuda.synchronize()


if __name__ == "__main__":
    main()
