"""(c) as CUDA-graph replays for a few (bs, B) shapes, the bench's way (bf16 randn x 3 logits,
seeded per bs, L=15, V=151936, `auto` path, 10 calls a graph, median of --iters): the figures
the speed goals name, for a same-run A/B of two builds (tools/ab_inputs.sh with AB_GRAPH=1).

    DDTREE_EXT_DIR=build/ddtree python3 kernels/ddtree/tools/ab_graph.py [--shapes 1x64,1x256,64x64,64x256]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # kernels/: the import name is ddtree

import torch  # noqa: E402

from ddtree import load, ops  # noqa: E402
from ddtree.bench import L, V, graph_us  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--shapes", default="1x64,1x256,64x64,64x256")
    p.add_argument("--iters", type=int, default=100)
    args = p.parse_args()
    ext = load()
    for shape in args.shapes.split(","):
        bs, budget = (int(v) for v in shape.split("x"))
        gen = torch.Generator(device="cuda").manual_seed(bs)
        x = (torch.randn(bs, L, V, device="cuda", generator=gen) * 3).to(torch.bfloat16)
        us = graph_us(lambda: ops.draft_tree(ext, x, budget), args.iters)
        print(f"bs={bs:>2} B={budget:>3}: {us:7.1f} us", flush=True)
        del x
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
