"""Linear layers written so tensor parallelism can shard them (Megatron-style).

Every parameter carries a `weight_loader(param, full_weight, shard_id)` that takes the *full* HF tensor
and copies in the slice that this rank owns, so loading for rank r of n is the same code as for 1 of 1.
Parameters are allocated with torch.empty: their values always come from a checkpoint.

A weight may also arrive still in its file's block format (a `QuantizedBlocks`, such as a GGUF
tensor's raw blocks, when the native kernels will run it): the layer then keeps the slice it owns as
blocks, and `pack_weight` turns them into its packed weight without ever materializing float32.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from models.kernels import cpu as cpu_kernels
from models.kernels.cpu import Precision
from models.layers.packed_weight import PackedWeight, QuantizedBlocks, pack_components, pack_exact
from models.layers.parallel import SINGLE, TPContext, balanced_shard, divide

WeightLoader = Callable[[nn.Parameter, torch.Tensor, Any], None]


def _new_param(shape: Sequence[int], dtype: torch.dtype, loader: WeightLoader) -> nn.Parameter:
    param = nn.Parameter(torch.empty(*shape, dtype=dtype), requires_grad=False)
    param.weight_loader = loader  # type: ignore[attr-defined]
    return param


def check_shape(loaded: torch.Tensor, expected: Sequence[int]) -> None:
    if tuple(loaded.shape) != tuple(expected):
        raise ValueError(f"has shape {tuple(loaded.shape)}, expected {tuple(expected)}")


def adopt_or_copy(param: nn.Parameter, loaded: torch.Tensor) -> None:
    """Fill param with loaded (same shape), taking the tensor itself when nothing needs converting.

    Tensors read from safetensors are backed by the file's page cache (mmap); adopting them skips
    first-touching a fresh copy, which is most of the cost of loading a model on a small CPU. A shard
    (a view into a bigger tensor) is copied, or it would keep the whole tensor alive on the device.
    """
    whole = loaded.untyped_storage().nbytes() == loaded.numel() * loaded.element_size()
    if whole and loaded.dtype == param.dtype and loaded.device == param.device and loaded.is_contiguous():
        param.data = loaded
    else:
        param.data.copy_(loaded)


def default_weight_loader(param: nn.Parameter, loaded: torch.Tensor, shard_id: Any = None) -> None:
    """Unsharded parameter (norm weights, biases of replicated layers, ...)."""
    check_shape(loaded, param.shape)
    adopt_or_copy(param, loaded)


def narrow_columns(
    loaded: torch.Tensor | QuantizedBlocks, start: int, length: int
) -> torch.Tensor | QuantizedBlocks:
    """Columns [start, start + length) of a weight; raw blocks that the cut would split become floats."""
    if isinstance(loaded, QuantizedBlocks):
        try:
            return loaded.narrow(1, start, length)
        except ValueError:
            return loaded.dequantize().narrow(1, start, length)
    return loaded.narrow(1, start, length)


class PackableLinear(nn.Module):
    """A layer whose weight may be kept block-quantized (see packed_weight.py): y = x W^T then runs
    on the quantized-linear CPU kernel, with `precision` the activations' (int8, the fast path, or
    float32, the reference).

    `pack_weight()` builds the packed weight from GGUF blocks the loader handed over (`take_blocks`)
    or, failing those, from a float weight that is exactly block-structured (pack_exact), and then
    drops the float32 copy.
    """

    weight: nn.Parameter | None
    packed: PackedWeight | None = None
    precision: Precision = "int8"

    def take_blocks(self, param: nn.Parameter, row_offset: int, part: torch.Tensor | QuantizedBlocks) -> bool:
        """Keep `part` (rows [row_offset, ...) of this layer's weight) as raw blocks if it is some;
        False when it is a float tensor for the caller to copy in."""
        if not isinstance(part, QuantizedBlocks):
            return False
        if param is not self.weight:
            raise ValueError("only a layer's weight may be block-quantized")
        self.__dict__.setdefault("_blocks", []).append((row_offset, part))
        return True

    def load_part(self, param: nn.Parameter, part: torch.Tensor | QuantizedBlocks) -> None:
        """All of `param` from this rank's `part` of the checkpoint's tensor: kept as blocks, or adopted
        (no copy where it can be) or copied in."""
        if not self.take_blocks(param, 0, part):
            adopt_or_copy(param, part)

    def load_rows(self, param: nn.Parameter, row_offset: int, part: torch.Tensor | QuantizedBlocks) -> None:
        """Rows [row_offset, row_offset + len(part)) of `param`: kept as blocks, or copied in."""
        if not self.take_blocks(param, row_offset, part):
            param.data.narrow(0, row_offset, part.shape[0]).copy_(part)

    def _pack_blocks(self) -> PackedWeight | None:
        parts = sorted(self.__dict__.pop("_blocks", []), key=lambda p: p[0])
        if not parts:
            return None
        rows = self.weight.shape[0] if self.weight is not None else 0
        covered = [off for off, _ in parts] == [
            sum(p.shape[0] for _, p in parts[:i]) for i in range(len(parts))
        ]
        if covered and sum(p.shape[0] for _, p in parts) == rows:
            return PackedWeight.concat([PackedWeight((pack_components(p.components()),)) for _, p in parts])
        # Some rows came as floats (a vocabulary padded for tensor parallelism): all of it as floats.
        for off, p in parts:
            self.weight.data[off : off + p.shape[0]].copy_(p.dequantize())
        return pack_exact(self.weight.data)

    def pack_weight(self, precision: Precision = "int8") -> PackedWeight | None:
        packed = self.packed
        if packed is None:
            packed = self._pack_blocks()
            if packed is None and self.weight is not None:
                packed = pack_exact(self.weight.data)
        return self._run_packed(packed, precision)

    def _run_packed(self, packed: PackedWeight | None, precision: Precision) -> PackedWeight | None:
        """Run on `packed` (None: stay on the float weight) with `precision` activations, float32 for
        F16/BF16 weights (the kernels have no int8 path for them); the float copy goes."""
        self.packed = packed
        self.precision = "float32" if packed is not None and packed.holds_floats else precision
        if packed is not None:
            self.weight = None
        return packed

    def matmul(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        if self.packed is not None:
            y = cpu_kernels.quant_linear(x, self.packed, self.precision)
            return y if bias is None else y + bias
        m = x.shape[0]
        if x.device.type == "cpu" and x.dtype in _ONEDNN_DTYPES and x.dim() == 2:
            rows = bucketed_rows(m)
            if rows != m:
                # [rows, in] with zero rows below x: oneDNN sees one of a few shapes (see bucketed_rows)
                return F.linear(F.pad(x, (0, 0, 0, rows - m)), self.weight, bias)[:m]
        return F.linear(x, self.weight, bias)


# On a CPU, torch runs bfloat16/float16 matmuls through oneDNN, which JIT-compiles a kernel for every
# new shape and caches it (about 0.5 MiB per shape and weight, measured on AMX; and a new shape's
# first call waits for the compile). Tokens per step take any value up to the token budget, so a
# server's memory grew by those caches for as long as new step sizes kept coming (issue #17).
_ONEDNN_DTYPES = (torch.bfloat16, torch.float16)


def bucketed_rows(m: int) -> int:
    """m rounded up to one of 8 sizes per power of two past 16 (16 exact sizes below): at most 12.5%
    more rows, and about 70 shapes for any m up to 8192."""
    if m <= 16:
        return m
    step = 1 << (m.bit_length() - 4)
    return -(-m // step) * step


class ParallelLinear(PackableLinear):
    """A linear of the checkpoint's full `input_size` x `output_size` of which this rank holds a part
    (which part: the subclass)."""

    def __init__(self, input_size: int, output_size: int, tp: TPContext) -> None:
        super().__init__()
        self.tp = tp
        self.input_size = input_size
        self.output_size = output_size


class ColumnParallelLinear(ParallelLinear):
    """y = x W^T + b with W's output dim split across ranks; each rank returns its slice of y."""

    def __init__(
        self,
        input_size: int,
        output_size: int,
        bias: bool = False,
        dtype: torch.dtype = torch.float32,
        tp: TPContext = SINGLE,
        gather_output: bool = False,
        local_output_size: int | None = None,
    ) -> None:
        """`local_output_size`: this rank's rows where they are not an even split (QKV's heads)."""
        super().__init__(input_size, output_size, tp)
        if local_output_size is None:
            local_output_size = divide(output_size, tp.size, "output size")
        self.local_output_size = local_output_size
        self.gather_output = gather_output
        self.weight = _new_param((self.local_output_size, input_size), dtype, self.weight_loader)
        self.bias = _new_param((self.local_output_size,), dtype, self.weight_loader) if bias else None

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: Any = None) -> None:
        check_shape(loaded, (self.output_size, *param.shape[1:]))
        n = self.local_output_size
        self.load_part(param, loaded.narrow(0, self.tp.rank * n, n))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.matmul(x, self.bias)
        return self.tp.all_gather_last_dim(y) if self.gather_output else y


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column-parallel linears over the same input fused into one matmul (e.g. gate and up).

    Shard i of every rank holds rows [r * n_i/tp, (r+1) * n_i/tp) of HF weight i, so the fused output
    on each rank is [gate_slice | up_slice] and activations stay local.
    """

    def __init__(
        self,
        input_size: int,
        output_sizes: Sequence[int],
        bias: bool = False,
        dtype: torch.dtype = torch.float32,
        tp: TPContext = SINGLE,
    ) -> None:
        self.output_sizes = list(output_sizes)
        for size in self.output_sizes:
            divide(size, tp.size, "merged output size")
        super().__init__(input_size, sum(self.output_sizes), bias, dtype, tp)

    def shard_sizes(self) -> dict[int, int]:
        """Each part's rows in the full (unsharded) weight, by shard id."""
        return dict(enumerate(self.output_sizes))

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: Any = None) -> None:
        if not isinstance(shard_id, int) or not 0 <= shard_id < len(self.output_sizes):
            raise ValueError(f"merged linear needs a shard index in [0, {len(self.output_sizes)})")
        full = self.output_sizes[shard_id]
        check_shape(loaded, (full, *param.shape[1:]))
        n = full // self.tp.size
        offset = sum(self.output_sizes[:shard_id]) // self.tp.size
        self.load_rows(param, offset, loaded.narrow(0, self.tp.rank * n, n))


