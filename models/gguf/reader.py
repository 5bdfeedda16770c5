"""A GGUF file's tensors under their HF names, read in place (memory-mapped), quantized ones kept as
their raw blocks.

convert.py writes a manifest (`gguf_weights.json`) next to the converted config and tokenizer:
the GGUF file, its size and mtime, and for every tensor the HF parameter name transformers' GGUF
loader maps it to, its type, shape and byte range in the file, plus the row permutation transformers
undoes on Llama's q/k projections (llama.cpp's converter interleaves their rotary halves) and the
offset it adds to Gemma's norms (stored as w + 1). A load
then memory-maps the file and never parses its metadata again (gguf-py takes seconds over a
tokenizer's 100k strings). `GGUFWeights` yields

    (hf_name, torch.Tensor)       F32 / F16 / BF16 tensors, and quantized ones that are not kept
    (hf_name, QuantizedTensor)    quantized tensors of a type packed_weight.py stores, when the
                                  caller keeps quantized weights (the native kernels run them)
    (hf_name, [QuantizedTensor])  the same for a mixture of experts' 3-D stack (ffn_*_exps): one
                                  per expert, which models/weight_names.py names expert by expert

so a Q4_K_M file loads at its own size instead of being expanded to float32 first. Dequantized
tensors are gguf-py's values, as transformers' are: the two paths give the same weights.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from models.errors import ModelLoadError
from models.gguf.blocks import decodable, decode_blocks
from models.layers.packed_weight import BlockComponents, QuantizedBlocks

MANIFEST = "gguf_weights.json"
MANIFEST_VERSION = 2
FLOAT_TYPES = ("F32", "F16", "BF16")


def reverse_permute_rows(rows: np.ndarray, n_head: int) -> np.ndarray:
    """transformers' LlamaTensorProcessor._reverse_permute_weights, on whole rows (of floats or of
    raw blocks alike): row order (head, pair, half) -> (head, half, pair)."""
    dim = rows.shape[0] // n_head // 2
    return rows.reshape(n_head, dim, 2, *rows.shape[1:]).swapaxes(2, 1).reshape(rows.shape)


@dataclass
class QuantizedTensor(QuantizedBlocks):
    """A 2-D weight [rows, cols] (HF orientation) as a GGUF type's raw blocks: uint8 [rows, bytes]."""

    ggml_type: str
    shape: tuple[int, int]
    raw: np.ndarray

    @property
    def block(self) -> tuple[int, int]:
        """(weights, bytes) per block."""
        from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

        return GGML_QUANT_SIZES[GGMLQuantizationType[self.ggml_type]]

    def narrow(self, dim: int, start: int, length: int) -> QuantizedTensor:
        rows, cols = self.shape
        if dim == 0:
            return QuantizedTensor(self.ggml_type, (length, cols), self.raw[start : start + length])
        weights, nbytes = self.block
        if start % weights or length % weights:
            raise ValueError(
                f"columns [{start}, {start + length}) split {self.ggml_type} blocks of {weights}"
            )
        b0, b1 = start // weights * nbytes, (start + length) // weights * nbytes
        return QuantizedTensor(self.ggml_type, (rows, length), self.raw[:, b0:b1])

    def components(self) -> BlockComponents:
        return decode_blocks(self.ggml_type, self.raw, self.shape[1])

    def dequantize(self) -> torch.Tensor:
        from gguf import GGMLQuantizationType, quants

        values = quants.dequantize(np.ascontiguousarray(self.raw), GGMLQuantizationType[self.ggml_type])
        return torch.from_numpy(np.array(values, dtype=np.float32).reshape(self.shape))


