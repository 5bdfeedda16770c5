"""Grammar masks in the engine (engine/grammar.py, engine/token_mask.py, the sampler's hook) on a tiny
random Llama: every sampled token is one the grammar allows, unconstrained rows are untouched, and the
matcher state survives preemption."""

from __future__ import annotations

import json
from pathlib import Path

import llguidance as llg
import pytest
import torch
from builders import cpu_engine_config
from fakes import run_to_end
from hypothesis import given, settings
from hypothesis import strategies as st

from engine.contract import SamplingParams
from engine.executor import LocalExecutor
from engine.grammar import GrammarCompiler, GrammarError, GrammarSpec
from engine.sampler import LOGPROB_FLOOR, Sampler
from scheduler.config import SchedulerConfig
from scheduler.core import Scheduler
from scheduler.request import Request

# Finite languages (bounded length), so even a random model's output ends within max_tokens.
SCHEMA = {
    "type": "object",
    "properties": {
        "colour": {"enum": ["red", "green", "blue"]},
        "n": {"type": "integer", "minimum": 0, "maximum": 999},
        "ok": {"type": "boolean"},
    },
    "required": ["colour", "n", "ok"],
    "additionalProperties": False,
}
SPECS = {
    "schema": GrammarSpec.json_schema(SCHEMA, any_whitespace=False),
    "regex": GrammarSpec("regex", r"(yes|no)-[0-9]{1,3}"),
    "choice": GrammarSpec.choice(["alpha", "beta gamma", "delta"]),
    "gbnf": GrammarSpec("grammar", 'root ::= "SELECT " col " FROM t"\ncol ::= "a" | "bb" | "ccc"'),
}
PROMPT = [1, 504, 3458, 28, 253, 1789, 30]


@pytest.fixture(scope="module")
def runner(tiny_llama_dir: Path) -> LocalExecutor:
    return LocalExecutor(cpu_engine_config(tiny_llama_dir, block_size=4, num_kv_blocks=256))


@pytest.fixture(scope="module")
def compiler(runner: LocalExecutor, tokenizer) -> GrammarCompiler:
    return GrammarCompiler(tokenizer.hf, runner.vocab_size, sorted(runner.eos_token_ids))


def run(runner, requests: list[tuple[list[int], SamplingParams]], num_kv_blocks: int = 256) -> list[Request]:
    """Every request to its end through the real scheduler (preemption included), synchronously."""
    sched = Scheduler(
        SchedulerConfig(max_num_seqs=16, max_num_batched_tokens=256),
        num_kv_blocks=num_kv_blocks,
        block_size=runner.block_size,
        max_model_len=runner.max_model_len,
        eos_token_ids=runner.eos_token_ids,
    )
    reqs = [Request(f"r{i}", p, params) for i, (p, params) in enumerate(requests)]
    run_to_end(sched, runner, reqs)
    return reqs


def replay(compiler: GrammarCompiler, spec: GrammarSpec, tokens: list[int]) -> llg.LLMatcher:
    """A fresh matcher fed the tokens one by one; fails on the first token the grammar forbids."""
    matcher = compiler.compile(spec).new_matcher().matcher
    for i, t in enumerate(tokens):
        assert matcher.consume_token(t), f"token {i} ({t}) is not allowed: {matcher.get_error()[:200]}"
    return matcher


def constrained(compiler, spec: GrammarSpec, **kw) -> SamplingParams:
    return SamplingParams(**{"max_tokens": 40, **kw, "grammar": compiler.compile(spec).new_matcher()})


@pytest.mark.parametrize("name", list(SPECS))
def test_greedy_constrained_output_is_a_complete_sentence(runner, compiler, tokenizer, name):
    spec = SPECS[name]
    (req,) = run(runner, [(PROMPT, constrained(compiler, spec, temperature=0.0))])
    assert req.output_token_ids[-1] in runner.eos_token_ids, "the grammar ended and EOS closed it"
    assert replay(compiler, spec, req.output_token_ids).is_stopped()
    text = tokenizer.decode(req.output_token_ids)
    if name == "schema":
        value = json.loads(text)
        assert value["colour"] in {"red", "green", "blue"} and 0 <= value["n"] <= 999
    elif name == "choice":
        assert text in {"alpha", "beta gamma", "delta"}


@settings(max_examples=12, deadline=None)
@given(
    name=st.sampled_from(sorted(SPECS)),
    seed=st.integers(0, 2**31),
    temperature=st.floats(0.3, 2.0),
    top_k=st.sampled_from([0, 5, 50]),
)
def test_every_sampled_token_is_allowed_by_the_grammar(runner, compiler, name, seed, temperature, top_k):
    spec = SPECS[name]
    params = [
        constrained(compiler, spec, temperature=temperature, seed=seed + i, top_k=top_k) for i in range(3)
    ]
    # Batch mates without a grammar, so constrained and unconstrained rows share every step.
    free = SamplingParams(temperature=1.0, seed=seed, max_tokens=12, ignore_eos=True)
    reqs = run(runner, [(PROMPT, p) for p in params] + [(PROMPT[:3], free)])
    for req in reqs[:3]:
        replay(compiler, spec, req.output_token_ids)
        assert req.output_token_ids[-1] in runner.eos_token_ids or len(req.output_token_ids) == 40


