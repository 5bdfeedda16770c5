"""Block-quantized weights kept at their file's size, in the tiled layout of the native kernels.

A GGUF weight is stored in blocks: every group of 32 (or 16) weights along a row is `a * q + z` with
small integer codes q and a per-group scale a and minimum z. `PackedWeight` keeps exactly that, in the
layout `models/kernels/quant_tiles.h` describes (16-row tiles, each one contiguous stream along K),
so a step reads ~4.5 bits per weight of a Q4 model instead of float32's 32. Reconstruction is
bit-identical to gguf-py's dequantization (and so to transformers' GGUF loader): packing never
changes a weight.

The formats (`FORMATS`, ids shared with the C code):

    name  codes           scales (per 16-row tile)                                   file bits/weight
    Q4_0  4-bit, q - 8    a: f16 per 32                                               4.5
    Q4_1  4-bit           a, z: f16 per 32                                            5.0
    Q8_0  8-bit signed    a: f16 per 32                                               8.5
    Q5_0  5-bit, q - 16   a: f16 per 32                                               5.5
    Q5_1  5-bit           a, z: f16 per 32                                            6.0
    Q4_K  4-bit           d, dmin: f16 per 256; sc, m: u8 per 32; a = d sc, z = -dmin m   4.5 (4.63)
    Q5_K  5-bit           as Q4_K                                                     5.5 (5.63)
    Q6_K  6-bit, q - 32   d: f16 per 256; sc: s8 per 16; a = d sc; bias: i32 per 256   6.56 (6.69)
    Q2_K  2-bit           d, dmin: f16 per 256; sc, m: u8 per 16; a = d sc, z = -dmin m   2.63 (3.13)
    Q3_K  3-bit, q - 4    d: f16 per 256; sc: s8 per 16; a = d sc; bias: i32 per 256   3.44 (3.69)
    IQ4_XS 4-bit index    d: f16 per 256; sc: s8 per 32; a = d sc; q = IQ4_NL_VALUES[code]  4.25 (4.31)
    IQ4_NL 4-bit index    a: f16 per 32; q = IQ4_NL_VALUES[code]                       4.5
    F16   the weight      none (the raw kind: 16-bit floats, k-major in a block)       16
    BF16  the weight      none                                                         16

(In brackets: the packed size where it differs from the file's: the K-quants' 4- and 6-bit sub-scales
and minimums kept a byte each; Q6_K's and Q3_K's code bias, `_code_bias`, which lets the int8 kernels
take x + 128 against signed codes with no offset correction over x's sums.) Codes below 8 bits are stored unsigned, as in the file, with the
format's offset, in a plane of their low bits (a nibble for 4- to 6-bit codes, 2 bits for 2- and 3-bit
ones) and, for 5-, 6- and 3-bit codes, a plane of their high bits: so every code costs the file's bits,
Q6_K's output heads and down projections (a Q4_K_M file's largest 6-bit tensors) 6 bits a weight, a
Q3_K_M file's Q3_K matrices 3 (they took a nibble each before 2026-11-28: a Llama-3.2-1B Q3_K_M file
held 776 MB for its 683, a Q2_K file 814 MB for 573; then 698 and 617, and the code bias has since added
0.125 bits a Q3_K or Q6_K weight). The kernels rebuild a vector of
codes from the planes with a load, a shift and a mask per plane (`code_unit`). IQ4_XS's and IQ4_NL's
codes index a 16-entry int8 codebook; the kernels look a unit of them up with one byte shuffle
(llama.cpp's route) and multiply the int8 values exactly as 8-bit codes.

Two ways in: `pack_components` from a format's codes and scales (models/gguf/blocks.py decodes them from a
GGUF file's raw blocks), and `pack_exact`, which recognises Q4_0 / Q4_1 / Q8_0 structure in float32
weights that were dequantized from such blocks (an HF directory converted from a GGUF file) and, failing
that, weights that are all bfloat16 or float16 values (`float16_components`: 16-bit checkpoints and
F16/BF16 GGUF tensors, read as float32).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

GROUP_SIZE = 32  # weights along K per block (GGUF's QK4_0 ... QK8_0; K-quants: 8 blocks per 256)
TILE_ROWS = 16  # rows of W per tile (quant_tiles.h)
# IQ4_NL / IQ4_XS's codebook (ggml's kvalues_iq4nl; quant_tiles.h's IQ4_NL_VALUES).
IQ4_NL_VALUES = (-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113)


@dataclass(frozen=True)
class BlockFormat:
    """One GGUF block format as the kernels store it (quant_tiles.h mirrors every size)."""

    name: str
    id: int  # QF_* in quant_tiles.h
    bits: int  # bits a code: 2, 3, 4, 5, 6 or 8; 16 for the raw kind
    kind: str  # "f16": scale (and min) f16 per 32; "k": K-quant super-blocks; "k16": scales per 16;
    # "raw": no scales, the weights themselves as 16-bit floats (F16, BF16)
    has_min: bool
    offset: int = 0  # added to the stored (unsigned) code: Q4_0's -8, Q3_K's -4, Q5_0's -16, Q6_K's -32
    file_bits: float = 0.0  # bits per weight in a GGUF file
    sub_signed: bool = False  # sub-scales stored s8 (else u8)
    codebook: tuple[int, ...] | None = None  # 4-bit codes index these int8 values (IQ4_XS, IQ4_NL)

    @property
    def blocks_per_super(self) -> int:
        return 1 if self.kind in ("f16", "raw") else 8

    @property
    def super_k(self) -> int:
        return GROUP_SIZE * self.blocks_per_super

    @property
    def unsigned_codes(self) -> bool:
        """Codes stored as uint8 values below 2**bits (all but Q8_0's int8 and the raw kind's int16
        bit patterns)."""
        return self.bits < 8

    @property
    def low_bits(self) -> int:
        """Bits of an unsigned code in its low plane (quant_tiles.h): a nibble for 4- to 6-bit codes,
        2 for 2- and 3-bit ones; the rest are in the high bits' plane."""
        return 2 if self.bits < 4 else 4

    @property
    def code_bytes(self) -> int:
        return self.bits * 64

    @property
    def sub_bytes(self) -> int:
        return {"f16": 0, "k": 16, "k16": 32, "raw": 0}[self.kind] * (1 + self.has_min)

    @property
    def header_bytes(self) -> int:
        return 0 if self.kind == "raw" else 32 * (1 + self.has_min) + 64 * self.has_bias

    @property
    def has_bias(self) -> bool:
        """The header holds each row's code bias over the super-block (quant_tiles.h: qf_has_bias)."""
        return self.kind == "k16" and not self.has_min

    @property
    def float_dtype(self) -> torch.dtype | None:
        """The raw kind's 16-bit float type (None for the block-quantized formats)."""
        return {"F16": torch.float16, "BF16": torch.bfloat16}.get(self.name) if self.kind == "raw" else None

    @property
    def sub_group(self) -> int:
        """Weights along K per sub-scale (K-quant kinds)."""
        return 16 if self.kind == "k16" else GROUP_SIZE

    @property
    def super_bytes(self) -> int:
        return self.header_bytes + self.blocks_per_super * (self.code_bytes + self.sub_bytes)

    def tile_bytes(self, k: int) -> int:
        return k // self.super_k * self.super_bytes


