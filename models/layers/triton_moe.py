"""A mixture of experts' routed MLP on a GPU in two Triton launches, with no host synchronisation.

The CPU runs the experts natively (moe.c); on a GPU the module loop ran one matmul pair per chosen
expert and read the experts' token counts back to the host to slice its rows, so each MoE layer cost
a device-to-host wait and 2 x (chosen experts) launches, and no CUDA graph could capture a step. Here,
as vLLM's fused_moe does:

1. `align_by_expert` (torch ops on the device, fixed shapes): the T x k (token, expert) pairs are
   sorted by expert and each expert's group is padded to a multiple of BLOCK_M with a sentinel pair,
   so every BLOCK_M-row block of the sorted list belongs to one expert (`block_expert`). The list's
   length is an upper bound known from T alone (T * k + E * (BLOCK_M - 1)); how much of it is used
   (`num_padded`) stays on the device.
2. `_expert_matmul_kernel` (one launch per matmul): program (b, n) multiplies block b's rows by
   columns n of its expert's weight, reading the weight tile once for the block's rows; blocks past
   `num_padded` return at once, so an expert no token chose is never read. The first launch gathers
   token rows of x (pair p reads row p // k) into the pairs' gate|up outputs; SiLU-and-mul runs on
   those; the second launch writes each pair's down projection times its routing weight.
3. The k rows of each token are summed (`view(T, k, hidden).sum(1)`).

Every pair's row is computed from its own inputs with a fixed tile configuration, so its result does
not depend on which other tokens share the step. On CPU tensors the same kernel runs in Triton's
interpreter (numpy), which is how CI tests it; the weights are the experts' own parameters stacked
as [E, N, K] (moe.StackedExperts).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

# Rows of a block (pairs of one expert), output columns and reduction step of a program: fixed, so a
# pair's result never depends on the batch (tl.dot needs every one >= 16). 16 rows fit a decode step,
# where each chosen expert has one or a few tokens.
BLOCK_M = 16
BLOCK_N = 64
BLOCK_K = 64
NUM_WARPS = 4
NUM_STAGES = 3


# num_pairs (tokens x experts per token) changes every step: specialising on it (== 1, % 16 == 0) would
# only add compiles while serving.
@triton.jit(do_not_specialize=["num_pairs"])
def _expert_matmul_kernel(
    a_ptr,  # [rows, K]: x (pair p reads token row p // PAIRS_PER_A_ROW) or one row per pair
    w_ptr,  # [E, N, K] each expert's weight, K contiguous
    c_ptr,  # [num_pairs, N]
    pair_weight_ptr,  # [num_pairs] float32 routing weights (read with MUL_WEIGHT)
    sorted_pairs_ptr,  # [max_padded] int32 pair ids grouped by expert; num_pairs pads each group
    block_expert_ptr,  # [max_padded // BLOCK_M] int32 the expert of each block
    num_padded_ptr,  # [1] int32 entries of sorted_pairs in use
    N,
    K,
    num_pairs,
    stride_a_row,
    stride_w_expert,
    stride_w_row,
    stride_c_row,
    PAIRS_PER_A_ROW: tl.constexpr,  # k where A is x (one row per token), 1 where A has a row per pair
    MUL_WEIGHT: tl.constexpr,
    DOT_PRECISION: tl.constexpr,  # "ieee" for float32 (no TF32), "tf32" otherwise (ignored for 16-bit)
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    block = tl.program_id(0)
    if block * BLOCK_M >= tl.load(num_padded_ptr):
        return
    offs_m = block * BLOCK_M + tl.arange(0, BLOCK_M)
    pairs = tl.load(sorted_pairs_ptr + offs_m)
    pair_ok = pairs < num_pairs
    rows = (pairs // PAIRS_PER_A_ROW).to(tl.int64)
    expert = tl.load(block_expert_ptr + block).to(tl.int64)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    n_ok = offs_n < N
    a_ptrs = a_ptr + rows[:, None] * stride_a_row + offs_k[None, :]  # [M, K]
    w_ptrs = w_ptr + expert * stride_w_expert + offs_n[None, :] * stride_w_row + offs_k[:, None]  # [K, N]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k_ok = offs_k < K - k0
        a = tl.load(a_ptrs, mask=pair_ok[:, None] & k_ok[None, :], other=0.0)
        w = tl.load(w_ptrs, mask=k_ok[:, None] & n_ok[None, :], other=0.0)
        acc = tl.dot(a, w, acc, input_precision=DOT_PRECISION)
        a_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    if MUL_WEIGHT:
        acc = acc * tl.load(pair_weight_ptr + pairs, mask=pair_ok, other=0.0)[:, None]
    tl.store(
        c_ptr + pairs.to(tl.int64)[:, None] * stride_c_row + offs_n[None, :],
        acc.to(c_ptr.dtype.element_ty),
        mask=pair_ok[:, None] & n_ok[None, :],
    )


@dataclass(frozen=True)
class ExpertBlocks:
    """A step's (token, expert) pairs grouped by expert in blocks of `block_m` (align_by_expert)."""

    sorted_pairs: torch.Tensor  # [max_padded] int32: pair ids (token * k + slot) by expert; num_pairs pads
    block_expert: torch.Tensor  # [max_padded // block_m] int32: each block's expert (past the end: any)
    num_padded: torch.Tensor  # [1] int32: entries of sorted_pairs in use (a multiple of block_m)
    num_pairs: int


