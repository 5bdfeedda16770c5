"""Speculative decoding through the real engine (tiny random Llamas, float32): the same greedy tokens
with and without it (n-gram proposals, a draft model that is the target itself, a 1-layer draft), in
every scheduling situation, with logprobs, stop strings, penalties and a grammar; seeded sampling gives
the same tokens too; and the verification keeps the target's distribution (chi-square tests through
the sampler's rows)."""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from pathlib import Path

import pytest
import torch
from builders import build_hf_model, cpu_engine_config, cuda_engine_config, tiny_llama_config
from fakes import run_to_end

from engine.contract import SamplingParams, ScheduledSequence
from engine.executor import LocalExecutor
from engine.grammar import GrammarCompiler, GrammarSpec
from engine.sampler import Sampler
from engine.speculative import accept, spread
from scheduler.config import SchedulerConfig
from scheduler.core import Scheduler
from scheduler.output_text import start_output
from scheduler.request import Request

BLOCK_SIZE = 4
# The tiny random models repeat themselves within a few tokens, so n-gram proposals get accepted.
PROMPTS = [
    [1, 504, 3458, 28, 253, 1789, 30, 504, 3458, 28],
    [20 + (i * 131) % 40000 for i in range(23)],
    [7, 7, 900, 901, 902, 7, 7, 900],
    [300 + i for i in range(5)],
]


@pytest.fixture(scope="module")
def target(tiny_llama_dir: Path) -> LocalExecutor:
    return LocalExecutor(cpu_engine_config(tiny_llama_dir, block_size=BLOCK_SIZE, num_kv_blocks=256))


@pytest.fixture(scope="module")
def packed_target(tiny_gguf_llama_dir: Path) -> LocalExecutor:
    """GGUF-structured weights: packed, so decode steps (verification rows too) take the native call."""
    return LocalExecutor(cpu_engine_config(tiny_gguf_llama_dir, block_size=BLOCK_SIZE, num_kv_blocks=256))


@pytest.fixture(scope="module")
def self_drafted(tiny_llama_dir: Path) -> LocalExecutor:
    """The target as its own draft: every greedy proposal is right, if the draft's cache is."""
    config = cpu_engine_config(
        tiny_llama_dir, block_size=BLOCK_SIZE, num_kv_blocks=256, draft_model=str(tiny_llama_dir)
    )
    return LocalExecutor(config)


@pytest.fixture(scope="module")
def small_drafted(tiny_llama_dir: Path, tmp_path_factory, smollm2_tokenizer_dir: Path) -> LocalExecutor:
    """A 1-layer random draft with the target's vocabulary: mostly wrong."""
    import shutil

    draft = tmp_path_factory.mktemp("draft-1-layer")
    build_hf_model(tiny_llama_config(num_hidden_layers=1), seed=7).save_pretrained(
        draft, safe_serialization=True
    )
    for f in smollm2_tokenizer_dir.iterdir():
        shutil.copy(f, draft / f.name)
    config = cpu_engine_config(
        tiny_llama_dir, block_size=BLOCK_SIZE, num_kv_blocks=256, draft_model=str(draft)
    )
    return LocalExecutor(config)


def greedy(max_tokens: int = 24, **kw) -> SamplingParams:
    return SamplingParams(**{"temperature": 0.0, "max_tokens": max_tokens, "ignore_eos": True, **kw})


def run(
    executor: LocalExecutor,
    requests: Sequence[tuple[Sequence[int], SamplingParams]],
    speculative: str,
    num_kv_blocks: int = 256,
    detokenizer=None,
    **cfg,
) -> tuple[list[Request], Scheduler]:
    """Every request to its end through the real scheduler, synchronously. A draft model is priced as
    if it were free, so that the target drafting for itself still proposes."""
    config = SchedulerConfig(
        **{"max_num_seqs": 8, "max_num_batched_tokens": 256, **cfg, "speculative": speculative}
    )
    draft_cost = 0.01 if executor.proposer is not None else None
    sched = Scheduler(
        config, num_kv_blocks, executor.block_size, executor.max_model_len, executor.eos_token_ids, draft_cost
    )
    reqs = [
        Request(f"r{i}", p, params, output_text=start_output(detokenizer, p, params))
        for i, (p, params) in enumerate(requests)
    ]
    run_to_end(sched, executor, reqs)
    return reqs, sched


def tokens(reqs: list[Request]) -> list[list[int]]:
    return [r.output_token_ids for r in reqs]