class QKVParallelLinear(ColumnParallelLinear):
    """Fused q/k/v projection, sharded by attention head.

    With at least as many KV heads as ranks, each rank takes a contiguous run of KV heads and the
    query heads that attend to them (whole GQA groups). When the KV heads do not divide evenly the
    runs differ by one KV head: SmolLM2-135M's 3 KV heads (9 query heads) on 2 ranks give rank 0 two
    groups (6 query heads) and rank 1 one (3), so the attention output projection is split to match
    (`q_shard`). With fewer KV heads than ranks, KV heads are replicated: rank r holds KV head
    r // (tp / kv_heads), and the query heads split evenly.
    Output layout per rank: [q (local_heads * D) | k (local_kv_heads * D) | v (local_kv_heads * D)].
    """

    def __init__(
        self,
        hidden_size: int,
        head_dim: int,
        num_heads: int,
        num_kv_heads: int,
        bias: bool = False,
        dtype: torch.dtype = torch.float32,
        tp: TPContext = SINGLE,
    ) -> None:
        self.head_dim = head_dim
        self.total_num_heads = num_heads
        self.total_num_kv_heads = num_kv_heads
        if num_kv_heads >= tp.size:
            group = divide(num_heads, num_kv_heads, "number of attention heads over KV heads")
            self.kv_start, self.num_kv_heads = balanced_shard(num_kv_heads, tp.size, tp.rank)
            self.q_start, self.num_heads = self.kv_start * group, self.num_kv_heads * group
            self.kv_replicas = 1
        else:
            self.num_heads = divide(num_heads, tp.size, "number of attention heads")
            self.q_start = tp.rank * self.num_heads
            self.num_kv_heads = 1
            self.kv_replicas = divide(tp.size, num_kv_heads, "tensor-parallel size over KV heads")
            self.kv_start = tp.rank // self.kv_replicas
        self.q_size, self.kv_size = self.num_heads * head_dim, self.num_kv_heads * head_dim
        # (start, size) of this rank's slice of the attention output (the o_proj input).
        self.q_shard = (self.q_start * head_dim, self.q_size)
        output_size = (num_heads + 2 * num_kv_heads) * head_dim
        local = self.q_size + 2 * self.kv_size
        super().__init__(hidden_size, output_size, bias, dtype, tp, local_output_size=local)

    def shard_sizes(self) -> dict[str, int]:
        """q's, k's and v's rows in the full (unsharded) weight."""
        kv = self.total_num_kv_heads * self.head_dim
        return {"q": self.total_num_heads * self.head_dim, "k": kv, "v": kv}

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: Any = None) -> None:
        d = self.head_dim
        if shard_id == "q":
            full, n, offset = self.total_num_heads * d, self.q_size, 0
            start = self.q_start * d
        elif shard_id in ("k", "v"):
            full, n = self.total_num_kv_heads * d, self.kv_size
            offset = self.q_size if shard_id == "k" else self.q_size + self.kv_size
            start = self.kv_start * d
        else:
            raise ValueError(f"QKV shard id must be 'q', 'k' or 'v', not {shard_id!r}")
        check_shape(loaded, (full, *param.shape[1:]))
        self.load_rows(param, offset, loaded.narrow(0, start, n))


