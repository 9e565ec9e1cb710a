"""DDTREE for SGLang 0.5.23: the speculative algorithm's registration, flags and validation.

Part of sglfleet's DDTree patchset (patches/sglang-0.5.23-ddtree). SGLang's plugin registry
(`SpeculativeAlgorithm.register`) carries the algorithm; the four `--speculative-ddtree-*`
fields are added to the `spec` namespace by an anchored edit, and spec_info imports this module
so the registration happens wherever the algorithm names are resolved.

Validation runs in SGLang's resolve phase (`ServerArgs.resolve_once`), like the builtin
algorithms' checks, and raises ValueError with a message that says what to change.
"""

from __future__ import annotations

import logging

# spec_info re-exports CustomSpecAlgo; SGLang asks plugins not to import spec_registry directly.
from sglang.srt.speculative.spec_info import CustomSpecAlgo, SpeculativeAlgorithm

logger = logging.getLogger(__name__)

NAME = "DDTREE"
DEFAULT_BUDGET = 64
# Layer kinds whose state is recurrent: one state per request, advanced in sequence order.
RECURRENT_LAYER_TYPES = ("linear_attention", "mamba", "mamba2", "gated_deltanet", "linear")


def _hf_config(path, server_args):
    from sglang.srt.utils.hf_transformers_utils import get_config

    return get_config(path, trust_remote_code=server_args.trust_remote_code)


def recurrent_layers(hf_config) -> int:
    """How many layers of the target keep recurrent (linear-attention / mamba) state."""
    text = getattr(hf_config, "text_config", None) or hf_config
    layer_types = getattr(text, "layer_types", None) or getattr(text, "layers_block_type", None) or []
    count = sum(1 for t in layer_types if str(t).lower() in RECURRENT_LAYER_TYPES)
    pattern = getattr(text, "hybrid_override_pattern", None)
    if not count and isinstance(pattern, str):
        count = pattern.count("M")
    return count


def draft_block_size(server_args):
    """The DFlash draft's block size from its config (None when it does not say)."""
    from sglang.srt.speculative.dflash_utils import parse_dflash_draft_config

    draft = _hf_config(server_args.speculative_draft_model_path, server_args)
    return parse_dflash_draft_config(draft_hf_config=draft).resolve_block_size(default=None)


def validate_server_args(server_args) -> None:
    if not str(server_args.device or "").startswith("cuda"):
        raise ValueError(f"{NAME} speculative decoding needs CUDA; device is {server_args.device!r}.")
    if server_args.speculative_draft_model_path is None:
        raise ValueError(f"{NAME} speculative decoding requires setting --speculative-draft-model-path "
                         "(a DFlash block-diffusion draft model).")
    budget = server_args.speculative_ddtree_budget
    if budget is not None and budget < 1:
        raise ValueError(f"--speculative-ddtree-budget must be >= 1 (tree nodes per request), got {budget}.")
    budget = DEFAULT_BUDGET if budget is None else budget
    cap = server_args.speculative_ddtree_topk_cap
    if cap is not None and not 1 <= cap <= budget:
        raise ValueError(f"--speculative-ddtree-topk-cap must be in [1, --speculative-ddtree-budget={budget}], "
                         f"got {cap}.")
    block = server_args.speculative_dflash_block_size
    drafts = server_args.speculative_num_draft_tokens
    if block is not None and drafts is not None and int(block) != int(drafts):
        raise ValueError("Both --speculative-num-draft-tokens and --speculative-dflash-block-size are set but "
                         f"they differ ({drafts} vs {block}). For {NAME} the draft tokens follow the DFlash "
                         "block size.")
    inferred = draft_block_size(server_args)
    given = block if block is not None else drafts
    if inferred is not None and given is not None and int(given) != int(inferred):
        raise ValueError(f"{NAME}: the DFlash draft {server_args.speculative_draft_model_path} has block_size "
                         f"{inferred}, but {given} draft tokens were asked for. Drop the flag or set it to "
                         f"{inferred}.")
    target = _hf_config(server_args.model_path, server_args)
    recurrent = recurrent_layers(target)
    if recurrent:
        arch = (getattr(target, "architectures", None) or ["?"])[0]
        missing = []
        if not server_args.speculative_ddtree_allow_hybrid_unsafe:
            missing.append("--speculative-ddtree-allow-hybrid-unsafe")
        if server_args.mamba_radix_cache_strategy != "extra_buffer":
            missing.append("--mamba-radix-cache-strategy extra_buffer")
        if missing:
            raise ValueError(
                f"{NAME} on a hybrid target: {arch} has {recurrent} linear-attention/mamba layers, whose "
                "recurrent state cannot branch across tree siblings (a draft tree verifies sibling "
                "branches in one pass, but each such layer holds one state per request, advanced in "
                "sequence order). Tree verification on this model needs per-node state snapshots and an "
                f"explicit opt-in: add {' '.join(missing)} (and --mamba-full-memory-ratio 0.5 for the "
                "snapshot slots; --speculative-ddtree-shadow-linear verifies the linear chain alongside).")


class DDTreeSpecAlgo(CustomSpecAlgo):
    def handle_server_args(self, server_args) -> None:
        # Called on SGLang's recording stand-in: plain assignments are declared resolutions.
        if server_args.speculative_ddtree_budget is None:
            server_args.speculative_ddtree_budget = DEFAULT_BUDGET
        if server_args.speculative_ddtree_topk_cap is None:
            server_args.speculative_ddtree_topk_cap = server_args.speculative_ddtree_budget
        # DDTree, like DFlash, drafts one block per step: EAGLE's steps/topk stay at 1.
        server_args.speculative_num_steps = 1
        server_args.speculative_eagle_topk = 1
        block = server_args.speculative_dflash_block_size or server_args.speculative_num_draft_tokens
        if block is None:
            block = draft_block_size(server_args) or 16
        server_args.speculative_num_draft_tokens = int(block)
        if server_args.max_running_requests is None:
            server_args.max_running_requests = 48
            logger.warning("Max running requests is reset to 48 for DDTREE speculative decoding.")


def _worker_factory(server_args):
    raise NotImplementedError(
        "DDTREE is registered and validated by sglfleet's DDTree patchset, but its worker (draft tree "
        "build, tree-masked verify, per-node recurrent state) is not part of it; see the patchset README.")


def _registered() -> bool:
    try:
        SpeculativeAlgorithm.from_string(NAME)
    except ValueError:
        return False
    return True


if not _registered():  # a re-import (importlib.reload) must not register twice
    SpeculativeAlgorithm.register(NAME, supports_overlap=True, validate_server_args=validate_server_args,
                                  spec_class=DDTreeSpecAlgo)(_worker_factory)
