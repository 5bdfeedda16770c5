"""LocalExecutor and its ModelRunner: sample=False entries, logprobs, attributes, config resolution, the
debug batch checks, CUDA backends vs sdpa."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from unittest import mock

import pytest
import torch
from builders import build_hf_model, cpu_engine_config, tiny_llama_config

from engine import config as engine_config
from engine.config import EngineConfig, resolve_dtype
from engine.contract import SamplingParams, ScheduledSequence
from engine.executor import LocalExecutor
from engine.model_runner import DEBUG_CHECKS_ENV

GREEDY = SamplingParams(temperature=0.0)


def tiny_executor(model_dir: Path) -> LocalExecutor:
    return LocalExecutor(cpu_engine_config(model_dir, block_size=4, num_kv_blocks=16))


@pytest.fixture(scope="module")
def runner(tiny_llama_dir: Path) -> LocalExecutor:
    return tiny_executor(tiny_llama_dir)


@pytest.fixture(scope="module")
def checked_runner(tiny_llama_dir: Path) -> LocalExecutor:
    """An executor built under the debug switch: it checks every batch before running it."""
    with mock.patch.dict(os.environ, {DEBUG_CHECKS_ENV: "1"}):
        return tiny_executor(tiny_llama_dir)


def seq(
    rid: str, tokens: list[int], start: int = 0, table: list[int] | None = None, sample: bool = True, **kw
):
    params = SamplingParams(**{"temperature": 0.0, **kw})
    return ScheduledSequence(rid, tokens, start, [0, 1, 2] if table is None else table, sample, params)


BAD_BATCHES = {
    "block table too short": (
        [seq("a", list(range(10, 19)), table=[0, 1])],
        "block table has 2 blocks, 3 needed",
    ),
    "token id too large": ([seq("a", [5, 49152, 7])], "token id 49152 out of range"),
    "negative token id": ([seq("a", [5, -1])], "token id -1 out of range"),
    "block id out of range": ([seq("a", [5, 6], table=[16])], "block id 16 out of range"),
    "negative block id": ([seq("a", [5, 6], table=[-1])], "block id -1 out of range"),
    "no tokens": ([seq("a", [])], "no tokens"),
    "past max_model_len": ([seq("a", [5], start=512, table=list(range(16)))], "exceed max_model_len"),
    "duplicate request": ([seq("a", [5]), seq("a", [6], table=[3])], "appears twice"),
}


@pytest.mark.parametrize("name", list(BAD_BATCHES))
def test_bad_batch_raises_before_touching_the_cache(checked_runner: LocalExecutor, name: str):
    """Serving trusts its batches (requests are validated at admission); the debug switch checks them
    anyway, before anything is written."""
    batch, message = BAD_BATCHES[name]
    # A good entry first: its K/V must not be written either.
    batch = [seq("ok", [1, 2, 3], table=[5])] + batch
    cache = checked_runner.runner.kv_cache
    k_before = cache.k_cache.clone()
    v_before = cache.v_cache.clone()
    with pytest.raises(ValueError, match=message):
        checked_runner.step(batch)
    assert torch.equal(cache.k_cache, k_before)
    assert torch.equal(cache.v_cache, v_before)


def test_sample_false_entries_give_none(runner: LocalExecutor):
    out = runner.step(
        [
            seq("chunk", [10, 11, 12, 13, 14], table=[0, 1], sample=False),
            seq("whole", [20, 21, 22], table=[2], sample=True),
            seq("chunk2", [30, 31], table=[3], sample=False),
        ]
    )
    assert out[0] is None and out[2] is None
    assert out[1] is not None and 0 <= out[1].token_id < runner.vocab_size
    assert runner.step([seq("only-chunk", [1, 2], table=[4], sample=False)]) == [None]
    assert runner.step([]) == []


def test_logprobs_come_back_through_step(runner: LocalExecutor):
    out = runner.step([seq("a", [3, 4, 5], table=[6], logprobs=3)])[0]
    assert out.logprob is not None and out.logprob <= 0.0
    assert len(out.top_logprobs) == 3
    assert out.top_logprobs[0][0] == out.token_id  # greedy: the best token is the chosen one


def test_runner_attributes(runner: LocalExecutor, tiny_llama_dir: Path):
    assert runner.num_kv_blocks == 16
    assert runner.block_size == 4
    assert runner.max_model_len == 512
    assert runner.eos_token_ids == frozenset({2})
    assert runner.vocab_size == 49152
    assert runner.dtype == torch.float32
    assert runner.device == torch.device("cpu")
    assert Path(runner.model_path) == tiny_llama_dir
    # layers, blocks (16 and the scratch block), block, kv heads, head dim
    assert runner.runner.kv_cache.k_cache.shape == (2, 17, 4, 2, 16)


def test_eos_ids_from_generation_config_and_kv_budget(tiny_llama_dir: Path, tmp_path: Path):
    model_dir = tmp_path / "model"
    shutil.copytree(tiny_llama_dir, model_dir)
    (model_dir / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 7, 9]}))
    bytes_per_block = 2 * 2 * 16 * 2 * 16 * 4  # K+V, layers, block 16, kv heads, head dim, float32
    r = LocalExecutor(
        EngineConfig(
            model=str(model_dir),
            dtype="float32",
            device="cpu",
            kv_cache_memory=10 * bytes_per_block + 5,
            max_model_len=128,
            kv_cache_dtype="float32",
        )
    )
    assert r.eos_token_ids == frozenset({2, 7, 9})
    assert r.num_kv_blocks == 10
    assert r.runner.kv_cache.bytes_per_block == bytes_per_block
    assert r.max_model_len == 128
    with pytest.raises(ValueError, match="exceeds the model's maximum"):
        LocalExecutor(EngineConfig(model=str(model_dir), device="cpu", num_kv_blocks=4, max_model_len=4096))


def test_config_validation():
    with pytest.raises(ValueError, match="dtype"):
        EngineConfig(dtype="float64")
    with pytest.raises(ValueError, match="block_size"):
        EngineConfig(block_size=0)
    with pytest.raises(ValueError, match="parallel"):
        EngineConfig(tensor_parallel_size=0)
    with pytest.raises(ValueError, match="one process"):
        LocalExecutor(EngineConfig(tensor_parallel_size=2))


def test_auto_dtype(monkeypatch: pytest.MonkeyPatch, tiny_llama_dir: Path, tmp_path: Path):
    """float32 for a quantized model or a 16-bit checkpoint where the native kernels run (they are
    faster than bf16 at every batch size, and a 16-bit checkpoint's weights stay 16-bit there); for a
    float32 checkpoint, bf16 where the CPU has bf16 matrix units."""
    from models.kernels import cpu as cpu_kernels

    bf16_dir = tmp_path / "bf16"
    build_hf_model(tiny_llama_config()).to(torch.bfloat16).save_pretrained(bf16_dir)
    cpu = torch.device("cpu")
    for native_bf16 in (False, True):
        monkeypatch.setattr(engine_config, "cpu_has_native_bf16", lambda v=native_bf16: v)
        for source in ("default", "/some/model.Q4_K_M.gguf", None, bf16_dir):
            expect = torch.float32 if cpu_kernels.available() or not native_bf16 else torch.bfloat16
            assert resolve_dtype("auto", cpu, source) == expect
        expect = torch.bfloat16 if native_bf16 else torch.float32
        assert resolve_dtype("auto", cpu, tiny_llama_dir) == expect  # stored in float32
    # A 16-bit checkpoint whose float32 copy (held while loading, before packing) would not fit stays
    # in bfloat16 where the CPU has bf16 units.
    from models import loader

    monkeypatch.setattr(loader, "available_memory_bytes", lambda: 1 << 20)
    assert resolve_dtype("auto", cpu, bf16_dir) == torch.bfloat16
    monkeypatch.setattr(cpu_kernels, "kernels", lambda: None)  # no kernels: bf16 wherever it is native
    assert resolve_dtype("auto", cpu, "default") == torch.bfloat16
    assert resolve_dtype("bfloat16", cpu) == torch.bfloat16
    with pytest.raises(ValueError, match="float16"):
        resolve_dtype("float16", cpu)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_backends_match_sdpa(tiny_llama_dir: Path):
    from models.layers.attention import available_backends

    def mixed_step_logits(backend: str) -> torch.Tensor:
        r = LocalExecutor(
            EngineConfig(
                model=str(tiny_llama_dir),
                dtype="bfloat16",
                device="cuda",
                num_kv_blocks=32,
                attention_backend=backend,
            )
        )
        r.step(
            [
                seq("c", list(range(100, 121)), table=[4, 9]),
                seq("b", list(range(200, 210)), table=[3], sample=False),
            ]
        )
        batch = [
            seq("c", [55], start=21, table=[4, 9]),
            seq("a", list(range(300, 340)), table=[1, 7, 8]),
            seq("b", list(range(210, 230)), start=10, table=[3, 5]),
        ]
        return r.runner.logits(batch, all_tokens=True)

    reference = mixed_step_logits("sdpa")
    others = [b for b in available_backends("cuda") if b != "sdpa"]
    assert others, "no CUDA attention backend besides sdpa is available"
    for backend in others:
        torch.testing.assert_close(mixed_step_logits(backend), reference, atol=5e-2, rtol=2e-2)
