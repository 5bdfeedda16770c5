"""Paged attention in Triton: every request of a step (prompt chunks and decodes alike) in one launch,
reading K/V in place from the paged cache.

Layout: q and out are [T, Hq, D] (any token/head strides: q may be a view of the fused qkv); the
caches are [num_blocks, block_size, Hkv, D]; block_tables [B, max_blocks] int32; query_start_loc
[B+1] (cu_seqlens_q) and seq_lens [B] (history length after this step, this step's K/V already
written). Sequence i's queries are the LAST query_len of its seq_len positions, so query j sees keys
0 .. seq_len - query_len + j (causal, aligned bottom-right: a chunk sees its cached prefix). With a
sliding window W (a runtime argument, 0 for none) it sees only the last W of those, itself included,
and a program starts at the key tile holding its first row's window start: the tiles before it are
never read.

One program handles one tile of BLOCK_M query rows against one KV head. The rows are BLOCK_Q
consecutive query tokens of one sequence times the QUERIES_PER_KV query heads that share the KV head
(GQA packing): every K/V tile is loaded once for all of them and both products are tl.dot. Keys are
walked in tiles of TILE_N positions, each position's block looked up in the block table, with an
online softmax in float32 (base 2, the scale folded into log2(e)). A program stops at the last key its
rows can see, so a prompt chunk's early rows never read the keys of its late rows.

Decode-only steps with too few (query, KV head) tiles to fill the GPU split the keys of each tile over
NUM_SPLITS programs; each writes an unnormalised partial output with its running max and sum, and a
second kernel merges them. Which split count runs is a host decision on static sizes (see
`launch_config`), never on device values, and the launch does no host synchronisation: it can be
captured in a CUDA graph.

On CPU tensors the same kernel source runs in Triton's interpreter (numpy), which is how CI tests it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import cache

import torch
import triton
import triton.language as tl
from triton.runtime.interpreter import InterpretedFunction

# A program's q rows, KV tile and head dim must all be >= 16: the smallest tl.dot shape on GPUs.
MIN_DOT = 16
# The most KV splits a decode step uses (a power of two: the merge loads them as one vector).
MAX_SPLITS = 16
# Keys per inner iteration of a decode step (prompt chunks: 64).
DECODE_TILE_N = 32


# num_seqs and the block tables' width change every step: specialising on them (== 1, % 16 == 0) would
# only add compiles, each ~0.5 s of a serving step.
@triton.jit(do_not_specialize=["num_seqs", "stride_table"])
def _paged_attention_kernel(
    out_ptr,  # [T, Hq, D], or unused when NUM_SPLITS > 1
    part_out_ptr,  # [T, Hq, NUM_SPLITS, HEAD_DIM_PAD] float32, unnormalised partial outputs
    part_max_ptr,  # [T, Hq, NUM_SPLITS] float32, running max (log2 units)
    part_sum_ptr,  # [T, Hq, NUM_SPLITS] float32, running sum of exp2(s - max)
    q_ptr,  # [T, Hq, D]
    k_cache_ptr,  # [num_blocks, block_size, Hkv, D]
    v_cache_ptr,
    block_tables_ptr,  # [B, max_blocks] int32
    seq_lens_ptr,  # [B] int32
    query_start_loc_ptr,  # [B+1] int32
    num_seqs,
    scale_log2,  # softmax scale * log2(e)
    window,  # sliding window in keys (itself included); 0: the whole history
    stride_q_tok,
    stride_q_head,
    stride_o_tok,
    stride_o_head,
    stride_k_block,
    stride_k_slot,
    stride_k_head,
    stride_v_block,
    stride_v_slot,
    stride_v_head,
    stride_table,
    QUERIES_PER_KV: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,  # HEAD_DIM rounded up to a power of two, >= 16
    BLOCK_SIZE: tl.constexpr,  # KV cache block size
    BLOCK_M: tl.constexpr,  # query rows per program: BLOCK_Q tokens x QUERIES_PER_KV heads, padded
    BLOCK_Q: tl.constexpr,
    TILE_N: tl.constexpr,  # keys per inner iteration
    NUM_SPLITS: tl.constexpr,
    DECODE_ONLY: tl.constexpr,  # every sequence has exactly one query token
    DOT_PRECISION: tl.constexpr,  # "ieee" for float32 (no TF32), "tf32" otherwise (ignored for 16-bit)
):
    q_tile = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)

    if DECODE_ONLY:
        # One query token per sequence: the grid is B and program i is sequence i.
        seq = q_tile
        q_start = tl.load(query_start_loc_ptr + seq)
        local_tile = q_tile * 0
    else:
        # Sequence i owns q tiles [query_start_loc[i] // BLOCK_Q + i, ...): an upper bound on the tiles
        # before it that needs no host-side count, so the grid is T // BLOCK_Q + B (see q_tiles). Find
        # the last sequence whose first tile is <= q_tile by binary search over query_start_loc.
        lo = q_tile * 0
        hi = q_tile * 0 + num_seqs
        while lo < hi:
            mid = (lo + hi) // 2
            starts_at_or_before = tl.load(query_start_loc_ptr + mid) // BLOCK_Q + mid <= q_tile
            lo = tl.where(starts_at_or_before, mid + 1, lo)
            hi = tl.where(starts_at_or_before, hi, mid)
        seq = lo - 1
        q_start = tl.load(query_start_loc_ptr + seq)
        local_tile = q_tile - (q_start // BLOCK_Q + seq)
    query_len = tl.load(query_start_loc_ptr + seq + 1) - q_start
    if local_tile * BLOCK_Q >= query_len:
        return  # one of the spare tiles of the upper bound

    seq_len = tl.load(seq_lens_ptr + seq)
    context_len = seq_len - query_len  # keys cached before this step's first query

    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM_PAD)
    offs_n = tl.arange(0, TILE_N)
    q_pos = local_tile * BLOCK_Q + offs_m // QUERIES_PER_KV  # [M] query index within the sequence
    head = kv_head * QUERIES_PER_KV + offs_m % QUERIES_PER_KV  # [M] query head
    row_ok = (q_pos < query_len) & (offs_m < BLOCK_Q * QUERIES_PER_KV)
    dim_ok = offs_d < HEAD_DIM
    token = (q_start + q_pos).to(tl.int64)

    q = tl.load(
        q_ptr + token[:, None] * stride_q_tok + head[:, None] * stride_q_head + offs_d[None, :],
        mask=row_ok[:, None] & dim_ok[None, :],
        other=0.0,
    )  # [M, D]

    # The keys any row of this tile sees: from its first row's window start (0 without a window) to its
    # last row's position; then this program's share of the key tiles that hold them.
    kv_end = tl.minimum(context_len + (local_tile + 1) * BLOCK_Q, seq_len)
    kv_start = tl.where(window > 0, tl.maximum(context_len + local_tile * BLOCK_Q - window + 1, 0), 0)
    tile_first = kv_start // TILE_N
    num_tiles = tl.cdiv(kv_end, TILE_N) - tile_first
    tiles_per_split = tl.cdiv(num_tiles, NUM_SPLITS)
    tile_lo = tile_first + split * tiles_per_split
    tile_hi = tl.minimum(tile_lo + tiles_per_split, tile_first + num_tiles)
    # Per row, the last key position it may NOT see (the window's start - 1; -1 without a window).
    before = tl.where(window > 0, context_len + q_pos - window, -1)  # [M]

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM_PAD], tl.float32)
    table_row = block_tables_ptr + seq.to(tl.int64) * stride_table
    for t in range(tile_lo, tile_hi):
        kv_pos = t * TILE_N + offs_n  # [N]
        kv_ok = kv_pos < kv_end
        block = tl.load(table_row + kv_pos // BLOCK_SIZE, mask=kv_ok, other=0).to(tl.int64)
        slot = kv_pos % BLOCK_SIZE
        k = tl.load(
            k_cache_ptr
            + block[None, :] * stride_k_block
            + slot[None, :] * stride_k_slot
            + kv_head * stride_k_head
            + offs_d[:, None],
            mask=dim_ok[:, None] & kv_ok[None, :],
            other=0.0,
        )  # [D, N]
        s = tl.dot(q, k, input_precision=DOT_PRECISION) * scale_log2  # [M, N]
        visible = (
            kv_ok[None, :]
            & (kv_pos[None, :] <= context_len + q_pos[:, None])
            & (kv_pos[None, :] > before[:, None])
        )
        s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        # A row that has seen no key yet keeps max -inf; subtract 0 instead so exp2 gives 0, not NaN.
        m_sub = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.math.exp2(s - m_sub[:, None])
        alpha = tl.math.exp2(m_i - m_sub)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        v = tl.load(
            v_cache_ptr
            + block[:, None] * stride_v_block
            + slot[:, None] * stride_v_slot
            + kv_head * stride_v_head
            + offs_d[None, :],
            mask=kv_ok[:, None] & dim_ok[None, :],
            other=0.0,
        )  # [N, D]
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
        m_i = m_new

    if NUM_SPLITS == 1:
        # Every query sees its own key, so a real row always has l_i > 0; padding rows are not stored.
        out = acc / tl.where(l_i > 0.0, l_i, 1.0)[:, None]
        tl.store(
            out_ptr + token[:, None] * stride_o_tok + head[:, None] * stride_o_head + offs_d[None, :],
            out.to(out_ptr.dtype.element_ty),
            mask=row_ok[:, None] & dim_ok[None, :],
        )
    else:
        # Every split writes, an empty one (-inf, 0, 0) too, so the merge reads no stale scratch.
        row = (token * tl.num_programs(1) * QUERIES_PER_KV + head) * NUM_SPLITS + split  # [M]
        tl.store(part_max_ptr + row, m_i, mask=row_ok)
        tl.store(part_sum_ptr + row, l_i, mask=row_ok)
        tl.store(
            part_out_ptr + row[:, None] * HEAD_DIM_PAD + offs_d[None, :],
            acc,
            mask=row_ok[:, None],
        )


@triton.jit
def _merge_splits_kernel(
    out_ptr,  # [T, Hq, D]
    part_out_ptr,  # [T, Hq, NUM_SPLITS, HEAD_DIM_PAD] float32
    part_max_ptr,  # [T, Hq, NUM_SPLITS] float32
    part_sum_ptr,  # [T, Hq, NUM_SPLITS] float32
    stride_o_tok,
    stride_o_head,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    row = (token * tl.num_programs(1) + head) * NUM_SPLITS + tl.arange(0, NUM_SPLITS)  # [S]
    offs_d = tl.arange(0, HEAD_DIM_PAD)
    m = tl.load(part_max_ptr + row)
    # Split 0 holds the first key the (decode) query sees: the max is finite and empty splits weigh 0.
    weight = tl.math.exp2(m - tl.max(m, axis=0))
    total = tl.sum(tl.load(part_sum_ptr + row) * weight, axis=0)
    acc = tl.sum(
        tl.load(part_out_ptr + row[:, None] * HEAD_DIM_PAD + offs_d[None, :]) * weight[:, None], axis=0
    )
    tl.store(
        out_ptr + token * stride_o_tok + head * stride_o_head + offs_d,
        (acc / total).to(out_ptr.dtype.element_ty),
        mask=offs_d < HEAD_DIM,
    )


# Triton decides at its first import (TRITON_INTERPRET=1) whether @triton.jit compiles for the GPU or
# interprets with numpy; its own library functions (tl.max, tl.sum, ...) follow the same switch, so one
# process cannot mix the two.
INTERPRETED = isinstance(_paged_attention_kernel, InterpretedFunction)


@cache
def _multiprocessor_count(device: torch.device) -> int:
    if device.type != "cuda":
        return 0
    return torch.cuda.get_device_properties(device).multi_processor_count


@dataclass(frozen=True)
class LaunchConfig:
    block_m: int  # query rows per program (>= 16)
    block_q: int  # query tokens per program: block_m // queries per KV head
    tile_n: int  # keys per inner iteration
    num_splits: int  # programs sharing one history (a power of two)
    decode_only: bool  # every sequence has one query token: program i is sequence i
    num_warps: int
    num_stages: int

    def q_tiles(self, num_tokens: int, num_seqs: int) -> int:
        """Programs along the query axis: exactly B for decode steps, else an upper bound the kernel
        needs no per-sequence count for (spare programs return at once)."""
        return num_seqs if self.decode_only else num_tokens // self.block_q + num_seqs


def launch_config(
    *,
    num_tokens: int,
    num_seqs: int,
    max_query_len: int,
    max_seq_len: int,
    num_q_heads: int,
    num_kv_heads: int,
    device: torch.device,
) -> LaunchConfig:
    """Tile sizes and the KV split count, from host-side sizes only (never device values).

    Decode rows are one token times its query heads, so they take the smallest dot tile; prompt
    chunks take 64 rows (BLOCK_Q = 64 // queries per KV head tokens). A decode-only step whose (query tile, KV head) programs cannot fill the GPU
    twice over, with histories long enough to share out, splits each history over up to MAX_SPLITS
    programs. The kernel is correct for any split count, so a CUDA graph captured for a batch size
    passes the longest history it will ever replay (max_model_len) as max_seq_len and keeps the
    result for every replay.
    """
    qpk = num_q_heads // num_kv_heads
    decode_only = max_query_len == 1
    num_splits = 1
    if decode_only:
        programs = num_seqs * num_kv_heads
        target = 2 * _multiprocessor_count(device)
        useful = max_seq_len // (2 * DECODE_TILE_N)  # at least two key tiles per split
        if programs < target and useful >= 2:
            num_splits = min(
                MAX_SPLITS, triton.next_power_of_2(-(-target // programs)), 1 << int(math.log2(useful))
            )
    return _config(qpk, decode_only, num_splits)


def _config(qpk: int, decode_only: bool, num_splits: int) -> LaunchConfig:
    if decode_only:
        block_m, block_q, tile_n = max(MIN_DOT, triton.next_power_of_2(qpk)), 1, DECODE_TILE_N
    else:
        block_m = max(64, triton.next_power_of_2(qpk))
        block_q, tile_n = block_m // qpk, 64
    # Triton 3.7 does not turn these gathered loads into async copies, so more stages buy nothing.
    return LaunchConfig(block_m, block_q, tile_n, num_splits, decode_only, num_warps=4, num_stages=2)


def every_launch_config(num_q_heads: int, num_kv_heads: int) -> list[LaunchConfig]:
    """Every config `launch_config` can choose for these heads: the prompt chunks' one, and a decode one
    per split count. They are the kernel's compile-time constants, so each is a compilation of its own
    the first time a step needs it."""
    qpk = num_q_heads // num_kv_heads
    splits = [1 << i for i in range(int(math.log2(MAX_SPLITS)) + 1)]
    return [_config(qpk, False, 1), *(_config(qpk, True, s) for s in splits)]


def compile_every_config(
    q_dtype: torch.dtype,
    k_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
    v_cache: torch.Tensor,
    num_q_heads: int,
    window: int | None,
    scratch_block: int,
) -> int:
    """Run each of `every_launch_config` once on a one-key history in `scratch_block` (which no
    sequence owns), so that Triton compiles them now: a fresh machine compiles a variant in 0.5-1 s,
    which would otherwise stall the serving step that first needs it (a decode step whose histories
    just grew past a split boundary, with --enforce-eager or beyond the largest CUDA graph). Returns
    how many configs ran. Arguments are laid out as a serving step's are (fresh, aligned tensors):
    Triton also compiles per pointer alignment."""
    device, head_dim = k_cache.device, k_cache.shape[-1]
    q = torch.zeros(1, num_q_heads, head_dim, dtype=q_dtype, device=device)
    tables = torch.full((1, 1), scratch_block, dtype=torch.int32, device=device)
    seq_lens = torch.ones(1, dtype=torch.int32, device=device)
    query_start_loc = torch.tensor([0, 1], dtype=torch.int32, device=device)
    configs = every_launch_config(num_q_heads, k_cache.shape[2])
    for config in configs:
        paged_attention(q, k_cache, v_cache, tables, seq_lens, query_start_loc, 1.0, config, window=window)
    return len(configs)


def paged_attention(
    q: torch.Tensor,  # [T, Hq, D]
    k_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,  # [B, max_blocks] int32
    seq_lens: torch.Tensor,  # [B] int32
    query_start_loc: torch.Tensor,  # [B+1] int32
    scale: float,
    config: LaunchConfig,
    out: torch.Tensor | None = None,  # [T, Hq, D], written in place when given
    window: int | None = None,  # sliding window in keys (None: the whole history)
) -> torch.Tensor:  # [T, Hq, D]
    """Causal attention of every sequence's new queries over its paged history (or the last `window`
    keys of it), one launch (two when the keys are split). Sizes come from shapes and `config`;
    nothing reads device values."""
    num_tokens, num_q_heads, head_dim = q.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    num_seqs = seq_lens.shape[0]
    splits = config.num_splits
    if num_q_heads % num_kv_heads:
        raise ValueError(f"{num_q_heads} query heads do not share {num_kv_heads} KV heads evenly")
    if not q.dtype == k_cache.dtype == v_cache.dtype:
        raise ValueError(f"q ({q.dtype}) and the caches ({k_cache.dtype}, {v_cache.dtype}) differ in dtype")
    if window is not None and window < 1:
        raise ValueError(f"a sliding window must be at least 1 key, not {window}")
    if splits < 1 or splits & (splits - 1):
        raise ValueError(f"num_splits must be a power of two, not {splits}")
    for name, t in (("q", q), ("k_cache", k_cache), ("v_cache", v_cache)):
        if t.stride(-1) != 1:
            raise ValueError(f"{name} must be contiguous in its last (head_dim) dimension")
    if out is None:
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    head_dim_pad = max(MIN_DOT, triton.next_power_of_2(head_dim))
    if splits > 1:
        part_out = torch.empty(
            num_tokens, num_q_heads, splits, head_dim_pad, dtype=torch.float32, device=q.device
        )
        part_max = torch.empty(num_tokens, num_q_heads, splits, dtype=torch.float32, device=q.device)
        part_sum = torch.empty_like(part_max)
    else:
        part_out = part_max = part_sum = out  # never touched
    grid = (config.q_tiles(num_tokens, num_seqs), num_kv_heads, splits)
    _paged_attention_kernel[grid](
        out,
        part_out,
        part_max,
        part_sum,
        q,
        k_cache,
        v_cache,
        block_tables,
        seq_lens,
        query_start_loc,
        num_seqs,
        scale * math.log2(math.e),
        window or 0,
        q.stride(0),
        q.stride(1),
        out.stride(0),
        out.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        v_cache.stride(0),
        v_cache.stride(1),
        v_cache.stride(2),
        block_tables.stride(0),
        QUERIES_PER_KV=num_q_heads // num_kv_heads,
        HEAD_DIM=head_dim,
        HEAD_DIM_PAD=head_dim_pad,
        BLOCK_SIZE=block_size,
        BLOCK_M=config.block_m,
        BLOCK_Q=config.block_q,
        TILE_N=config.tile_n,
        NUM_SPLITS=splits,
        DECODE_ONLY=config.decode_only,
        DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        num_warps=config.num_warps,
        num_stages=config.num_stages,
    )
    if splits > 1:
        _merge_splits_kernel[(num_tokens, num_q_heads)](
            out,
            part_out,
            part_max,
            part_sum,
            out.stride(0),
            out.stride(1),
            HEAD_DIM=head_dim,
            HEAD_DIM_PAD=head_dim_pad,
            NUM_SPLITS=splits,
        )
    return out