def align_by_expert(chosen: torch.Tensor, num_experts: int, block_m: int = BLOCK_M) -> ExpertBlocks:
    """Group the pairs of `chosen` [T, k] (expert ids) by expert, each group padded to a multiple of
    block_m, with device ops of shapes known from T alone (no host read: CUDA graphs capture it).
    Within a group pairs keep token order (a stable sort)."""
    flat = chosen.reshape(-1).long()
    num_pairs = flat.numel()
    device = flat.device
    counts = torch.zeros(num_experts, dtype=torch.int64, device=device)
    counts.scatter_add_(0, flat, torch.ones_like(flat))
    padded = (counts + block_m - 1) // block_m * block_m
    padded_end = torch.cumsum(padded, 0)
    padded_start = padded_end - padded
    order = torch.argsort(flat, stable=True)
    by_expert = flat[order]
    # A pair's rank within its expert's group: its place in the sorted list past the group's start.
    rank = torch.arange(num_pairs, device=device) - (torch.cumsum(counts, 0) - counts)[by_expert]
    max_padded = -(-(num_pairs + num_experts * (block_m - 1)) // block_m) * block_m
    sorted_pairs = torch.full((max_padded,), num_pairs, dtype=torch.int32, device=device)
    sorted_pairs[padded_start[by_expert] + rank] = order.to(torch.int32)
    block_start = torch.arange(0, max_padded, block_m, device=device)
    block_expert = torch.searchsorted(padded_end, block_start, right=True).clamp_(max=num_experts - 1)
    return ExpertBlocks(
        sorted_pairs=sorted_pairs,
        block_expert=block_expert.to(torch.int32),
        num_padded=padded_end[-1:].to(torch.int32),
        num_pairs=num_pairs,
    )


def expert_matmul(
    a: torch.Tensor,
    w: torch.Tensor,
    blocks: ExpertBlocks,
    pairs_per_a_row: int,
    pair_weight: torch.Tensor | None = None,
) -> torch.Tensor:
    """[num_pairs, N]: row p = a[p // pairs_per_a_row] @ w[expert of p]^T (times pair_weight[p])."""
    num_experts, n, k = w.shape
    if a.shape[-1] != k or a.stride(-1) != 1 or w.stride(-1) != 1:
        raise ValueError(f"expert matmul: a {tuple(a.shape)} and w {tuple(w.shape)} need contiguous K")
    out = torch.empty(blocks.num_pairs, n, dtype=a.dtype, device=a.device)
    grid = (blocks.block_expert.numel(), triton.cdiv(n, BLOCK_N))
    _expert_matmul_kernel[grid](
        a,
        w,
        out,
        pair_weight if pair_weight is not None else out,
        blocks.sorted_pairs,
        blocks.block_expert,
        blocks.num_padded,
        n,
        k,
        blocks.num_pairs,
        a.stride(0),
        w.stride(0),
        w.stride(1),
        out.stride(0),
        PAIRS_PER_A_ROW=pairs_per_a_row,
        MUL_WEIGHT=pair_weight is not None,
        DOT_PRECISION="ieee" if a.dtype == torch.float32 else "tf32",
        BLOCK_M=BLOCK_M,
        BLOCK_N=BLOCK_N,
        BLOCK_K=BLOCK_K,
        num_warps=NUM_WARPS,
        num_stages=NUM_STAGES,
    )
    return out


def fused_experts(
    x: torch.Tensor,
    gate_up: torch.Tensor,
    down: torch.Tensor,
    weights: torch.Tensor,
    chosen: torch.Tensor,
    act: torch.nn.Module,
) -> torch.Tensor:
    """The routed experts' weighted sum for every token: x [T, hidden]; gate_up [E, 2I, hidden] and
    down [E, hidden, I] (this rank's slices); weights [T, k] float32 and chosen [T, k] from the
    routing; act maps [P, 2I] (gate | up) to [P, I]. Returns [T, hidden] in x's dtype."""
    num_tokens, top_k = chosen.shape
    blocks = align_by_expert(chosen, gate_up.shape[0])
    h = expert_matmul(x, gate_up, blocks, pairs_per_a_row=top_k)  # [T * k, 2I]
    y = expert_matmul(act(h), down, blocks, pairs_per_a_row=1, pair_weight=weights.reshape(-1).float())
    return y.view(num_tokens, top_k, -1).sum(dim=1)