FORMATS: dict[str, BlockFormat] = {
    f.name: f
    for f in (
        BlockFormat("Q4_0", 0, 4, "f16", False, -8, 4.5),
        BlockFormat("Q4_1", 1, 4, "f16", True, 0, 5.0),
        BlockFormat("Q8_0", 2, 8, "f16", False, 0, 8.5),
        BlockFormat("Q5_0", 3, 5, "f16", False, -16, 5.5),
        BlockFormat("Q5_1", 4, 5, "f16", True, 0, 6.0),
        BlockFormat("Q4_K", 5, 4, "k", True, 0, 4.5),
        BlockFormat("Q5_K", 6, 5, "k", True, 0, 5.5),
        BlockFormat("Q6_K", 7, 6, "k16", False, -32, 6.5625, sub_signed=True),
        BlockFormat("Q2_K", 8, 2, "k16", True, 0, 2.625),
        BlockFormat("Q3_K", 9, 3, "k16", False, -4, 3.4375, sub_signed=True),
        BlockFormat("IQ4_XS", 10, 4, "k", False, 0, 4.25, sub_signed=True, codebook=IQ4_NL_VALUES),
        BlockFormat("IQ4_NL", 11, 4, "f16", False, 0, 4.5, codebook=IQ4_NL_VALUES),
        BlockFormat("F16", 12, 16, "raw", False, 0, 16.0),
        BlockFormat("BF16", 13, 16, "raw", False, 0, 16.0),
    )
}