def same_as_without(executor, requests, method, **kw) -> Scheduler:
    """Assert the tokens with speculation are those without it; returns the speculating scheduler."""
    plain, _ = run(executor, requests, "off", **kw)
    spec, sched = run(executor, requests, method, **kw)
    assert tokens(spec) == tokens(plain)
    stats = sched.stats().speculation
    assert stats.proposed_tokens > 0
    return sched


# ---- greedy: lossless ----------------------------------------------------------------------------


@pytest.mark.parametrize("which", ["target", "packed_target"])
def test_ngram_greedy_tokens_are_unchanged_alone_and_batched(which, request):
    executor = request.getfixturevalue(which)
    for p in PROMPTS:
        sched = same_as_without(executor, [(p, greedy(30))], "ngram")
    sched = same_as_without(executor, [(p, greedy(20 + 3 * i)) for i, p in enumerate(PROMPTS)], "ngram")
    assert sched.stats().speculation.accepted_tokens > 0


SCENARIOS = {
    "chunked prefill": dict(max_num_batched_tokens=12),
    "preemption": dict(num_kv_blocks=24),
    "no prefix caching": dict(enable_prefix_caching=False),
    "reserve": dict(kv_policy="reserve"),
}


@pytest.mark.parametrize("scenario", list(SCENARIOS))
@pytest.mark.parametrize(
    "which, method", [("target", "ngram"), ("self_drafted", "draft"), ("small_drafted", "draft")]
)
def test_greedy_tokens_are_unchanged_in_every_scheduling_situation(scenario, which, method, request):
    executor = request.getfixturevalue(which)
    requests = [(p, greedy(24 + 2 * i)) for i, p in enumerate(PROMPTS)]
    sched = same_as_without(executor, requests, method, **SCENARIOS[scenario])
    if scenario == "preemption":
        assert sched.num_preemptions > 0


def test_prefix_cached_prompts_and_repeats_keep_their_tokens(target):
    """Prompts that start from cached blocks (a repeat, a follow-up that quotes an earlier answer)."""
    first, _ = run(target, [(PROMPTS[0], greedy(30))], "off")
    follow_up = [*PROMPTS[0], *first[0].output_token_ids, 42]
    requests = [(PROMPTS[0], greedy(30)), (PROMPTS[0], greedy(30)), (follow_up, greedy(20))]
    sched = same_as_without(target, requests, "ngram", max_num_seqs=1)
    assert sched.prefix_cache_stats().hits > 0


def test_a_draft_that_is_the_target_is_always_right(self_drafted):
    """Its cache follows the target's through rollbacks and catch-ups, or its proposals would drift."""
    requests = [(p, greedy(30)) for p in PROMPTS]
    _, sched = run(self_drafted, requests, "draft", num_kv_blocks=24)  # with preemptions
    stats = sched.stats().speculation
    assert stats.proposed_tokens > 20 and stats.accepted_tokens == stats.proposed_tokens
    assert sched.num_preemptions > 0


def test_sampled_requests_verify_a_draft_distribution(self_drafted, small_drafted):
    """Sampling with a draft model: proposals drawn from the draft's distribution and kept with
    probability min(1, p/q). The target as its own draft has q = p (up to rounding): nearly all kept; a
    1-layer random draft's distribution is far from the target's: its proposals are rejected (and soon
    no longer made), and the requests run to their end either way."""
    requests = [
        (p, SamplingParams(temperature=0.8, top_k=40, max_tokens=30, ignore_eos=True)) for p in PROMPTS
    ]
    _, sched = run(self_drafted, requests, "draft")
    stats = sched.stats().speculation
    assert stats.proposed_tokens > 20 and stats.accepted_tokens >= 0.9 * stats.proposed_tokens
    reqs, sched = run(small_drafted, requests, "draft")
    stats = sched.stats().speculation
    assert stats.proposed_tokens > 0 and stats.accepted_tokens < stats.proposed_tokens
    assert all(len(r.output_token_ids) == 30 for r in reqs)


def test_a_poor_draft_is_rejected_and_turned_down(small_drafted):
    requests = [(p, greedy(40)) for p in PROMPTS[:2]]
    _, sched = run(small_drafted, requests, "draft")
    stats = sched.stats().speculation
    assert stats.accepted_tokens < stats.proposed_tokens
    # Rejections lower a request's acceptance, and with it how much it proposes.
    assert stats.proposed_tokens < 4 * stats.num_verifications


