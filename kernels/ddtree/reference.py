"""DDTree reference implementation: plain Python/PyTorch, written from the published algorithm.

This file defines the semantics the compiled ops must reproduce exactly:

* top-K per depth: the K largest logits, ties by lower token id first; log-probs are
  fp32(top logit) - fp32(logsumexp over the whole vocab), the logsumexp computed in float64
  and rounded once to fp32. No temperature.
* best-first tree build over heap entries (score, rank_tuple, parent, depth, rank): the first
  entry is ((0,), depth 1, parent 0, score lp[0,0]); pop the highest score, ties by the rank
  tuple in lexicographic order ((0,) < (0,0) < (0,1) < (1,)); the i-th pop is node i (node 0
  is the root). After popping (d, r, s): push the sibling (r+1) with score
  (s - lp[d-1,r]) + lp[d-1,r+1] when r+1 < K, and the first child (d+1, rank 0) with score
  s + lp[d,0] when d < L. All score arithmetic is fp32, in exactly that order. Stop after B
  pops or when the heap is empty.
* visibility: vis[0,0] = 1; vis[i,:i] = vis[parent[i],:i]; vis[i,i] = 1.
* verify walk: next = posterior[0]; while `next` is the token of a child of the current node,
  move to that child and set next = posterior[child]. Accepted = visited nodes (from 0);
  `next` is the bonus token.
* KV compaction: slot base+i <- slot base+accepted[i], for i in increasing order.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass, field

import numpy as np
import torch

f32 = np.float32


def topk_logprobs(logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """logits [L, V] (any float dtype) -> token ids [L, K] int64, log-probs [L, K] fp32, lse [L] fp32."""
    x = logits.float()
    # Stable sort keeps equal values in token-id order: ties go to the lower id.
    values, ids = torch.sort(x, dim=-1, descending=True, stable=True)
    lse = torch.logsumexp(logits.double(), dim=-1).float()
    return ids[:, :k].contiguous(), (values[:, :k] - lse[:, None]).contiguous(), lse


@dataclass
class Tree:
    tokens: list[int] = field(default_factory=list)  # node i (1-based) -> tokens[i-1]
    depths: list[int] = field(default_factory=list)
    ranks: list[int] = field(default_factory=list)
    parents: list[int] = field(default_factory=lambda: [-1])  # parents[0] = -1 (root)
    first_child: list[int] = field(default_factory=lambda: [-1])
    next_sibling: list[int] = field(default_factory=lambda: [-1])

    @property
    def n(self) -> int:
        return len(self.tokens)

    def visibility(self) -> np.ndarray:
        n = self.n
        vis = np.zeros((n + 1, n + 1), dtype=bool)
        vis[0, 0] = True
        for i in range(1, n + 1):
            vis[i, :i] = vis[self.parents[i], :i]
            vis[i, i] = True
        return vis

    def children_by_token(self) -> list[dict[int, int]]:
        children: list[dict[int, int]] = [dict() for _ in range(self.n + 1)]
        for i in range(1, self.n + 1):
            children[self.parents[i]][self.tokens[i - 1]] = i
        return children


def build_tree(token_ids: torch.Tensor, logprobs: torch.Tensor, budget: int) -> Tree:
    """token_ids [L, K], logprobs [L, K] fp32 (sorted descending per depth) -> Tree."""
    lp = logprobs.detach().cpu().numpy().astype(np.float32)
    ids = token_ids.detach().cpu().numpy()
    depth_limit, k = lp.shape
    tree = Tree()
    if budget <= 0 or k == 0 or depth_limit == 0:
        return tree
    # heapq is a min-heap: key (-score, rank_tuple). -score is exact in fp32 (sign flip).
    # Entries also carry parent, depth, rank and the node index of the previous sibling.
    heap = [(-lp[0, 0], (0,), 0, 1, 0, -1)]
    while heap and tree.n < budget:
        neg_score, rank_tuple, parent, depth, rank, prev_sibling = heapq.heappop(heap)
        score = -neg_score
        tree.tokens.append(int(ids[depth - 1, rank]))
        tree.depths.append(depth)
        tree.ranks.append(rank)
        tree.parents.append(parent)
        tree.first_child.append(-1)
        tree.next_sibling.append(-1)
        node = tree.n
        if rank == 0:
            tree.first_child[parent] = node
        else:
            tree.next_sibling[prev_sibling] = node
        if rank + 1 < k:
            sibling_score = f32(f32(score - lp[depth - 1, rank]) + lp[depth - 1, rank + 1])
            heapq.heappush(heap, (-sibling_score, rank_tuple[:-1] + (rank + 1,), parent, depth, rank + 1, node))
        if depth < depth_limit:
            child_score = f32(score + lp[depth, 0])
            heapq.heappush(heap, (-child_score, rank_tuple + (0,), node, depth + 1, 0, -1))
    return tree


def verify_walk(tree: Tree, posterior: list[int]) -> tuple[list[int], int]:
    """posterior[i] = the target's greedy token after node i. -> (accepted nodes, bonus token)."""
    children = tree.children_by_token()
    node, accepted = 0, [0]
    nxt = posterior[0]
    while nxt in children[node]:
        node = children[node][nxt]
        accepted.append(node)
        nxt = posterior[node]
    return accepted, nxt


def compact_kv(cache: torch.Tensor, base: int, accepted: list[int]) -> None:
    """In place: cache[base+i] <- cache[base+accepted[i]] in increasing i (safe: accepted[i] >= i)."""
    for i, a in enumerate(accepted):
        if a != i:
            cache[base + i] = cache[base + a]


def build_from_logits(logits: torch.Tensor, budget: int, topk_cap: int | None = None) -> Tree:
    """The whole reference path for one request: logits [L, V] -> Tree."""
    k = min(budget, logits.shape[-1], topk_cap or budget)
    ids, lp, _ = topk_logprobs(logits, k)
    return build_tree(ids, lp, budget)
