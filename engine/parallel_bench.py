"""What tensor and pipeline parallelism cost: step times of one configuration, plus the bytes each step
moves between ranks (counted from the shapes, per the layout in engine/distributed_executor.py).

    python -m engine.parallel_bench -tp 2 -pp 1 [--model default] [--batch-sizes 1,8,32]
                                    [--prompt-len 64] [--steps 16] [--dtype float32] [--json out.json]
                                    (and every engine flag of `python -m server`)

One configuration per run (a process joins one process group). Per batch size: one prefill step of
batch x prompt-len tokens, then --steps decode steps, each timed alone (submit + collect: one batch in
flight). With --pp > 1 it also runs two batches of that size kept in flight together, as the
pipelined scheduler loop does with enough requests, and reports that throughput. Medians, so a shared
machine's hiccups do not dominate.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from engine.config import EngineConfig
from engine.contract import SamplingParams, ScheduledSequence
from engine.executor import ExecutorBase
from engine.executor_factory import create_executor

GREEDY = SamplingParams(temperature=0.0, ignore_eos=True)


@dataclass
class CommVolume:
    """Bytes sent by all ranks together in one step (ring all-reduce / all-gather: 2(n-1)/n and (n-1)/n
    of the buffer per rank)."""

    control: int  # step messages (int64)
    tensor_parallel: int  # all-reduces of the activations, all-gather of the logits
    pipeline: int  # hidden states between stages, logits to the driver


def comm_volume(
    tp: int,
    pp: int,
    num_layers: int,
    hidden: int,
    vocab: int,
    act_bytes: int,
    tokens: int,
    seqs: int,
    blocks: int,
) -> CommVolume:
    msg = 8 * (8 + tokens + 3 * seqs + seqs * blocks)
    control = msg * (tp - 1 + (pp - 1) * tp)  # stage 0's broadcast, then each TP rank to its counterpart
    act = tokens * hidden * act_bytes
    # Per stage: 2 all-reduces per layer; the embedding's all-reduce on stage 0; the logits' all-gather.
    reduces = 2 * num_layers + 1
    tensor_parallel = 0
    if tp > 1:
        tensor_parallel = reduces * 2 * (tp - 1) * act + (tp - 1) * seqs * vocab * 4
    pipeline = (pp - 1) * tp * act + (seqs * vocab * 4 if pp > 1 else 0)
    return CommVolume(control, tensor_parallel, pipeline)


@dataclass
class Row:
    tp: int
    pp: int
    batch_size: int
    prompt_len: int
    prefill_ms: float
    decode_step_ms: float  # median, one batch in flight
    decode_tok_s: float
    pipelined_tok_s: float | None  # two batches of batch_size in flight (pp > 1 only)
    decode_comm: CommVolume


def seqs_for(
    first: int, batch: int, prompt_len: int, step: int, blocks_per_seq: int
) -> list[ScheduledSequence]:
    """Sequences first..first+batch-1: their prompts at step 0, then one decode token each (token ids
    are arbitrary: only the shapes matter for timing)."""
    out = []
    for i in range(first, first + batch):
        table = list(range(i * blocks_per_seq, (i + 1) * blocks_per_seq))
        if step == 0:
            tokens = [(17 + i * 31 + j * 7) % 1000 + 17 for j in range(prompt_len)]
            out.append(ScheduledSequence(f"r{i}", tokens, 0, table, True, GREEDY, tokens, []))
        else:
            out.append(
                ScheduledSequence(f"r{i}", [100 + i], prompt_len + step - 1, table, True, GREEDY, [], [])
            )
    return out


def bench_batch(
    runner: ExecutorBase, batch: int, prompt_len: int, steps: int
) -> tuple[float, list[float], float | None]:
    """(prefill seconds, decode step seconds, pipelined decode tokens/s or None)."""
    pipelined = runner.pipeline_depth > 1
    num_seqs = 2 * batch if pipelined else batch
    blocks_per_seq = -(-(prompt_len + 2 * steps + 1) // runner.block_size)
    if num_seqs * blocks_per_seq > runner.num_kv_blocks:
        raise ValueError(
            f"{num_seqs} sequences need {num_seqs * blocks_per_seq} KV blocks, the cache has "
            f"{runner.num_kv_blocks} (raise --num-kv-blocks)"
        )
    t0 = time.perf_counter()
    runner.step(seqs_for(0, batch, prompt_len, 0, blocks_per_seq))
    prefill = time.perf_counter() - t0
    times = []
    for s in range(1, steps + 1):
        t0 = time.perf_counter()
        runner.step(seqs_for(0, batch, prompt_len, s, blocks_per_seq))
        times.append(time.perf_counter() - t0)
    if not pipelined:
        return prefill, times, None
    # ORCA with 2 stages: a second batch of as many sequences, the two alternating, each submitted
    # while the other is still in the pipeline.
    runner.step(seqs_for(batch, batch, prompt_len, 0, blocks_per_seq))
    order = []
    for s in range(1, steps + 1):
        order += [seqs_for(0, batch, prompt_len, steps + s, blocks_per_seq)]
        order += [seqs_for(batch, batch, prompt_len, s, blocks_per_seq)]
    t0 = time.perf_counter()
    pending = [runner.submit(order[0])]
    for part in order[1:]:
        pending.append(runner.submit(part))
        runner.collect(pending.pop(0))
    runner.collect(pending.pop(0))
    return prefill, times, 2 * batch * steps / (time.perf_counter() - t0)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    EngineConfig.add_cli_args(p)
    p.add_argument("--batch-sizes", default="1,8,32")
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--steps", type=int, default=16)
    p.add_argument("--json", type=Path, default=None)
    p.add_argument("--threads", type=int, default=None, help="torch threads of a one-process run")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    p = build_parser()
    a = p.parse_args(argv)
    if a.threads is not None:
        torch.set_num_threads(a.threads)  # parallel runs give each rank cores / ranks threads
    config = EngineConfig.from_cli_args(a)
    runner = create_executor(config)
    try:
        hf = runner.runner.model.config
        rows = []
        for batch in (int(b) for b in a.batch_sizes.split(",")):
            prefill, times, pipelined = bench_batch(runner, batch, a.prompt_len, a.steps)
            step_ms = 1000 * statistics.median(times)
            blocks = -(-(a.prompt_len + 2 * a.steps + 1) // runner.block_size)
            comm = comm_volume(
                config.tensor_parallel_size,
                config.pipeline_parallel_size,
                hf.num_hidden_layers,
                hf.hidden_size,
                hf.vocab_size,
                4,
                batch,
                batch,
                blocks,  # Llama
            )
            rows.append(
                Row(
                    config.tensor_parallel_size,
                    config.pipeline_parallel_size,
                    batch,
                    a.prompt_len,
                    1000 * prefill,
                    step_ms,
                    1000 * batch / step_ms,
                    pipelined,
                    comm,
                )
            )
            r = rows[-1]
            piped = f"{r.pipelined_tok_s:8.1f}" if r.pipelined_tok_s is not None else "       -"
            print(
                f"tp={config.tensor_parallel_size} pp={config.pipeline_parallel_size} batch={batch:3d} prefill {r.prefill_ms:8.1f} ms  decode step "
                f"{r.decode_step_ms:7.1f} ms  {r.decode_tok_s:7.1f} tok/s  pipelined {piped} tok/s  "
                f"comm/step tp {comm.tensor_parallel / 1e6:.2f} MB pp {comm.pipeline / 1e6:.2f} MB "
                f"control {comm.control / 1e3:.1f} kB",
                flush=True,
            )
        if a.json is not None:
            a.json.write_text(json.dumps([asdict(r) for r in rows], indent=2))
    finally:
        runner.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
