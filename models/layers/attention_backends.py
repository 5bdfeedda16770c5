"""Attention backends: causal attention of each request's new queries over its paged K/V history.

A backend splits its work in two: `plan(metadata)` runs once per step (index tensors, masks: anything
that is the same for every layer) and `forward(...)` runs once per layer. Only attention is per request
(selective batching); everything here reads the paged cache, whose layout is
[num_blocks, block_size, num_kv_heads, head_dim] (see metadata.py).

A layer with a sliding window W (`forward(..., window=W)`) lets each query see only the keys at most
W - 1 positions before it, itself included (transformers' `kv_idx > q_idx - W`; flash-attn's
`window_size=(W - 1, 0)`). Plans that depend on the window (sdpa's masks) are built once per step
for each window a layer asks for: a Gemma 3 step has two, its local layers' and its global layers'.

CUDA-only backends import their kernels lazily, inside __init__, so importing this module never needs
CUDA, flash-attn or triton.
"""

from __future__ import annotations

import inspect
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F

from models.kernels import cpu as cpu_kernels
from models.layers.kv_format import decode, gather_kv
from models.layers.metadata import AttentionMetadata


class AttentionBackend(ABC):
    name: str
    # Whether a step's attention can be captured in a CUDA graph (engine/cuda_graphs.py): per-layer work
    # that reads host-side sizes only, allocates through torch, and never synchronises. The per-request
    # plans of sdpa and cpu-decode, and history_slots' host-sized gathers, are not.
    capturable: bool = False
    # Whether forward takes a sliding window (models with windowed layers refuse a backend without).
    supports_sliding_window: bool = True

    @abstractmethod
    def plan(self, md: AttentionMetadata) -> Any:
        """Per-step precomputation shared by all layers."""

    @abstractmethod
    def forward(
        self,
        q: torch.Tensor,  # [T, Hq, D]
        k_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D], already holding this step's K
        v_cache: torch.Tensor,
        md: AttentionMetadata,
        plan: Any,
        scale: float,
        window: int | None = None,  # sliding window in tokens (None: the whole history)
    ) -> torch.Tensor:  # [T, Hq, D]
        """Attention output for every query token."""

    def warm_up(self, layers: Sequence[WarmUpLayer], dtype: torch.dtype, scratch_block: int) -> int:
        """Compile now what forward would compile the first time a step needs it (a backend of
        compiled kernels); `scratch_block` is a KV block no sequence owns. Returns the kernel variants
        it ran (0: nothing to do, the default)."""
        return 0


@dataclass(frozen=True)
class WarmUpLayer:
    """What an attention layer runs its backend with, for `AttentionBackend.warm_up`."""

    num_heads: int  # query heads (this rank's)
    window: int | None  # sliding window in keys (None: the whole history)
    k_cache: torch.Tensor  # [num_blocks, block_size, Hkv, D]
    v_cache: torch.Tensor


