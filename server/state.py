"""The app's lifetime: load the model in a worker thread (the HTTP server answers meanwhile: /health
says 503), then start the IterationLoop on the event loop; shut it down at exit."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from engine.contract import Executor
from engine.grammar import GrammarCompiler
from models.errors import ModelLoadError
from models.pooling import DECODER_DEFAULT, ModelPooling
from scheduler.loop import IterationLoop, new_step_thread
from scheduler.outputs import SchedulerStats, StepReport
from server.config import ServerConfig
from server.errors import not_ready
from server.generation import LoopClient
from server.live_feed import IterationFeed
from server.metrics import ServerMetrics
from server.reasoning import REASONING_FORMATS, special_tag_problem
from server.responses_api.background import BackgroundResponses
from server.responses_api.store import ResponseStore
from server.stats_log import StatsLogger
from server.tokenizer import ServerTokenizer

logger = logging.getLogger(__name__)


@dataclass
class LoadedModel:
    executor: Executor
    tokenizer: ServerTokenizer
    vocab_size: int  # the model's (embedding rows); token ids at or above it are rejected
    pooling: ModelPooling = DECODER_DEFAULT  # what its files say embeddings pool with (models/pooling.py)


# Blocking: runs in a worker thread while the event loop keeps answering /health.
ModelLoader = Callable[[], LoadedModel]


class ServerState:
    def __init__(self, config: ServerConfig, loader: ModelLoader) -> None:
        self.config = config
        self._loader = loader
        self.loop: IterationLoop | None = None
        self.tokenizer: ServerTokenizer | None = None
        self.grammars: GrammarCompiler | None = None  # structured outputs and tool calls
        self.vocab_size = 0
        self.kv_cache_capacity: dict[str, str | int] = {}  # set once loaded (/health)
        # How /v1/embeddings and /v1/rerank pool: --pooling, else the model's own (set once loaded).
        self.pooling: ModelPooling = DECODER_DEFAULT
        self.load_error: str | None = None
        self.created = int(time.time())
        self.metrics = ServerMetrics(config.model_name, self._stats)
        self._load_task: asyncio.Task[None] | None = None
        self._stats_task: asyncio.Task[None] | None = None
        self._step_thread: ThreadPoolExecutor | None = None  # the model is built and stepped in it
        # Set on SIGTERM (server.cli): new requests get 503 while those in flight finish.
        self.draining = False
        # Called when loading fails (the CLI stops the server: a server without a model is useless).
        self.on_load_failed: Callable[[str], None] | None = None
        # The live iteration view's step feed (server.live_feed); None without the web UI.
        self.live_feed: IterationFeed | None = IterationFeed() if config.webui else None
        # /v1/responses: stored responses (opened on first use) and those running in the background.
        self.response_store = ResponseStore(
            config.responses_store_path, config.responses_store_max_entries, config.responses_store_max_age_s
        )
        self.background = BackgroundResponses()

    @property
    def ready(self) -> bool:
        return self.loop is not None and self.loop.is_running and not self.draining

    def start_draining(self) -> None:
        if not self.draining:
            logger.info("draining: no new requests; those in flight may finish")
        self.draining = True
        if self.live_feed is not None:  # open live views end now, or they would hold up the drain
            self.live_feed.end()

    def require_ready(self) -> tuple[LoopClient, ServerTokenizer]:
        if self.loop is None or self.tokenizer is None:
            raise not_ready()
        return self.loop, self.tokenizer

    def _stats(self) -> SchedulerStats | None:
        return self.loop.stats() if self.loop is not None else None

    def _on_step(self, report: StepReport) -> None:
        self.metrics.observe_iteration(report)

    # --- lifecycle ---
    def start_loading(self) -> None:
        if self._load_task is not None:  # a second lifespan startup (the app embedded twice): load once
            return
        self._load_task = asyncio.get_running_loop().create_task(self._load(), name="orca-model-load")

    async def wait_ready(self) -> None:
        """Until the model is loaded (or its loading failed); for tests and embedders."""
        if self._load_task is not None:
            await asyncio.shield(self._load_task)

    async def _load(self) -> None:
        t0 = time.monotonic()
        # The model is built in the thread its steps will run in (IterationLoop explains why).
        step_thread = self._step_thread = new_step_thread()
        try:
            loaded = await asyncio.get_running_loop().run_in_executor(step_thread, self._loader)
            cfg = self.config
            loop = IterationLoop(
                loaded.executor, cfg.scheduler, step_thread=step_thread, detokenizer=loaded.tokenizer
            )
            await loop.start()
            loop.add_step_listener(self._on_step)
            if self.live_feed is not None:
                loop.add_step_listener(self.live_feed.on_step)
        except Exception as exc:
            self.load_error = f"{type(exc).__name__}: {exc}"
            # A ModelLoadError names the file and what is wrong with it (an unsupported architecture
            # or ggml type, a truncated file): its traceback would only bury that.
            expected = isinstance(exc, ModelLoadError)
            logger.error("loading the model failed: %s", self.load_error, exc_info=None if expected else exc)
            if self.on_load_failed is not None:
                self.on_load_failed(self.load_error)
            return
        self.tokenizer = loaded.tokenizer
        self.vocab_size = loaded.vocab_size
        ex = loaded.executor
        # /health's capacity: a smaller --kv-cache-dtype fits more tokens in the same memory.
        self.kv_cache_capacity = {
            "dtype": ex.kv_cache_dtype,
            "blocks": ex.num_kv_blocks,
            "block_size": ex.block_size,
            "tokens": ex.num_kv_blocks * ex.block_size,
        }
        self.pooling = ModelPooling(cfg.pooling, "--pooling") if cfg.pooling is not None else loaded.pooling
        if self.pooling.method is None:
            logger.info("no embeddings: %s (--pooling turns them on)", self.pooling.problem)
        else:
            logger.info("embeddings: %s pooling, from %s", self.pooling.method, self.pooling.source)
        if cfg.reasoning_parser is not None:
            problem = special_tag_problem(
                REASONING_FORMATS[cfg.reasoning_parser], loaded.tokenizer.special_tokens
            )
            if problem is not None:
                logger.warning("%s", problem)
        self.grammars = GrammarCompiler(
            loaded.tokenizer.hf, loaded.vocab_size, sorted(loaded.executor.eos_token_ids)
        )
        self.loop = loop
        if cfg.log_stats_interval_s > 0:
            stats_logger = StatsLogger(self.metrics, self._stats)
            self._stats_task = asyncio.get_running_loop().create_task(
                stats_logger.run(cfg.log_stats_interval_s), name="orca-stats-log"
            )
        logger.info(
            "model %r ready in %.1fs (max_model_len=%d); try:\n  %s",
            cfg.model_name,
            time.monotonic() - t0,
            loop.max_model_len,
            self.example_curl(),
        )

    def example_curl(self) -> str:
        host = "127.0.0.1" if self.config.host in ("0.0.0.0", "::") else self.config.host
        # The key itself stays out of the logs.
        auth = ' -H "Authorization: Bearer $ORCA_API_KEY"' if self.config.all_api_keys else ""
        return (
            f"curl http://{host}:{self.config.port}/v1/chat/completions -H 'Content-Type: application/json'{auth} "
            f'-d \'{{"model": "{self.config.model_name}", "messages": [{{"role": "user", "content": "Hello!"}}], '
            f'"max_tokens": 32}}\''
        )

    async def shutdown(self) -> None:
        self.draining = True
        await self.background.shutdown()  # while the loop still runs: their choices are aborted in it
        self.response_store.close()
        if self.live_feed is not None:
            await self.live_feed.close()
        if self._stats_task is not None:
            self._stats_task.cancel()
        if self._load_task is not None and not self._load_task.done():
            # The worker thread cannot be interrupted; the task is dropped and the thread finishes alone.
            self._load_task.cancel()
        if self.loop is not None:
            await self.loop.shutdown()
        if self._step_thread is not None:
            # Not waited for if a load is still running in it (it cannot be interrupted).
            self._step_thread.shutdown(wait=self._load_task is None or self._load_task.done())
