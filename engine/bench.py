"""Decode throughput of this engine next to Hugging Face `generate` (static batching), in one run.

    python -m engine.bench [--dtype auto] [--batch-sizes 1,8,32,64] [--new-tokens 32] [--prompt-len 64]
                           [--skip-hf] [--json out.json]

Both sides get the same model, dtype, prompts (random token ids, all of --prompt-len), greedy decoding
and exactly --new-tokens new tokens (HF: min_new_tokens so EOS cannot cut it short). Only decode is
timed, step by step: the engine times each `step()` after the prefill step; HF is timed through a
streamer, whose put() generate calls once per new token, so the gaps between puts after the first new
token are its decode steps. Throughput is batch / median step time: the median keeps the figure
honest on a shared machine where other processes steal a few steps (the mean-based figure is in the
JSON too).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from engine.config import EngineConfig
from engine.contract import SamplingParams, ScheduledSequence
from engine.executor import LocalExecutor
from models.kernels import cpu as cpu_kernels
from models.weight_packing import packable_layers

GREEDY_FIXED = SamplingParams(temperature=0.0, ignore_eos=True)
WARMUP_SEQS, WARMUP_TOKENS = 2, 3  # first calls pay for kernel selection and allocator growth


@dataclass
class StepTimes:
    """Per-step wall times (seconds) of one side at one batch size."""

    batch_size: int
    prefill_s: float
    decode_steps_s: list[float]

    @property
    def median_step_ms(self) -> float:
        return 1000 * statistics.median(self.decode_steps_s)

    @property
    def decode_tok_s(self) -> float:
        """batch / median decode step."""
        return 1000 * self.batch_size / self.median_step_ms

    @property
    def mean_decode_tok_s(self) -> float:
        return self.batch_size * len(self.decode_steps_s) / sum(self.decode_steps_s)


@dataclass
class BenchRow:
    batch_size: int
    engine: StepTimes
    hf: StepTimes | None

    @property
    def ratio(self) -> float | None:
        return self.engine.decode_tok_s / self.hf.decode_tok_s if self.hf else None

    def to_json(self) -> dict:
        def side(t: StepTimes | None) -> dict | None:
            if t is None:
                return None
            return {
                "decode_tok_s": t.decode_tok_s,
                "median_step_ms": t.median_step_ms,
                "mean_decode_tok_s": t.mean_decode_tok_s,
                "prefill_s": t.prefill_s,
                "decode_steps_ms": [1000 * x for x in t.decode_steps_s],
            }

        return {
            "batch_size": self.batch_size,
            "engine": side(self.engine),
            "hf": side(self.hf),
            "ratio": self.ratio,
        }


def make_prompts(batch_size: int, prompt_len: int, vocab_size: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    # Skip the low ids, where tokenizers keep their special tokens.
    return torch.randint(100, vocab_size, (batch_size, prompt_len), generator=g).tolist()


def engine_prefill(
    runner: LocalExecutor, prompts: list[list[int]], new_tokens: int
) -> tuple[list[list[int]], list[list[int]]]:
    """Run all prompts in one step; returns (block tables, outputs) ready for decode steps."""
    blocks_per_seq = -(-(len(prompts[0]) + new_tokens) // runner.block_size)
    tables = [list(range(i * blocks_per_seq, (i + 1) * blocks_per_seq)) for i in range(len(prompts))]
    outputs: list[list[int]] = [[] for _ in prompts]
    first = runner.step(
        [
            ScheduledSequence(str(i), p, 0, tables[i], True, GREEDY_FIXED, p, outputs[i])
            for i, p in enumerate(prompts)
        ]
    )
    for out, tok in zip(outputs, first, strict=True):
        assert tok is not None
        out.append(tok.token_id)
    return tables, outputs


def engine_decode_steps(
    runner: LocalExecutor,
    prompts: list[list[int]],
    tables: list[list[int]],
    outputs: list[list[int]],
    steps: int,
) -> list[float]:
    """`steps` decode steps of the whole batch, appending to `outputs`; returns each step's seconds
    (building the batch included, as the scheduler's loop would pay it)."""
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        batch = [
            ScheduledSequence(str(i), [o[-1]], len(p) + len(o) - 1, tables[i], True, GREEDY_FIXED, p, o)
            for i, (p, o) in enumerate(zip(prompts, outputs, strict=True))
        ]
        for out, tok in zip(outputs, runner.step(batch), strict=True):
            assert tok is not None
            out.append(tok.token_id)
        times.append(time.perf_counter() - t0)
    return times


def engine_decode(runner: LocalExecutor, prompts: list[list[int]], new_tokens: int) -> StepTimes:
    t0 = time.perf_counter()
    tables, outputs = engine_prefill(runner, prompts, new_tokens)
    prefill_s = time.perf_counter() - t0
    steps = engine_decode_steps(runner, prompts, tables, outputs, new_tokens - 1)
    return StepTimes(len(prompts), prefill_s, steps)


class _StepClock:
    """A generate() streamer that only notes when each put() (prompt, then every new token) happens."""

    def __init__(self) -> None:
        self.times: list[float] = []

    def put(self, value: torch.Tensor) -> None:
        self.times.append(time.perf_counter())

    def end(self) -> None:
        pass


def hf_decode(model, prompts: list[list[int]], new_tokens: int, pad_id: int) -> StepTimes:
    input_ids = torch.tensor(prompts)  # [B, prompt_len]: equal lengths, so no padding
    clock = _StepClock()
    with torch.inference_mode():
        out = model.generate(
            input_ids,
            attention_mask=torch.ones_like(input_ids),
            max_new_tokens=new_tokens,
            min_new_tokens=new_tokens,
            do_sample=False,
            pad_token_id=pad_id,
            streamer=clock,
        )
    assert out.shape[1] == input_ids.shape[1] + new_tokens
    t = clock.times  # [prompt, token 1 (prefill), token 2, ..., token N]
    assert len(t) == new_tokens + 1
    return StepTimes(len(prompts), t[1] - t[0], [b - a for a, b in zip(t[1:-1], t[2:], strict=True)])


def bench_executor(args: argparse.Namespace, num_kv_blocks: int | None) -> LocalExecutor:
    """The executor the engine flags on a benchmark's command line describe (EngineConfig.add_cli_args),
    with a KV cache of `num_kv_blocks` (None: the flags' budget). Shared with scheduler.bench."""
    return LocalExecutor(replace(EngineConfig.from_cli_args(args), num_kv_blocks=num_kv_blocks))


def run(args: argparse.Namespace) -> tuple[list[BenchRow], dict]:
    batch_sizes = [int(b) for b in args.batch_sizes.split(",")]
    # Room for the largest batch and for the warm-up (WARMUP_SEQS sequences of WARMUP_TOKENS).
    seqs = max(*batch_sizes, WARMUP_SEQS)
    max_tokens = seqs * (-(-(args.prompt_len + max(args.new_tokens, WARMUP_TOKENS)) // args.block_size))
    runner = bench_executor(args, num_kv_blocks=max_tokens)
    hf = None
    if not args.skip_hf:
        from transformers import AutoModelForCausalLM

        hf = (
            AutoModelForCausalLM.from_pretrained(runner.model_path, dtype=runner.dtype)
            .to(runner.device)
            .eval()
        )
    pad_id = min(runner.eos_token_ids) if runner.eos_token_ids else 0

    # Warm-up: first calls pay for kernel selection and allocator growth.
    warm = make_prompts(WARMUP_SEQS, args.prompt_len, runner.vocab_size, seed=123)
    engine_decode(runner, warm, WARMUP_TOKENS)
    if hf is not None:
        hf_decode(hf, warm, WARMUP_TOKENS, pad_id)

    rows = []
    for b in batch_sizes:
        prompts = make_prompts(b, args.prompt_len, runner.vocab_size, seed=b)
        engine = _pool([engine_decode(runner, prompts, args.new_tokens) for _ in range(args.repeats)])
        hf_times = None
        if hf is not None:
            hf_times = _pool([hf_decode(hf, prompts, args.new_tokens, pad_id) for _ in range(args.repeats)])
        rows.append(BenchRow(b, engine, hf_times))
    setup = {
        "model": str(runner.model_path),
        "dtype": str(runner.dtype).removeprefix("torch."),
        "device": str(runner.device),
        "attention_backend": runner.runner.model.attn_backend.name,
        "native_kernels": cpu_kernels.available() and runner.device.type == "cpu",
        "packed_weights": sum(m.packed is not None for m in packable_layers(runner.runner.model)),
        "prompt_len": args.prompt_len,
        "new_tokens": args.new_tokens,
        "repeats": args.repeats,
        "torch_threads": torch.get_num_threads(),
    }
    return rows, setup


def _pool(runs: list[StepTimes]) -> StepTimes:
    """Repeats of one measurement as one: every decode step, and the best prefill."""
    return StepTimes(
        runs[0].batch_size, min(r.prefill_s for r in runs), [x for r in runs for x in r.decode_steps_s]
    )


def print_table(rows: list[BenchRow], setup: dict) -> None:
    from rich.console import Console
    from rich.table import Table

    def fmt(x: float | None, spec: str) -> str:
        return "-" if x is None else format(x, spec)

    table = Table(
        title=(
            f"decode throughput, {setup['dtype']} on {setup['device']} ({setup['attention_backend']}, "
            f"native kernels {'on' if setup['native_kernels'] else 'off'}, "
            f"{setup['packed_weights']} packed weights), "
            f"prompt {setup['prompt_len']}, {setup['new_tokens']} new tokens; tok/s = batch / median step"
        )
    )
    for col in ("batch", "engine tok/s", "engine ms/step", "HF tok/s", "HF ms/step", "engine / HF"):
        table.add_column(col, justify="right")
    for r in rows:
        table.add_row(
            str(r.batch_size),
            fmt(r.engine.decode_tok_s, ".1f"),
            fmt(r.engine.median_step_ms, ".1f"),
            fmt(r.hf.decode_tok_s if r.hf else None, ".1f"),
            fmt(r.hf.median_step_ms if r.hf else None, ".1f"),
            fmt(r.ratio, ".2f") + ("x" if r.ratio else ""),
        )
    Console().print(table)


def profile_decode(args: argparse.Namespace, batch_size: int, steps: int = 5) -> str:
    """torch.profiler's top ops (by self CPU time) over `steps` decode steps at one batch size."""
    from torch.profiler import ProfilerActivity, profile

    blocks_per_seq = -(-(args.prompt_len + 2 * steps + 2) // args.block_size)
    runner = bench_executor(args, num_kv_blocks=batch_size * blocks_per_seq)
    prompts = make_prompts(batch_size, args.prompt_len, runner.vocab_size, seed=batch_size)
    tables, outputs = engine_prefill(runner, prompts, 2 * steps + 1)
    engine_decode_steps(runner, prompts, tables, outputs, steps)  # warm-up
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if runner.device.type == "cuda" else [])
    with profile(activities=activities) as prof, cpu_kernels.labelled_for_profiler():
        engine_decode_steps(runner, prompts, tables, outputs, steps)
    sort_by = "self_cuda_time_total" if runner.device.type == "cuda" else "self_cpu_time_total"
    return prof.key_averages().table(sort_by=sort_by, row_limit=15)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m engine.bench", description=__doc__.split("\n\n")[0])
    EngineConfig.add_cli_args(p)
    p.add_argument("--batch-sizes", default="1,8,32,64")
    p.add_argument("--new-tokens", type=int, default=32)
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--repeats", type=int, default=1, help="runs per figure (their steps are pooled)")
    p.add_argument("--skip-hf", action="store_true", help="engine only")
    p.add_argument("--json", type=Path, help="also write the figures here")
    p.add_argument(
        "--profile", type=int, metavar="BATCH", help="only profile decode steps at this batch size"
    )
    return p


def main(argv: list[str] | None = None) -> None:
    p = build_parser()
    args = p.parse_args(argv)
    if args.new_tokens < 2:
        p.error("--new-tokens must be at least 2 (one prefill token plus decode steps)")

    if args.profile:
        print(profile_decode(args, args.profile))
        return
    rows, setup = run(args)
    print_table(rows, setup)
    if args.json:
        payload = {"setup": setup, "rows": [r.to_json() for r in rows]}
        args.json.write_text(json.dumps(payload, indent=2))


if __name__ == "__main__":
    main()