@dataclass
class BlockComponents:
    """One format's codes and scales for rows of a weight, before tiling.

    codes [N, K]: uint8 below 2**bits for the formats under 8 bits (the stored code, before the
        format's offset; IQ4_XS, IQ4_NL: the codebook index), int8 for Q8_0; for the raw kind the
        weights themselves, float16 or bfloat16 (scale then holds nothing: [N, 0]).
    scale [N, K / super_k] float16: "f16" kind: a per block; "k"/"k16": d per super-block.
    minimum [N, K / super_k] float16: "f16": z per block; "k"/"k16": dmin per super-block; else None.
    sub_scale: "k": sc [N, K / 32]; "k16": sc [N, K / 16]; int8 where the format's are signed, else
        uint8; None for "f16".
    sub_min: m [N, K / sub_group] uint8 for the K-quant kinds with a minimum; else None.
    """

    fmt: BlockFormat
    codes: torch.Tensor
    scale: torch.Tensor
    minimum: torch.Tensor | None = None
    sub_scale: torch.Tensor | None = None
    sub_min: torch.Tensor | None = None

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.codes.shape)  # type: ignore[return-value]


class QuantizedBlocks(ABC):
    """A 2-D weight [rows, cols] (HF orientation) still in its file's block format, as a loader hands it
    to a layer (models/gguf/reader.py's QuantizedTensor): the layer slices its shard out of it and
    packs it (`components`) or, where a cut would split blocks, takes floats (`dequantize`)."""

    shape: tuple[int, int]

    @abstractmethod
    def narrow(self, dim: int, start: int, length: int) -> QuantizedBlocks:
        """Rows or columns [start, start + length); ValueError where columns would split a block."""

    @abstractmethod
    def components(self) -> BlockComponents:
        """The codes and scales of every row (for pack_components)."""

    @abstractmethod
    def dequantize(self) -> torch.Tensor:
        """float32 [rows, cols], the values the file's blocks encode."""


