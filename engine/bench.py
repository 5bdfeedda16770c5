"""Decode and prefill throughput of this engine next to Hugging Face `generate` (static batching) and
next to the memory roofline, in one run.

    python -m engine.bench [--model default | --shape llama3-8b] [--device cuda] [--batch-sizes 1,8,32,64]
                           [--new-tokens 32] [--prompt-len 64] [--prefill-lens 128,512,2048]
                           [--skip-hf] [--json out.json]

Both sides get the same model, dtype, prompts (random token ids, all of --prompt-len), greedy decoding
and exactly --new-tokens new tokens (HF: min_new_tokens so EOS cannot cut it short). Only decode is
timed, step by step: the engine times each `step()` after the prefill step; HF is timed through a
streamer, whose put() generate calls once per new token, so the gaps between puts after the first new
token are its decode steps. The first WARMUP_STEPS decode steps of every run are left out (a new batch
size may compile a kernel variant or pick a cuBLAS algorithm). Throughput is batch / median step time:
the median keeps the figure honest on a shared machine (the mean-based figure is in the JSON too).

On CUDA the engine captures CUDA graphs for the batch sizes and every batch size is measured twice,
replaying them and eagerly (`--enforce-eager`: eagerly only). Beside each figure: the roofline, the
bytes a decode step must read (weights once, every history's K/V) over the device-to-device copy
bandwidth measured at the start of the same run (engine/roofline.py). Prefill: one step of
--prefill-tokens tokens as prompts of each --prefill-lens length, engine step against HF's forward.

`--shape NAME` runs a model shape with random weights (engine/model_shapes.py, `--load-format dummy`;
HF builds the same config with its own random init): an 8B model's costs without its 16 GB of
weights. `--tiny` cuts the shape to toy sizes, which checks the whole path on a CPU in seconds.
"""

from __future__ import annotations

import argparse
import inspect
import json
import platform
import statistics
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch

from engine.config import EngineConfig, resolve_device
from engine.contract import SamplingParams, ScheduledSequence
from engine.cuda_graphs import DecodeGraphs
from engine.executor import LocalExecutor
from engine.model_shapes import SHAPES, write_shape
from engine.piecewise_graphs import PiecewiseGraphs
from engine.roofline import DecodeBytes, decode_bytes, measure_copy_bandwidth
from models.kernels import cpu as cpu_kernels
from models.weight_packing import packable_layers

GREEDY_FIXED = SamplingParams(temperature=0.0, ignore_eos=True)
WARMUP_SEQS, WARMUP_TOKENS = 2, 3  # first calls pay for kernel selection and allocator growth
WARMUP_STEPS = 2  # decode steps of each run left out of its figures
PREFILL_REPEATS = 5
GRAPHS, EAGER = "graphs", "eager"


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

    def to_json(self) -> dict:
        return {
            "decode_tok_s": self.decode_tok_s,
            "median_step_ms": self.median_step_ms,
            "mean_decode_tok_s": self.mean_decode_tok_s,
            "prefill_s": self.prefill_s,
            "decode_steps_ms": [1000 * x for x in self.decode_steps_s],
        }


@dataclass
class BenchRow:
    batch_size: int
    engine: dict[str, StepTimes]  # by mode: "graphs" (CUDA graphs replayed) and/or "eager"
    hf: StepTimes | None
    roofline_tok_s: float | None = None
    bytes_per_step: float | None = None

    @property
    def best(self) -> StepTimes:
        return self.engine[GRAPHS] if GRAPHS in self.engine else self.engine[EAGER]

    @property
    def ratio(self) -> float | None:
        """The engine (graphs where captured) over HF."""
        return self.best.decode_tok_s / self.hf.decode_tok_s if self.hf else None

    @property
    def graph_speedup(self) -> float | None:
        if GRAPHS not in self.engine or EAGER not in self.engine:
            return None
        return self.engine[GRAPHS].decode_tok_s / self.engine[EAGER].decode_tok_s

    @property
    def roofline_fraction(self) -> float | None:
        return self.best.decode_tok_s / self.roofline_tok_s if self.roofline_tok_s else None

    def to_json(self) -> dict:
        return {
            "batch_size": self.batch_size,
            "engine": self.best.to_json(),
            "engine_by_mode": {mode: t.to_json() for mode, t in self.engine.items()},
            "hf": self.hf.to_json() if self.hf else None,
            "ratio": self.ratio,
            "graph_speedup": self.graph_speedup,
            "roofline_tok_s": self.roofline_tok_s,
            "roofline_fraction": self.roofline_fraction,
            "bytes_per_step": self.bytes_per_step,
        }


