"""Overlapped scheduling over the real engine (LocalExecutor, a tiny random Llama): byte-identical
output with --overlap-schedule on and off, request for request, in one batch of everything the loop
treats differently (carried decodes, sampler penalties and seeds that read the carried outputs,
logprobs, stop tokens seen one step late, grammars (their matchers advanced past carried tokens), speculation,
preemption, shared prefixes), and every KV block back."""

from __future__ import annotations

import asyncio
import json
from dataclasses import replace
from pathlib import Path

import pytest
from builders import cpu_engine_config
from waiting import wait_until

from engine.contract import SamplingParams
from engine.executor import LocalExecutor
from engine.grammar import GrammarCompiler, GrammarSpec
from scheduler.config import SchedulerConfig
from scheduler.loop import IterationLoop
from scheduler.outputs import FinishReason

GUARD_S = 300
# A finite JSON language (bounded length): even a random model's output ends within max_tokens.
SCHEMA = {
    "type": "object",
    "properties": {
        "colour": {"enum": ["red", "green", "blue"]},
        "n": {"type": "integer", "minimum": 0, "maximum": 999},
    },
    "required": ["colour", "n"],
    "additionalProperties": False,
}


def prompt(n: int, seed: int) -> list[int]:
    return [20 + (seed * 977 + i * 131) % 40000 for i in range(n)]


@pytest.fixture(scope="module")
def runners(tiny_llama_dir: Path) -> dict[str, LocalExecutor]:
    return {
        "roomy": LocalExecutor(cpu_engine_config(tiny_llama_dir, block_size=4, num_kv_blocks=256)),
        "tight": LocalExecutor(cpu_engine_config(tiny_llama_dir, block_size=4, num_kv_blocks=24)),
    }


async def run(runner: LocalExecutor, config: SchedulerConfig, specs) -> list[tuple]:
    loop = IterationLoop(runner, config)
    await loop.start()

    async def one(rid: str, tokens: list[int], params: SamplingParams) -> tuple:
        deltas = [d async for d in loop.generate(tokens, params, rid)]
        logprobs = [(t.token_id, t.logprob) for d in deltas for t in d.logprobs or ()]
        return [t for d in deltas for t in d.token_ids], deltas[-1].finish_reason, deltas[-1].error, logprobs

    try:
        out = await asyncio.wait_for(asyncio.gather(*(one(*s) for s in specs)), GUARD_S)
        assert loop.stats().kv_blocks_used == 0
        return list(out)
    finally:
        await loop.shutdown()


def mixed_batch(
    stop_id: int, grammar_params: tuple[SamplingParams, SamplingParams]
) -> list[tuple[str, list[int], SamplingParams]]:
    greedy = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    shared = prompt(13, 9)
    return [
        ("plain", prompt(7, 0), greedy),
        ("short", prompt(11, 1), replace(greedy, max_tokens=3)),
        ("stop id", prompt(7, 0), replace(greedy, stop_token_ids=(stop_id,))),
        ("logprobs", prompt(9, 2), replace(greedy, logprobs=3)),
        ("penalties", prompt(9, 3), replace(greedy, repetition_penalty=1.3, frequency_penalty=0.7)),
        ("seeded", prompt(8, 4), replace(greedy, temperature=0.9, seed=7)),
        ("grammar", prompt(6, 5), grammar_params[0]),
        ("schema", prompt(6, 6), grammar_params[1]),
        ("shared a", [*shared, 5], greedy),
        ("shared b", [*shared, 6], greedy),
    ]


@pytest.mark.parametrize(
    "runner_name, config",
    [
        ("roomy", SchedulerConfig(speculative="off")),
        ("roomy", SchedulerConfig(speculative="ngram", max_num_batched_tokens=64, max_num_seqs=8)),
        ("tight", SchedulerConfig(speculative="off", max_num_seqs=5)),  # preemptions
    ],
    ids=["plain", "ngram-chunked", "preemption"],
)
async def test_the_same_output_with_overlap_on_and_off(runners, tokenizer, runner_name, config):
    runner = runners[runner_name]
    (reference,) = await run(
        runner,
        replace(config, overlap_schedule=False),
        mixed_batch(-1, (SamplingParams(), SamplingParams()))[:1],
    )
    plain = reference[0]
    # The first token of "plain" that is not its first: "stop id" stops there, in the middle of the run.
    stop_id = next(t for t in plain if t != plain[0])
    stop_at = plain.index(stop_id) + 1
    compiler = GrammarCompiler(tokenizer.hf, runner.vocab_size, sorted(runner.eos_token_ids))
    specs = [
        GrammarSpec.choice(["alpha", "beta gamma", "delta"]),
        GrammarSpec.json_schema(SCHEMA, any_whitespace=False),
    ]

    def batch():
        # Fresh matchers for every run: a matcher keeps its request's position in the grammar.
        grammars = [
            SamplingParams(temperature=0.0, max_tokens=40, grammar=compiler.compile(spec).new_matcher())
            for spec in specs
        ]
        return mixed_batch(stop_id, (grammars[0], grammars[1]))

    sync = await run(runner, replace(config, overlap_schedule=False), batch())
    overlapped = await run(runner, replace(config, overlap_schedule=True), batch())
    # Tokens, finish reasons and errors exactly; logprob values to float32 noise: the tiny float32
    # model's linears run in torch's matmul, whose rows can move by an ulp with the batch's row count,
    # and the two modes batch differently (the packed GGUF kernels are batch-invariant; their own
    # tests say so bit for bit).
    assert [o[:3] for o in overlapped] == [o[:3] for o in sync]
    for got, want in zip(overlapped, sync, strict=True):
        assert [t for t, _ in got[3]] == [t for t, _ in want[3]]
        assert [lp for _, lp in got[3]] == pytest.approx([lp for _, lp in want[3]], abs=1e-5)
    by_id = dict(zip([s[0] for s in batch()], sync, strict=True))
    assert by_id["plain"][0] == plain and by_id["stop id"][0] == plain[:stop_at] and stop_at < len(plain)
    assert all(r[2] is None for r in sync)
    assert by_id["schema"][1] is FinishReason.STOP and json.loads(tokenizer.decode(by_id["schema"][0]))


