"""A lossless speculative greedy decode with the DDTree ops and a real `transformers` causal LM.

    PYTHONPATH=kernels python -m ddtree.e2e [--device cuda] [--dtype bfloat16] [--json out.json]

The target is a Qwen3-style model built from a config with seeded random weights (no download);
the drafter is a second, smaller random model (`--drafter random`), the target itself (`self`)
or a noisy copy of it (`noisy`). Each step:

  1. draft: the drafter runs greedily for L positions from the context (its KV cache), giving
     logits [L, V] (depth d: the next-token distribution after d - 1 greedy draft tokens);
  2. `draft_tree` (top-K + logsumexp, best-first build, visibility mask) with budget B;
  3. verify: one target forward over [root] + the tree's nodes, positions start + depth, a 4D
     attention mask (the prefix fully visible, the tree block the visibility mask);
  4. the verify walk (`verify`) on the target's greedy token per node: accepted nodes, bonus;
  5. KV compaction (`compact_kv`) of the accepted nodes' slots in every layer, then the cache is
     cut after them; the bonus token is the next step's root.

Checks: the emitted tokens equal the target's own greedy decode (one token at a time with a KV
cache) token for token, for several prompts and budgets; with the target as its own drafter
every step accepts the whole greedy chain the tree holds (its depth along rank 0: L when the
budget allows). Reported: tokens per target forward, and the median per-step GPU time of the
tree ops (draft_tree, verify, compact) against the target's verify forward.

Numerics: a tree forward and a one-token decode multiply matrices of different shapes, so their
logits differ in the last bits. In fp32 (TF32 off) that never moved an argmax here; in bf16 it can
at a near-tie of the random model, where the decode is only defined up to that noise: a bf16
divergence is reported with the target's top-2 margin at that position (`--dtype float32` is the
strict check).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from dataclasses import dataclass, field

import torch

from . import load, ops


def make_model(vocab: int, hidden: int, layers: int, heads: int, kv_heads: int, seed: int, dtype, device,
               sharpen: float = 1.0):
    from transformers import Qwen3Config, Qwen3ForCausalLM

    cfg = Qwen3Config(vocab_size=vocab, hidden_size=hidden, intermediate_size=hidden * 3, num_hidden_layers=layers,
                      num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=hidden // heads,
                      max_position_embeddings=4096, tie_word_embeddings=False, rope_theta=10000.0)
    cfg._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = Qwen3ForCausalLM(cfg)
    with torch.no_grad():  # a confident model: its greedy chain dominates the draft tree
        model.lm_head.weight.mul_(sharpen)
    return model.to(device=device, dtype=dtype).eval()


def noisy_copy(model, scale: float, seed: int):
    import copy

    other = copy.deepcopy(model)
    g = torch.Generator(device="cpu").manual_seed(seed)
    with torch.no_grad():
        for p in other.parameters():
            noise = torch.randn(p.shape, generator=g).to(p.device, p.dtype)
            p.add_(noise * scale * p.float().std().to(p.dtype))
    return other


def new_cache(model):
    from transformers import DynamicCache

    try:
        return DynamicCache(config=model.config)
    except TypeError:
        return DynamicCache()


def cut(cache, keep: int) -> None:
    """Keep the first `keep` positions (a negative crop: tokens to drop, in transformers 4 and 5)."""
    drop = cache.get_seq_length() - keep
    if drop > 0:
        cache.crop(-drop)


def kv_pairs(cache):
    if hasattr(cache, "layers"):
        return [(layer.keys, layer.values) for layer in cache.layers]
    return list(zip(cache.key_cache, cache.value_cache))


def forward(model, cache, ids: list[int] | torch.Tensor, positions: torch.Tensor, mask: torch.Tensor | None = None):
    """Logits [n, V] (fp32) of ids at positions, appending their keys and values to cache."""
    dev = next(model.parameters()).device
    ids = torch.as_tensor(ids, device=dev).view(1, -1)
    past = cache.get_seq_length()
    kwargs = dict(input_ids=ids, position_ids=positions.view(1, -1).to(dev), past_key_values=cache, use_cache=True,
                  cache_position=torch.arange(past, past + ids.shape[1], device=dev))
    if mask is not None:
        kwargs["attention_mask"] = {"full_attention": mask}  # used as is (transformers >= 4.53)
    with torch.no_grad():
        out = model(**kwargs)
    return out.logits[0].float()


def greedy_reference(model, prompt: list[int], new_tokens: int) -> tuple[list[int], list[float]]:
    """The target's own greedy decode, one token at a time; also the top-2 margin of each step."""
    cache = new_cache(model)
    logits = forward(model, cache, prompt, torch.arange(len(prompt)))[-1]
    out, margins = [], []
    for _ in range(new_tokens):
        top = torch.topk(logits, 2)
        out.append(int(top.indices[0]))
        margins.append(float(top.values[0] - top.values[1]))
        logits = forward(model, cache, [out[-1]], torch.tensor([len(prompt) + len(out) - 1]))[-1]
    return out, margins


