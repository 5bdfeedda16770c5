"""int8 activations ("exact enough" as a test): the fast path against the float32 reference on the
same quantized weights, by perplexity on a fixed text (tests/data/perplexity.txt: Python standard-
library docstrings, 2405 tokens for SmolLM2's tokenizer) and by greedy agreement on fixed prompts.

Greedy agreement is measured two ways. Free-running (each precision decodes on its own) compounds: one
near-tie flipped early changes everything after it, so it is reported, not held to a bar. Teacher-
forced (every position scored after float32's own greedy prefix: does the argmax match?) counts the
flips themselves; it is held to bf16's (torch's bfloat16 path on the same weights dequantized, the
precision GPU servers run in): int8 activations must not flip more of float32's choices than bf16 does.

The slow test runs the default model (SmolLM2-135M-Instruct Q4_1) and prints its figures; the fast one
runs a tiny GGUF-structured model."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from builders import cpu_engine_config, single_seq_logits
from kernel_marks import needs_native_kernels

from engine.contract import SamplingParams, ScheduledSequence
from engine.executor import LocalExecutor
from models.loader import load_model, load_tokenizer, resolve_model

TEXT = Path(__file__).parent.parent / "data" / "perplexity.txt"
PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain in one sentence what a hash table is.",
    "List three prime numbers greater than 10.",
    "Translate 'good morning' into Spanish.",
    "Why is the sky blue?",
    "Give me a tip for learning to cook.",
    "What does HTTP stand for?",
]
GREEDY = SamplingParams(temperature=0.0, max_tokens=10_000, ignore_eos=True)

# Teacher-forced top-1 agreement with float32's greedy continuation the default model must keep.
INT8_FORCED_AGREEMENT = 0.96


def perplexity(model, ids: list[int], window: int = 1024, kv_cache_dtype: str | None = None) -> float:
    """exp(mean NLL) over the text in consecutive windows (each scored from its second token), with
    the KV cache in the model's dtype or in a --kv-cache-dtype."""
    nll, count = 0.0, 0
    for start in range(0, len(ids) - 1, window):
        chunk = ids[start : start + window]
        if len(chunk) < 2:
            break
        logp = torch.log_softmax(single_seq_logits(model, chunk, kv_cache_dtype).double(), dim=-1)
        target = torch.tensor(chunk[1:])
        nll -= float(logp[:-1].gather(1, target.unsqueeze(1)).sum())
        count += len(chunk) - 1
    return math.exp(nll / count)


def greedy_tokens(runner: LocalExecutor, prompts: list[list[int]], new_tokens: int) -> list[list[int]]:
    """All prompts decoded together, greedily, for exactly new_tokens tokens."""
    bs = runner.block_size
    tables, start = [], 0
    for p in prompts:
        n = -(-(len(p) + new_tokens) // bs)
        tables.append(list(range(start, start + n)))
        start += n
    outputs: list[list[int]] = [[] for _ in prompts]
    batch = [ScheduledSequence(str(i), p, 0, tables[i], True, GREEDY, p, []) for i, p in enumerate(prompts)]
    for _ in range(new_tokens):
        for out, tok in zip(outputs, runner.step(batch), strict=True):
            out.append(tok.token_id)
        batch = [
            ScheduledSequence(str(i), [o[-1]], len(p) + len(o) - 1, tables[i], True, GREEDY, p, o)
            for i, (p, o) in enumerate(zip(prompts, outputs, strict=True))
        ]
    return outputs


def agreement(a: list[list[int]], b: list[list[int]]) -> tuple[float, float]:
    """(share of sequences identical throughout, mean share of tokens before the first difference)."""
    prefixes = []
    for x, y in zip(a, b, strict=True):
        same = next((i for i, (u, v) in enumerate(zip(x, y, strict=True)) if u != v), len(x))
        prefixes.append(same / len(x))
    return sum(p == 1.0 for p in prefixes) / len(prefixes), sum(prefixes) / len(prefixes)


def teacher_forced_agreement(
    model, prompts: list[list[int]], reference: list[list[int]], kv_cache_dtype: str | None = None
) -> float:
    """Share of reference tokens that are `model`'s argmax after the reference's own prefix."""
    same = total = 0
    for prompt, out in zip(prompts, reference, strict=True):
        logits = single_seq_logits(model, prompt + out, kv_cache_dtype)
        predicted = logits[len(prompt) - 1 : len(prompt) + len(out) - 1].argmax(-1).tolist()
        same += sum(a == b for a, b in zip(predicted, out, strict=True))
        total += len(out)
    return same / total


def runner_for(source: str | Path, mode: str) -> LocalExecutor:
    return LocalExecutor(cpu_engine_config(source, num_kv_blocks=256, weight_packing=mode))


def tiny_model_inputs(path: Path) -> tuple[list[int], list[list[int]]]:
    """A tiny model's perplexity text (768 tokens: windows within its 512 positions) and the first four
    PROMPTS, as its tokenizer reads them."""
    tok = load_tokenizer(path)
    return tok(TEXT.read_text())["input_ids"][:768], [tok(p)["input_ids"] for p in PROMPTS[:4]]


def default_model_inputs() -> tuple[Path, list[int], list[list[int]]]:
    """The default model's path, its perplexity text and PROMPTS as chats (its template applied)."""
    path = resolve_model("default")
    tok = load_tokenizer(path)
    chats = [
        tok.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True) for p in PROMPTS
    ]
    prompts = [list(c["input_ids"] if hasattr(c, "keys") else c) for c in chats]
    return path, tok(TEXT.read_text())["input_ids"], prompts


