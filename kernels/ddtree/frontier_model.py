"""A Python model of the CUDA register-frontier tree build (`fast_build` in csrc/ddtree_cuda.cu).

It keeps the kernel's structure — 32 lanes x F positions, order keys of fp32 scores, the packed
(depth, rank, parent, previous sibling) word, each entry's precomputed successor scores, the
placement rule (sibling into the popped position, child appended), the lane-best refresh and the
tie branch that compares rank tuples — so the algorithm can be checked against reference.py on a
machine without a GPU. It models the algorithm, not the timing.
"""

from __future__ import annotations

import numpy as np

f32 = np.float32


def order_key(score) -> int:
    """The kernel's fkey: order-preserving u32 of an fp32 value, -0 folded into +0."""
    u = int(np.array([f32(score) + f32(0.0)], dtype=np.float32).view(np.uint32)[0])
    return (~u & 0xFFFFFFFF) if (u & 0x80000000) else (u | 0x80000000)


def pack(depth: int, rank: int, parent: int, prev: int) -> int:
    return depth | rank << 4 | parent << 13 | prev << 22


def unpack(meta: int) -> tuple[int, int, int, int]:
    return meta & 15, (meta >> 4) & 511, (meta >> 13) & 511, meta >> 22


def successor_scores(lp: np.ndarray, s, meta: int) -> tuple:
    L, K = lp.shape
    d, r, _, _ = unpack(meta)
    sib = f32(f32(s - lp[d - 1, r]) + lp[d - 1, r + 1]) if r + 1 < K else f32(0)
    child = f32(s + lp[d, 0]) if d < L else f32(0)
    return sib, child


def build(lp: np.ndarray, budget: int) -> list[tuple[int, int, int]]:
    """lp [L, K] fp32 -> (depth, rank, parent) of nodes 1..n in pop order."""
    L, K = lp.shape
    frontier = next(f for f in (1, 2, 4, 8) if 32 * f >= budget)
    lanes = [{"key": [0] * frontier, "meta": [0] * frontier, "sib": [f32(0)] * frontier,
              "child": [f32(0)] * frontier} for _ in range(32)]
    tuples = {0: (0,) * 15}  # rank tuple of node i, as rank + 1 per level

    def lane_best(lane):
        e = lanes[lane]
        j = max(range(frontier), key=lambda i: (e["key"][i], -i))
        dup = e["key"][j] != 0 and e["key"].count(e["key"][j]) > 1
        return e["key"][j], j, dup

    first = lanes[0]
    first["key"][0], first["meta"][0] = order_key(lp[0, 0]), pack(1, 0, 0, 0)
    first["sib"][0], first["child"][0] = successor_scores(lp, lp[0, 0], first["meta"][0])
    nodes, top = [], 1
    while len(nodes) < budget:
        best = [lane_best(lane) for lane in range(32)]
        top_key = max(b[0] for b in best)
        if top_key == 0:
            break
        holders = [lane for lane in range(32) if best[lane][0] == top_key]
        if len(holders) == 1 and not best[holders[0]][2]:
            w, wj = holders[0], best[holders[0]][1]
        else:  # exact tie: the smallest rank tuple (parent's tuple extended by the rank)
            def rank_tuple(lane, j):
                d, r, p, _ = unpack(lanes[lane]["meta"][j])
                t = list(tuples[p])
                t[d - 1] = r + 1
                return tuple(t)
            _, w, wj = min((rank_tuple(lane, j), lane, j) for lane in range(32) for j in range(frontier)
                           if lanes[lane]["key"][j] == top_key)
        e = lanes[w]
        d, r, parent, _ = unpack(e["meta"][wj])
        p_sib, p_child = e["sib"][wj], e["child"][wj]
        node = len(nodes) + 1
        t = list(tuples[parent])
        t[d - 1] = r + 1
        tuples[node] = tuple(t)
        nodes.append((d, r, parent))
        if node == budget:
            break
        has_sib, has_child = r + 1 < K, d < L
        sib_meta, child_meta = pack(d, r + 1, parent, node), pack(d + 1, 0, node, 0)
        sib_entry = (order_key(p_sib), sib_meta, *successor_scores(lp, p_sib, sib_meta)) if has_sib else None
        child_entry = (order_key(p_child), child_meta, *successor_scores(lp, p_child, child_meta)) \
            if has_child else None
        placed = sib_entry or child_entry
        if placed:
            e["key"][wj], e["meta"][wj], e["sib"][wj], e["child"][wj] = placed
        else:
            e["key"][wj] = 0
        if sib_entry and child_entry:  # the child takes the next unused position
            a = lanes[top & 31]
            assert top >> 5 < frontier, "positions used never exceed the budget"
            a["key"][top >> 5], a["meta"][top >> 5], a["sib"][top >> 5], a["child"][top >> 5] = child_entry
            top += 1
    return nodes
