"""The server's settings (one dataclass, filled by the CLI or by tests) and byte-size parsing."""

from __future__ import annotations

import re
from dataclasses import dataclass

_SIZE_UNITS = {
    "": 1,
    "b": 1,
    "k": 10**3,
    "kb": 10**3,
    "m": 10**6,
    "mb": 10**6,
    "g": 10**9,
    "gb": 10**9,
    "t": 10**12,
    "tb": 10**12,
    "ki": 2**10,
    "kib": 2**10,
    "mi": 2**20,
    "mib": 2**20,
    "gi": 2**30,
    "gib": 2**30,
    "ti": 2**40,
    "tib": 2**40,
}
_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*$")


def parse_size(text: str) -> int:
    """'2GiB' -> 2147483648, '512MB' -> 512000000, '1e9' is not accepted, '4096' -> 4096."""
    match = _SIZE_RE.match(text)
    if not match or match.group(2).lower() not in _SIZE_UNITS:
        raise ValueError(f"not a size: {text!r} (use bytes or a suffix such as 512MiB, 2GiB, 1GB)")
    value = int(float(match.group(1)) * _SIZE_UNITS[match.group(2).lower()])
    if value <= 0:
        raise ValueError(f"size must be positive: {text!r}")
    return value


@dataclass
class ServerConfig:
    model: str = "default"
    served_model_name: str | None = None  # None: the --model value, as vLLM does
    host: str = "127.0.0.1"
    port: int = 8000
    dtype: str = "auto"
    device: str = "auto"
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    max_model_len: int | None = None
    kv_cache_memory: int | None = None
    num_kv_blocks: int | None = None
    block_size: int = 16
    scheduling: str = "iteration"
    kv_policy: str = "lazy"
    chunked_prefill: bool = True
    attention_backend: str = "auto"
    api_key: str | None = None
    seed: int = 0
    log_level: str = "info"

    @property
    def model_name(self) -> str:
        return self.served_model_name or self.model
