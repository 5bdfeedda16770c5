"""The engine against transformers: one mixed selective-batching step gives the per-sequence logits,
and greedy generation of many prompts batched together gives each prompt's solo `generate`."""

from __future__ import annotations

import random
from collections.abc import Sequence
from pathlib import Path

import pytest
import torch
from builders import cpu_engine_config, cuda_engine_config

from engine.config import EngineConfig
from engine.contract import SamplingParams, ScheduledSequence
from engine.executor import LocalExecutor

BLOCK_SIZE = 4  # small, so sequences cross many block boundaries


def hf_model(path: Path):
    from models.loader import load_hf_model

    return load_hf_model(path, torch.float32)


def hf_logits(model, token_ids: Sequence[int]) -> torch.Tensor:
    """[len, vocab] logits of one sequence run alone."""
    with torch.inference_mode():
        return model(torch.tensor([list(token_ids)])).logits[0].float()


def hf_generate(model, prompt: Sequence[int], new_tokens: int) -> list[int]:
    with torch.inference_mode():
        out = model.generate(
            torch.tensor([list(prompt)]),
            attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
            max_new_tokens=new_tokens,
            min_new_tokens=new_tokens,  # EOS banned until then, as SamplingParams.min_tokens does
            do_sample=False,
            pad_token_id=0,
        )
    return out[0, len(prompt) :].tolist()


@pytest.fixture(
    params=[
        "llama",
        "gpt2",
        "gguf-llama",
        "gemma3",
        "mistral-window",
        "qwen3",
        "phi3",
        "qwen3-moe",
        "mixtral",
        "olmoe",
        "qwen2-moe",
    ]
)
def model_dir(request) -> Path:
    """gguf-llama and gemma3 have GGUF-structured weights, so the runner packs them
    (models/weight_packing.py) and the quantized-linear kernel runs every matmul where it builds
    (float32 activations: the parity reference; int8 activations are checked against float32 in
    test_quantized_accuracy.py). gemma3's local layers and mistral-window's layers have windows (8 and
    6 tokens) shorter than most prompts here, and the generations run past them. qwen3 has q/k norms;
    phi3 is Phi-4-mini-like (fused qkv and gate/up, partial rotary, LongRoPE). The mixtures of experts
    (qwen3-moe, mixtral, olmoe, qwen2-moe with its shared expert) group every request's tokens by
    expert: batching must not change any request's tokens."""
    fixture = {
        "llama": "tiny_llama_dir",
        "gpt2": "tiny_gpt2_dir",
        "gguf-llama": "tiny_gguf_llama_dir",
        "gemma3": "tiny_gemma3_dir",
        "mistral-window": "tiny_mistral_window_dir",
        "qwen3": "tiny_qwen3_dir",
        "phi3": "tiny_phi3_dir",
        "qwen3-moe": "tiny_qwen3_moe_dir",
        "mixtral": "tiny_mixtral_dir",
        "olmoe": "tiny_olmoe_dir",
        "qwen2-moe": "tiny_qwen2_moe_dir",
    }[request.param]
    return request.getfixturevalue(fixture)


def make_runner(path: Path | str, backend: str = "auto", num_blocks: int = 128) -> LocalExecutor:
    config = cpu_engine_config(
        path,
        block_size=BLOCK_SIZE,
        num_kv_blocks=num_blocks,
        attention_backend=backend,
        weight_packing="float32",
    )
    return LocalExecutor(config)


@pytest.mark.parametrize("backend", ["sdpa", "cpu-decode"])
def test_one_mixed_step_matches_per_sequence_forward(model_dir: Path, backend: str):
    runner = make_runner(model_dir, backend)
    hf = hf_model(model_dir)
    rng = random.Random(0)
    prompt_a = [rng.randrange(3, 49152) for _ in range(11)]
    prompt_b = [rng.randrange(3, 49152) for _ in range(13)]
    prompt_c = [rng.randrange(3, 49152) for _ in range(9)]
    # Scattered, non-contiguous blocks; each table covers the sequence's tokens.
    table_a, table_b, table_c = [9, 3, 14], [2, 11, 5, 20], [7, 1, 12]
    greedy = SamplingParams(temperature=0.0)

    # Earlier step: C's whole prompt (samples its first token) and B's first chunk.
    first = runner.step(
        [
            ScheduledSequence("c", prompt_c, 0, table_c, True, greedy),
            ScheduledSequence("b", prompt_b[:5], 0, table_b, False, greedy),
        ]
    )
    assert first[1] is None
    c_token = first[0].token_id
    assert c_token == int(hf_logits(hf, prompt_c)[-1].argmax())

    # The mixed step: a decode token of C, all of A's prompt, the next chunk of B's prompt.
    mixed = [
        ScheduledSequence("c", [c_token], len(prompt_c), table_c, True, greedy),
        ScheduledSequence("a", prompt_a, 0, table_a, True, greedy),
        ScheduledSequence("b", prompt_b[5:10], 5, table_b, False, greedy),
    ]
    got = runner.runner.logits(mixed, all_tokens=True)  # [1 + 11 + 5, vocab]
    assert got.shape == (17, hf.config.vocab_size)
    expect = torch.cat(
        [
            hf_logits(hf, prompt_c + [c_token])[-1:],
            hf_logits(hf, prompt_a),
            hf_logits(hf, prompt_b[:10])[5:10],
        ]
    )
    torch.testing.assert_close(got, expect, atol=1e-4, rtol=0)


