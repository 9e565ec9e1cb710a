"""DDTree tree utilities for SGLang: the compiled `ddtree_ext` when it imports, else the reference.

Part of sglfleet's DDTree patchset. Both paths have the same semantics (the extension is tested
bit-identical to the reference, ties included); `BACKEND` says which one this process uses.
A DDTree worker calls `draft_trees` once per step on the drafter's logits and `verify` on the
target's greedy tokens per node.
"""

from __future__ import annotations

import torch

from sglang.srt.speculative import ddtree_ops as ops
from sglang.srt.speculative import ddtree_reference as reference

try:  # installed into site-packages by `sglfleet push` when the host matches its ABI fingerprint
    import ddtree_ext as _ext
except ImportError:
    _ext = None

BACKEND = "ddtree_ext" if _ext is not None else "reference"


def draft_trees(logits: torch.Tensor, budget: int, topk_cap: int | None = None) -> ops.TreeBatch:
    """Draft logits [bs, L, V] -> one best-first tree per request, with visibility masks."""
    if _ext is not None:
        return ops.draft_tree(_ext, logits, budget, topk_cap)
    return _stack([reference.build_from_logits(row, budget, topk_cap) for row in logits], budget)


def verify(tree: ops.TreeBatch, posterior: torch.Tensor, max_accept: int):
    """Target greedy token per node [bs, B+1] -> accepted nodes [bs, max_accept] (-1 padded),
    accept lengths [bs], bonus tokens [bs]."""
    if _ext is not None:
        return ops.verify(_ext, tree, posterior, max_accept)
    bs = posterior.shape[0]
    accepted = torch.full((bs, max_accept), -1, dtype=torch.int32)
    lengths = torch.zeros(bs, dtype=torch.int32)
    bonus = torch.zeros(bs, dtype=torch.int64)
    for b in range(bs):
        n = int(tree.num_nodes[b])
        walk_tree = reference.Tree(tokens=tree.tokens[b, :n].tolist(), parents=tree.parents[b, :n + 1].tolist())
        row = posterior[b].tolist()
        nodes, bonus[b] = reference.verify_walk(walk_tree, row)
        if len(nodes) > max_accept:  # the walk stops at max_accept; the bonus follows the last kept node
            nodes = nodes[:max_accept]
            bonus[b] = row[nodes[-1]]
        accepted[b, :len(nodes)] = torch.tensor(nodes, dtype=torch.int32)
        lengths[b] = len(nodes)
    return accepted, lengths, bonus


def _stack(trees: list, budget: int) -> ops.TreeBatch:
    bs = len(trees)

    def table(rows, width, fill, dtype):
        out = torch.full((bs, width), fill, dtype=dtype)
        for b, row in enumerate(rows):
            out[b, :len(row)] = torch.tensor(row, dtype=dtype)
        return out

    vis = torch.zeros((bs, budget + 1, budget + 1), dtype=torch.bool)
    for b, t in enumerate(trees):
        vis[b, :t.n + 1, :t.n + 1] = torch.from_numpy(t.visibility())
    return ops.TreeBatch(
        num_nodes=torch.tensor([t.n for t in trees], dtype=torch.int32),
        tokens=table([t.tokens for t in trees], budget, -1, torch.int64),
        depths=table([t.depths for t in trees], budget, 0, torch.int32),
        ranks=table([t.ranks for t in trees], budget, -1, torch.int32),
        parents=table([t.parents for t in trees], budget + 1, -1, torch.int32),
        first_child=table([t.first_child for t in trees], budget + 1, -1, torch.int32),
        next_sibling=table([t.next_sibling for t in trees], budget + 1, -1, torch.int32),
        vis=vis)
