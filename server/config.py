"""The server's settings: one dataclass nesting the engine's and the scheduler's configs, filled by the
CLI (server/cli.py) or by tests."""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from pathlib import Path

from engine.cli_args import flag, size_arg
from engine.config import EngineConfig
from engine.contract import POOLING_METHODS
from models.options import cache_root
from scheduler.config import SchedulerConfig
from server.reasoning import REASONING_FORMATS


@dataclass
class ServerConfig:
    """Everything `python -m server` runs with: the engine's and the scheduler's configs as they are
    (vLLM's VllmConfig nests its parts the same way), and the HTTP server's own settings."""

    engine: EngineConfig = field(default_factory=EngineConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    # None: the --model value, as vLLM does.
    served_model_name: str | None = flag(None, "name clients send as `model` (default: the --model value)")
    host: str = flag("127.0.0.1")
    port: int = flag(8000)
    api_key: str | None = field(default=None, repr=False)  # secrets stay out of logs and reprs
    # More keys (rotation, one per client); any of these or api_key is accepted.
    api_keys: tuple[str, ...] = field(default=(), repr=False)
    # None: no CORS headers at all (browsers on other origins are refused); ["*"] allows every origin.
    allowed_origins: tuple[str, ...] | None = None
    # Requests (choices) allowed to wait for admission; past it new ones get 429. None (flag 0): unbounded.
    max_queue_len: int | None = flag(
        1024, "requests allowed to wait for admission; more get 429 + Retry-After (0: unbounded)"
    )
    # Seconds a request may take from arrival to its last token; None: no limit.
    request_timeout_s: float | None = flag(
        None,
        "seconds a request may run before it is aborted with 408 (default: no limit)",
        name="--request-timeout",
        metavar="SECONDS",
    )
    # A larger body is refused with 413 before it is read whole.
    max_body_bytes: int = flag(
        4 * 2**20, "request body limit (413)", name="--max-body-size", metavar="SIZE", type=size_arg
    )
    # Floods and slow clients. Open connections past max_connections get uvicorn's fast 503 (None: no
    # cap); a body must arrive whole within body_timeout_s (408); a stream whose client has read
    # nothing for stream_send_timeout_s (its send buffers are full) is aborted. The flags' 0 is None.
    max_connections: int | None = flag(
        1024, "open connections; a request on a connection past it gets a fast 503 (0: no cap)"
    )
    body_timeout_s: float | None = flag(
        30.0,
        "seconds a request body may take to arrive whole (408; 0: no limit)",
        name="--body-timeout",
        metavar="SECONDS",
    )
    stream_send_timeout_s: float | None = flag(
        30.0,
        "abort a stream whose client has read nothing for this long (0: never)",
        name="--stream-send-timeout",
        metavar="SECONDS",
    )
    # What a client may ask for in one request (vLLM has no caps; OpenAI documents n <= 128).
    max_n: int = flag(16, "largest n a request may ask for")
    # Prompts x n of one request: each choice is a request in the loop.
    max_choices: int = flag(64, "largest prompts x n of one request")
    max_logprobs: int = flag(20, "largest (top_)logprobs")
    max_stop_strings: int = flag(4)
    # Per request; None: whatever fits max_model_len.
    max_tokens: int | None = flag(
        None, "largest max_tokens of a request", name="--max-tokens-limit", metavar="N"
    )
    retry_after_s: int = 1  # the Retry-After header of 429 / draining 503 answers
    # SIGTERM: in-flight requests get this long to finish.
    shutdown_grace_s: float = flag(
        30.0,
        "on SIGTERM, seconds in-flight requests get to finish before they are cut",
        name="--shutdown-grace",
        metavar="SECONDS",
    )
    # The periodic throughput / queue / KV log line; 0: off.
    log_stats_interval_s: float = flag(
        10.0,
        "seconds between throughput / queue / KV log lines (0: off)",
        name="--log-stats-interval",
        metavar="SECONDS",
    )
    # The chat page at /, the live iteration view at /live and its event stream.
    webui: bool = flag(
        True,
        "serve no chat page at / and no live iteration view at /live (the API only)",
        name="--no-webui",
        action="store_false",
    )
    # The model's thinking format (server/reasoning.py: qwen3, deepseek_r1): split from the answer in
    # every chat API, and kept out of the tool-call and response-format grammars. None: no split.
    reasoning_parser: str | None = flag(
        None,
        "split the model's <think>...</think> from the answer (reasoning_content, reasoning items, thinking "
        "blocks); tool calls and response formats then constrain only the answer",
        choices=sorted(REASONING_FORMATS),
    )
    # Stored /v1/responses (store: true): a SQLite file, by default responses.sqlite under the cache
    # directory ($ORCA_CACHE_DIR or ~/.cache/orca-serve); ":memory:" keeps them in memory only. The
    # oldest are evicted past the count, and any older than the age.
    responses_store: Path | str | None = flag(
        None,
        "SQLite file of stored /v1/responses (default: responses.sqlite in $ORCA_CACHE_DIR or "
        "~/.cache/orca-serve; ':memory:' keeps them in memory only)",
        metavar="PATH",
        type=str,
    )
    responses_store_max_entries: int = flag(10_000, "stored responses kept; the oldest are evicted past it")
    responses_store_max_age_s: float = flag(
        30 * 24 * 3600.0,
        "seconds a stored response is kept",
        name="--responses-store-max-age",
        metavar="SECONDS",
    )
    # How /v1/embeddings and /v1/rerank pool the final hidden states; None: what the model's files say
    # (models/pooling.py: a GGUF's pooling_type, a sentence-transformers Pooling module, else the last
    # token's).
    pooling: str | None = flag(
        None,
        "how embeddings pool the final hidden states (default: the model's GGUF pooling_type or "
        "sentence-transformers config, else last)",
        choices=POOLING_METHODS,
    )
    # Inputs of one /v1/embeddings request (OpenAI's limit), documents of one /v1/rerank request.
    max_embedding_inputs: int = flag(2048, "most inputs of one /v1/embeddings (documents of one /v1/rerank)")
    log_level: str = flag("info", choices=("debug", "info", "warning", "error"))

    def __post_init__(self) -> None:
        # The engine sizes its CUDA graphs by the largest batch and the most tokens a step holds: the
        # scheduler's max_num_seqs and max_num_batched_tokens, passed down here so that each number
        # has one flag and one default.
        for name in ("max_num_seqs", "max_num_batched_tokens"):
            engine_value, scheduler_value = getattr(self.engine, name), getattr(self.scheduler, name)
            if engine_value is None:
                self.engine = replace(self.engine, **{name: scheduler_value})
            elif engine_value != scheduler_value:
                raise ValueError(
                    f"engine {name} ({engine_value}) differs from the scheduler's ({scheduler_value})"
                )
        # Checked here, before a model loads: the scheduler would refuse it only once the engine is up.
        if self.scheduler.speculative == "draft" and self.engine.draft_model is None:
            raise ValueError("--speculative draft needs a --draft-model")

    @property
    def responses_store_path(self) -> Path | str:
        if self.responses_store is not None:
            return self.responses_store
        return cache_root() / "responses.sqlite"

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