@dataclass
class PrefillRow:
    prompt_len: int
    num_prompts: int
    engine_s: float  # median step time (with piecewise CUDA graphs where they were captured)
    hf_s: float | None
    eager_s: float | None = None  # the same step eagerly, where engine_s replayed piecewise graphs

    @property
    def tokens(self) -> int:
        return self.prompt_len * self.num_prompts

    def to_json(self) -> dict:
        return {
            "prompt_len": self.prompt_len,
            "num_prompts": self.num_prompts,
            "engine_tok_s": self.tokens / self.engine_s,
            "hf_tok_s": self.tokens / self.hf_s if self.hf_s else None,
            "engine_step_ms": 1000 * self.engine_s,
            "hf_forward_ms": 1000 * self.hf_s if self.hf_s else None,
            "eager_tok_s": self.tokens / self.eager_s if self.eager_s else None,
        }


@dataclass
class BenchResult:
    setup: dict[str, Any]
    rows: list[BenchRow]
    prefill: list[PrefillRow] = field(default_factory=list)

    def to_json(self) -> dict:
        return {
            "setup": self.setup,
            "rows": [r.to_json() for r in self.rows],
            "prefill": [p.to_json() for p in self.prefill],
        }


def make_prompts(batch_size: int, prompt_len: int, vocab_size: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    # Skip the low ids, where tokenizers keep their special tokens.
    return torch.randint(100, vocab_size, (batch_size, prompt_len), generator=g).tolist()


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _step_and_append(runner: LocalExecutor, batch: list[ScheduledSequence], outputs: list[list[int]]) -> None:
    for out, tok in zip(outputs, runner.step(batch), strict=True):
        assert tok is not None
        out.append(tok.token_id)


def engine_prefill(
    runner: LocalExecutor,
    prompts: list[list[int]],
    new_tokens: int,
    params: Sequence[SamplingParams] | None = None,  # per prompt; greedy by default
) -> tuple[list[list[int]], list[list[int]]]:
    """Run all prompts in one step; returns (block tables, outputs) ready for decode steps."""
    blocks_per_seq = -(-(max(len(p) for p in prompts) + new_tokens) // runner.block_size)
    tables = [list(range(i * blocks_per_seq, (i + 1) * blocks_per_seq)) for i in range(len(prompts))]
    outputs: list[list[int]] = [[] for _ in prompts]
    params = params or [GREEDY_FIXED] * len(prompts)
    batch = [
        ScheduledSequence(str(i), p, 0, tables[i], True, params[i], p, outputs[i])
        for i, p in enumerate(prompts)
    ]
    _step_and_append(runner, batch, outputs)
    return tables, outputs


def engine_decode_steps(
    runner: LocalExecutor,
    prompts: list[list[int]],
    tables: list[list[int]],
    outputs: list[list[int]],
    steps: int,
    params: Sequence[SamplingParams] | None = None,  # per prompt; greedy by default
) -> list[float]:
    """`steps` decode steps of the whole batch, appending to `outputs`; returns each step's seconds
    (building the batch included, as the scheduler's loop would pay it; each step ends when its tokens
    are on the host, so no separate synchronisation is needed)."""
    params = params or [GREEDY_FIXED] * len(prompts)
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        batch = [
            ScheduledSequence(str(i), [o[-1]], len(p) + len(o) - 1, tables[i], True, params[i], p, o)
            for i, (p, o) in enumerate(zip(prompts, outputs, strict=True))
        ]
        _step_and_append(runner, batch, outputs)
        times.append(time.perf_counter() - t0)
    return times


def engine_decode(
    runner: LocalExecutor, prompts: list[list[int]], new_tokens: int, skip: int = 0
) -> StepTimes:
    t0 = time.perf_counter()
    tables, outputs = engine_prefill(runner, prompts, new_tokens)
    prefill_s = time.perf_counter() - t0
    steps = engine_decode_steps(runner, prompts, tables, outputs, new_tokens - 1)
    return StepTimes(len(prompts), prefill_s, steps[skip:])


class _StepClock:
    """A generate() streamer that only notes when each put() (prompt, then every new token) happens."""

    def __init__(self) -> None:
        self.times: list[float] = []

    def put(self, value: torch.Tensor) -> None:
        self.times.append(time.perf_counter())

    def end(self) -> None:
        pass


def hf_decode(model, prompts: list[list[int]], new_tokens: int, pad_id: int, skip: int = 0) -> StepTimes:
    device = next(model.parameters()).device
    input_ids = torch.tensor(prompts, device=device)  # [B, prompt_len]: equal lengths, so no padding
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
    t = clock.times  # [prompt, token 1 (prefill), token 2, ..., token N]; generate copies each to the host
    assert len(t) == new_tokens + 1
    steps = [b - a for a, b in zip(t[1:-1], t[2:], strict=True)]
    return StepTimes(len(prompts), t[1] - t[0], steps[skip:])


def engine_prefill_time(runner: LocalExecutor, prompts: list[list[int]]) -> float:
    """Median seconds of one step running all `prompts` (and sampling their first tokens)."""
    times = []
    for _ in range(PREFILL_REPEATS):
        t0 = time.perf_counter()
        engine_prefill(runner, prompts, 1)
        times.append(time.perf_counter() - t0)
    return statistics.median(times[1:])  # the first may compile a variant


def hf_prefill_time(model, prompts: list[list[int]]) -> float:
    """Median seconds of HF's forward over `prompts`, with the cache generate would build and the
    logits of the last position only (as generate asks for them)."""
    device = next(model.parameters()).device
    input_ids = torch.tensor(prompts, device=device)
    kwargs: dict[str, Any] = {"use_cache": True}
    if "logits_to_keep" in inspect.signature(model.forward).parameters:
        kwargs["logits_to_keep"] = 1
    times = []
    with torch.inference_mode():
        for _ in range(PREFILL_REPEATS):
            sync(device)
            t0 = time.perf_counter()
            model(input_ids, attention_mask=torch.ones_like(input_ids), **kwargs)
            sync(device)
            times.append(time.perf_counter() - t0)
    return statistics.median(times[1:])


def bench_executor(args: argparse.Namespace, num_kv_blocks: int | None, **overrides: Any) -> LocalExecutor:
    """The executor the engine flags on a benchmark's command line describe (EngineConfig.add_cli_args),
    with a KV cache of `num_kv_blocks` (None: the flags' budget) and the model `--shape` names."""
    config = replace(EngineConfig.from_cli_args(args), num_kv_blocks=num_kv_blocks, **overrides)
    if getattr(args, "shape", None):
        config = replace(config, model=str(shape_dir(args)), load_format="dummy")
    return LocalExecutor(config)


def shape_dir(args: argparse.Namespace) -> Path:
    """The directory of the --shape model (config only), written once per process."""
    if getattr(args, "_shape_dir", None) is None:
        root = Path(tempfile.mkdtemp(prefix="orca-shape-"))
        args._shape_dir = write_shape(args.shape, root / args.shape, tiny=args.tiny)
    return args._shape_dir


def load_hf(runner: LocalExecutor, args: argparse.Namespace):
    """HF's model for the same checkpoint, or for the same shape with HF's own random weights."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from models.loader import load_hf_model

    if getattr(args, "shape", None):
        config = AutoConfig.from_pretrained(shape_dir(args))
        with torch.device(runner.device):  # built on the device: no 16 GB detour through the host
            return AutoModelForCausalLM.from_config(config, dtype=runner.dtype).eval()
    return load_hf_model(runner.model_path, runner.dtype).to(runner.device)


def modes(runner: LocalExecutor) -> list[str]:
    return [GRAPHS, EAGER] if runner.runner.decode_graphs is not None else [EAGER]


def in_mode(runner: LocalExecutor, mode: str) -> LocalExecutor:
    runner.runner.use_cuda_graphs = mode == GRAPHS
    return runner


def blocks_for(tokens: int, block_size: int) -> int:
    return -(-tokens // block_size)


def prefill_prompts(args: argparse.Namespace, length: int) -> int:
    """Prompts of `length` tokens in one prefill step: --prefill-tokens of them, at least one."""
    return max(1, args.prefill_tokens // length)


def prefill_lens(args: argparse.Namespace, device: torch.device) -> list[int]:
    text = (
        args.prefill_lens
        if args.prefill_lens is not None
        else ("128,512,2048" if device.type == "cuda" else "")
    )
    return [int(x) for x in text.split(",") if x.strip()]


def run(args: argparse.Namespace) -> BenchResult:
    batch_sizes = [int(b) for b in args.batch_sizes.split(",")]
    device = resolve_device(args.device)
    lens = prefill_lens(args, device)
    # Room for the largest batch, for the warm-up (WARMUP_SEQS sequences of WARMUP_TOKENS) and for the
    # prefill steps (--prefill-tokens in prompts of each length, one token more to sample).
    seqs = max(*batch_sizes, WARMUP_SEQS)
    blocks = [seqs * blocks_for(args.prompt_len + max(args.new_tokens, WARMUP_TOKENS), args.block_size)]
    blocks += [prefill_prompts(args, n) * blocks_for(n + 1, args.block_size) for n in lens]
    # The largest batch bounds the decode graphs' sizes, as --max-num-seqs does for a server, and the
    # largest prefill step the piecewise graphs' token counts, as --max-num-batched-tokens does.
    step_tokens = max((prefill_prompts(args, n) * n for n in lens), default=None)
    runner = bench_executor(
        args, num_kv_blocks=max(blocks), max_num_seqs=seqs, max_num_batched_tokens=step_tokens
    )
    hf = None if args.skip_hf else load_hf(runner, args)
    pad_id = min(runner.eos_token_ids) if runner.eos_token_ids else 0
    costs = decode_bytes(runner.runner.model, runner.runner.kv_cache.spec)
    bandwidth = measure_copy_bandwidth(
        device, args.bandwidth_bytes or (1 << 30 if device.type == "cuda" else 1 << 28)
    )

    # Warm-up: first calls pay for kernel selection and allocator growth.
    warm = make_prompts(WARMUP_SEQS, args.prompt_len, runner.vocab_size, seed=123)
    for mode in modes(runner):
        engine_decode(in_mode(runner, mode), warm, WARMUP_TOKENS)
    if hf is not None:
        hf_decode(hf, warm, WARMUP_TOKENS, pad_id)

    skip = WARMUP_STEPS if args.new_tokens - 1 > WARMUP_STEPS else 0
    context = args.prompt_len + args.new_tokens / 2  # the mean history of the decode steps
    rows = []
    for b in batch_sizes:
        prompts = make_prompts(b, args.prompt_len, runner.vocab_size, seed=b)
        engine = {
            mode: _pool(
                [
                    engine_decode(in_mode(runner, mode), prompts, args.new_tokens, skip)
                    for _ in range(args.repeats)
                ]
            )
            for mode in modes(runner)
        }
        hf_times = None
        if hf is not None:
            hf_times = _pool(
                [hf_decode(hf, prompts, args.new_tokens, pad_id, skip) for _ in range(args.repeats)]
            )
        rows.append(
            BenchRow(
                b, engine, hf_times, costs.roofline_tok_s(b, context, bandwidth), costs.per_step(b, context)
            )
        )

    prefill = []  # with piecewise graphs (steps with prompt tokens) and eagerly, where captured
    pieces = runner.runner.piecewise_graphs is not None
    for length in lens:
        prompts = make_prompts(prefill_prompts(args, length), length, runner.vocab_size, seed=length)
        engine_s = engine_prefill_time(in_mode(runner, GRAPHS if pieces else EAGER), prompts)
        eager_s = engine_prefill_time(in_mode(runner, EAGER), prompts) if pieces else None
        hf_s = hf_prefill_time(hf, prompts) if hf is not None else None
        prefill.append(PrefillRow(length, len(prompts), engine_s, hf_s, eager_s))
    return BenchResult(describe(args, runner, costs, bandwidth), rows, prefill)


def describe(args: argparse.Namespace, runner: LocalExecutor, costs: DecodeBytes, bandwidth: float) -> dict:
    """The run's setup, for the JSON: what ran, where, and what the roofline assumed."""
    device = runner.device

    def captured(graphs: DecodeGraphs | PiecewiseGraphs | None) -> dict[str, Any] | None:
        if graphs is None:
            return None
        stats = graphs.stats
        return {
            "sizes": list(graphs.sizes),
            "capture_s": stats.seconds if stats else None,
            "capture_mib": stats.memory_bytes / 2**20 if stats else None,
        }

    setup: dict[str, Any] = {
        "model": (args.shape + (" (tiny)" if args.tiny else "")) if args.shape else str(runner.model_path),
        "weights": "random (load_format dummy)" if args.shape else "checkpoint",
        "dtype": str(runner.dtype).removeprefix("torch."),
        "device": str(device),
        "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else cpu_name(),
        "torch": torch.__version__,
        "attention_backend": runner.runner.model.attn_backend.name,
        "cuda_graphs": captured(runner.runner.decode_graphs),
        "piecewise_graphs": captured(runner.runner.piecewise_graphs),  # token counts as sizes
        "native_kernels": device.type == "cpu" and cpu_kernels.available(),
        "packed_weights": sum(m.packed is not None for m in packable_layers(runner.runner.model)),
        "prompt_len": args.prompt_len,
        "new_tokens": args.new_tokens,
        "warmup_steps_left_out": WARMUP_STEPS,
        "repeats": args.repeats,
        "torch_threads": torch.get_num_threads(),
        "copy_bandwidth_gb_s": bandwidth / 1e9,
        "weight_bytes_per_step": costs.weight_bytes,
        "kv_bytes_per_token": costs.kv_bytes_per_token,
        "roofline_context_len": args.prompt_len + args.new_tokens / 2,
        "prefill_tokens": args.prefill_tokens,
    }
    if device.type == "cuda":
        import triton

        setup["triton"] = triton.__version__
        setup["cuda"] = torch.version.cuda
    else:
        flags = cpu_kernels.cpu_flags()
        setup["cpu_isa"] = sorted(f for f in flags if f.startswith(("avx", "amx", "fma")))
    return setup


def cpu_name() -> str:
    """The CPU's model name (/proc/cpuinfo), else what the platform module knows."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _pool(runs: list[StepTimes]) -> StepTimes:
    """Repeats of one measurement as one: every decode step, and the best prefill."""
    return StepTimes(
        runs[0].batch_size, min(r.prefill_s for r in runs), [x for r in runs for x in r.decode_steps_s]
    )


def print_table(result: BenchResult) -> None:
    from rich.console import Console
    from rich.table import Table

    setup = result.setup

    def fmt(x: float | None, spec: str, suffix: str = "") -> str:
        return "-" if x is None else format(x, spec) + suffix

    # Logs and captured output get a wide table rather than rich's 80 columns.
    console = Console(width=None if sys.stdout.isatty() else 160)
    table = Table(
        title=(
            f"decode throughput, {setup['model']} in {setup['dtype']} on {setup['device_name']} "
            f"({setup['attention_backend']}), prompt {setup['prompt_len']}, {setup['new_tokens']} new "
            f"tokens; tok/s = batch / median step; roofline at {setup['copy_bandwidth_gb_s']:.0f} GB/s copy"
        )
    )
    graphs = any(GRAPHS in r.engine for r in result.rows)
    columns = ["batch", "engine tok/s", "ms/step"]
    if graphs:
        columns += ["eager tok/s", "graphs / eager"]
    columns += ["HF tok/s", "engine / HF", "roofline tok/s", "of roofline"]
    for col in columns:
        table.add_column(col, justify="right")
    for r in result.rows:
        cells = [str(r.batch_size), fmt(r.best.decode_tok_s, ".1f"), fmt(r.best.median_step_ms, ".2f")]
        if graphs:
            eager = r.engine.get(EAGER)
            cells += [fmt(eager.decode_tok_s if eager else None, ".1f"), fmt(r.graph_speedup, ".2f", "x")]
        cells += [
            fmt(r.hf.decode_tok_s if r.hf else None, ".1f"),
            fmt(r.ratio, ".2f", "x"),
            fmt(r.roofline_tok_s, ".0f"),
            fmt(100 * r.roofline_fraction if r.roofline_fraction else None, ".0f", "%"),
        ]
        table.add_row(*cells)
    console.print(table)
    if result.prefill:
        pre = Table(title=f"prefill throughput: one step of about {setup['prefill_tokens']} prompt tokens")
        for col in ("prompt len", "prompts", "engine tok/s", "eager tok/s", "HF tok/s", "engine / HF"):
            pre.add_column(col, justify="right")
        for p in result.prefill:
            j = p.to_json()
            ratio = j["engine_tok_s"] / j["hf_tok_s"] if j["hf_tok_s"] else None
            pre.add_row(
                str(p.prompt_len),
                str(p.num_prompts),
                fmt(j["engine_tok_s"], ".0f"),
                fmt(j["eager_tok_s"], ".0f"),
                fmt(j["hf_tok_s"], ".0f"),
                fmt(ratio, ".2f", "x"),
            )
        console.print(pre)


def profile_decode(args: argparse.Namespace, batch_size: int, steps: int = 5) -> str:
    """torch.profiler's top ops (by self CPU time, or CUDA time on a GPU) over `steps` decode steps
    at one batch size."""
    from torch.profiler import ProfilerActivity, profile

    blocks_per_seq = -(-(args.prompt_len + 2 * steps + 2) // args.block_size)
    runner = bench_executor(args, num_kv_blocks=batch_size * blocks_per_seq, max_num_seqs=batch_size)
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
    p.add_argument(
        "--shape",
        choices=sorted(SHAPES),
        help="run this model shape with random weights instead of --model (HF gets the same config)",
    )
    p.add_argument("--tiny", action="store_true", help="with --shape: toy sizes of the shape (a dry run)")
    p.add_argument("--batch-sizes", default="1,8,32,64")
    p.add_argument("--new-tokens", type=int, default=32)
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--repeats", type=int, default=1, help="runs per figure (their steps are pooled)")
    p.add_argument(
        "--prefill-lens",
        default=None,
        help="prompt lengths of the prefill steps, comma-separated (default: 128,512,2048 on CUDA, none "
        "on a CPU; '' for none)",
    )
    p.add_argument(
        "--prefill-tokens",
        type=int,
        default=2048,
        help="prompt tokens in each prefill step (the default budget)",
    )
    p.add_argument(
        "--bandwidth-bytes",
        type=int,
        default=None,
        help="bytes of the copy that measures the device's bandwidth for the roofline (default: 1 GiB on "
        "CUDA, 256 MiB on a CPU; far larger than the caches either way)",
    )
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
    if args.tiny and not args.shape:
        p.error("--tiny needs --shape")

    if args.profile:
        print(profile_decode(args, args.profile))
        return
    result = run(args)
    print_table(result)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result.to_json(), indent=2))


if __name__ == "__main__":
    main()
