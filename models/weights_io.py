"""Reading checkpoint tensors: safetensors files of an HF directory, streamed one tensor at a time."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from models.errors import ModelLoadError

INDEX_FILE = "model.safetensors.index.json"


def safetensors_files(model_dir: Path) -> list[Path]:
    """The weight files of an HF directory: those the shard index names, else every *.safetensors."""
    index = model_dir / INDEX_FILE
    if index.exists():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise ModelLoadError(f"{index}: unreadable shard index ({e})") from None
        files = [model_dir / name for name in sorted(set(weight_map.values()))]
        absent = [f.name for f in files if not f.is_file()]
        if absent:
            raise ModelLoadError(f"{index}: names shard files that are missing: {', '.join(absent)}")
        return files
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise ModelLoadError(f"{model_dir}: no *.safetensors weight files")
    return files


def matrices_all_16_bit(model_dir: Path) -> bool:
    """Whether every 2-D tensor of an HF directory's weight files is stored as float16 or bfloat16 (most
    checkpoints: their linear weights then pack as F16/BF16, packed_weight.float16_components). Reads
    the files' headers only; False where there are none or one is unreadable."""
    try:
        dtypes = []
        for path in safetensors_files(model_dir):
            with safe_open(str(path), framework="pt") as f:
                slices = [f.get_slice(name) for name in f.keys()]
                dtypes += [s.get_dtype() for s in slices if len(s.get_shape()) == 2]
    except (ModelLoadError, OSError, SafetensorError):
        return False
    return bool(dtypes) and all(d in ("F16", "BF16") for d in dtypes)


class SafetensorsReader:
    """Iterates (name, tensor) over the files, remembering which file is being read so a weight that
    fails later (wrong shape, unknown name) can be reported with its file."""

    def __init__(self, files: list[Path], device: torch.device | str = "cpu") -> None:
        self.files = files
        self.device = str(torch.device(device))
        self.current: Path | None = None

    @property
    def file_bytes(self) -> int:
        """The weight files' size on disk."""
        return sum(p.stat().st_size for p in self.files)

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        for path in self.files:
            self.current = path
            try:
                with safe_open(path, framework="pt", device=self.device) as f:
                    for name in f.keys():
                        yield name, f.get_tensor(name)
            except ModelLoadError:
                raise
            except Exception as e:  # safetensors raises its own error types, and OSError on truncation
                raise ModelLoadError(f"{path}: corrupt or truncated safetensors file ({e})") from None
