"""The server's settings: one dataclass nesting the engine's and the scheduler's configs, filled by the
CLI (server/cli.py) or by tests."""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from pathlib import Path

from engine.config import EngineConfig
from scheduler.config import SchedulerConfig


@dataclass
class ServerConfig:
    """Everything `python -m server` runs with: the engine's and the scheduler's configs as they are
    (vLLM's VllmConfig nests its parts the same way), and the HTTP server's own settings."""

    engine: EngineConfig = field(default_factory=EngineConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    served_model_name: str | None = None  # None: the --model value, as vLLM does
    host: str = "127.0.0.1"
    port: int = 8000
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
    # Floods and slow clients. Open connections past max_connections get uvicorn's fast 503 (None: no
    # cap); a body must arrive whole within body_timeout_s (408); a stream whose client has read
    # nothing for stream_send_timeout_s (its send buffers are full) is aborted.
    max_connections: int | None = 1024
    body_timeout_s: float | None = 30.0
    stream_send_timeout_s: float | None = 30.0
    # What a client may ask for in one request (vLLM has no caps; OpenAI documents n <= 128).
    max_n: int = 16
    max_choices: int = 64  # prompts x n of one request: each choice is a request in the loop
    max_logprobs: int = 20  # top logprobs per token
    max_stop_strings: int = 4
    max_tokens: int | None = None  # per request; None: whatever fits max_model_len
    retry_after_s: int = 1  # the Retry-After header of 429 / draining 503 answers
    shutdown_grace_s: float = 30.0  # SIGTERM: in-flight requests get this long to finish
    log_stats_interval_s: float = 10.0  # the periodic throughput / queue / KV log line; 0: off
    webui: bool = True  # the chat page at /, the live iteration view at /live and its event stream
    log_level: str = "info"

    def __post_init__(self) -> None:
        # The engine sizes its CUDA graphs by the largest batch the scheduler forms: the scheduler's
        # max_num_seqs, passed down here so that the number has one flag and one default.
        if self.engine.max_num_seqs is None:
            self.engine = replace(self.engine, max_num_seqs=self.scheduler.max_num_seqs)
        elif self.engine.max_num_seqs != self.scheduler.max_num_seqs:
            raise ValueError(
                f"engine max_num_seqs ({self.engine.max_num_seqs}) differs from the scheduler's "
                f"({self.scheduler.max_num_seqs})"
            )
        # Checked here, before a model loads: the scheduler would refuse it only once the engine is up.
        if self.scheduler.speculative == "draft" and self.engine.draft_model is None:
            raise ValueError("--speculative draft needs a --draft-model")

    @property
    def model_name(self) -> str:
        return self.served_model_name or self.engine.model

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