def test_unconstrained_rows_keep_their_greedy_tokens(runner, compiler):
    free = [
        (PROMPT[: 3 + i], SamplingParams(temperature=0.0, max_tokens=15, ignore_eos=True)) for i in range(3)
    ]
    alone = [r.output_token_ids for r in run(runner, free)]
    mates = [(PROMPT, constrained(compiler, SPECS[n], temperature=0.0)) for n in ("schema", "regex")]
    shared = run(runner, [mates[0], *free[:2], mates[1], free[2]])
    assert [shared[i].output_token_ids for i in (1, 2, 4)] == alone


def test_grammar_state_survives_preemption(runner, compiler):
    spec = SPECS["schema"]
    # 8 blocks of 4 tokens for 4 requests of ~7 + ~20 tokens: the newest are preempted and recomputed.
    reqs = run(runner, [(PROMPT, constrained(compiler, spec, temperature=0.0)) for _ in range(4)], 8)
    assert sum(r.num_preemptions for r in reqs) > 0
    for req in reqs:
        replay(compiler, spec, req.output_token_ids)
    assert len({tuple(r.output_token_ids) for r in reqs}) == 1, "greedy: recomputation changes nothing"


def test_logprobs_are_those_of_the_constrained_distribution(runner, compiler):
    spec = SPECS["choice"]
    (req,) = run(runner, [(PROMPT, constrained(compiler, spec, temperature=0.0, logprobs=5))])
    first = req.output_text.take()[1][0]
    matcher = compiler.compile(spec).new_matcher().matcher
    allowed = set(torch.nonzero(_allowed(matcher, runner.vocab_size)).flatten().tolist())
    tops = [t for t, lp in first.top_logprobs if lp > LOGPROB_FLOOR]
    assert tops and set(tops) <= allowed, "only allowed tokens have a probability"
    assert first.token_id in allowed and first.logprob > LOGPROB_FLOOR
    # The allowed tokens' probabilities sum to 1: log-softmax over the allowed set only.
    assert sum(torch.tensor([lp for _, lp in first.top_logprobs]).exp().tolist()) <= 1.0 + 1e-4


def _allowed(matcher: llg.LLMatcher, vocab: int) -> torch.Tensor:
    import llguidance.numpy as llg_np
    import numpy as np

    bitmask = llg_np.allocate_token_bitmask(1, vocab)
    llg_np.fill_next_token_bitmask(matcher, bitmask)
    return torch.from_numpy(np.unpackbits(bitmask.view(np.uint8), bitorder="little")[:vocab].astype(bool))


def test_min_tokens_gives_way_to_a_finished_grammar(runner, compiler):
    spec = SPECS["choice"]
    params = constrained(compiler, spec, temperature=0.0, min_tokens=30)
    (req,) = run(runner, [(PROMPT, params)])
    assert req.output_token_ids[-1] in runner.eos_token_ids
    replay(compiler, spec, req.output_token_ids)


def test_sampler_without_a_mask_is_unchanged_by_the_hook():
    sampler = Sampler(8, frozenset({0}))
    logits = torch.tensor([[0.0, 1.0, 5.0, 2.0, 0.0, 0.0, 0.0, 0.0]])

    class Row:
        sampling = SamplingParams(temperature=0.0)
        prompt_token_ids = (1,)
        output_token_ids = ()

    assert [t.token_id for t in sampler(logits.clone(), [Row()], None)] == [2]


@pytest.mark.parametrize(
    "spec, message",
    [
        (GrammarSpec.json_schema({"type": "strin"}), "Invalid type"),
        (GrammarSpec.json_schema({"type": "object", "required": "a"}), "required"),
        (GrammarSpec("json_schema", "{not json"), "not valid JSON"),
        (GrammarSpec("regex", "(unclosed"), "regex"),
        (GrammarSpec("grammar", "root ::= missing_rule"), "missing_rule"),
        (GrammarSpec.choice([]), "at least one option"),
    ],
)
def test_bad_grammars_raise_grammar_error(compiler, spec, message):
    with pytest.raises(GrammarError, match=message):
        compiler.compile(spec)


def test_compiled_grammars_are_cached_by_spec(compiler):
    spec = GrammarSpec.json_schema({"type": "object", "properties": {"cached": {"type": "string"}}})
    before = compiler.num_compiled
    first = compiler.compile(spec)
    assert compiler.compile(GrammarSpec.json_schema(json.loads(spec.text))) is first
    assert compiler.num_compiled == before + 1
    a, b = first.new_matcher(), first.new_matcher()
    assert a.matcher is not b.matcher, "each request gets its own state"