@dataclass
class Stats:
    steps: int = 0
    accepted: list[int] = field(default_factory=list)   # draft tokens accepted per step (root excluded)
    chain: list[int] = field(default_factory=list)      # the tree's depth along rank 0 per step
    tree_ms: list[float] = field(default_factory=list)  # draft_tree + verify + compact, GPU time
    target_ms: list[float] = field(default_factory=list)  # the verify forward, GPU time


class Timer:
    """GPU time of a region on CUDA (events), wall time on the CPU."""

    def __init__(self, device):
        self.cuda = device.type == "cuda"

    def __enter__(self):
        if self.cuda:
            self.a, self.b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            self.a.record()
        else:
            self.t = time.perf_counter()
        return self

    def __exit__(self, *exc):
        if self.cuda:
            self.b.record()
        else:
            self.ms = (time.perf_counter() - self.t) * 1e3

    def elapsed(self) -> float:
        if self.cuda:
            self.b.synchronize()
            return self.a.elapsed_time(self.b)
        return self.ms


def rank0_depth(tree: ops.TreeBatch) -> int:
    """How deep the chain of rank-0 nodes from the root goes in the tree."""
    n = int(tree.num_nodes[0])
    ranks, parents = tree.ranks[0, :n].tolist(), tree.parents[0, : n + 1].tolist()
    depth, node = 0, 0
    while True:
        nxt = next((i for i in range(1, n + 1) if parents[i] == node and ranks[i - 1] == 0), None)
        if nxt is None:
            return depth
        node, depth = nxt, depth + 1


