"""How many candidates the streaming top-K's bound lets through (a NumPy model of its candidate
rule, no GPU): the figures quoted in README.md ("The streaming top-K") come from here.

    python -m kernels.ddtree.stream_model [--rows 300] [--k 64]

Per row: 512 threads, 2 vectors of 8 bf16 logits per thread and step (thread t gets vectors
u * 512 + t of the step); the bound tau is the smallest over the 16 warps of the warp's q-th
largest lane maximum (q = ceil(K / 16)), set after step 1 and raised after 2, 3, 4, 6, 9, 13, ...
steps; a vector is staged when its max is >= the tau in force; at the end the staged elements
>= the final bound survive to the ranking.
"""

from __future__ import annotations

import argparse

import numpy as np
import torch

THREADS, VECS, VEC, WARPS = 512, 2, 8, 16


def bound(lane_max: np.ndarray, q: int) -> float:
    return float(np.sort(lane_max.reshape(WARPS, 32), axis=1)[:, -q].min())


def stream_row(row: np.ndarray, k: int) -> tuple[int, np.ndarray]:
    """(vectors staged, the values that survive the final bound) for one row of logits."""
    q = -(-k // WARPS)
    vecs = row.reshape(-1, VEC)
    per_step = VECS * THREADS
    lane_max = np.full(THREADS, -np.inf)
    staged: list[np.ndarray] = []
    refresh, tau = 2, -np.inf
    for i in range(-(-len(vecs) // per_step)):
        step = np.full((VECS, THREADS, VEC), -np.inf)
        block = vecs[i * per_step:(i + 1) * per_step]
        for u in range(VECS):
            part = block[u * THREADS:(u + 1) * THREADS]
            step[u, :len(part)] = part
        lane_max = np.maximum(lane_max, step.max(axis=(0, 2)))
        if i == 0:
            tau = bound(lane_max, q)
        hit = step.max(axis=2) >= tau
        staged.append(step[hit])
        if i + 1 == refresh and i > 0:
            tau = bound(lane_max, q)
            refresh += max(1, refresh // 2)
    staged_vecs = np.concatenate(staged)
    return len(staged_vecs), staged_vecs[staged_vecs >= bound(lane_max, q)]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rows", type=int, default=300)
    parser.add_argument("--k", type=int, default=64)
    args = parser.parse_args()
    torch.manual_seed(0)
    rows = (torch.randn(args.rows, 151936) * 3).to(torch.bfloat16).float().numpy()
    res = np.array([(n, len(kept)) for n, kept in (stream_row(r, args.k) for r in rows)])
    for name, col in (("vectors staged", res[:, 0]), ("survivors of the final bound", res[:, 1])):
        print(f"{name}: mean {col.mean():.0f}, p99 {np.percentile(col, 99):.0f}, max {col.max()}, min {col.min()}")


if __name__ == "__main__":
    main()