@dataclass(frozen=True)
class PackedSegment:
    """Rows [row_start, row_start + rows) of a weight, all in one format: tiles [ceil(rows/16), bytes].
    Frozen: a PackedWeight keeps its tiles' address for the kernel (kernel_args)."""

    fmt: BlockFormat
    row_start: int
    rows: int
    cols: int
    tiles: torch.Tensor  # uint8

    def __post_init__(self) -> None:
        t = self.tiles
        n_tiles = -(-self.rows // TILE_ROWS)
        if self.rows <= 0 or self.cols <= 0 or self.cols % self.fmt.super_k:
            raise ValueError(f"{self.fmt.name}: {self.rows} x {self.cols} is not a whole number of blocks")
        expect = (n_tiles, self.fmt.tile_bytes(self.cols))
        if (
            t.dtype != torch.uint8
            or not t.is_contiguous()
            or t.device.type != "cpu"
            or tuple(t.shape) != expect
        ):
            raise ValueError(f"tiles: expected contiguous uint8 CPU {expect}, got {t.dtype} {tuple(t.shape)}")

    @property
    def nbytes(self) -> int:
        return self.tiles.numel()


@dataclass
class PackedWeight:
    """W [N, K] as one or more row segments, each in one block format (a fused q/k/v projection may
    mix formats: Q4_K_M files keep some v projections in Q6_K).

    Checked once here, so the kernel (models/kernels/cpu.py), which trusts its pointers, can take a
    PackedWeight on every call without looking at it again."""

    segments: tuple[PackedSegment, ...]
    shape: tuple[int, int] = field(init=False)

    def __post_init__(self) -> None:
        if not self.segments:
            raise ValueError("a packed weight needs at least one segment")
        k = self.segments[0].cols
        start = 0
        for seg in self.segments:
            if seg.row_start != start or seg.cols != k:
                raise ValueError("segments must cover consecutive rows of one width")
            start += seg.rows
        self.shape = (start, k)
        self._set_kernel_args()

    def _set_kernel_args(self) -> None:
        # What the kernel is called with for each segment, fixed while the tiles stay where they are:
        # (tiles address, format id, rows, byte offset of its first output column). Built once, not on
        # every call.
        self.kernel_args: tuple[tuple[int, int, int, int], ...] = tuple(
            (seg.tiles.data_ptr(), seg.fmt.id, seg.rows, 4 * seg.row_start) for seg in self.segments
        )

    @property
    def nbytes(self) -> int:
        return sum(s.nbytes for s in self.segments)

    def replace_tiles(self, tiles: Sequence[torch.Tensor]) -> None:
        """Each segment's tiles replaced by a copy elsewhere (huge-page memory: huge_pages.py), in place,
        so whatever shares this weight (a tied embedding and head) follows. Call before anything keeps
        the tiles' addresses (the native decode structs)."""
        if len(tiles) != len(self.segments):
            raise ValueError(f"{len(tiles)} tile tensors for {len(self.segments)} segments")
        self.segments = tuple(
            PackedSegment(s.fmt, s.row_start, s.rows, s.cols, t)
            for s, t in zip(self.segments, tiles, strict=True)
        )
        self._set_kernel_args()

    @property
    def holds_floats(self) -> bool:
        """Every segment F16 or BF16 (the raw kind): multiplied in float32 whatever precision is asked."""
        return all(s.fmt.kind == "raw" for s in self.segments)

    @property
    def formats(self) -> tuple[str, ...]:
        return tuple(dict.fromkeys(s.fmt.name for s in self.segments))

    def dequantize(self, rows: torch.Tensor | None = None) -> torch.Tensor:
        """W (or W[rows]) in float32, bit-identical to gguf-py's dequantization."""
        from models.kernels import cpu as cpu_kernels

        if rows is None:
            rows = torch.arange(self.shape[0])
        return cpu_kernels.dequant_rows(self, rows)

    @staticmethod
    def concat(parts: Sequence[PackedWeight]) -> PackedWeight:
        """Row-stacked weights (fused q/k/v, gate/up); segments of one format merge when the rows
        before the seam fill whole tiles."""
        segs: list[PackedSegment] = []
        start = 0
        for part in parts:
            for seg in part.segments:
                prev = segs[-1] if segs else None
                if (
                    prev is not None
                    and prev.fmt == seg.fmt
                    and prev.rows % TILE_ROWS == 0
                    and prev.cols == seg.cols
                ):
                    tiles = torch.cat([prev.tiles, seg.tiles])
                    segs[-1] = PackedSegment(prev.fmt, prev.row_start, prev.rows + seg.rows, prev.cols, tiles)
                else:
                    segs.append(PackedSegment(seg.fmt, start, seg.rows, seg.cols, seg.tiles))
                start += seg.rows
        return PackedWeight(tuple(segs))


def _tiled(t: torch.Tensor, n_tiles: int) -> torch.Tensor:
    """[N, ...] -> [T, 16, ...], padded with zero rows."""
    pad = n_tiles * TILE_ROWS - t.shape[0]
    if pad:
        t = torch.cat([t, t.new_zeros(pad, *t.shape[1:])])
    return t.reshape(n_tiles, TILE_ROWS, *t.shape[1:])


def _bytes(t: torch.Tensor) -> torch.Tensor:
    """A tensor's bytes along its last dim (uint8 [..., last * itemsize])."""
    t = t.contiguous()
    return t.view(torch.uint8).reshape(*t.shape[:-1], -1)


def _byte_values(x: torch.Tensor) -> torch.Tensor:
    """Sub-scales as their stored bytes: int8 reinterpreted (two's complement), others as uint8."""
    return x.contiguous().view(torch.uint8) if x.dtype == torch.int8 else x.to(torch.uint8)


def _low_plane(codes: torch.Tensor, lb: int, t: int, g: int) -> torch.Tensor:
    """The low `lb` bits of codes [T, 16, K] as quant_tiles.h lays them out: unit u's (k = 4u..4u+3)
    in byte group u % lb at bit lb * (u // lb), bytes (row, k % 4) as in a unit (for 4-bit codes:
    k and k + 16 share a byte, GGUF's nibble order). -> [T, G, lb * 64]."""
    per = 8 // lb
    lo = (codes & ((1 << lb) - 1)).reshape(t, TILE_ROWS, g, per, lb, 4).permute(0, 2, 3, 4, 1, 5)
    plane = torch.zeros(t, g, lb, TILE_ROWS, 4, dtype=torch.uint8)
    for j in range(per):
        plane |= lo[:, :, j] << (lb * j)
    return plane.reshape(t, g, lb * 64)


def _high_plane(codes: torch.Tensor, lb: int, hb: int, t: int, g: int) -> torch.Tensor:
    """The high `hb` bits (above the low `lb`) of codes [T, 16, K] as quant_tiles.h lays them out:
    unit u's in byte group u // (8 // hb) at bit hb * (u % (8 // hb)), bytes (row, k % 4) as in a
    unit. -> [T, G, hb * 64]."""
    per = 8 // hb
    hi = (codes >> lb).reshape(t, TILE_ROWS, g, 8, 4).permute(0, 2, 3, 1, 4).reshape(t, g, hb, per, 64)
    plane = torch.zeros(t, g, hb, 64, dtype=torch.uint8)
    for j in range(per):
        plane |= hi[:, :, :, j] << (hb * j)
    return plane.reshape(t, g, hb * 64)


def _code_bias(c: BlockComponents) -> torch.Tensor:
    """-128 * sum_j sc_j * sum_{k in j} (q_k + offset) of each row and super-block [N, S] int32: what
    x + 128 adds to the sub-scaled dot products with the signed codes (quant_tiles.h: qf_has_bias)."""
    f = c.fmt
    n, k = c.shape
    signed = c.codes.view(torch.uint8).to(torch.int64) + f.offset
    per_group = signed.reshape(n, k // f.sub_group, f.sub_group).sum(-1)  # [N, J]
    weighed = per_group * c.sub_scale.to(torch.int64)
    return (-128 * weighed.reshape(n, k // f.super_k, -1).sum(-1)).to(torch.int32)


def pack_components(c: BlockComponents, row_start: int = 0) -> PackedSegment:
    """Lay one format's codes and scales out as 16-row tiles (quant_tiles.h)."""
    f = c.fmt
    n, k = c.shape
    if k % f.super_k:
        raise ValueError(f"{f.name}: {k} columns are not a whole number of {f.super_k}-blocks")
    t, g, s = -(-n // TILE_ROWS), k // GROUP_SIZE, k // f.super_k
    if f.kind == "raw":  # each block k-major: k's 16 rows side by side, one vector to widen
        bits = _tiled(c.codes.contiguous().view(torch.int16), t)  # [T, 16, K]
        blocks = bits.reshape(t, TILE_ROWS, g, GROUP_SIZE).permute(0, 2, 3, 1).contiguous()
        return PackedSegment(f, row_start, n, k, blocks.view(torch.uint8).reshape(t, -1))
    codes = _tiled(c.codes.view(torch.uint8), t)  # [T, 16, K]
    if f.unsigned_codes:
        blocks = _low_plane(codes, f.low_bits, t, g)
        if f.bits > f.low_bits:
            blocks = torch.cat([blocks, _high_plane(codes, f.low_bits, f.bits - f.low_bits, t, g)], dim=-1)
    else:
        blocks = codes.reshape(t, TILE_ROWS, g, 8, 4).permute(0, 2, 3, 1, 4).reshape(t, g, 512)

    def per_tile(x: torch.Tensor) -> torch.Tensor:  # [N, J] -> [T, J, 16] (row fastest)
        return _tiled(x, t).permute(0, 2, 1)

    header = [_bytes(per_tile(c.scale.half()))]  # [T, S, 32]
    if f.has_min:
        if c.minimum is None:
            raise ValueError(f"{f.name} needs its minimum")
        header.append(_bytes(per_tile(c.minimum.half())))
    if f.has_bias:
        header.append(_bytes(per_tile(_code_bias(c))))
    if f.kind != "f16":
        per_block = GROUP_SIZE // f.sub_group  # sub-scales per 32-weight block

        def sub_bytes(x: torch.Tensor) -> torch.Tensor:  # [N, G * per_block] -> [T, G, 16 * per_block]
            x = _tiled(_byte_values(x), t).reshape(t, TILE_ROWS, g, per_block).permute(0, 2, 3, 1)
            return x.reshape(t, g, per_block * TILE_ROWS)

        subs = [sub_bytes(c.sub_scale)]
        if f.has_min:
            subs.append(sub_bytes(c.sub_min))
        blocks = torch.cat([blocks, *subs], dim=-1)
    supers = torch.cat([torch.cat(header, dim=-1), blocks.reshape(t, s, -1)], dim=-1)
    return PackedSegment(f, row_start, n, k, supers.reshape(t, -1).contiguous())


# The range of the stored codes of each format (Q8_0 stores the true signed value).
CODE_RANGE = {
    "Q4_0": (0, 15),
    "Q4_1": (0, 15),
    "Q8_0": (-127, 127),
    "Q5_0": (0, 31),
    "Q5_1": (0, 31),
    "Q4_K": (0, 15),
    "Q5_K": (0, 31),
    "Q6_K": (0, 63),
    "Q2_K": (0, 3),
    "Q3_K": (0, 7),
    "IQ4_XS": (0, 15),
    "IQ4_NL": (0, 15),
}


def float16_components(values: torch.Tensor) -> BlockComponents | None:
    """A float32 weight as BF16 or F16 components where every value is one exactly (a checkpoint kept
    in 16 bits and read as float32: bf16 safetensors, F16/BF16 GGUF tensors); None otherwise. BF16 is
    tested first, bitwise (the low half of every float32 zero: one pass, where a conversion and a
    comparison take three over a large checkpoint); then F16 (NaN never matches there). The first row
    decides cheaply whether to look at the rest, as pack_exact's first row does."""
    bits = values.view(torch.int32)
    if bool((bits[:1] & 0xFFFF).eq(0).all()) and bool((bits & 0xFFFF).eq(0).all()):
        return BlockComponents(
            FORMATS["BF16"], values.to(torch.bfloat16), values.new_zeros(values.shape[0], 0)
        )
    if not torch.equal(values[:1].half().float(), values[:1]):
        return None
    narrow = values.half()
    if not torch.equal(narrow.float(), values):
        return None
    return BlockComponents(FORMATS["F16"], narrow, values.new_zeros(values.shape[0], 0))


def random_components(fmt: BlockFormat, n: int, k: int, seed: int = 0) -> BlockComponents:
    """Random but valid codes and scales of a format (kernel tests and micro-benchmarks)."""
    g = torch.Generator().manual_seed(seed)
    if fmt.float_dtype is not None:
        values = (torch.randn(n, k, generator=g) * 0.05).to(fmt.float_dtype)
        return BlockComponents(fmt, values, torch.zeros(n, 0))
    lo, hi = CODE_RANGE[fmt.name]
    dtype = torch.uint8 if fmt.unsigned_codes else torch.int8
    codes = torch.randint(lo, hi + 1, (n, k), generator=g).to(dtype)
    per = k // fmt.super_k
    scale = (torch.rand(n, per, generator=g) * 0.02 + 1e-3).half()
    minimum = (-torch.rand(n, per, generator=g) * 0.1).half() if fmt.has_min else None
    sub_scale = sub_min = None
    if fmt.kind != "f16":
        subs = k // fmt.sub_group
        if fmt.sub_signed:  # Q6_K's 8-bit sub-scales, Q3_K's and IQ4_XS's 6-bit ones
            bound = 64 if fmt.name == "Q6_K" else 32
            sub_scale = torch.randint(-bound, bound, (n, subs), generator=g).to(torch.int8)
        else:  # Q4_K / Q5_K: 6-bit; Q2_K: 4-bit
            bound = 16 if fmt.name == "Q2_K" else 64
            sub_scale = torch.randint(0, bound, (n, subs), generator=g).to(torch.uint8)
        if fmt.has_min:
            sub_min = torch.randint(0, bound, (n, subs), generator=g).to(torch.uint8)
            minimum = (torch.rand(n, per, generator=g) * 0.002).half()
    return BlockComponents(fmt, codes, scale, minimum, sub_scale, sub_min)


# ------------------------------------------------------------------------------------------------
# Recognising Q4_0 / Q4_1 / Q8_0 structure in float32 weights.


def _half(t: torch.Tensor) -> torch.Tensor:
    return t.half().float()


def _extreme(lo: torch.Tensor, hi: torch.Tensor) -> torch.Tensor:
    """The signed value of largest magnitude in each group."""
    return torch.where(hi.abs() > lo.abs(), hi, lo)


# Candidate (scale, zero, qmin, qmax) per group of each format, from the groups' min and max: the
# values gguf-py's quantizer would have stored.
_CANDIDATES = {
    "Q4_1": lambda lo, hi: (_half((hi - lo) / 15), lo, 0, 15),
    "Q8_0": lambda lo, hi: (_half(_extreme(lo, hi).abs() / 127), torch.zeros_like(lo), -127, 127),
    "Q4_0": lambda lo, hi: (_half(_extreme(lo, hi) / -8), torch.zeros_like(lo), -8, 7),
}


def _fit(groups: torch.Tensor, name: str, lo: torch.Tensor, hi: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """(codes [N, G, 32] float, scale, zero, exact rows [N]) of one candidate format.

    In-place ops and a reciprocal instead of a division: this runs over every weight of the model at
    load. The codes only need to round to the right integers, and the exactness check catches any
    that do not. A group with scale 0 is constant and gets codes 0 (its zero, or 0, is the value)."""
    scale, zero, qmin, qmax = _CANDIDATES[name](lo, hi)
    s, z = scale.unsqueeze(-1), zero.unsqueeze(-1)
    inv = torch.where(s == 0, torch.zeros_like(s), 1.0 / s)
    codes = groups - z
    codes.mul_(inv).round_().clamp_(qmin, qmax)
    recon = codes * s
    recon.add_(z)  # a * q is exact; one rounding for + z, as gguf-py
    exact = recon.eq_(groups).all(dim=-1) & (_half(zero) == zero)  # Q4_1's minimum is stored as f16
    return codes, scale, zero, exact.all(dim=-1)


def _components(name: str, codes: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor) -> BlockComponents:
    n = codes.shape[0]
    fmt = FORMATS[name]
    if name == "Q8_0":
        q = codes.to(torch.int8).reshape(n, -1)
    else:
        q = (codes - fmt.offset).to(torch.uint8).reshape(n, -1)
    return BlockComponents(fmt, q, scale.half(), zero.half() if fmt.has_min else None)


def pack_exact(weight: torch.Tensor) -> PackedWeight | None:
    """The packed form of a 2-D float32 weight if every row of it is exactly one of Q4_0 / Q4_1 / Q8_0
    (rows may differ: a fused projection of differently quantized tensors), or failing that every
    value an F16 or BF16 one (float16_components), else None."""
    if weight.dim() != 2 or weight.dtype != torch.float32 or weight.shape[1] % GROUP_SIZE:
        return None
    n, k = weight.shape
    groups = weight.detach().reshape(n, k // GROUP_SIZE, GROUP_SIZE)
    # The first row decides cheaply whether to look further (a float checkpoint fails there) and
    # which format to try first on the rest (an embedding is Q8_0 where the projections are Q4_1).
    # NaN and infinities need no check of their own: they never reconstruct exactly.
    lo1, hi1 = groups[:1].amin(dim=-1), groups[:1].amax(dim=-1)
    first = next((name for name in _CANDIDATES if bool(_fit(groups[:1], name, lo1, hi1)[3][0])), None)
    if first is None:
        return _pack_float16(weight)
    lo, hi = groups.amin(dim=-1), groups.amax(dim=-1)
    row_format = torch.full((n,), -1, dtype=torch.int64)
    fitted: dict[int, tuple[torch.Tensor, ...]] = {}
    for i, name in enumerate([first, *(nm for nm in _CANDIDATES if nm != first)]):
        todo = row_format < 0
        codes, scale, zero, exact = _fit(groups, name, lo, hi)
        row_format[todo & exact] = i
        fitted[i] = (codes, scale, zero)
        if bool((row_format >= 0).all()):
            break
    else:
        return _pack_float16(weight)
    names = [first, *(nm for nm in _CANDIDATES if nm != first)]
    # Runs of consecutive rows in one format become segments.
    change = torch.nonzero(row_format[1:] != row_format[:-1]).squeeze(1) + 1
    bounds = [0, *change.tolist(), n]
    parts = []
    for a, b in zip(bounds[:-1], bounds[1:], strict=True):
        i = int(row_format[a])
        codes, scale, zero = (t[a:b] for t in fitted[i])
        seg = pack_components(_components(names[i], codes, scale, zero), 0)
        parts.append(PackedWeight((seg,)))
    return PackedWeight.concat(parts)


def _pack_float16(weight: torch.Tensor) -> PackedWeight | None:
    c = float16_components(weight.detach())
    return PackedWeight((pack_components(c),)) if c is not None else None
