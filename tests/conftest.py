"""Shared fixtures: tiny random models built from configs (no hub), and the default model's tokenizer."""

from __future__ import annotations

import glob
import os
from pathlib import Path
from typing import Any

import pytest
from builders import TINY_CONFIGS, build_hf_model, default_gguf_path, gguf_structured

TEST_CACHE = Path(os.environ.get("ORCA_TEST_CACHE", Path.home() / ".cache" / "orca-serve" / "tests"))

# Without an NVIDIA GPU the Triton kernels (models/layers/triton_attention.py) run in Triton's
# interpreter. Triton reads this switch once, when it is first imported, so it is set here, before any
# test module loads; with a GPU it stays unset and the same tests run the compiled kernels.
if not glob.glob("/dev/nvidia[0-9]*"):
    os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture(scope="session")
def smollm2_tokenizer_dir() -> Path:
    """The default model's tokenizer (with its chat template) as a plain HF directory, cached on disk."""
    from transformers import AutoTokenizer

    out = TEST_CACHE / "smollm2-tokenizer"
    if not (out / "tokenizer.json").exists():
        gguf = default_gguf_path()
        tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        tok.save_pretrained(out)
    return out


def _save_with_tokenizer(model, out: Path, tokenizer_dir: Path) -> Path:
    import shutil

    model.save_pretrained(out, safe_serialization=True)
    for f in tokenizer_dir.iterdir():
        shutil.copy(f, out / f.name)
    return out


def tiny_model_dir(name: str, family: str, quantized: bool = False, **overrides: Any) -> Any:
    """A session fixture `name`: a random model from the family's tiny config (builders.TINY_CONFIGS,
    with `overrides`) saved as an HF directory (config.json, safetensors) with the default model's
    tokenizer; `quantized`: its weights went through GGUF quantization (builders.gguf_structured), so
    they pack and the native decode call runs its layers."""

    @pytest.fixture(scope="session", name=name)
    def fixture(tmp_path_factory, smollm2_tokenizer_dir) -> Path:
        model = build_hf_model(TINY_CONFIGS[family](**overrides))
        if quantized:
            model = gguf_structured(model)
        return _save_with_tokenizer(model, tmp_path_factory.mktemp(name), smollm2_tokenizer_dir)

    return fixture


tiny_llama_dir = tiny_model_dir("tiny_llama_dir", "llama")
# Q4_1 projections and a Q8_0 (tied) embedding like the default model's, stored dequantized as float32.
tiny_gguf_llama_dir = tiny_model_dir("tiny_gguf_llama_dir", "llama", quantized=True)
# The same with head_dim 32 (2 query heads over 1 KV head): whole q8_0 blocks, so its KV cache can be
# q8_0 (--kv-cache-dtype).
tiny_gguf_llama_d32_dir = tiny_model_dir(
    "tiny_gguf_llama_d32_dir", "llama", quantized=True, num_attention_heads=2, num_key_value_heads=1
)
# Local layers with a window of 8 tokens, global ones between them.
tiny_gemma3_dir = tiny_model_dir("tiny_gemma3_dir", "gemma3", quantized=True)
# A sliding window (6 tokens) that every test prompt outgrows.
tiny_mistral_window_dir = tiny_model_dir("tiny_mistral_window_dir", "mistral", sliding_window=6)
# q/k norms, head_dim apart from hidden / heads.
tiny_qwen3_dir = tiny_model_dir("tiny_qwen3_dir", "qwen3")
# Phi-4-mini-like (fused qkv/gate_up, partial rotary, LongRoPE). Its original context (64) holds every
# test sequence: transformers recomputes a sequence that outgrows it with the long factors, which this
# server does not (models/layers/rotary.py says why).
tiny_phi3_dir = tiny_model_dir("tiny_phi3_dir", "phi4_mini", original=64)
tiny_gpt2_dir = tiny_model_dir("tiny_gpt2_dir", "gpt2")
# Mixtures of experts, saved as transformers 5 saves them (one tensor per expert): Qwen3-MoE (8 experts,
# 2 per token; a dense layer between two sparse ones), Qwen2-MoE (routed experts and a gated shared
# expert), Mixtral (block_sparse_moe.experts.N.w1/w2/w3 in its files), OLMoE (q/k norms over the whole
# projections, clipped q/k/v).
tiny_qwen3_moe_dir = tiny_model_dir("tiny_qwen3_moe_dir", "qwen3_moe")
tiny_qwen2_moe_dir = tiny_model_dir("tiny_qwen2_moe_dir", "qwen2_moe")
tiny_mixtral_dir = tiny_model_dir("tiny_mixtral_dir", "mixtral")
tiny_olmoe_dir = tiny_model_dir("tiny_olmoe_dir", "olmoe")


