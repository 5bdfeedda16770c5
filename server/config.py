"""The server's settings (one dataclass, filled by the CLI or by tests) and byte-size parsing."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path

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
    weight_packing: str = "auto"  # "auto" | "off": see engine.config.EngineConfig
    tensor_parallel_size: int = 1  # ranks that split every layer (engine.distributed_executor)
    pipeline_parallel_size: int = 1  # pipeline stages; the loop keeps this many batches in flight
    api_key: str | None = field(default=None, repr=False)  # secrets stay out of logs and reprs
    # More keys (rotation, one per client); any of these or api_key is accepted.
    api_keys: tuple[str, ...] = field(default=(), repr=False)
    # None: no CORS headers at all (browsers on other origins are refused); ["*"] allows every origin.
    allowed_origins: tuple[str, ...] | None = None
    # Requests (choices) allowed to wait for admission; past it new ones get 429. None: unbounded.
    max_queue_len: int | None = 1024
    # Seconds a request may take from arrival to its last token; None: no limit.
    request_timeout_s: float | None = None
    max_body_bytes: int = 4 * 2**20  # a larger body is refused with 413 before it is read whole
    # What a client may ask for in one request (vLLM has no caps; OpenAI documents n <= 128).
    max_n: int = 16
    max_choices: int = 64  # prompts x n of one request: each choice is a request in the loop
    max_logprobs: int = 20  # top logprobs per token
    max_stop_strings: int = 4
    max_tokens: int | None = None  # per request; None: whatever fits max_model_len
    retry_after_s: int = 1  # the Retry-After header of 429 / draining 503 answers
    shutdown_grace_s: float = 30.0  # SIGTERM: in-flight requests get this long to finish
    log_stats_interval_s: float = 10.0  # the periodic throughput / queue / KV log line; 0: off
    seed: int = 0
    log_level: str = "info"

    @property
    def model_name(self) -> str:
        return self.served_model_name or self.model

    @property
    def all_api_keys(self) -> tuple[str, ...]:
        keys = ([self.api_key] if self.api_key else []) + [k for k in self.api_keys if k]
        return tuple(dict.fromkeys(keys))


def read_key_file(path: Path) -> tuple[str, ...]:
    """One key per line; blank lines and `#` comments are skipped."""
    keys = []
    for line in path.read_text(encoding="utf-8").splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            keys.append(line)
    if not keys:
        raise ValueError(f"{path}: no API keys in this file")
    return tuple(keys)
