"""The real model behind the server: engine.runner.TorchModelRunner and the model's tokenizer."""

from __future__ import annotations

from server.config import ServerConfig
from server.state import LoadedModel
from server.tokenizer import ServerTokenizer


def load_model(config: ServerConfig) -> LoadedModel:
    """Blocking (weights, GGUF conversion, KV cache allocation): call it from a worker thread."""
    # Imported here so that `python -m server --help` and the app factory stay free of torch.
    from engine.config import EngineConfig
    from engine.runner import TorchModelRunner
    from models.loader import load_tokenizer

    runner = TorchModelRunner(
        EngineConfig(
            model=config.model,
            dtype=config.dtype,
            device=config.device,
            block_size=config.block_size,
            num_kv_blocks=config.num_kv_blocks,
            kv_cache_memory=config.kv_cache_memory,
            max_model_len=config.max_model_len,
            attention_backend=config.attention_backend,
            seed=config.seed,
        )
    )
    tokenizer = ServerTokenizer(load_tokenizer(runner.model_path))
    return LoadedModel(runner=runner, tokenizer=tokenizer, vocab_size=runner.vocab_size)