def write_manifest(
    gguf: Path,
    out: Path,
    mapping: dict[str, str],
    permute: dict[str, int],
    arch: str,
    reader: Any,
    offsets: dict[str, float] | None = None,
) -> None:
    """mapping: GGUF name -> HF name (transformers'); permute: GGUF name -> heads of its reverse
    permutation; reader: the file's gguf.GGUFReader; offsets: GGUF name -> what transformers adds to
    its values (Gemma's stored norms). Tensors the model has no parameter for (rope_freqs, rope
    factors, ...) are left out, as transformers leaves them."""
    st = gguf.stat()
    tensors = {
        t.name: {
            "hf": mapping[t.name],
            "type": t.tensor_type.name,
            "shape": [int(d) for d in t.shape],  # GGML order: the contiguous dimension first
            "offset": int(t.data_offset),
            "bytes": int(t.n_bytes),
            "permute": permute.get(t.name),
            "offset_add": (offsets or {}).get(t.name),
        }
        for t in reader.tensors
        if t.name in mapping
    }
    manifest = {
        "version": MANIFEST_VERSION,
        "gguf": str(gguf.resolve()),
        "size": st.st_size,
        "mtime_ns": st.st_mtime_ns,
        "architecture": arch,
        "tensors": tensors,
    }
    (out / MANIFEST).write_text(json.dumps(manifest, indent=1))


def has_manifest(model_dir: Path) -> bool:
    return (Path(model_dir) / MANIFEST).is_file()


class GGUFWeights:
    """Iterates (HF name, tensor or QuantizedTensor) over the GGUF file a manifest names; `current`
    is the file (for error messages, as SafetensorsReader's)."""

    def __init__(self, model_dir: Path, keep_quantized: bool) -> None:
        path = Path(model_dir) / MANIFEST
        try:
            self.manifest: dict[str, Any] = json.loads(path.read_text())
        except (OSError, ValueError) as e:
            raise ModelLoadError(f"{path}: unreadable ({e})") from None
        if self.manifest.get("version") != MANIFEST_VERSION:
            raise ModelLoadError(f"{path}: written by another version; delete {model_dir} to convert again")
        self.gguf = Path(self.manifest["gguf"])
        self.keep_quantized = keep_quantized
        self.current: Path | None = None
        try:
            st = os.stat(self.gguf)
        except OSError:
            raise ModelLoadError(
                f"{self.gguf}: the GGUF file this model was converted from is gone"
            ) from None
        if (st.st_size, st.st_mtime_ns) != (self.manifest["size"], self.manifest["mtime_ns"]):
            raise ModelLoadError(
                f"{self.gguf}: changed since it was converted; delete {model_dir} to convert again"
            )

    @property
    def file_bytes(self) -> int:
        """The GGUF file's size on disk."""
        return int(self.manifest["size"])

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor | QuantizedTensor]]:
        from gguf import GGMLQuantizationType, quants

        self.current = self.gguf
        data = np.memmap(self.gguf, dtype=np.uint8, mode="r")
        for info in self.manifest["tensors"].values():
            qtype, shape = info["type"], info["shape"]
            raw = data[info["offset"] : info["offset"] + info["bytes"]]
            if raw.size != info["bytes"]:
                raise ModelLoadError(f"{self.gguf}: truncated (tensor {info['hf']!r} runs past the end)")
            hf_shape = tuple(reversed(shape))
            heads = info["permute"]
            add = info.get("offset_add")  # manifests written before it have no such key
            if qtype in FLOAT_TYPES or add:
                values = quants.dequantize(raw.view(np.uint8), GGMLQuantizationType[qtype])
                values = np.asarray(values, dtype=np.float32).reshape(hf_shape)
                if heads:
                    values = reverse_permute_rows(values, heads)
                if add:  # in float32, as transformers' (weights - 1)
                    values = values + np.float32(add)
                yield info["hf"], torch.from_numpy(np.array(values))  # a copy: the map is read-only
                continue
            rows = int(np.prod(hf_shape[:-1]))
            q = QuantizedTensor(qtype, (rows, hf_shape[-1]), raw.reshape(rows, -1))
            if heads:
                q = QuantizedTensor(qtype, q.shape, reverse_permute_rows(q.raw, heads))
            if not (self.keep_quantized and decodable(qtype) and len(shape) in (2, 3)):
                yield info["hf"], q.dequantize().reshape(hf_shape)
            elif len(shape) == 2:
                yield info["hf"], q
            else:  # an expert stack [experts, rows, cols]: each expert's rows, still as blocks
                n = hf_shape[1]
                yield info["hf"], [q.narrow(0, e * n, n) for e in range(hf_shape[0])]