def test_logprobs_of_accepted_tokens_match_the_plain_run(target):
    requests = [(p, greedy(24, logprobs=3)) for p in PROMPTS]
    plain, _ = run(target, requests, "off")
    spec, sched = run(target, requests, "ngram")
    assert sched.stats().speculation.accepted_tokens > 0
    for a, b in zip(plain, spec, strict=True):
        la, lb = a.output_text.take()[1], b.output_text.take()[1]
        assert [t.token_id for t in la] == [t.token_id for t in lb] == a.output_token_ids
        for x, y in zip(la, lb, strict=True):
            assert x.logprob == pytest.approx(y.logprob, abs=1e-4)
            assert [t for t, _ in x.top_logprobs] == [t for t, _ in y.top_logprobs]


def test_penalties_see_the_proposals_before_each_position(target):
    """Repetition and frequency penalties at a proposed position count the proposals before it, as
    if they had been generated one by one."""
    requests = [(p, greedy(30, repetition_penalty=1.2, frequency_penalty=0.1, min_tokens=5)) for p in PROMPTS]
    same_as_without(target, requests, "ngram")


def test_stop_strings_and_stop_tokens_cut_an_accepted_run(target, tokenizer):
    probe, _ = run(target, [(PROMPTS[2], greedy(30))], "off")
    out = probe[0].output_token_ids
    stop_token = out[17]
    stop_text = tokenizer.decode([out[9]]).strip() or tokenizer.decode(out[9:11])
    requests = [
        (PROMPTS[2], greedy(30, stop=(stop_text,))),
        (PROMPTS[2], greedy(30, stop_token_ids=(stop_token,), ignore_eos=False)),
    ]
    plain, _ = run(target, requests, "off", detokenizer=tokenizer)
    spec, sched = run(target, requests, "ngram", detokenizer=tokenizer)
    assert sched.stats().speculation.accepted_tokens > 0
    for a, b in zip(plain, spec, strict=True):
        assert (a.output_token_ids, a.status, a.output_text.take()[0]) == (
            b.output_token_ids,
            b.status,
            b.output_text.take()[0],
        )
    assert len(spec[0].output_token_ids) < 30 and spec[1].output_token_ids[-1] == stop_token


def test_grammar_masks_follow_the_proposals(target, tokenizer):
    compiler = GrammarCompiler(tokenizer.hf, target.vocab_size, sorted(target.eos_token_ids))
    specs = [
        GrammarSpec("regex", r"(ab|cd){1,12}"),
        GrammarSpec.choice(["alpha", "beta gamma", "delta"]),
        GrammarSpec.json_schema(
            {"type": "object", "properties": {"k": {"type": "array", "items": {"enum": ["x", "y"]}}}},
            any_whitespace=False,
        ),
    ]

    def requests():
        return [
            (p, greedy(30, ignore_eos=False, min_tokens=m, grammar=compiler.compile(s).new_matcher()))
            for p in PROMPTS[:2]
            for s in specs
            for m in (0, 20)
        ]

    plain, _ = run(target, requests(), "off")
    spec, sched = run(target, requests(), "ngram")
    assert tokens(spec) == tokens(plain)
    assert sched.stats().speculation.accepted_tokens > 0


def test_seeded_sampling_gives_the_same_tokens(target):
    """A seeded row draws from the generator of its output index, speculating or not, and a point-mass
    proposal is accepted exactly when the row draws it: the same tokens either way."""
    requests = [
        (p, SamplingParams(temperature=0.3, seed=11 + i, max_tokens=30, ignore_eos=True, top_k=20))
        for i, p in enumerate(PROMPTS)
    ]
    same_as_without(target, requests, "ngram")


# ---- the target's distribution, kept -------------------------------------------------------------

VOCAB = 6
# Critical value of chi-square with VOCAB - 1 = 5 degrees of freedom at p = 1e-4 (the draws are seeded,
# so the test is deterministic; this is how unlikely a pass would be for a wrong distribution).
CHI2_5DF_1E4 = 25.74


def chi_square(counts: Counter, probs: torch.Tensor, n: int) -> float:
    expected = probs * n
    return float(sum((counts.get(t, 0) - expected[t]) ** 2 / expected[t] for t in range(VOCAB)))


