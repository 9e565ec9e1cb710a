"""Python models of the CUDA tree builds in csrc/ddtree_cuda.cu: `build` mirrors the serial
register-frontier build (`fast_build`), `select_build` the parallel one that runs first.

`build` keeps the kernel's structure — 32 lanes x F slots, slot p holding the entry of node p's next
unpopped child (lane p % 32, register p // 32), order keys of fp32 scores, the packed (depth,
rank, previous sibling) word, each entry's precomputed successor scores, the placement rule (the
sibling replaces the popped entry in its slot, the first child fills the popped node's own slot),
the lane-best refresh and the tie branch that rebuilds rank tuples from the node records — so the
algorithm can be checked against reference.py on a machine without a GPU. They model the
algorithms, not the timing.
"""

from __future__ import annotations

import numpy as np

f32 = np.float32


def order_key(score) -> int:
    """The kernel's score_key: order-preserving u32 of an fp32 value, -0 folded into +0."""
    u = int(np.array([f32(score) + f32(0.0)], dtype=np.float32).view(np.uint32)[0])
    return (~u & 0xFFFFFFFF) if (u & 0x80000000) else (u | 0x80000000)


def key_value(key: int):
    """The fp32 value of an order key (order_key's inverse)."""
    u = (key & 0x7FFFFFFF) if (key & 0x80000000) else (~key & 0xFFFFFFFF)
    return np.array([u], dtype=np.uint32).view(np.float32)[0]


def sibling_score(s, lp_r, lp_next):
    return f32(f32(s - lp_r) + lp_next)


def successor_scores(lp: np.ndarray, s, depth: int, rank: int) -> tuple:
    """The scores an entry's sibling and first child get (0 where it has none)."""
    L, K = lp.shape
    sib = sibling_score(s, lp[depth - 1, rank], lp[depth - 1, rank + 1]) if rank + 1 < K else f32(0)
    child = f32(s + lp[depth, 0]) if depth < L else f32(0)
    return sib, child


def build(lp: np.ndarray, budget: int) -> list[tuple[int, int, int]]:
    """lp [L, K] fp32 -> (depth, rank, parent) of nodes 1..n in pop order."""
    L, K = lp.shape
    frontier = next(f for f in (1, 2, 4, 8) if 32 * f >= budget)
    # slots[p] = (key, depth, rank, prev, sib_score, child_score) or None; p = lane + 32 j.
    slots: list[tuple | None] = [None] * (32 * frontier)
    records: list[tuple[int, int, int]] = []  # node i at i - 1: (depth, rank, parent)

    def lane_best(lane):
        keys = [(slots[lane + 32 * j] or (0,))[0] for j in range(frontier)]
        j = max(range(frontier), key=lambda i: (keys[i], -i))
        return keys[j], j, keys[j] != 0 and keys.count(keys[j]) > 1

    def rank_tuple(p, depth, rank):  # walks the records up from slot p's node
        t = [0] * 15
        a = p
        while a > 0:
            d, r, parent = records[a - 1]
            t[d - 1] = r + 1
            a = parent
        t[depth - 1] = rank + 1
        return tuple(t)

    s0 = lp[0, 0]
    slots[0] = (order_key(s0), 1, 0, 0, *successor_scores(lp, s0, 1, 0))
    while len(records) < budget:
        best = [lane_best(lane) for lane in range(32)]
        top_key = max(b[0] for b in best)
        if top_key == 0:
            break
        holders = [lane for lane in range(32) if best[lane][0] == top_key]
        if len(holders) == 1 and not best[holders[0]][2]:
            p = holders[0] + 32 * best[holders[0]][1]
        else:  # exact tie: the smallest rank tuple
            p = min((rank_tuple(q, e[1], e[2]), q) for q, e in enumerate(slots)
                    if e is not None and e[0] == top_key)[1]
        _, d, r, prev, p_sib, p_child = slots[p]
        records.append((d, r, p))
        node = len(records)
        slots[p] = (order_key(p_sib), d, r + 1, node, *successor_scores(lp, p_sib, d, r + 1)) if r + 1 < K else None
        if node == budget:
            break
        assert slots[node] is None and node < len(slots), "slot i is first used when node i is popped"
        if d < L:
            slots[node] = (order_key(p_child), d + 1, 0, 0, *successor_scores(lp, p_child, d + 1, 0))
    return records


def select_build(lp: np.ndarray, budget: int, cap: int = 1024) -> list[tuple[int, int, int]] | None:
    """Model of the parallel build (`select_build` in csrc/ddtree_cuda.cu): lp [L, K] fp32 ->
    (depth, rank, parent) of nodes 1..B in pop order, or None where the kernel falls back to the
    serial build. Same steps: tau0 from the comb, the gathered set E, positions by (score desc,
    rank tuple asc), the generator check."""
    L, K = lp.shape
    M = min(K, budget)
    if L * M < budget:
        return None
    comb = []
    for d in range(1, L + 1):  # depth d's chain node and its first M - 1 siblings
        m = lp[0, 0]
        for j in range(1, d):
            m = f32(m + lp[j, 0])
        comb.append(m)
        for r in range(1, M):
            m = sibling_score(m, lp[d - 1, r - 1], lp[d - 1, r])
            comb.append(m)
    # The kernel's radix select stops 10 bits short: the smallest key of the B-th best's bin.
    tau = key_value(order_key(sorted(comb, key=order_key, reverse=True)[budget - 1]) & ~0x3FF)
    if not np.isfinite(tau):
        return None
    E: list[tuple] = []  # (score, depth, rank, parent index or -1, previous sibling index or -1, tuple)
    level = [-1]
    for d in range(1, L + 1):
        nxt = []
        for p in level:
            s = lp[d - 1, 0] if p < 0 else f32(E[p][0] + lp[d - 1, 0])
            prev = -1
            for r in range(K):
                if r > 0:
                    s = sibling_score(s, lp[d - 1, r - 1], lp[d - 1, r])
                if np.isnan(s) or s == np.inf:
                    return None
                if not s >= tau:
                    break
                E.append((s, d, r, p, prev, (E[p][5] if p >= 0 else ()) + (r,)))
                prev = len(E) - 1
                nxt.append(prev)
        if len(E) > cap:
            return None
        level = nxt
        if not level:
            break
    if len(E) < budget:
        return None
    best = sorted(range(len(E)), key=lambda i: (-E[i][0], E[i][5]))[:budget]
    for i in best:  # every one of the B best scores no higher than its generator
        s, d, r, p, prev, _ = E[i]
        g = prev if r > 0 else p
        if g >= 0 and not E[g][0] >= s:
            return None
    node = {i: n + 1 for n, i in enumerate(best)}
    return [(E[i][1], E[i][2], node[E[i][3]] if E[i][3] >= 0 else 0) for i in best]