class RowParallelLinear(ParallelLinear):
    """y = x W^T + b with W's input dim split across ranks; partial outputs are summed by all-reduce.

    `input_shard` = (start, size) of this rank's input columns when they are not an even split (the
    attention output of unevenly sharded heads); by default rank r takes the r-th equal slice.
    """

    def __init__(
        self,
        input_size: int,
        output_size: int,
        bias: bool = False,
        dtype: torch.dtype = torch.float32,
        tp: TPContext = SINGLE,
        input_shard: tuple[int, int] | None = None,
    ) -> None:
        super().__init__(input_size, output_size, tp)
        if input_shard is None:
            self.local_input_size = divide(input_size, tp.size, "input size")
            self.input_start = tp.rank * self.local_input_size
        else:
            self.input_start, self.local_input_size = input_shard
        self.weight = _new_param((output_size, self.local_input_size), dtype, self.weight_loader)
        # The bias is not sharded: it is added once, after the reduction.
        self.bias = _new_param((output_size,), dtype, default_weight_loader) if bias else None

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: Any = None) -> None:
        check_shape(loaded, (self.output_size, self.input_size))
        self.load_part(param, narrow_columns(loaded, self.input_start, self.local_input_size))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.tp.size == 1:
            return self.matmul(x, self.bias)
        y = self.tp.all_reduce(self.matmul(x))
        return y if self.bias is None else y + self.bias