def speculative_decode(ext, target, drafter, prompt: list[int], new_tokens: int, budget: int, depth: int,
                       stats: Stats) -> list[int]:
    dev = next(target.parameters()).device
    dtype = next(target.parameters()).dtype
    t_cache, d_cache = new_cache(target), new_cache(drafter)
    forward(target, t_cache, prompt[:-1], torch.arange(len(prompt) - 1))  # the root's KV comes with the tree
    forward(drafter, d_cache, prompt[:-1], torch.arange(len(prompt) - 1))
    out: list[int] = []
    root, pending = prompt[-1], [prompt[-1]]  # tokens the drafter's cache lacks, the root last
    while len(out) < new_tokens:
        start = t_cache.get_seq_length()  # the root's position
        # 1. Draft: greedy for `depth` positions; its cache is cut back to the context after.
        committed = d_cache.get_seq_length()
        rows = [forward(drafter, d_cache, pending, torch.arange(committed, committed + len(pending)))[-1]]
        for d in range(1, depth):
            tok = int(rows[-1].argmax())
            rows.append(forward(drafter, d_cache, [tok], torch.tensor([start + d]))[-1])
        cut(d_cache, committed + len(pending))
        logits = torch.stack(rows)[None].to(dtype)  # [1, L, V]
        with Timer(dev) as t_draft:
            tree = ops.draft_tree(ext, logits, budget)
        n = int(tree.num_nodes[0])
        # 3. Verify: [root] + nodes at start + depth, ancestors-only within the tree.
        node_ids = [root] + tree.tokens[0, :n].tolist()
        positions = start + torch.tensor([0] + tree.depths[0, :n].tolist())
        vis = tree.vis[0, : n + 1, : n + 1].to(dev)
        mask = torch.zeros(1, 1, n + 1, start + n + 1, device=dev, dtype=dtype)
        mask[0, 0, :, start:] = torch.where(vis, 0.0, torch.finfo(dtype).min).to(dtype)
        with Timer(dev) as t_fwd:
            vlogits = forward(target, t_cache, node_ids, positions, mask)
        posterior = torch.full((1, budget + 1), -1, dtype=torch.long, device=tree.tokens.device)
        posterior[0, : n + 1] = vlogits.argmax(-1).to(posterior.device)
        # 4. Walk; 5. keep the accepted nodes' keys and values, in order, then cut the cache.
        with Timer(dev) as t_walk:
            accepted, accept_len, bonus = ops.verify(ext, tree, posterior, depth + 1)
            for keys, values in kv_pairs(t_cache):
                heads, slots = keys.shape[1], keys.shape[2]
                base = torch.arange(heads, dtype=torch.long, device=keys.device) * slots + start
                acc = accepted.to(keys.device).expand(heads, -1).contiguous()
                alen = accept_len.to(keys.device).expand(heads).contiguous()
                for cache in (keys, values):
                    ext.compact_kv(cache.view(heads * slots, -1), base, acc, alen)
        m = int(accept_len[0])
        cut(t_cache, start + m)
        nodes = accepted[0, :m].tolist()
        emitted = [node_ids[i] for i in nodes[1:]] + [int(bonus[0])]
        out.extend(emitted)
        pending, root = emitted, int(bonus[0])
        stats.steps += 1
        stats.accepted.append(m - 1)
        stats.chain.append(rank0_depth(tree))
        stats.target_ms.append(t_fwd.elapsed())
        stats.tree_ms.append(t_draft.elapsed() + t_walk.elapsed())
    return out[:new_tokens]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    p.add_argument("--vocab", type=int, default=151936)
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--draft-hidden", type=int, default=256)
    p.add_argument("--draft-layers", type=int, default=2)
    p.add_argument("--prompts", type=int, default=3)
    p.add_argument("--prompt-len", type=int, default=24)
    p.add_argument("--new-tokens", type=int, default=48)
    p.add_argument("--budgets", type=int, nargs="+", default=[16, 64, 256])
    p.add_argument("--depth", type=int, default=8, help="draft positions L (<= 15)")
    p.add_argument("--drafters", nargs="+", default=["random", "self", "noisy"])
    p.add_argument("--noise", type=float, default=0.05)
    p.add_argument("--sharpen", type=float, default=20.0, help="scale of the target's output layer")
    p.add_argument("--json")
    args = p.parse_args(argv)
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    dev, dtype = torch.device(args.device), getattr(torch, args.dtype)
    ext = load()
    heads = max(1, args.hidden // 64)
    target = make_model(args.vocab, args.hidden, args.layers, heads, max(1, heads // 2), 1, dtype, dev, args.sharpen)
    drafters = {
        "random": lambda: make_model(args.vocab, args.draft_hidden, args.draft_layers, max(1, args.draft_hidden // 64),
                                     max(1, args.draft_hidden // 128), 2, dtype, dev),
        "self": lambda: target,
        "noisy": lambda: noisy_copy(target, args.noise, 3),
    }
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, args.vocab, (args.prompt_len,), generator=g).tolist() for _ in range(args.prompts)]
    refs = [greedy_reference(target, pr, args.new_tokens) for pr in prompts]
    results, ok = [], True
    for name in args.drafters:
        drafter = drafters[name]()
        for budget in args.budgets:
            st = Stats()
            mismatches = []
            for i, pr in enumerate(prompts):
                got = speculative_decode(ext, target, drafter, pr, args.new_tokens, budget, args.depth, st)
                want, margins = refs[i]
                if got != want:
                    at = next(j for j in range(len(want)) if got[j] != want[j])
                    mismatches.append({"prompt": i, "at": at, "margin": margins[at]})
            lossless = not mismatches
            full_depth = all(a == c for a, c in zip(st.accepted, st.chain)) if name == "self" else None
            row = {
                "drafter": name, "budget": budget, "depth": args.depth, "dtype": args.dtype,
                "prompts": len(prompts), "new_tokens": args.new_tokens, "lossless": lossless,
                "mismatches": mismatches, "steps": st.steps,
                "tokens_per_target_forward": round(len(prompts) * args.new_tokens / st.steps, 3),
                "mean_accepted": round(statistics.mean(st.accepted), 3),
                "mean_chain": round(statistics.mean(st.chain), 3),
                "self_accepts_full_chain": full_depth,
                "steps_with_chain_at_depth_L": sum(c == args.depth for c in st.chain),
                "tree_ops_ms_median": round(statistics.median(st.tree_ms), 4),
                "target_forward_ms_median": round(statistics.median(st.target_ms), 4),
            }
            results.append(row)
            strict = args.dtype == "float32"
            ok &= (lossless or not strict) and full_depth is not False
            print(f"{name:6s} B={budget:4d} L={args.depth} {args.dtype}: lossless={lossless} "
                  f"tokens/target-forward={row['tokens_per_target_forward']:.2f} accepted/step={row['mean_accepted']:.2f} "
                  f"rank0-chain={row['mean_chain']:.2f} tree ops {row['tree_ops_ms_median']:.3f} ms vs target "
                  f"forward {row['target_forward_ms_median']:.3f} ms"
                  + (f" full-chain={full_depth} (chain = L in {row['steps_with_chain_at_depth_L']}/{st.steps} steps)"
                     if full_depth is not None else "")
                  + (f" mismatches={mismatches}" if mismatches else ""), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "device": str(dev), "results": results}, f, indent=1)
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
