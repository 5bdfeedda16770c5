"""Model shapes for benchmarks: HF config directories without weights, run with random weights
(`--load-format dummy`, models/loader.py dummy_weights).

What a decode step costs depends on a model's shapes and dtype, not on its weights' values, so a shape
measures the same throughput as the real checkpoint without downloading or loading it: the
Llama-3-8B shape runs on a GPU with no 16 GB file, and the default model's shape runs where the default
model's file is not installed. `tiny=True` keeps a shape's family and head layout at toy sizes, to
check a benchmark's whole path on a CPU in seconds.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

# config.json contents. rope_theta is written both ways (transformers 4 reads `rope_theta`,
# transformers 5 `rope_parameters`).
SHAPES: dict[str, dict[str, Any]] = {
    # The default model's (SmolLM2-135M-Instruct) config, as its GGUF converts.
    "smollm2-135m": {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": 576,
        "intermediate_size": 1536,
        "num_hidden_layers": 30,
        "num_attention_heads": 9,
        "num_key_value_heads": 3,
        "head_dim": 64,
        "vocab_size": 49152,
        "max_position_embeddings": 8192,
        "rms_norm_eps": 1e-5,
        "rope_theta": 100000.0,
        "tie_word_embeddings": True,
        "bos_token_id": 1,
        "eos_token_id": 2,
    },
    # Meta-Llama-3-8B's config.json.
    "llama3-8b": {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": 4096,
        "intermediate_size": 14336,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "head_dim": 128,
        "vocab_size": 128256,
        "max_position_embeddings": 8192,
        "rms_norm_eps": 1e-5,
        "rope_theta": 500000.0,
        "tie_word_embeddings": False,
        "bos_token_id": 128000,
        "eos_token_id": 128001,
    },
    # allenai/OLMoE-1B-7B-0924's config.json: 64 experts of 1024, 8 per token (6.9B parameters, 1.3B
    # active); on a GPU its experts run in the fused Triton kernels (models/layers/triton_moe.py).
    "olmoe-1b-7b": {
        "architectures": ["OlmoeForCausalLM"],
        "model_type": "olmoe",
        "hidden_size": 2048,
        "intermediate_size": 1024,
        "num_hidden_layers": 16,
        "num_attention_heads": 16,
        "num_key_value_heads": 16,
        "num_experts": 64,
        "num_experts_per_tok": 8,
        "norm_topk_prob": False,
        "vocab_size": 50304,
        "max_position_embeddings": 4096,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "tie_word_embeddings": False,
        "bos_token_id": 50279,
        "eos_token_id": 50279,
    },
    # google/gemma-3-1b-it's config.json: head_dim 256, MQA, local layers (a 512-token window, rope
    # base 10000) with every sixth layer global (rope base 1e6), a 262144-token vocabulary, tied.
    "gemma-3-1b": {
        "architectures": ["Gemma3ForCausalLM"],
        "model_type": "gemma3_text",
        "hidden_size": 1152,
        "intermediate_size": 6912,
        "num_hidden_layers": 26,
        "num_attention_heads": 4,
        "num_key_value_heads": 1,
        "head_dim": 256,
        "query_pre_attn_scalar": 256,
        "sliding_window": 512,
        "sliding_window_pattern": 6,
        "vocab_size": 262144,
        "max_position_embeddings": 32768,
        "rms_norm_eps": 1e-6,
        "rope_theta": 1_000_000.0,
        "rope_local_base_freq": 10_000.0,
        "tie_word_embeddings": True,
        "bos_token_id": 2,
        "eos_token_id": 1,
        "pad_token_id": 0,
    },
    # Qwen/Qwen3-8B's config.json: q/k norms, head_dim 128, untied (8.2B parameters, 6.95B without
    # the embeddings).
    "qwen3-8b": {
        "architectures": ["Qwen3ForCausalLM"],
        "model_type": "qwen3",
        "hidden_size": 4096,
        "intermediate_size": 12288,
        "num_hidden_layers": 36,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "head_dim": 128,
        "vocab_size": 151936,
        "max_position_embeddings": 40960,
        "rms_norm_eps": 1e-6,
        "rope_theta": 1_000_000.0,
        "tie_word_embeddings": False,
        "bos_token_id": 151643,
        "eos_token_id": 151645,
    },
    # microsoft/Phi-4-mini-instruct's config.json: fused qkv and gate/up, 96 of 128 head dims turn,
    # LongRoPE from 4096 to 131072 tokens (synthetic factors: they change which frequencies turn, not
    # what a step costs), tied (3.8B parameters).
    "phi-4-mini": {
        "architectures": ["Phi3ForCausalLM"],
        "model_type": "phi3",
        "hidden_size": 3072,
        "intermediate_size": 8192,
        "num_hidden_layers": 32,
        "num_attention_heads": 24,
        "num_key_value_heads": 8,
        "partial_rotary_factor": 0.75,
        "vocab_size": 200064,
        "max_position_embeddings": 131072,
        "original_max_position_embeddings": 4096,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "rope_scaling": {
            "type": "longrope",
            "short_factor": [1.0] * 48,
            "long_factor": [1.0 + i for i in range(48)],
        },
        "tie_word_embeddings": True,
        "bos_token_id": 199999,
        "eos_token_id": 199999,
        "pad_token_id": 199999,
    },
}
TINY_HEAD_DIM = 16
TINY_VOCAB = 512


def shape_config(name: str, tiny: bool = False) -> dict[str, Any]:
    """The config.json of a shape as transformers writes it (transformers 5's `rope_parameters`, per
    layer type for Gemma 3, beside the flat keys transformers 4 reads); `tiny`: 2 layers, one KV head
    and the shape's query heads per KV head, head_dim 16, a 512-token vocabulary (the family, GQA ratio,
    tying, windows and rope kept)."""
    from transformers import AutoConfig

    if name not in SHAPES:
        raise ValueError(f"unknown model shape {name!r}; choose one of {', '.join(SHAPES)}")
    shape = dict(SHAPES[name])
    if tiny:
        group = shape["num_attention_heads"] // shape["num_key_value_heads"]
        hidden = group * TINY_HEAD_DIM
        shape.update(
            hidden_size=hidden,
            intermediate_size=2 * hidden,
            num_hidden_layers=2,
            num_attention_heads=group,
            num_key_value_heads=1,
            head_dim=TINY_HEAD_DIM,
            vocab_size=TINY_VOCAB,
            bos_token_id=1,
            eos_token_id=2,
        )
        if "pad_token_id" in shape:
            shape["pad_token_id"] = 0
        if "rope_scaling" in shape:  # LongRoPE: a factor per rotated pair of the smaller head
            pairs = int(TINY_HEAD_DIM * shape.get("partial_rotary_factor", 1.0)) // 2
            scaling = shape["rope_scaling"]
            shape["rope_scaling"] = {
                **scaling,
                **{k: scaling[k][:pairs] for k in ("short_factor", "long_factor")},
            }
    fields = {k: v for k, v in shape.items() if k != "model_type"}
    config = {**shape, **AutoConfig.for_model(shape["model_type"], **fields).to_dict()}
    config["torch_dtype"] = "bfloat16"
    return config


def write_shape(name: str, directory: Path, tiny: bool = False) -> Path:
    """A model directory for a shape (config.json and generation_config.json, no weights): load it
    with load_format "dummy", or with transformers' from_config."""
    config = shape_config(name, tiny)
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(config, indent=2))
    generation = {"bos_token_id": config["bos_token_id"], "eos_token_id": config["eos_token_id"]}
    (directory / "generation_config.json").write_text(json.dumps(generation, indent=2))
    return directory


def parameter_count(config: dict[str, Any]) -> int:
    """Parameters of a shape's config as transformers builds the model (on the meta device: no memory),
    embedding and head counted once where tied."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    fields = {k: v for k, v in config.items() if k != "model_type"}
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.for_model(config["model_type"], **fields))
    return sum(p.numel() for p in model.parameters())
