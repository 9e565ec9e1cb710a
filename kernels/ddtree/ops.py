"""One call per DDTree step on top of the raw extension ops (all batched, graph-safe on CUDA)."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class TreeBatch:
    num_nodes: torch.Tensor     # [bs] int32
    tokens: torch.Tensor        # [bs, B] int64, node i at i-1, -1 padding
    depths: torch.Tensor        # [bs, B] int32
    ranks: torch.Tensor         # [bs, B] int32
    parents: torch.Tensor       # [bs, B+1] int32, parents[:, 0] = -1
    first_child: torch.Tensor   # [bs, B+1] int32, -1 = none
    next_sibling: torch.Tensor  # [bs, B+1] int32, -1 = none
    vis: torch.Tensor | None = None         # [bs, B+1, B+1] bool
    vis_packed: torch.Tensor | None = None  # [bs, B+1, ceil((B+1)/32)] int32 bit-packed


def draft_tree(ext, logits: torch.Tensor, budget: int, topk_cap: int | None = None, mask: bool = True,
               path: str = "auto") -> TreeBatch:
    """Draft logits [bs, L, V] -> the DDTree of each request (top-K + logsumexp, build, mask).

    path: "auto" takes whichever measured faster for the shape; "fused" (CUDA, K and B <= 256)
    or "composed" force one."""
    k = min(budget, logits.shape[-1], topk_cap or budget)
    # One extension call: on CUDA (K, B <= 256) a single kernel launch does all three steps.
    out = ext.draft_tree(logits, budget, k, mask, path)
    tree = TreeBatch(*out[3:10])
    if mask:
        tree.vis, tree.vis_packed = out[10], out[11]
    return tree


def verify(ext, tree: TreeBatch, posterior: torch.Tensor, max_accept: int):
    """Target greedy tokens per node [bs, B+1] -> accepted [bs, M], accept_len [bs], bonus [bs]."""
    return ext.verify(posterior, tree.tokens, tree.parents, tree.num_nodes, max_accept)