def history_slots(md: AttentionMetadata) -> torch.Tensor:
    """[sum(seq_lens)] int64 cache slots of every request's whole history, requests back to back
    (the cu_seqlens_k layout). Device-side only: no host sync."""
    total = sum(md.seq_lens_cpu)
    device = md.block_tables.device
    seq_ids = torch.repeat_interleave(
        torch.arange(md.num_seqs, device=device), md.seq_lens.long(), output_size=total
    )  # [total]
    pos = torch.arange(total, device=device) - md.seq_start_loc.long()[seq_ids]  # position in its sequence
    blocks = md.block_tables.long()[seq_ids, pos // md.block_size]
    return blocks * md.block_size + pos % md.block_size


# --------------------------------------------------------------------------------------------- sdpa


@dataclass
class _SeqPlan:
    q_start: int
    q_end: int
    seq_len: int
    k_start: int  # the first key any of its queries sees (0, or the window's start for the first query)
    block_ids: torch.Tensor  # the blocks holding keys [k_start, seq_len), int64
    mask: torch.Tensor | None  # [query_len, seq_len - k_start] bool, or None
    is_causal: bool


@dataclass
class SdpaPlan:
    """The step's per-request plans, one list per sliding window the layers ask for (None: full
    attention), built by the first layer that asks. Requests before `first` are another backend's
    (cpu-decode batches its leading decodes itself)."""

    md: AttentionMetadata
    first: int = 0
    by_window: dict[int | None, list[_SeqPlan]] = field(default_factory=dict)

    def seqs(self, window: int | None) -> list[_SeqPlan]:
        seqs = self.by_window.get(window)
        if seqs is None:
            seqs = self.by_window[window] = _seq_plans(self.md, self.first, window)
        return seqs


def _seq_plans(md: AttentionMetadata, first: int, window: int | None) -> list[_SeqPlan]:
    """Sequence i's queries are the LAST query_len of its seq_len positions, so query j may see keys
    up to seq_len - query_len + j (causal, aligned bottom-right) and, with a window W, from
    seq_len - query_len + j - W + 1. Only keys from the first query's window start are gathered."""
    device = md.block_tables.device
    block_tables = md.block_tables.long()
    bs = md.block_size
    plans = []
    q_start = sum(md.query_lens_cpu[:first])
    for i in range(first, md.num_seqs):
        q_len, seq_len = md.query_lens_cpu[i], md.seq_lens_cpu[i]
        context = seq_len - q_len  # keys cached before the first query
        end_block = -(-seq_len // bs)
        mask = None
        if window is None or window >= seq_len:  # no query reaches back past the window
            k_start = 0
            if 1 < q_len < seq_len:
                mask = torch.ones(q_len, seq_len, dtype=torch.bool, device=device).tril(context)
            is_causal = q_len == seq_len > 1
        else:
            k_start = max(0, context - window + 1)
            keys = seq_len - k_start
            if q_len > 1:  # one query sees exactly the keys gathered
                ones = torch.ones(q_len, keys, dtype=torch.bool, device=device)
                diagonal = context - k_start  # query j sits at key index j + diagonal
                mask = ones.tril(diagonal) & ones.triu(diagonal - window + 1)
            is_causal = False
        plans.append(
            _SeqPlan(
                q_start,
                q_start + q_len,
                seq_len,
                k_start,
                block_tables[i, k_start // bs : end_block],
                mask,
                is_causal,
            )
        )
        q_start += q_len
    return plans


class SdpaBackend(AttentionBackend):
    """Reference backend: one F.scaled_dot_product_attention per request over its gathered history.

    The queries are the LAST query_len of seq_len positions, so query j may see keys 0..seq_len -
    query_len + j: a causal mask aligned to the bottom right. SDPA's is_causal aligns top-left, which is
    only right when query_len == seq_len; other prefill chunks get an explicit mask, and so does every
    prompt chunk of a windowed layer whose window binds.
    """

    name = "sdpa"

    def plan(self, md: AttentionMetadata, first: int = 0) -> SdpaPlan:
        return SdpaPlan(md, first)

    def forward(self, q, k_cache, v_cache, md, plan, scale, window=None):
        h_kv, row = k_cache.shape[-2:]
        d = q.shape[-1]
        bs = k_cache.shape[1]
        outs = []
        for p in plan.seqs(window):
            lo = p.k_start % bs  # the first gathered key's offset in its block
            n = p.seq_len - p.k_start
            # The blocks read, in the queries' dtype (a 16-bit or q8_0 cache is widened here, these
            # rows only).
            k = decode(k_cache[p.block_ids].view(-1, h_kv, row)[lo : lo + n], d, q.dtype).transpose(0, 1)
            v = decode(v_cache[p.block_ids].view(-1, h_kv, row)[lo : lo + n], d, q.dtype).transpose(0, 1)
            qi = q[p.q_start : p.q_end].transpose(0, 1)  # [Hq, q_len, D]
            # With a batch dimension: torch's CPU flash kernel takes 4-D inputs only, and 3-D ones fall
            # to the math path (it materializes the scores): 3.3x slower on a 512-token prompt.
            o = F.scaled_dot_product_attention(
                qi[None],
                k[None],
                v[None],
                attn_mask=p.mask,
                is_causal=p.is_causal,
                scale=scale,
                enable_gqa=True,
            )[0]
            outs.append(o.transpose(0, 1))  # [q_len, Hq, D]
        return outs[0] if len(outs) == 1 else torch.cat(outs, dim=0)


# --------------------------------------------------------------------------------------- cpu-decode


@dataclass
class _PromptChunks:
    """The requests after the leading decodes, as the native prefill kernel takes them."""

    block_tables: torch.Tensor  # [n, max_blocks] int32, contiguous
    query_lens: torch.Tensor  # [n] int32: each one's new tokens (its rows of q, back to back)
    seq_lens: torch.Tensor  # [n] int32: its history after this step, the new tokens the last of it


@dataclass
class _DecodePlan:
    num_decodes: int  # the leading requests with one query token each, batched together
    block_tables: torch.Tensor | None  # [num_decodes, max_blocks] int32, contiguous
    seq_lens: torch.Tensor | None  # [num_decodes] int32
    max_len: int  # longest history among them
    rest: SdpaPlan | None  # the other requests, per-request sdpa (where the native kernels do not fit)
    chunks: _PromptChunks | None  # the same requests for the native prefill kernel
    # The torch path's padded gather index, built by the first layer that needs it, and its masks
    # (key position < seq_len, and within the window), one per window.
    slots: torch.Tensor | None = None  # [num_decodes, max_len] int64 cache slots (padding: a valid slot)
    masks: dict[int | None, torch.Tensor] = field(default_factory=dict)  # [num_decodes, 1, 1, max_len]


class BatchedDecodeBackend(AttentionBackend):
    """All decode tokens of a step in one call, then all prompt chunks in another.

    Per-request Python work is what dominates small-batch decode on a CPU; here a decode step costs a
    fixed handful of ops per layer whatever the batch size. The engine puts decode tokens first, so the
    leading run of one-token requests is batched. Float32 queries on a CPU with the native kernels
    (models/kernels/cpu.py) read K/V in place from the paged cache, in the cache's own element type
    (float32, float16, bfloat16 or q8_0); otherwise every history is gathered (and widened to the
    queries' dtype) into a padded [B, Hkv, max_len, D] tensor for one masked sdpa. The prompt chunks
    (several query rows a request: prefill, a chunk after a cached prefix) go to the native prefill
    kernel likewise, in place from the cache, or else through per-request sdpa.
    """

    name = "cpu-decode"

    def __init__(self) -> None:
        self._sdpa = SdpaBackend()
        self._native = cpu_kernels.available()

    def plan(self, md: AttentionMetadata) -> _DecodePlan:
        n = 0
        while n < md.num_seqs and md.query_lens_cpu[n] == 1:
            n += 1
        rest = self._sdpa.plan(md, first=n) if n < md.num_seqs else None
        chunks = None
        if rest is not None and self._native:
            chunks = _PromptChunks(
                md.block_tables[n:].to(torch.int32).contiguous(),
                torch.tensor(md.query_lens_cpu[n:], dtype=torch.int32),
                md.seq_lens[n:].to(torch.int32).contiguous(),
            )
        if n == 0:
            return _DecodePlan(0, None, None, 0, rest, chunks)
        tables = md.block_tables[:n].to(torch.int32).contiguous()
        lens = md.seq_lens[:n].to(torch.int32).contiguous()
        return _DecodePlan(n, tables, lens, max(md.seq_lens_cpu[:n]), rest, chunks)

    def _padded(
        self, plan: _DecodePlan, block_size: int, window: int | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        assert plan.block_tables is not None and plan.seq_lens is not None
        n, device = plan.num_decodes, plan.block_tables.device
        pos = torch.arange(plan.max_len, device=device)  # [L]
        if plan.slots is None:
            blocks = plan.block_tables.long()[:, pos // block_size]  # [n, L]; padded entries are block 0
            plan.slots = blocks * block_size + pos % block_size
        mask = plan.masks.get(window)
        if mask is None:
            lens = plan.seq_lens.unsqueeze(1)
            visible = pos.unsqueeze(0) < lens
            if window is not None:
                visible &= pos.unsqueeze(0) >= lens - window
            mask = plan.masks[window] = visible.view(n, 1, 1, plan.max_len)
        return plan.slots, mask

    def _native_fits(self, q: torch.Tensor, k_cache: torch.Tensor, prompts: bool = False) -> bool:
        """Whether the native kernel takes this layer's shapes: the decode one, or with `prompts` the
        prefill one."""
        h_kv, d = k_cache.shape[-2], q.shape[-1]
        supports = (
            cpu_kernels.supports_prefill_attention if prompts else cpu_kernels.supports_decode_attention
        )
        return (
            self._native
            and q.device.type == "cpu"
            and q.dtype == torch.float32
            and k_cache.is_contiguous()
            and supports(d, q.shape[1], h_kv, k_cache.dtype)
        )

    def forward(self, q, k_cache, v_cache, md, plan, scale, window=None):
        n = plan.num_decodes
        outs = []
        if n and self._native_fits(q, k_cache):
            outs.append(
                cpu_kernels.paged_decode_attention(
                    q[:n], k_cache, v_cache, plan.block_tables, plan.seq_lens, scale, window
                )
            )
        elif n:
            d = q.shape[-1]
            slots, mask = self._padded(plan, md.block_size, window)
            k = gather_kv(k_cache, slots, d, q.dtype).transpose(1, 2)  # [n, Hkv, L, D]
            v = gather_kv(v_cache, slots, d, q.dtype).transpose(1, 2)
            qd = q[:n].unsqueeze(2)  # [n, Hq, 1, D]
            o = F.scaled_dot_product_attention(qd, k, v, attn_mask=mask, scale=scale, enable_gqa=True)
            outs.append(o.squeeze(2))  # [n, Hq, D]
        if plan.chunks is not None and self._native_fits(q, k_cache, prompts=True):
            c = plan.chunks
            outs.append(
                cpu_kernels.paged_prefill_attention(
                    q[n:], k_cache, v_cache, c.block_tables, c.query_lens, c.seq_lens, scale, window
                )
            )
        elif plan.rest is not None:
            outs.append(self._sdpa.forward(q, k_cache, v_cache, md, plan.rest, scale, window))
        return outs[0] if len(outs) == 1 else torch.cat(outs, dim=0)


# ------------------------------------------------------------------------------------ CUDA varlen


# flash-attn's paged kernels read the cache in place only for block sizes that are a multiple of 256;
# smaller blocks are gathered into the contiguous cu_seqlens_k layout first.
FLASH_PAGED_BLOCK_MULTIPLE = 256


@dataclass
class _VarlenPlan:
    slots: torch.Tensor | None  # [sum(seq_lens)] gather index, None when the kernel reads pages itself


class TorchVarlenBackend(AttentionBackend):
    """torch.nn.attention.varlen.varlen_attn: one fused launch for all requests (CUDA)."""

    name = "torch-varlen"

    def __init__(self) -> None:
        from torch.nn.attention.varlen import varlen_attn

        self._attn = varlen_attn
        params = inspect.signature(varlen_attn).parameters
        # Older torch spelled causal as is_causal=True; newer as a (-1, 0) window. Both align the
        # causal mask bottom-right, which is what prefill chunks against a cached prefix need. Only the
        # newer one takes a sliding window: (W - 1, 0), flash-attn's convention.
        self._causal = {"is_causal": True} if "is_causal" in params else {"window_size": (-1, 0)}
        self._gqa = {"enable_gqa": True} if "enable_gqa" in params else {}
        self.supports_sliding_window = "window_size" in params

    def plan(self, md: AttentionMetadata) -> _VarlenPlan:
        return _VarlenPlan(history_slots(md))

    def forward(self, q, k_cache, v_cache, md, plan, scale, window=None):
        causal = self._causal
        if window is not None:
            if not self.supports_sliding_window:
                raise ValueError("this torch's varlen_attn has no window_size: no sliding-window attention")
            causal = {"window_size": (window - 1, 0)}
        h_kv, d = k_cache.shape[-2:]
        k = k_cache.view(-1, h_kv, d)[plan.slots]  # [sum(seq_lens), Hkv, D]
        v = v_cache.view(-1, h_kv, d)[plan.slots]
        if not self._gqa and q.shape[1] != h_kv:
            k = k.repeat_interleave(q.shape[1] // h_kv, dim=1)
            v = v.repeat_interleave(q.shape[1] // h_kv, dim=1)
        return self._attn(
            q,
            k,
            v,
            md.query_start_loc,
            md.seq_start_loc,
            md.max_query_len,
            md.max_seq_len,
            scale=scale,
            **causal,
            **self._gqa,
        )


class FlashAttnBackend(AttentionBackend):
    """flash_attn_varlen_func from the flash-attn package (CUDA), paged when the block size allows."""

    name = "flash-attn"

    def __init__(self) -> None:
        from flash_attn import flash_attn_varlen_func

        self._attn = flash_attn_varlen_func

    def plan(self, md: AttentionMetadata) -> _VarlenPlan:
        if md.block_size % FLASH_PAGED_BLOCK_MULTIPLE == 0:
            return _VarlenPlan(None)
        return _VarlenPlan(history_slots(md))

    def forward(self, q, k_cache, v_cache, md, plan, scale, window=None):
        common: dict[str, Any] = dict(
            cu_seqlens_q=md.query_start_loc,
            cu_seqlens_k=md.seq_start_loc,
            max_seqlen_q=md.max_query_len,
            max_seqlen_k=md.max_seq_len,
            softmax_scale=scale,
            causal=True,  # flash-attn >= 2.1 aligns causal bottom-right
        )
        if window is not None:
            # flash-attn (>= 2.3) counts the keys left of the query's own: W - 1 for a window of W.
            common["window_size"] = (window - 1, 0)
        if plan.slots is None:
            return self._attn(q, k_cache, v_cache, block_table=md.block_tables, **common)
        h_kv, d = k_cache.shape[-2:]
        k = k_cache.view(-1, h_kv, d)[plan.slots]  # [sum(seq_lens), Hkv, D]
        v = v_cache.view(-1, h_kv, d)[plan.slots]
        return self._attn(q, k, v, **common)


# ------------------------------------------------------------------------------------------ triton


@dataclass
class _TritonPlan:
    # Tile sizes and split count per (query heads, KV heads), chosen by the first layer that asks: they
    # depend on the step's sizes and the heads, not on the layer.
    configs: dict[tuple[int, int], Any]


class TritonBackend(AttentionBackend):
    """Paged attention in Triton (models/layers/triton_attention.py): the whole step, prompt chunks and
    decodes, in one launch that reads K/V in place from the cache blocks (no gather). CUDA; on CPU
    tensors only under Triton's interpreter (TRITON_INTERPRET=1), which is how it is tested."""

    name = "triton"
    capturable = True  # launch sizes from host values, no sync (see launch_config)

    def __init__(self) -> None:
        from models.layers import triton_attention

        self._kernels = triton_attention

    def plan(self, md: AttentionMetadata) -> _TritonPlan:
        return _TritonPlan({})

    def forward(self, q, k_cache, v_cache, md, plan, scale, window=None):
        heads = (q.shape[1], k_cache.shape[2])
        config = plan.configs.get(heads)
        if config is None:
            config = plan.configs[heads] = self._kernels.launch_config(
                num_tokens=q.shape[0],
                num_seqs=md.num_seqs,
                max_query_len=md.max_query_len,
                max_seq_len=md.max_seq_len,
                num_q_heads=heads[0],
                num_kv_heads=heads[1],
                device=q.device,
            )
        return self._kernels.paged_attention(
            q,
            k_cache,
            v_cache,
            md.block_tables,
            md.seq_lens,
            md.query_start_loc,
            scale,
            config,
            window=window,
        )

    def warm_up(self, layers: Sequence[WarmUpLayer], dtype: torch.dtype, scratch_block: int) -> int:
        """Every launch config the model's layers can meet, compiled at start-up (layers that differ
        in nothing the kernel is compiled for run once)."""
        seen: set[tuple[object, ...]] = set()
        ran = 0
        for layer in layers:
            k = layer.k_cache
            key = (layer.num_heads, layer.window, tuple(k.shape[1:]), k.dtype, k.device)
            if key in seen:
                continue
            seen.add(key)
            ran += self._kernels.compile_every_config(
                dtype, k, layer.v_cache, layer.num_heads, layer.window, scratch_block
            )
        return ran