def generate_batched(
    runner: LocalExecutor, prompts: list[list[int]], new_tokens: int, chunk: int
) -> list[list[int]]:
    """A minimal iteration-level loop: decodes first, then prompt chunks of at most `chunk` tokens."""
    blocks_per_seq = -(-(max(map(len, prompts)) + new_tokens) // runner.block_size)
    tables = [list(range(i * blocks_per_seq, (i + 1) * blocks_per_seq)) for i in range(len(prompts))]
    params = SamplingParams(temperature=0.0, min_tokens=new_tokens, max_tokens=new_tokens)
    done_prompt = [0] * len(prompts)  # prompt tokens already in the cache
    outputs: list[list[int]] = [[] for _ in prompts]
    while any(len(o) < new_tokens for o in outputs):
        batch: list[ScheduledSequence] = []
        for i, p in enumerate(prompts):  # decodes first, as the scheduler orders them
            if done_prompt[i] == len(p) and len(outputs[i]) < new_tokens:
                ctx = len(p) + len(outputs[i]) - 1
                batch.append(
                    ScheduledSequence(str(i), [outputs[i][-1]], ctx, tables[i], True, params, p, outputs[i])
                )
        for i, p in enumerate(prompts):
            if done_prompt[i] < len(p):
                end = min(len(p), done_prompt[i] + chunk)
                batch.append(
                    ScheduledSequence(
                        str(i),
                        p[done_prompt[i] : end],
                        done_prompt[i],
                        tables[i],
                        end == len(p),
                        params,
                        p,
                        outputs[i],
                    )
                )
        results = runner.step(batch)
        for seq, res in zip(batch, results, strict=True):
            i = int(seq.request_id)
            if seq.start_position < len(prompts[i]):
                done_prompt[i] = seq.context_len
            if res is not None:
                outputs[i].append(res.token_id)
    return outputs


def test_batched_greedy_generation_equals_solo_generate(model_dir: Path):
    runner = make_runner(model_dir)
    hf = hf_model(model_dir)
    rng = random.Random(1)
    prompts = [[rng.randrange(3, 49152) for _ in range(n)] for n in (3, 17, 8, 1, 12, 25, 5, 9)]
    got = generate_batched(runner, prompts, new_tokens=8, chunk=10)
    for prompt, tokens in zip(prompts, got, strict=True):
        assert tokens == hf_generate(hf, prompt, 8)


@pytest.mark.slow
def test_default_model_batched_greedy_equals_solo_generate():
    from models.loader import load_tokenizer

    # float32 activations: the parity reference (the default, int8 activations, is held to float32 by
    # tests/models/test_quantized_accuracy.py instead).
    runner = LocalExecutor(
        EngineConfig(
            model="default",
            dtype="float32",
            device="cpu",
            num_kv_blocks=256,
            weight_packing="float32",
            kv_cache_dtype="float32",
        )
    )
    hf = hf_model(runner.model_path)
    tok = load_tokenizer(runner.model_path)
    texts = [
        "The capital of France is",
        "def fibonacci(n):",
        "Once upon a time, in a small village by the sea,",
        "List three colours:",
        "The quick brown fox",
        "Water boils at",
        "Explain selective batching in one sentence.",
        "1, 2, 3, 4,",
    ]
    prompts = [tok(t)["input_ids"] for t in texts]
    got = generate_batched(runner, prompts, new_tokens=16, chunk=64)
    for prompt, tokens in zip(prompts, got, strict=True):
        assert tokens == hf_generate(hf, prompt, 16)


# ------------------------------------------------------------------------------------------ CUDA

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def hf_generate_on(model, prompt: Sequence[int], new_tokens: int, device: str) -> list[int]:
    """hf_generate with the model and its inputs on `device`."""
    with torch.inference_mode():
        out = model.generate(
            torch.tensor([list(prompt)], device=device),
            attention_mask=torch.ones(1, len(prompt), dtype=torch.long, device=device),
            max_new_tokens=new_tokens,
            min_new_tokens=new_tokens,
            do_sample=False,
            pad_token_id=0,
        )
    return out[0, len(prompt) :].tolist()


@pytest.mark.cuda
@cuda
def test_every_family_on_cuda_with_graphs_equals_solo_generate(model_dir: Path):
    """What serving runs on a GPU (the Triton attention, decode steps in CUDA graphs of 1-8 rows, steps
    with prompt chunks in piecewise graphs of 16-64 tokens), in float32 so that it can be held to
    transformers on the same GPU token for token: the sliding windows of gemma3 and mistral-window in
    the compiled kernel, qwen3's q/k norms and phi3's partial rotary in the fused small ops, the
    mixtures of experts in the fused Triton experts."""
    runner = LocalExecutor(
        cuda_engine_config(model_dir, block_size=BLOCK_SIZE, num_kv_blocks=128, max_num_batched_tokens=64)
    )
    assert runner.runner.use_cuda_graphs and runner.runner.piecewise_graphs is not None
    hf = hf_model(model_dir).to("cuda")
    rng = random.Random(1)
    prompts = [[rng.randrange(3, 49152) for _ in range(n)] for n in (3, 17, 8, 1, 12, 25, 5, 9)]
    got = generate_batched(runner, prompts, new_tokens=8, chunk=10)
    for prompt, tokens in zip(prompts, got, strict=True):
        assert tokens == hf_generate_on(hf, prompt, 8, "cuda"), f"prompt of {len(prompt)} tokens"
