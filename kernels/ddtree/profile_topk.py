"""One warm top-K call at a given batch, for Nsight Compute on the device:

    ncu --clock-control none -k regex:topk_chunk -c 1 --section SpeedOfLight ... \
        python3 -m kernels.ddtree.profile_topk --bs 32
"""

from __future__ import annotations

import argparse

import torch

from . import load


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--bs", type=int, default=32)
    parser.add_argument("--k", type=int, default=64)
    args = parser.parse_args()
    ext = load()
    x = (torch.randn(args.bs, 15, 151936, device="cuda") * 3).to(torch.bfloat16)
    for _ in range(3):  # warm-up launches are profiled too unless -c / --launch-skip say otherwise
        ext.topk_lse(x, args.k)
    torch.cuda.synchronize()


if __name__ == "__main__":
    main()
