"""Rotary position embeddings (neox/HF layout: the two halves of the rotated dims form the pairs).

The cos/sin table is computed once at construction for every position up to max_position_embeddings
and indexed by `positions` each step, so a step allocates nothing but the gathered rows. With a
partial rotary factor (Phi-4-mini) only the first `rotary_dim` dims of a head turn; the rest pass.

LongRoPE (Phi-3.5 / Phi-4-mini, `rope_type` "longrope") scales the frequencies by `short_factor`
up to `original_max_position_embeddings` and by `long_factor` past it, and multiplies cos and sin by
an attention factor. Here a position's own row decides: short below the original context, long from
it on. That is transformers' result for every sequence within the original context (4096 tokens for
Phi-4-mini). Past it, transformers uses the long set for the whole sequence: a forward over a longer
prompt turns every position with it, and its `generate` drops the cache once a sequence outgrows the
original context and recomputes all of it (Phi3ForCausalLM.prepare_inputs_for_generation). Doing that
here would make every K/V depend on its sequence's final length, which prefix caching (blocks shared
across requests), chunked prompts and batch invariance rule out; so a long sequence keeps the short
rows of its first positions (vLLM's cache keeps them too, and llama.cpp picks one set for all
positions by the configured context). tests/models/test_models.py holds both sides of the table to
transformers' cos/sin.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from models.errors import ModelLoadError


@dataclass(frozen=True)
class RopeParams:
    theta: float
    rope_type: str = "default"  # "default" | "linear" | "llama3"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int | None = None
    # longrope: per-frequency divisors below / from the original context, and cos/sin's multiplier
    # (None: transformers' default from the context ratio).
    short_factor: tuple[float, ...] = ()
    long_factor: tuple[float, ...] = ()
    attention_factor: float | None = None
    # The fraction of head_dim that turns (the rest passes through).
    partial_rotary_factor: float = 1.0


SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "longrope")


def rope_params_from_config(config: Any, layer_type: str | None = None) -> RopeParams:
    """Read RoPE settings from a transformers config, old style or new.

    transformers < 5 keeps `rope_theta` and `rope_scaling` (dict or None) on the config; transformers 5
    folds both into `rope_parameters` (a dict with rope_type, rope_theta, factor, ...), and for models
    whose layer types rotate differently (Gemma 3's local and global layers) nests one such dict per
    type: {"full_attention": {...}, "sliding_attention": {...}}. Those are read for `layer_type`, and
    must name their theta: no default stands in for a type the config does not describe.
    """
    nested = getattr(config, "rope_parameters", None)
    if isinstance(nested, dict) and nested and all(isinstance(v, dict) for v in nested.values()):
        if layer_type is None or layer_type not in nested:
            raise ModelLoadError(
                f"rope_parameters are given per layer type ({', '.join(nested)}); "
                f"none for {layer_type or 'an unnamed layer type'}"
            )
        chosen = nested[layer_type]
        if not chosen.get("rope_theta"):
            raise ModelLoadError(f"rope_parameters[{layer_type!r}] has no rope_theta")
        return _rope_params(chosen, chosen["rope_theta"], config)
    params: dict[str, Any] = {}
    for attr in ("rope_scaling", "rope_parameters"):
        value = getattr(config, attr, None)
        if isinstance(value, dict):
            params.update(value)
    theta = params.get("rope_theta") or getattr(config, "rope_theta", None) or 10000.0
    return _rope_params(params, theta, config)


def _rope_params(params: dict[str, Any], theta: float, config: Any) -> RopeParams:
    """One set of RoPE settings; the original context and the partial rotary factor may be on the
    config itself (Phi-3's transformers < 5 configs) rather than in `params`."""
    rope_type = params.get("rope_type") or params.get("type") or "default"
    if rope_type == "su":  # Phi-3's early name for longrope (transformers renames it too)
        rope_type = "longrope"
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ModelLoadError(
            f"unsupported rope type {rope_type!r}; supported: {', '.join(SUPPORTED_ROPE_TYPES)}"
        )
    return RopeParams(
        theta=float(theta),
        rope_type=rope_type,
        factor=float(params.get("factor") or 1.0),
        low_freq_factor=float(params.get("low_freq_factor") or 1.0),
        high_freq_factor=float(params.get("high_freq_factor") or 4.0),
        original_max_position_embeddings=params.get("original_max_position_embeddings")
        or getattr(config, "original_max_position_embeddings", None),
        short_factor=tuple(float(f) for f in params.get("short_factor") or ()),
        long_factor=tuple(float(f) for f in params.get("long_factor") or ()),
        attention_factor=params.get("attention_factor"),
        partial_rotary_factor=float(
            params.get("partial_rotary_factor") or getattr(config, "partial_rotary_factor", None) or 1.0
        ),
    )


def rotary_dim(params: RopeParams, head_dim: int) -> int:
    """The dims of a head that turn, as transformers computes them (int(head_dim * factor))."""
    return int(head_dim * params.partial_rotary_factor)


def longrope_attention_factor(params: RopeParams, max_position_embeddings: int) -> float:
    """cos/sin's multiplier under longrope: the config's, else sqrt(1 + ln(s) / ln(original context))
    for s = max_position_embeddings / original context (transformers' _compute_longrope_parameters)."""
    if params.attention_factor is not None:
        return float(params.attention_factor)
    original = params.original_max_position_embeddings or max_position_embeddings
    factor = max_position_embeddings / original
    return 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))