def verifying(
    params: SamplingParams, prompt: tuple[int, ...], outputs: tuple[int, ...], proposal: tuple[int, ...]
) -> ScheduledSequence:
    """One request's decode row at position 10 (token 3), with `proposal` to verify after it."""
    return ScheduledSequence(
        "r", (3,), 10, list(range(4)), True, params, prompt, outputs,
        spec_token_ids=proposal, num_spec_tokens=len(proposal),
    )  # fmt: skip


def verify_once(
    sampler: Sampler, logits: torch.Tensor, params: SamplingParams, draft: int, q: torch.Tensor | None
) -> list[int]:
    """One verification of one proposal: the tokens it yields (1 or 2)."""
    seq = verifying(params, (1, 2, 3), (4,), (draft,))
    rows = spread([seq], {0: q[None]} if q is not None else None)
    sampled = sampler(logits.clone(), rows.sampling, None, rows.drafts if rows.has_drafts else None)
    (tok,) = accept(rows, sampled)
    assert tok is not None
    return [t.token_id for t in tok.tokens]


@pytest.mark.parametrize("proposal", ["point mass", "draft distribution"])
def test_verification_keeps_the_target_distribution(proposal):
    """The first token a verification yields is distributed as the target's p at that position, and the
    second (after an accepted proposal) as p at the next, whatever proposes."""
    torch.manual_seed(0)
    p0 = torch.tensor([0.05, 0.30, 0.25, 0.20, 0.15, 0.05])
    p1 = torch.tensor([0.40, 0.10, 0.10, 0.10, 0.10, 0.20])
    q = torch.tensor([0.10, 0.10, 0.50, 0.10, 0.10, 0.10])  # the draft's idea of position 0
    logits = torch.stack([p0.log(), p1.log()])
    params = SamplingParams(temperature=1.0)
    sampler = Sampler(VOCAB, seed=1)
    gen = torch.Generator().manual_seed(2)
    n = 6000
    first: Counter = Counter()
    second: Counter = Counter()
    accepted = 0
    for _ in range(n):
        if proposal == "point mass":
            draft, dist = 2, None
        else:
            draft, dist = int(torch.multinomial(q, 1, generator=gen)), q
        out = verify_once(sampler, logits, params, draft, dist)
        first[out[0]] += 1
        if len(out) == 2:
            accepted += 1
            second[out[1]] += 1
    assert chi_square(first, p0, n) < CHI2_5DF_1E4
    assert chi_square(second, p1, accepted) < CHI2_5DF_1E4
    # Acceptance is p(d) for a point mass, sum(min(p, q)) for a draft distribution.
    want = float(p0[2]) if proposal == "point mass" else float(torch.minimum(p0, q).sum())
    assert abs(accepted / n - want) < 4 * (want * (1 - want) / n) ** 0.5


def test_greedy_verification_accepts_exactly_the_argmax_run():
    logits = torch.tensor([[0.0, 5.0, 1.0, 0, 0, 0], [0, 0, 0, 7.0, 1.0, 0], [2.0, 0, 0, 0, 0, 0]])
    seq = verifying(SamplingParams(temperature=0.0), (1,), (), (1, 4))
    rows = spread([seq])
    (tok,) = accept(rows, Sampler(VOCAB)(logits.clone(), rows.sampling))
    assert tok is not None and [t.token_id for t in tok.tokens] == [1, 3] and tok.num_accepted == 1


# ---- on a GPU: verification steps beside CUDA graphs ---------------------------------------------


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("method", ["ngram", "draft"])
def test_speculation_on_cuda_keeps_greedy_tokens(method, tiny_llama_dir: Path):
    """A verification step (several tokens a row) between graph-replayed decode steps, KV rolled back
    on the GPU, a draft model (the target itself: always right, if its cache follows) on the GPU too:
    the greedy tokens are those without speculation, and proposals are made and accepted."""
    extra = {"draft_model": str(tiny_llama_dir)} if method == "draft" else {}
    executor = LocalExecutor(
        cuda_engine_config(
            tiny_llama_dir, block_size=BLOCK_SIZE, num_kv_blocks=256, max_num_batched_tokens=256, **extra
        )
    )
    assert executor.runner.use_cuda_graphs
    requests = [(p, greedy(24 + 2 * i)) for i, p in enumerate(PROMPTS)]
    for cfg in ({}, {"max_num_batched_tokens": 12}, {"num_kv_blocks": 24}):
        sched = same_as_without(executor, requests, method, **cfg)
        stats = sched.stats().speculation
        assert stats.accepted_tokens > 0
        if method == "draft":
            assert stats.accepted_tokens == stats.proposed_tokens