@pytest.fixture(scope="session")
def tokenizer(smollm2_tokenizer_dir):
    """The default model's tokenizer as the server loads it."""
    from server.tokenizer import ServerTokenizer

    return ServerTokenizer.from_pretrained(str(smollm2_tokenizer_dir))


@pytest.fixture(scope="session")
def chromium_session():
    """One headless Chromium for all browser tests; they skip, saying how to get it, where it is missing."""
    from browser import chromium, missing_browser

    reason = missing_browser()
    if reason is not None:
        pytest.skip(reason)
    with chromium() as driver:
        yield driver


@pytest.fixture
def browser(chromium_session):
    """The session's Chromium, left with one blank tab after the test, which fails if a page logged an
    error (an uncaught exception, a file that did not load). Every test serves its app on a new port,
    so it starts with its own (empty) local storage."""
    from browser import page_errors

    page_errors(chromium_session)  # what earlier tests left
    yield chromium_session
    errors: list[str] = []
    handles = chromium_session.window_handles
    for handle in reversed(handles):
        chromium_session.switch_to.window(handle)
        errors += page_errors(chromium_session)
        if handle != handles[0]:
            chromium_session.close()
    chromium_session.switch_to.window(handles[0])
    chromium_session.get("about:blank")
    assert not errors, errors


@pytest.fixture(scope="session")
def thinking_tokenizer(smollm2_tokenizer_dir):
    """The default model's tokenizer with THINKING_TEMPLATE as its chat template."""
    from fakes import THINKING_TEMPLATE
    from transformers import AutoTokenizer

    from server.tokenizer import ServerTokenizer

    hf = AutoTokenizer.from_pretrained(str(smollm2_tokenizer_dir))
    hf.chat_template = THINKING_TEMPLATE
    return ServerTokenizer(hf)


@pytest.fixture(params=[True, False], ids=["overlap", "sync"])
def both_overlap_modes(request, monkeypatch) -> bool:
    """Every IterationLoop the test makes runs with overlapped scheduling on, then off (whatever its
    config says): a module marks itself with `pytestmark = pytest.mark.usefixtures(...)`."""
    import dataclasses

    from scheduler.config import SchedulerConfig
    from scheduler.loop import IterationLoop

    init = IterationLoop.__init__

    def with_mode(self, executor, config=None, *args, **kwargs):
        config = dataclasses.replace(config or SchedulerConfig(), overlap_schedule=request.param)
        init(self, executor, config, *args, **kwargs)

    monkeypatch.setattr(IterationLoop, "__init__", with_mode)
    return request.param


@pytest.fixture
def fresh_model_cache(tmp_path: Path, monkeypatch) -> Path:
    """An empty orca-serve cache ($ORCA_CACHE_DIR) for converted models, whose kernels/ is the
    directory this process loaded its native kernels from: a spawned rank finds them built, where with
    an empty kernels/ it would compile them first and could outlast a test's short distributed
    timeout on a loaded machine."""
    from models.kernels.cpu import kernels
    from models.options import cache_root

    loaded = kernels()
    built = Path(loaded.lib._name).parent if loaded is not None else cache_root() / "kernels"
    built.mkdir(parents=True, exist_ok=True)
    cache = tmp_path / "cache"
    cache.mkdir()
    (cache / "kernels").symlink_to(built, target_is_directory=True)
    monkeypatch.setenv("ORCA_CACHE_DIR", str(cache))
    return cache
