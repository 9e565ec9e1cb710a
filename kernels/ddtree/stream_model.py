"""How many candidates the top-K bounds let through (NumPy models of the candidate rules, no GPU):
the figures quoted in README.md come from here.

    PYTHONPATH=kernels python -m ddtree.stream_model [--rows 300] [--k 64]              # the streaming top-K
    PYTHONPATH=kernels python -m ddtree.stream_model --fused [--rows 60] [--k 64] [--splits 17]  # the fused launch

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


DRAFT_VECS = 4  # the fused launch: 16-byte vectors per thread of a chunk CTA


def fused_params(k: int, splits: int) -> tuple[int, int]:
    """(qw, qc) as draft_layout picks them: keys a warp offers, keys a CTA publishes."""
    qw = 1 if k <= 32 else 2 if k <= 64 else 4
    return qw, min(WARPS * qw, max(8, -(-2 * k // splits)))


def fused_row(row: np.ndarray, k: int, splits: int, vecs: int = DRAFT_VECS) -> tuple[float, np.ndarray]:
    """The fused launch's bound for one row of bf16 logits (as floats): (tau, candidates per chunk).

    A chunk CTA's thread t holds vectors v * 512 + t (v < vecs: 4, or 5 in the cluster variant's
    8 chunks a row) of 8 elements; each warp offers its
    qw largest thread maxima, each CTA publishes the qc largest offered, and tau is the K-th largest
    published value: they are distinct elements, so at least K elements are >= tau."""
    vocab = len(row)
    chunk = -(-(-(-vocab // splits)) // 16) * 16
    qw, qc = fused_params(k, splits)
    published, per_chunk = [], []
    for s in range(-(-vocab // chunk)):
        part = row[s * chunk:(s + 1) * chunk]
        padded = np.full(THREADS * vecs * VEC, -np.inf)
        padded[:len(part)] = part
        thread_max = padded.reshape(vecs, THREADS, VEC).max(axis=(0, 2))
        offered = np.sort(thread_max.reshape(WARPS, 32), axis=1)[:, ::-1][:, :qw].ravel()
        published.extend(np.sort(offered)[::-1][:qc])
    published = np.sort(np.array(published))[::-1]
    tau = float(published[k - 1]) if len(published) >= k else -np.inf
    for s in range(-(-vocab // chunk)):
        per_chunk.append(int((row[s * chunk:(s + 1) * chunk] >= tau).sum()))
    return tau, np.array(per_chunk)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rows", type=int, default=300)
    parser.add_argument("--k", type=int, default=64)
    parser.add_argument("--fused", action="store_true", help="the fused launch's row bound")
    parser.add_argument("--splits", type=int, default=8, help="chunks per row (--fused; clusters: 8)")
    args = parser.parse_args()
    torch.manual_seed(0)
    if args.fused:
        rows = (torch.randn(args.rows, 151936) * 3).to(torch.bfloat16).float().numpy()
        per = [fused_row(r, args.k, args.splits, 5 if args.splits <= 8 else DRAFT_VECS)[1] for r in rows]
        for name, col in (("candidates a row", np.array([p.sum() for p in per])),
                          ("candidates a chunk", np.concatenate(per))):
            print(f"{name}: mean {col.mean():.1f}, p99 {np.percentile(col, 99):.0f}, max {col.max()}")
        return
    rows = (torch.randn(args.rows, 151936) * 3).to(torch.bfloat16).float().numpy()
    res = np.array([(n, len(kept)) for n, kept in (stream_row(r, args.k) for r in rows)])
    for name, col in (("vectors staged", res[:, 0]), ("survivors of the final bound", res[:, 1])):
        print(f"{name}: mean {col.mean():.0f}, p99 {np.percentile(col, 99):.0f}, max {col.max()}, min {col.min()}")


if __name__ == "__main__":
    main()