class VocabParallelEmbedding(PackableLinear):
    """Embedding table split by vocabulary rows; rank r owns ids [r * per_rank, (r+1) * per_rank).

    The vocabulary is padded up to a multiple of the TP size (GPT-2's 50257 is prime-ish); padding rows
    are zero and never indexed. A block-quantized table is looked up row by row, dequantized exactly
    (the same values as the float table); a tied LM head multiplies by the same packed table.
    """

    def __init__(
        self,
        num_embeddings: int,
        embedding_dim: int,
        dtype: torch.dtype = torch.float32,
        tp: TPContext = SINGLE,
    ) -> None:
        super().__init__()
        self.tp = tp
        self.num_embeddings = num_embeddings
        self.embedding_dim = embedding_dim
        self.per_rank = -(-num_embeddings // tp.size)
        self.vocab_start = tp.rank * self.per_rank
        self.vocab_end = min(self.vocab_start + self.per_rank, num_embeddings)
        self.weight = _new_param((self.per_rank, embedding_dim), dtype, self.weight_loader)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: Any = None) -> None:
        check_shape(loaded, (self.num_embeddings, self.embedding_dim))
        n = self.vocab_end - self.vocab_start
        part = loaded.narrow(0, self.vocab_start, n)
        if n < self.per_rank:
            param.data[n:].zero_()
        if n == self.per_rank:
            self.load_part(param, part)
        elif not self.take_blocks(param, 0, part):
            param.data[:n].copy_(part)

    def lookup(self, ids: torch.Tensor) -> torch.Tensor:
        if self.packed is not None:
            return cpu_kernels.dequant_rows(self.packed, ids)
        return F.embedding(ids, self.weight)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tp.size == 1:
            return self.lookup(input_ids)
        # Ids owned by other ranks look up row 0 and are zeroed; the all-reduce fills them in.
        local = input_ids - self.vocab_start
        outside = (local < 0) | (local >= self.vocab_end - self.vocab_start)
        out = self.lookup(local.masked_fill(outside, 0))
        out.masked_fill_(outside.unsqueeze(-1), 0.0)
        return self.tp.all_reduce(out)


class ParallelLMHead(VocabParallelEmbedding):
    """Output projection to the vocabulary, sharded like the embedding so the two can be tied."""

    tied: VocabParallelEmbedding | None = None

    def __init__(
        self,
        num_embeddings: int,
        embedding_dim: int,
        bias: bool = False,
        dtype: torch.dtype = torch.float32,
        tp: TPContext = SINGLE,
    ) -> None:
        super().__init__(num_embeddings, embedding_dim, dtype, tp)
        if bias:
            raise ValueError("an LM head with a bias is not supported")

    def tie_to(self, embedding: VocabParallelEmbedding) -> None:
        self.weight = embedding.weight
        # A plain reference, not a registered submodule: the embedding belongs to the model body.
        object.__setattr__(self, "tied", embedding)

    def pack_weight(self, precision: Precision = "int8") -> PackedWeight | None:
        if self.tied is None:
            return super().pack_weight(precision)
        # Tied: the embedding's table, packed once (the embedding comes first in module order).
        table = self.tied.packed if self.tied.packed is not None else self.tied.pack_weight(precision)
        return self._run_packed(table, precision)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self.matmul(hidden)  # [B, per_rank]
        logits = self.tp.all_gather_last_dim(logits)  # [B, per_rank * tp]
        return logits[..., : self.num_embeddings]