def compare(
    source: str | Path,
    path: Path,
    prompts: list[list[int]],
    text_ids: list[int],
    new_tokens: int,
    window: int,
):
    """Perplexities, free-running agreement and teacher-forced agreement (int8 and, for comparison,
    bf16) with float32 on the same weights."""
    models = {
        "int8": load_model(path, torch.float32, "cpu", weight_packing="int8"),
        "float32": load_model(path, torch.float32, "cpu", weight_packing="float32"),
        "bf16": load_model(path, torch.bfloat16, "cpu", weight_packing="off"),
    }
    ppl = {m: perplexity(models[m], text_ids, window) for m in ("int8", "float32")}
    outs = {m: greedy_tokens(runner_for(source, m), prompts, new_tokens) for m in ("int8", "float32")}
    forced = {m: teacher_forced_agreement(models[m], prompts, outs["float32"]) for m in ("int8", "bf16")}
    return ppl, agreement(outs["int8"], outs["float32"]), forced


@needs_native_kernels
def test_int8_close_to_float32_on_a_tiny_gguf_model(tiny_gguf_llama_dir: Path) -> None:
    text_ids, prompts = tiny_model_inputs(tiny_gguf_llama_dir)
    ppl, (identical, prefix), forced = compare(
        tiny_gguf_llama_dir, tiny_gguf_llama_dir, prompts, text_ids, 8, 256
    )
    assert abs(ppl["int8"] / ppl["float32"] - 1) < 0.01, ppl
    assert forced["int8"] >= forced["bf16"], forced


@pytest.mark.slow
@needs_native_kernels
def test_int8_close_to_float32_on_the_default_model() -> None:
    path, text_ids, prompts = default_model_inputs()
    ppl, (identical, prefix), forced = compare("default", path, prompts, text_ids, 32, 1024)
    print(
        f"\nperplexity over {len(text_ids)} tokens: float32 {ppl['float32']:.4f}, int8 {ppl['int8']:.4f} "
        f"({100 * (ppl['int8'] / ppl['float32'] - 1):+.2f}%); greedy, {len(prompts)} prompts x 32 tokens: "
        f"{identical:.0%} identical, {prefix:.0%} of tokens before the first difference; "
        f"teacher-forced top-1 agreement: int8 {forced['int8']:.1%}, bf16 {forced['bf16']:.1%}"
    )
    assert abs(ppl["int8"] / ppl["float32"] - 1) < 0.01
    # A fixed bar: int8's figures are the same on every ISA variant (97.3% measured on an AMX Xeon and
    # an AVX2 EPYC), bf16's are not (96.1% where AMX/AVX512-BF16 multiply in bf16, 98.8% on AVX2,
    # where torch widens bf16 matmuls to float32), so bf16 is printed beside it, not compared.
    assert forced["int8"] >= INT8_FORCED_AGREEMENT, forced