def inverse_frequencies(
    params: RopeParams, rotary_dim: int, max_position_embeddings: int, long: bool = False
) -> torch.Tensor:
    """[rotary_dim // 2] float32 inverse frequencies, same formulas as transformers' rope init functions
    (longrope: the short set, or with `long` the long one)."""
    exponents = torch.arange(0, rotary_dim, 2, dtype=torch.int64).float() / rotary_dim
    if params.rope_type == "longrope":
        factors = params.long_factor if long else params.short_factor
        if len(factors) != rotary_dim // 2:
            raise ModelLoadError(
                f"longrope needs {rotary_dim // 2} short and long factors (one per rotary frequency), "
                f"got {len(params.short_factor)} and {len(params.long_factor)}"
            )
        return 1.0 / (torch.tensor(factors, dtype=torch.float32) * params.theta**exponents)
    inv_freq = 1.0 / (params.theta**exponents)
    if params.rope_type == "linear":
        return inv_freq / params.factor
    if params.rope_type == "llama3":
        old_context = params.original_max_position_embeddings or max_position_embeddings
        low_freq_wavelen = old_context / params.low_freq_factor
        high_freq_wavelen = old_context / params.high_freq_factor
        wavelen = 2 * math.pi / inv_freq
        # Long wavelengths are slowed down by `factor`, short ones kept, the band between interpolated.
        scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / params.factor, inv_freq)
        smooth = (old_context / wavelen - params.low_freq_factor) / (
            params.high_freq_factor - params.low_freq_factor
        )
        smoothed = (1 - smooth) * scaled / params.factor + smooth * scaled
        is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
        return torch.where(is_medium, smoothed, scaled)
    return inv_freq


def cos_sin_table(params: RopeParams, rotary_dim: int, max_position_embeddings: int) -> torch.Tensor:
    """[max_position_embeddings, rotary_dim] float32: cos | sin of every position's angles (longrope:
    short rows below the original context, long rows from it, both times the attention factor)."""
    t = torch.arange(max_position_embeddings, dtype=torch.float32)
    freqs = torch.outer(t, inverse_frequencies(params, rotary_dim, max_position_embeddings))
    if params.rope_type == "longrope":
        original = params.original_max_position_embeddings or max_position_embeddings
        long = torch.outer(t, inverse_frequencies(params, rotary_dim, max_position_embeddings, long=True))
        freqs = torch.where((t >= original).unsqueeze(1), long, freqs)
        scale = longrope_attention_factor(params, max_position_embeddings)
        return torch.cat([freqs.cos() * scale, freqs.sin() * scale], dim=-1)
    return torch.cat([freqs.cos(), freqs.sin()], dim=-1)


class RotaryEmbedding(nn.Module):
    def __init__(
        self,
        head_dim: int,
        max_position_embeddings: int,
        params: RopeParams,
        dtype: torch.dtype = torch.float32,
    ) -> None:
        super().__init__()
        self.head_dim = head_dim
        self.rotary_dim = rotary_dim(params, head_dim)
        if self.rotary_dim % 2 or not 0 < self.rotary_dim <= head_dim:
            raise ModelLoadError(
                f"partial_rotary_factor {params.partial_rotary_factor} turns {self.rotary_dim} of "
                f"{head_dim} head dims (needs an even number, at least 2)"
            )
        # Build on the CPU in float32 whatever the default device (the model may be built under
        # `with torch.device("cuda")`), like transformers, then move and cast once.
        device = torch.get_default_device()
        with torch.device("cpu"):
            cos_sin = cos_sin_table(params, self.rotary_dim, max_position_embeddings)
        self.register_buffer("cos_sin_cache", cos_sin.to(device=device, dtype=dtype), persistent=False)

    def forward(self, positions: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """Rotate x [T, heads, head_dim] (q and k heads together: one call per layer) by positions [T]."""
        cos, sin = self.cos_sin_cache[positions].unsqueeze(1).chunk(2, dim=-1)  # [T, 1, R/2] each
        if self.rotary_dim == self.head_dim:
            x1, x2 = x.chunk(2, dim=-1)
            return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
        turned, passed = x[..., : self.rotary_dim], x[..., self.rotary_dim :]
        x1, x2 = turned.chunk(2, dim=-1)
        return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin, passed), dim=-1)
