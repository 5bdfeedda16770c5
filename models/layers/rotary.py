"""Rotary position embeddings (neox/HF layout: the two halves of head_dim form the pairs).

The cos/sin table is computed once at construction for every position up to max_position_embeddings
and indexed by `positions` each step, so a step allocates nothing but the gathered rows.
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


SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")


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
        return _rope_params(chosen, chosen["rope_theta"])
    params: dict[str, Any] = {}
    for attr in ("rope_scaling", "rope_parameters"):
        value = getattr(config, attr, None)
        if isinstance(value, dict):
            params.update(value)
    return _rope_params(params, params.get("rope_theta") or getattr(config, "rope_theta", None) or 10000.0)


def _rope_params(params: dict[str, Any], theta: float) -> RopeParams:
    rope_type = params.get("rope_type") or params.get("type") or "default"
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
        original_max_position_embeddings=params.get("original_max_position_embeddings"),
    )


def inverse_frequencies(params: RopeParams, rotary_dim: int, max_position_embeddings: int) -> torch.Tensor:
    """[rotary_dim // 2] float32 inverse frequencies, same formulas as transformers' rope init functions."""
    exponents = torch.arange(0, rotary_dim, 2, dtype=torch.int64).float() / rotary_dim
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
        inv_freq = inverse_frequencies(params, head_dim, max_position_embeddings)
        # Build on the CPU in float32 whatever the default device (the model may be built under
        # `with torch.device("cuda")`), like transformers, then move and cast once.
        device = torch.get_default_device()
        with torch.device("cpu"):
            t = torch.arange(max_position_embeddings, dtype=torch.float32)
            freqs = torch.outer(t, inv_freq.cpu())  # [max_pos, head_dim / 2]
            cos_sin = torch.cat([freqs.cos(), freqs.sin()], dim=-1)  # [max_pos, head_dim]
        self.register_buffer("cos_sin_cache", cos_sin.to(device=device, dtype=dtype), persistent=False)

    def forward(self, positions: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """Rotate x [T, heads, head_dim] (q and k heads together: one call per layer) by positions [T]."""
        cos, sin = self.cos_sin_cache[positions].unsqueeze(1).chunk(2, dim=-1)  # [T, 1, D/2] each
        x1, x2 = x.chunk(2, dim=-1)
        return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
