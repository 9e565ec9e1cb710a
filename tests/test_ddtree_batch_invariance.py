"""Batch invariance: one request's ids, log-probs, logsumexp and tree are bit-identical whatever
else is in its batch, wherever it sits, and whichever path (`auto`, `fused` in both variants,
`composed`: streaming, chunk or fused top-K kernels) computes them.

The CUDA logsumexp has one fixed reduction order per row (segments of 32 16-byte vectors, see
`segment_lse` in ddtree_cuda.cu), so these compare with torch.equal, not a tolerance. The fused
launch's two variants are chosen once per process (DDTREE_FUSED): device_run.sh runs the tests
named "fused" once more under each.
"""

from __future__ import annotations

import random

import pytest

torch = pytest.importorskip("torch")

from ddtree import ops, reference  # noqa: E402
from tests.test_ddtree_kernels import DEVICES, assert_tree_equal, ext  # noqa: E402,F401

FIELDS = ("num_nodes", "tokens", "depths", "ranks", "parents", "first_child", "next_sibling", "vis", "vis_packed")


def request(L, V, scale, seed, dtype):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(L, V, generator=g) * scale).to(dtype)


def batch_with(req, bs, pos, seed, device="cpu"):
    """bs requests on `device`, `req` at position pos, the others random of several scales."""
    L, V = req.shape
    g = torch.Generator(device=device).manual_seed(seed)
    scale = torch.tensor([3.0, 300.0, 1.0], device=device)[torch.arange(bs, device=device) % 3].view(bs, 1, 1)
    x = (torch.randn(bs, L, V, generator=g, device=device) * scale).to(req.dtype)
    x[pos] = req.to(device)
    return x


def run(ext, logits, B, path):  # noqa: F811
    out = ext.draft_tree(logits, B, min(B, logits.shape[-1]), True, path)
    ids, lp, lse = out[0], out[1], out[2]
    tree = ops.TreeBatch(*out[3:10])
    tree.vis, tree.vis_packed = out[10], out[11]
    return ids, lp, lse, tree


def row_of(result, b):
    ids, lp, lse, tree = result
    return (ids[b].cpu(), lp[b].cpu(), lse[b].cpu(), {f: getattr(tree, f)[b].cpu() for f in FIELDS})


def assert_same(got, want, context):
    for name, a, w in (("ids", got[0], want[0]), ("logprobs", got[1], want[1]), ("lse", got[2], want[2])):
        assert torch.equal(a, w), (context, name, (a != w).sum().item())
    for f in FIELDS:
        assert torch.equal(got[3][f], want[3][f]), (context, f)


# (L, V, B, scale, dtype): the case (randn x 300, V = 151935: rows not 16-byte aligned,
# so no streaming kernel) and aligned rows (streaming kernel past 128 rows at K <= 64; chunk at 256).
CASES = [
    (15, 151935, 256, 300.0, torch.bfloat16),
    (15, 151936, 64, 300.0, torch.bfloat16),
    (15, 151936, 64, 3.0, torch.bfloat16),
    (15, 151936, 256, 3.0, torch.bfloat16),
    (8, 151936, 64, 30.0, torch.float16),
    (15, 151936, 64, 3.0, torch.float32),
    (4, 4099, 33, 300.0, torch.bfloat16),
]
SIZES = [1, 2, 3, 7, 8, 9, 16, 33, 64]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the CUDA paths; the CPU one is per row in fp64")
@pytest.mark.parametrize("L,V,B,scale,dtype", CASES)
def test_batch_invariant_fused_and_composed(ext, L, V, B, scale, dtype):  # noqa: F811
    rng = random.Random(V + B + L)
    req = request(L, V, scale, seed=B + L, dtype=dtype)
    alone = run(ext, req[None].cuda(), B, "fused")
    want = row_of(alone, 0)
    # The tree from the kernel's own log-probs is the reference heap's, and the lse is close to fp64.
    assert_tree_equal(ops.TreeBatch(*(want[3][f][None] for f in FIELDS[:7])), 0,
                      reference.build_tree(want[0], want[1], B), B)
    ref_lse = torch.logsumexp(req.double(), dim=-1).float()
    assert torch.allclose(want[2], ref_lse, rtol=0, atol=2e-6 * max(1.0, float(ref_lse.abs().max()))), (want[2], ref_lse)
    for path in ("composed", "auto"):
        assert_same(row_of(run(ext, req[None].cuda(), B, path), 0), want, ("alone", path))
    for bs in SIZES:
        pos = rng.randrange(bs)
        logits = batch_with(req, bs, pos, seed=bs, device="cuda")
        for path in ("fused", "composed", "auto"):
            assert_same(row_of(run(ext, logits, B, path), pos), want, (bs, pos, path))
        # The top-K op alone (fused top-K, streaming or chunk kernel by the number of rows).
        ids, lp, lse = ext.topk_lse(logits, min(B, V))
        assert torch.equal(ids[pos].cpu(), want[0]) and torch.equal(lp[pos].cpu(), want[1]), (bs, "topk_lse")
        assert torch.equal(lse[pos].cpu(), want[2]), (bs, "topk_lse lse")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs")
def test_batch_invariant_fused_graph_replay(ext):  # noqa: F811
    """Replays of one captured graph, the request moving through the batch: still the same bits."""
    L, V, B, bs = 15, 151936, 64, 9
    req = request(L, V, 300.0, seed=7, dtype=torch.bfloat16)
    want = row_of(run(ext, req[None].cuda(), B, "fused"), 0)
    static = batch_with(req, bs, 0, seed=1, device="cuda")
    run(ext, static, B, "auto")
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = run(ext, static, B, "auto")
    for pos in (0, 4, 8):
        static.copy_(batch_with(req, bs, pos, seed=pos + 2, device="cuda"))
        graph.replay()
        assert_same(row_of(out, pos), want, ("graph", pos))


@pytest.mark.parametrize("device", DEVICES)
def test_batch_invariant_small_vocab_every_device(ext, device):  # noqa: F811
    """A small case on every device (the CPU build too: its lse is per row in fp64)."""
    L, V, B = 6, 1000, 16
    req = request(L, V, 300.0, seed=3, dtype=torch.bfloat16)
    want = row_of(run(ext, req[None].to(device), B, "auto"), 0)
    for bs in (2, 5, 11):
        pos = bs // 2
        got = row_of(run(ext, batch_with(req, bs, pos, seed=bs, device=device), B, "auto"), pos)
        assert_same(got, want, (device, bs))
