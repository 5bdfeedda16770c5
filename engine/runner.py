"""The model runner: one scheduler batch -> one forward pass over flat tokens -> sampled tokens."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from engine.config import (
    EngineConfig,
    resolve_device,
    resolve_dtype,
    resolve_max_model_len,
    resolve_model_path,
)
from engine.contract import SampledToken, ScheduledSequence
from engine.inputs import InputLimits, StepInputs, build_step_inputs
from engine.kv_cache import PagedKVCache, plan_kv_cache
from engine.sampler import Sampler, validate_sampling


def read_eos_token_ids(model_path: Path, hf_config: Any) -> frozenset[int]:
    """EOS ids from generation_config.json and config.json together (either may list several)."""
    ids: set[int] = set()

    def add(value: Any) -> None:
        if isinstance(value, int):
            ids.add(value)
        elif isinstance(value, (list, tuple)):
            ids.update(v for v in value if isinstance(v, int))

    add(getattr(hf_config, "eos_token_id", None))
    gen_file = Path(model_path) / "generation_config.json"
    if gen_file.is_file():
        with open(gen_file) as f:
            add(json.load(f).get("eos_token_id"))
    return frozenset(ids)


class TorchModelRunner:
    """Implements engine.contract.ModelRunner on one device (CPU or one GPU)."""

    def __init__(self, config: EngineConfig) -> None:
        from models.loader import load_model, max_model_len

        if config.tensor_parallel_size * config.pipeline_parallel_size > 1:
            raise ValueError("TorchModelRunner runs one process; tensor/pipeline parallel sizes must be 1")
        self.config = config
        self.device = resolve_device(config.device)
        self.dtype = resolve_dtype(config.dtype, self.device)
        self.model_path = resolve_model_path(config.model)
        self.model = load_model(
            self.model_path,
            self.dtype,
            self.device,
            attention_backend=config.attention_backend,
            weight_packing=config.weight_packing,
        )
        hf_config = self.model.config
        self.max_model_len: int = resolve_max_model_len(config.max_model_len, max_model_len(hf_config))
        self.vocab_size: int = self.model.vocab_size
        self.eos_token_ids: frozenset[int] = read_eos_token_ids(self.model_path, hf_config)

        spec, num_blocks = plan_kv_cache(self.model, config, self.dtype, self.device)
        self.kv_cache = PagedKVCache(spec, num_blocks, self.device)
        self.num_kv_blocks: int = num_blocks
        self.block_size: int = config.block_size
        self.limits = InputLimits(num_blocks, config.block_size, self.max_model_len, self.vocab_size)
        self.sampler = Sampler(self.vocab_size, self.eos_token_ids, self.device, config.seed)

    @property
    def max_num_tokens_in_cache(self) -> int:
        return self.num_kv_blocks * self.block_size

    def step(self, batch: Sequence[ScheduledSequence]) -> list[SampledToken | None]:
        """Run one iteration: every entry's tokens in one forward, a token for each sample=True entry."""
        if not batch:
            return []
        with torch.inference_mode():
            inputs, hidden = self._forward(batch)
            out: list[SampledToken | None] = [None] * len(batch)
            if not inputs.sample_rows:
                return out
            logits = self.model.compute_logits(hidden[inputs.logits_indices])  # [S, vocab] float32
            sampled = self.sampler(logits, [batch[i] for i in inputs.sample_rows])
        for i, tok in zip(inputs.sample_rows, sampled, strict=True):
            out[i] = tok
        return out

    def compute_logits(self, batch: Sequence[ScheduledSequence], all_tokens: bool = False) -> torch.Tensor:
        """Run a step without sampling (the KV cache is written as in step()).

        Returns [S, vocab] logits at the last token of each sample=True entry, or [T, vocab] at every
        token of the flat batch when all_tokens is set (for parity checks).
        """
        with torch.inference_mode():
            inputs, hidden = self._forward(batch)
            if all_tokens:
                return self.model.compute_logits(hidden)
            return self.model.compute_logits(hidden[inputs.logits_indices])

    def _forward(self, batch: Sequence[ScheduledSequence]) -> tuple[StepInputs, torch.Tensor]:
        # Validate everything before the forward writes the cache.
        validate_sampling([s for s in batch if s.sample], self.vocab_size)
        inputs = build_step_inputs(batch, self.limits, self.device)
        hidden = self.model(
            inputs.input_ids, inputs.positions, self.kv_cache.layers, inputs.attn_metadata
        )  # [T, hidden]
        return inputs, hidden