@pytest.mark.parametrize("carriable_only", [True, False], ids=["carriable", "mixed"])
async def test_tokens_carried_on_the_device_give_the_same_output(
    runners, tokenizer, monkeypatch, carriable_only
):
    """As on a GPU: the executor samples in submit() (samples_ahead, turned on here on a CPU), the loop
    queues each step before collecting the one before, and carried rows read their tokens from that
    step's draws on the device (engine.contract.DeviceCarry). Rows that read their outputs (penalties,
    grammars) are not carried that way: their steps put the tokens in on the host. The output is the
    synchronous loop's, request for request."""
    runner = runners["roomy"]
    config = SchedulerConfig(speculative="off")
    compiler = GrammarCompiler(tokenizer.hf, runner.vocab_size, sorted(runner.eos_token_ids))
    stop_id = 20

    def batch():
        grammars = [
            SamplingParams(temperature=0.0, max_tokens=40, grammar=compiler.compile(spec).new_matcher())
            for spec in (GrammarSpec.choice(["alpha", "beta"]), GrammarSpec.json_schema(SCHEMA))
        ]
        specs = mixed_batch(stop_id, (grammars[0], grammars[1]))
        if carriable_only:
            specs = [s for s in specs if not s[2].reads_outputs]
        return specs

    sync = await run(runner, replace(config, overlap_schedule=False), batch())
    carried: list[int] = []
    collected: list = []  # the handles themselves: an id could be reused once one is freed
    submit, collect = runner.submit, runner.collect

    def counting_submit(seqs, carry=None):
        if carry is None:
            return submit(seqs)
        # Queued behind a step that is not collected yet: what lets a GPU go on without the host.
        assert not any(h is carry.handle for h in collected)
        carried.append(len(carry.rows))
        return submit(seqs, carry=carry)

    def noting_collect(handle):
        collected.append(handle)
        return collect(handle)

    monkeypatch.setattr(runner, "samples_ahead", True)
    monkeypatch.setattr(runner, "submit", counting_submit)
    monkeypatch.setattr(runner, "collect", noting_collect)
    overlapped = await run(runner, replace(config, overlap_schedule=True), batch())
    assert [o[:3] for o in overlapped] == [o[:3] for o in sync]
    for got, want in zip(overlapped, sync, strict=True):
        assert [t for t, _ in got[3]] == [t for t, _ in want[3]]
        assert [lp for _, lp in got[3]] == pytest.approx([lp for _, lp in want[3]], abs=1e-5)
    if carriable_only:
        # Most steps carried their decodes, most of the batch at once (a request that its next token
        # ends by max_tokens waits for it instead).
        assert len(carried) >= 10 and max(carried) >= len(batch()) - 2


async def test_a_client_that_leaves_while_its_tokens_are_carried_frees_its_blocks(runners, monkeypatch):
    """Tokens carried on the device, and the client of one request leaves mid-stream: its rows already
    queued run for nothing, its blocks come back, and the other request's tokens are its own."""
    runner = runners["roomy"]
    config = SchedulerConfig(speculative="off", overlap_schedule=True)
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    (alone,) = await run(runner, replace(config, overlap_schedule=False), [("staying", prompt(9, 1), params)])
    monkeypatch.setattr(runner, "samples_ahead", True)
    loop = IterationLoop(runner, config)
    await loop.start()
    try:
        leaving = loop.generate(prompt(7, 0), params, "leaving")
        staying = loop.generate(prompt(9, 1), params, "staying")

        async def leave() -> None:
            got = 0
            async for delta in leaving:
                got += len(delta.token_ids)
                if got >= 3:
                    break
            await leaving.aclose()

        async def stay() -> list[int]:
            return [t async for d in staying for t in d.token_ids]

        _, tokens = await asyncio.wait_for(asyncio.gather(leave(), stay()), GUARD_S)
        await wait_until(lambda: loop.stats().kv_blocks_used == 0 and loop.stats().running == 0)
    finally:
        await loop.shutdown()
    assert tokens == alone[0]


def test_the_tpot_tool_prints_the_bare_step_and_both_modes(tiny_llama_dir: Path, tmp_path: Path, capsys):
    from loadtest import tpot

    out = tmp_path / "rows.json"
    tpot.main(
        ["--model", str(tiny_llama_dir), "--dtype", "float32", "--device", "cpu", "--num-kv-blocks", "64"]
        + [
            "--block-size",
            "4",
            "--new-tokens",
            "6",
            "--prompt-len",
            "5",
            "--repeats",
            "1",
            "--concurrency",
            "2",
        ]
        + ["--json", str(out)]
    )
    rows = json.loads(out.read_text())
    assert [r["label"] for r in rows] == [
        "bare step (engine.bench)",
        "TPOT, --overlap-schedule off",
        "TPOT, --overlap-schedule on",
    ]
    assert all(r["tpot_ms"] > 0 and r["ratio"] > 0 for r in rows)
    assert rows[0]["idle_ms"] is None and all(r["idle_ms"] >= 0 for r in rows[1:])
    assert rows[0]["step_ms"] is None and all(r["step_ms"] > 0 for r in rows[1:])
    assert "/ bare" in capsys.readouterr().out
