"""The memory roofline of a decode step: the bytes it must read over the bandwidth the device delivers.

A decode step reads every weight once (the LM head included; the embedding table only at the batch's
token rows, which is nothing next to it) and every running sequence's K/V history once. At batch B
with histories of L tokens that is

    bytes(B, L) = weight_bytes + B * L * kv_bytes_per_token

A mixture of experts reads only the experts its tokens chose: with k of E experts per token, an
expert is left unread by all B tokens of a step with probability (1 - k/E)^B under even routing, so
the routed experts count at their expected share, 1 - (1 - k/E)^B of their bytes (k/E at B = 1).

and no implementation can finish the step faster than bytes / bandwidth, so B * bandwidth / bytes is
the ceiling on decode tokens per second. The bandwidth is measured, not read off a datasheet: a large
device-to-device copy, counting the bytes read and the bytes written (how CUDA's bandwidth tests and
the device notes count it). At large batch a step becomes bound by arithmetic instead; the roofline is
then an upper bound that no longer binds.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass

import torch
from torch import nn

from engine.kv_cache import KVCacheSpec
from models.layers.linear import PackableLinear, ParallelLMHead, VocabParallelEmbedding
from models.layers.moe import SparseMoE


@dataclass(frozen=True)
class DecodeBytes:
    """What one decode step of a model reads from device memory."""

    weight_bytes: int  # every weight a step reads whatever its tokens chose: all but routed experts
    kv_bytes_per_token: int  # K and V of every layer for one token
    expert_bytes: int = 0  # a mixture of experts' routed experts, all of them
    expert_share: float = 0.0  # the share of them one token takes: top_k / num_experts

    def per_step(self, batch_size: int, context_len: float) -> float:
        """Bytes a decode step of `batch_size` sequences with `context_len`-token histories reads."""
        experts = self.expert_bytes * (1.0 - (1.0 - self.expert_share) ** batch_size)
        return self.weight_bytes + experts + batch_size * context_len * self.kv_bytes_per_token

    def roofline_tok_s(self, batch_size: int, context_len: float, bandwidth: float) -> float:
        """Decode tokens per second if the step only had to read its bytes at `bandwidth` (bytes/s)."""
        return batch_size * bandwidth / self.per_step(batch_size, context_len)


def weight_bytes_per_step(model: nn.Module) -> int:
    """Bytes of the weights a decode step reads: every parameter once (packed weights at their packed
    size), except an input embedding table that is not also the LM head (only B rows are read)."""
    head_weights = {
        id(m.weight) for m in model.modules() if isinstance(m, ParallelLMHead) and m.weight is not None
    }
    lookup_only = {
        id(m.weight)
        for m in model.modules()
        if isinstance(m, VocabParallelEmbedding) and not isinstance(m, ParallelLMHead)
    } - head_weights
    total = sum(p.numel() * p.element_size() for p in model.parameters() if id(p) not in lookup_only)
    packed = {id(m.packed): m.packed for m in model.modules() if isinstance(m, PackableLinear) and m.packed}
    return total + sum(p.nbytes for p in packed.values())


def routed_expert_bytes(model: nn.Module) -> tuple[int, float]:
    """The bytes of every routed expert of the model's mixtures of experts (packed where packed), and
    the share of them a token takes (top_k / num_experts); (0, 0.0) for a dense model."""
    layers = [m for m in model.modules() if isinstance(m, SparseMoE)]
    if not layers:
        return 0, 0.0
    total = sum(weight_bytes_per_step(expert) for moe in layers for expert in moe.experts)
    routing = layers[0].routing
    return total, routing.top_k / routing.num_experts


def decode_bytes(model: nn.Module, spec: KVCacheSpec) -> DecodeBytes:
    experts, share = routed_expert_bytes(model)
    kv = spec.bytes_per_block // spec.block_size
    return DecodeBytes(weight_bytes_per_step(model) - experts, kv, experts, share)


def measure_copy_bandwidth(device: torch.device, nbytes: int = 1 << 30, repeats: int = 20) -> float:
    """Bytes per second of a device-to-device copy of `nbytes`, counting read + write (median of
    `repeats` copies after a warm-up). On CUDA timed with events; on a CPU with the host clock."""
    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    src.random_(0, 256)  # never time on zeros (and never on an untouched, unmapped buffer)
    dst = torch.empty_like(src)
    dst.copy_(src)
    times: list[float] = []
    for _ in range(repeats):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            dst.copy_(src)
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1000)
        else:
            t0 = time.perf_counter()
            dst.copy_(src)
            times.append(time.perf_counter() - t0)
    return 2 * nbytes / statistics.median(times)


def measure_read_bandwidth(nbytes: int = 1 << 30, repeats: int = 10) -> float:
    """Bytes per second of a float32 sum over `nbytes` on the CPU (reads only: the figure a decode
    step's weight and KV streaming is held to), median of `repeats` after a warm-up."""
    x = torch.rand(nbytes // 4)
    x.sum()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        x.sum()
        times.append(time.perf_counter() - t0)
    return nbytes / statistics.median(times)
