"""Model directories of the lab image: config.json only (SGLang parses and validates with that).

Sizes are small on purpose; what matters is the shape SGLang's validation reads: the hybrid
Qwen3.6 target mixes linear_attention and full_attention layers, the DFlash draft declares
its block size, Qwen3-8B is a plain dense model for the non-hybrid cases.
"""

from __future__ import annotations

import json
from pathlib import Path

HYBRID_LAYERS = 16  # 3 linear-attention layers, then 1 full-attention layer, repeated

# The Qwen3.6 decoder's shape; the DFlash draft shares it (same vocab, width and heads).
QWEN36_SHAPE = {
    "vocab_size": 248320,
    "hidden_size": 512,
    "intermediate_size": 1024,
    "num_attention_heads": 8,
    "num_key_value_heads": 2,
    "head_dim": 64,
    "hidden_act": "silu",
    "max_position_embeddings": 262144,
    "rms_norm_eps": 1e-06,
}

QWEN36_27B = {
    "architectures": ["Qwen3_5ForConditionalGeneration"],
    "model_type": "qwen3_5",
    "torch_dtype": "bfloat16",
    "tie_word_embeddings": False,
    "image_token_id": 248056,
    "video_token_id": 248057,
    "vision_start_token_id": 248053,
    "text_config": {
        "model_type": "qwen3_5_text",
        **QWEN36_SHAPE,
        "num_hidden_layers": HYBRID_LAYERS,
        "attention_bias": False,
        "attn_output_gate": True,
        "full_attention_interval": 4,
        "layer_types": ["linear_attention" if (i + 1) % 4 else "full_attention" for i in range(HYBRID_LAYERS)],
        "linear_conv_kernel_dim": 4,
        "linear_key_head_dim": 64,
        "linear_value_head_dim": 64,
        "linear_num_key_heads": 4,
        "linear_num_value_heads": 8,
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000000, "partial_rotary_factor": 0.25,
                            "mrope_section": [11, 11, 10], "mrope_interleaved": True},
        "torch_dtype": "bfloat16",
    },
    "vision_config": {
        "model_type": "qwen3_5",
        "depth": 2,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_heads": 4,
        "patch_size": 16,
        "temporal_patch_size": 2,
        "spatial_merge_size": 2,
        "in_channels": 3,
        "out_hidden_size": 512,
        "num_position_embeddings": 2304,
    },
}

QWEN36_27B_DFLASH = {
    "architectures": ["DFlashDraftModel"],
    "model_type": "qwen3",
    "block_size": 16,
    "num_target_layers": HYBRID_LAYERS,
    "target_layer_ids": [1, 5, 9, 13],
    **QWEN36_SHAPE,
    "num_hidden_layers": 2,
    "rope_theta": 10000000,
    "torch_dtype": "bfloat16",
}

QWEN3_8B = {
    "architectures": ["Qwen3ForCausalLM"],
    "model_type": "qwen3",
    "vocab_size": 151936,
    "hidden_size": 512,
    "intermediate_size": 1024,
    "num_hidden_layers": 4,
    "num_attention_heads": 8,
    "num_key_value_heads": 2,
    "head_dim": 64,
    "hidden_act": "silu",
    "max_position_embeddings": 40960,
    "rms_norm_eps": 1e-06,
    "rope_theta": 1000000,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
}

MODELS = {"Qwen3.6-27B": QWEN36_27B, "Qwen3.6-27B-DFlash": QWEN36_27B_DFLASH, "Qwen3-8B": QWEN3_8B}


def write_models(models_dir: Path) -> None:
    for name, config in MODELS.items():
        (models_dir / name).mkdir(parents=True, exist_ok=True)
        (models_dir / name / "config.json").write_text(json.dumps(config, indent=2) + "\n")
