"""The real model behind the server: the engine's runner (one process, or tensor / pipeline parallel
ranks) and the model's tokenizer."""

from __future__ import annotations

import os

from server.config import ServerConfig
from server.state import LoadedModel
from server.tokenizer import ServerTokenizer


def load_served_model(config: ServerConfig) -> LoadedModel:
    """Blocking (weights, GGUF conversion, KV cache allocation): call it from a worker thread."""
    # Imported here so that `python -m server --help` and the app factory stay free of torch.
    from engine.executor_factory import create_executor
    from models.loader import load_tokenizer
    from models.pooling import model_pooling

    executor = create_executor(config.engine)  # starts the worker ranks when parallel
    tokenizer = ServerTokenizer(load_tokenizer(executor.model_path))
    return LoadedModel(
        executor=executor,
        tokenizer=tokenizer,
        vocab_size=executor.vocab_size,
        pooling=model_pooling(executor.model_path),
    )


def is_torchrun_worker() -> bool:
    """True in a process torchrun started as a rank other than 0 (those run no HTTP server)."""
    return "WORLD_SIZE" in os.environ and int(os.environ.get("RANK", "0")) != 0
