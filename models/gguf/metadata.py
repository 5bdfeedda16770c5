"""A GGUF file's metadata, tensor table and small tensors, parsed once for the converter (convert.py),
with the checks that turn a bad file into one clear ModelLoadError before anything is written:

    meta = GGUFFile(path)          # raises: truncated or corrupt, unknown or unreadable ggml types
    meta.architecture              # general.architecture
    meta.arch_value("attention.key_length")
    meta.tensor("rope_factors_long.weight")

It is the `GGUFMetadata` a family's GGUF config function reads (models/family.py).
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

import numpy as np

from models.errors import ModelLoadError
from models.gguf.blocks import decodable

FLOAT_TYPES = ("F32", "F16", "BF16")

# Token spellings that end a turn in some chat format: llama.cpp stops on every one a vocabulary has
# (llama-vocab.cpp's end-of-generation list), whatever the file's eos/eot ids say.
END_OF_TURN_TOKENS = (
    "<|eot_id|>",
    "<|eom_id|>",
    "<|im_end|>",
    "<|end|>",
    "<|endoftext|>",
    "<|end_of_text|>",
    "<end_of_turn>",
    "<|return|>",
    "<|call|>",
    "<EOT>",
    "_<EOT>",
    "<｜end▁of▁sentence｜>",
    "<end_of_utterance>",
)


@functools.cache
def readable_types() -> tuple[str, ...]:
    """The ggml types gguf-py dequantizes (the float route for types the kernels do not run)."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, quants

    names = []
    for qtype in GGMLQuantizationType:
        block, size = GGML_QUANT_SIZES.get(qtype, (0, 0))
        if not size:
            continue
        try:
            quants.dequantize(np.zeros(size, dtype=np.uint8), qtype)
        except (NotImplementedError, ValueError, TypeError):
            continue
        names.append(qtype.name)
    return tuple(names)


def _corrupt(path: Path, why: str) -> ModelLoadError:
    return ModelLoadError(f"{path}: truncated or corrupt GGUF file ({why})")


class GGUFFile:
    """One GGUF file's metadata and tensor table (gguf-py's reader over a memory map)."""

    def __init__(self, path: Path) -> None:
        from gguf import GGUFReader

        self.path = path
        try:
            reader = GGUFReader(path)
        except ValueError as e:
            if "GGMLQuantizationType" in str(e):  # a tensor's type id that gguf-py does not know
                raise ModelLoadError(f"{path}: a tensor has an unknown ggml type ({e})") from None
            raise _corrupt(path, f"its header or tables do not parse: {e}") from None
        except (IndexError, KeyError, OverflowError, MemoryError) as e:
            raise _corrupt(path, f"its header or tables do not parse: {type(e).__name__}: {e}") from None
        self.reader = reader
        self.tensors = {t.name: t for t in reader.tensors}
        size = path.stat().st_size
        for t in reader.tensors:
            if int(t.data_offset) + int(t.n_bytes) > size:
                raise _corrupt(path, f"tensor {t.name!r} runs past the end of the file, at {size} bytes")
        arch = self.value("general.architecture")
        if not isinstance(arch, str) or not arch:
            raise _corrupt(path, "no general.architecture")
        self.architecture = arch
        self._check_types()

    def _check_types(self) -> None:
        readable = set(readable_types())
        for t in self.reader.tensors:
            name = t.tensor_type.name
            if name not in FLOAT_TYPES and not decodable(name) and name not in readable:
                from models.layers.packed_weight import FORMATS

                raise ModelLoadError(
                    f"{self.path}: tensor {t.name!r} has ggml type {name}, which nothing here reads; "
                    f"supported: {', '.join(FORMATS)} on the native kernels, "
                    f"{', '.join(n for n in readable if n not in FORMATS)} as float"
                )

    def value(self, key: str, default: Any = None) -> Any:
        field = self.reader.fields.get(key)
        if field is None or not field.types:
            return default
        try:
            return field.contents()
        except (ValueError, IndexError, UnicodeDecodeError) as e:
            raise _corrupt(self.path, f"metadata {key!r} does not parse: {e}") from None

    def arch_value(self, name: str, default: Any = None) -> Any:
        return self.value(f"{self.architecture}.{name}", default)

    def has_tensor(self, name: str) -> bool:
        return name in self.tensors

    def tensor(self, name: str) -> np.ndarray | None:
        from gguf import quants

        t = self.tensors.get(name)
        if t is None:
            return None
        return np.asarray(quants.dequantize(t.data, t.tensor_type), dtype=np.float32).reshape(-1)

    def end_of_turn_ids(self) -> list[int]:
        """Every token id that ends generation: the file's eos, eot and eom ids, and every token
        spelled as one of END_OF_TURN_TOKENS (a chat template's end-of-turn marker), as llama.cpp
        stops on them."""
        ids = {
            self.value(f"tokenizer.ggml.{key}") for key in ("eos_token_id", "eot_token_id", "eom_token_id")
        }
        tokens = self.value("tokenizer.ggml.tokens") or []
        ids |= {i for i, text in enumerate(tokens) if text in END_OF_TURN_TOKENS}
        n = len(tokens)
        return sorted(i for i in ids if isinstance(i, int) and i >= 0 and (not n or i < n))
