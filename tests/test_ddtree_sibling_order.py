"""The sibling score's order of operations, `(s - lp[d-1,r]) + lp[d-1,r+1]`, pinned by hand.

Random log-probs never sit one ulp from a tie, and the dyadic tie tests use values whose fp32
sums are exact in either order, so `s + (lp[d-1,r+1] - lp[d-1,r])` passed every other test. The
inputs here are 2x2 log-probs whose two orders differ by one ulp, with the other depth-1 entry
set to the larger of the two values, so the order decides which node is popped third.

Hand computation (fp32, L = K = 2), lp = [[a0, x], [b0, b1]]:
  a0 = -0.5537824, b0 = -0.32130402, b1 = -2.261155, x = -2.814937
  pop 1: (depth 1, rank 0), s = a0. Pushes: sibling (1,) with (a0 - a0) + x = x;
         child (0, 0) with a0 + b0 = -0.8750864.
  pop 2: (0, 0), s = -0.8750864 (> x). Pushes its sibling (0, 1):
         reference order (s - b0) + b1 = (-0.55378240) + b1 = -2.8149374
         other order     s + (b1 - b0) = s + (-1.939851)   = -2.814937  (one ulp higher)
  pop 3: (1,) with x = -2.814937 beats (0, 1) at -2.8149374: node 3 is depth 1, rank 1, parent 0.
         (With the other order, (0, 1) ties x exactly and wins on its rank tuple (0,1) < (1,):
         node 3 would be depth 2, rank 1, parent 1.)
  pop 4 (budget >= 4): (0, 1), then the child of node 3 at x + b0, then its sibling.

The same two rows embedded in larger trees (deeper rows and further ranks far below) take the
CUDA build's other paths (parallel, register frontier, heap: B = 3 .. 1024).
"""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from ddtree import ops, reference  # noqa: E402
from tests.test_ddtree_kernels import DEVICES, assert_tree_equal, ext  # noqa: E402,F401

f32 = np.float32
A0, X, B0, B1 = f32(-0.5537824), f32(-2.814937), f32(-0.32130402), f32(-2.261155)
# Token ids: depth 1 -> 10, 11, ...; depth 2 -> 20, 21, ...; depth d -> 10 * d + rank.


def test_the_two_orders_really_differ_here():
    """The premise, in numpy fp32: the two orders are one ulp apart and x is the larger one."""
    s2 = f32(A0 + B0)
    ref_order = f32(f32(s2 - B0) + B1)
    other_order = f32(s2 + f32(B1 - B0))
    assert ref_order == f32(-2.8149374) and other_order == X
    assert ref_order < X and np.nextafter(ref_order, f32(0)) == other_order  # one ulp apart
    assert f32(f32(A0 - A0) + X) == X and s2 > X


def rows(L: int, K: int) -> tuple[torch.Tensor, torch.Tensor]:
    """lp [L, K]: the 2x2 block at the top left, everything else far below (sorted per depth)."""
    lp = np.empty((L, K), dtype=np.float32)
    for d in range(L):
        lp[d] = -40.0 - d - np.arange(K, dtype=np.float32)  # far below every score that matters
    lp[0, 0] = A0
    if K > 1:
        lp[0, 1] = X
    if L > 1:
        lp[1, 0] = B0
        if K > 1:
            lp[1, 1] = B1
    ids = np.array([[10 * (d + 1) + r for r in range(K)] for d in range(L)], dtype=np.int64)
    return torch.from_numpy(ids), torch.from_numpy(lp)


# (node, token, depth, rank, parent) of the first four pops, by hand (docstring).
FIRST_FOUR = [(1, 10, 1, 0, 0), (2, 20, 2, 0, 1), (3, 11, 1, 1, 0), (4, 21, 2, 1, 1)]


def check_first_nodes(tokens, depths, ranks, parents, n):
    for node, token, depth, rank, parent in FIRST_FOUR[:n]:
        assert (tokens[node - 1], depths[node - 1], ranks[node - 1], parents[node]) == (token, depth, rank, parent), \
            f"node {node}: got token {tokens[node - 1]} depth {depths[node - 1]} rank {ranks[node - 1]} " \
            f"parent {parents[node]}, want {(token, depth, rank, parent)} (sibling score order)"


SHAPES = [(2, 2, 3), (2, 2, 4), (2, 2, 6), (2, 2, 1024), (15, 64, 64), (15, 64, 256), (8, 8, 1024), (3, 4, 16)]


def test_reference_hand_tree():
    ids, lp = rows(2, 2)
    tree = reference.build_tree(ids, lp, 6)
    # All six nodes of the 2x2 tree, in pop order, by hand.
    assert tree.tokens == [10, 20, 11, 21, 20, 21]
    assert tree.depths == [1, 2, 1, 2, 2, 2]
    assert tree.ranks == [0, 0, 1, 1, 0, 1]
    assert tree.parents == [-1, 0, 1, 0, 1, 3, 3]
    for L, K, B in SHAPES:
        ids, lp = rows(L, K)
        t = reference.build_tree(ids, lp, B)
        check_first_nodes(t.tokens, t.depths, t.ranks, t.parents, min(4, B))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("L,K,B", SHAPES)
def test_build_hand_tree(ext, device, L, K, B):  # noqa: F811
    """CPU and CUDA builds, batched (the case in rows 0 and 2 of 3, a shuffled copy in row 1)."""
    ids, lp = rows(L, K)
    ids_b = torch.stack([ids, ids.flip(-1), ids])
    lp_b = torch.stack([lp, lp, lp])
    got = ops.TreeBatch(*(t.cpu() for t in ext.build_tree(ids_b.to(device), lp_b.to(device), B)))
    for b in (0, 2):
        n = int(got.num_nodes[b])
        check_first_nodes(got.tokens[b].tolist(), got.depths[b].tolist(), got.ranks[b].tolist(),
                          got.parents[b].tolist(), min(4, n))
        assert_tree_equal(got, b, reference.build_tree(ids, lp, B), B)
    assert_tree_equal(got, 1, reference.build_tree(ids.flip(-1), lp, B), B)
