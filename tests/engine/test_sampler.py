"""The sampler: greedy, truncation (top-k/top-p/min-p), penalties, logit bias, seeds, logprobs."""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field

import pytest
import torch

from engine.contract import SamplingParams
from engine.sampler import (
    LOGPROB_FLOOR,
    TOP_P_CANDIDATES,
    Sampler,
    row_seed,
    top_k_top_p,
    top_k_top_p_by_sort,
)

V = 10


@dataclass
class Row:
    sampling: SamplingParams
    prompt_token_ids: Sequence[int] = ()
    output_token_ids: Sequence[int] = field(default_factory=list)


def probs_logits(probs: list[float]) -> torch.Tensor:
    """[V] logits whose softmax is `probs` (padded with near-zero mass)."""
    p = torch.tensor(probs + [1e-12] * (V - len(probs)))
    return p.log()


def draw_many(sampler: Sampler, logits: torch.Tensor, params: SamplingParams, n: int) -> Counter:
    """n independent draws for one distribution, as one batch of n identical rows."""
    batch = logits.expand(n, -1).clone()
    out = sampler(batch, [Row(params) for _ in range(n)])
    return Counter(t.token_id for t in out)


def full_logprobs(sampler: Sampler, logits: torch.Tensor, row: Row) -> torch.Tensor:
    """The processed distribution's log-softmax of one row, read back through top_logprobs (N == V)."""
    params = SamplingParams(**{**row.sampling.__dict__, "logprobs": V})
    out = sampler(logits[None].clone(), [Row(params, row.prompt_token_ids, row.output_token_ids)])[0]
    lp = torch.full((V,), float("nan"))
    for tok, val in out.top_logprobs:
        lp[tok] = val
    return lp


def test_greedy_is_exact_argmax():
    torch.manual_seed(0)
    logits = torch.randn(32, 1000)
    expect = logits.argmax(-1).tolist()
    sampler = Sampler(1000)
    out = sampler(logits.clone(), [Row(SamplingParams(temperature=0.0)) for _ in range(32)])
    assert [t.token_id for t in out] == expect
    assert all(t.logprob is None and t.top_logprobs is None for t in out)
    # Also through the processing path (logprobs requested, a sampled row in the batch).
    rows = [Row(SamplingParams(temperature=0.0, logprobs=2)) for _ in range(31)] + [Row(SamplingParams())]
    out = sampler(logits.clone(), rows)
    assert [t.token_id for t in out[:31]] == expect[:31]


def test_logprobs_shapes_and_values_are_log_softmax():
    torch.manual_seed(1)
    logits = torch.randn(3, 50)
    sampler = Sampler(50)
    rows = [
        Row(SamplingParams(temperature=0.0, logprobs=5)),
        Row(SamplingParams(temperature=2.0, logprobs=0, seed=3)),
        Row(SamplingParams(temperature=0.0)),
    ]
    out = sampler(logits.clone(), rows)
    ref0 = torch.log_softmax(logits[0], -1)
    ref1 = torch.log_softmax(logits[1] / 2.0, -1)  # temperature is part of the processed distribution
    assert out[0].logprob == pytest.approx(ref0[out[0].token_id].item(), abs=1e-5)
    assert len(out[0].top_logprobs) == 5
    top = ref0.topk(5)
    assert [t for t, _ in out[0].top_logprobs] == top.indices.tolist()
    assert [v for _, v in out[0].top_logprobs] == pytest.approx(top.values.tolist(), abs=1e-5)
    assert out[1].top_logprobs == []
    assert out[1].logprob == pytest.approx(ref1[out[1].token_id].item(), abs=1e-5)
    assert out[2].logprob is None and out[2].top_logprobs is None


def test_temperature_matches_softmax_frequencies():
    logits = probs_logits([0.6, 0.3, 0.1])
    n = 6000
    counts = draw_many(Sampler(V, seed=0), logits, SamplingParams(temperature=2.0), n)
    expect = torch.softmax(logits / 2.0, -1)
    for tok in range(3):
        assert counts[tok] / n == pytest.approx(expect[tok].item(), abs=0.03)


def test_top_k_keeps_only_the_k_best():
    logits = probs_logits([0.3, 0.25, 0.2, 0.15, 0.1])
    counts = draw_many(Sampler(V, seed=1), logits, SamplingParams(top_k=3), 3000)
    assert set(counts) == {0, 1, 2}
    for tok, p in zip(range(3), [0.3, 0.25, 0.2], strict=True):
        assert counts[tok] / 3000 == pytest.approx(p / 0.75, abs=0.04)


@pytest.mark.parametrize(
    ("top_p", "kept"), [(0.45, {0}), (0.75, {0, 1}), (0.85, {0, 1, 2}), (0.99, {0, 1, 2, 3})]
)
def test_top_p_keeps_the_smallest_set_reaching_p(top_p: float, kept: set[int]):
    probs = [0.5, 0.3, 0.15, 0.05]
    counts = draw_many(Sampler(V, seed=2), probs_logits(probs), SamplingParams(top_p=top_p), 4000)
    assert set(counts) == kept
    mass = sum(probs[t] for t in kept)
    for tok in kept:
        assert counts[tok] / 4000 == pytest.approx(probs[tok] / mass, abs=0.04)


@pytest.mark.parametrize(
    ("scale", "top_k", "top_p"), [(8.0, 0, 0.95), (8.0, 40, 0.9), (0.5, 0, 0.95), (0.5, 2000, 0.9)]
)
def test_top_p_on_candidates_keeps_what_a_full_sort_keeps(scale: float, top_k: int, top_p: float):
    # A large vocabulary: peaked rows are cut among their best TOP_P_CANDIDATES tokens, flat ones (whose
    # nucleus is larger) are sorted whole; either way the kept tokens are the full sort's.
    vocab = 8 * TOP_P_CANDIDATES
    logits = torch.randn(16, vocab, generator=torch.Generator().manual_seed(3)) * scale
    k = top_k or vocab
    got = top_k_top_p(logits, [k] * 16, [top_p] * 16)
    expect = top_k_top_p_by_sort(logits, torch.full((16, 1), k), torch.full((16, 1), top_p))
    assert torch.equal(got > float("-inf"), expect > float("-inf"))
    assert torch.equal(got[got > float("-inf")], logits[got > float("-inf")])


def test_draws_over_a_large_vocabulary_stay_in_the_nucleus():
    vocab = 4 * TOP_P_CANDIDATES
    logits = torch.randn(vocab, generator=torch.Generator().manual_seed(4)) * 8
    params = SamplingParams(temperature=1.0, top_p=0.8, seed=11)
    nucleus = set((top_k_top_p(logits[None], [vocab], [0.8])[0] > float("-inf")).nonzero().flatten().tolist())
    sampler = Sampler(vocab, seed=5)
    tokens = [
        sampler(logits[None].clone(), [Row(params, output_token_ids=[0] * i)])[0].token_id for i in range(200)
    ]
    assert set(tokens) <= nucleus and len(set(tokens)) > 1
    again = [
        sampler(logits[None].clone(), [Row(params, output_token_ids=[0] * i)])[0].token_id for i in range(200)
    ]
    assert again == tokens  # a seeded row draws the same tokens for the same step


def test_top_k_then_top_p():
    # top-k 3 renormalises to [0.5, 0.3, 0.2]/1.0 of the three; top_p 0.7 then keeps two.
    probs = [0.4, 0.24, 0.16, 0.12, 0.08]
    counts = draw_many(Sampler(V, seed=3), probs_logits(probs), SamplingParams(top_k=3, top_p=0.7), 2000)
    assert set(counts) == {0, 1}


def test_min_p_drops_tokens_below_a_fraction_of_the_best():
    probs = [0.5, 0.3, 0.15, 0.05]
    counts = draw_many(Sampler(V, seed=4), probs_logits(probs), SamplingParams(min_p=0.2), 4000)
    assert set(counts) == {0, 1, 2}  # 0.05 < 0.2 * 0.5


def test_logit_bias_changes_exactly_the_biased_logits():
    torch.manual_seed(5)
    logits = torch.randn(V)
    bias = {3: 5.0, 7: -2.5}
    lp = full_logprobs(Sampler(V), logits, Row(SamplingParams(temperature=0.0, logit_bias=bias)))
    expect = logits.clone()
    expect[3] += 5.0
    expect[7] -= 2.5
    torch.testing.assert_close(lp, torch.log_softmax(expect, -1), atol=1e-5, rtol=0)
    # A large bias wins the greedy choice.
    out = Sampler(V)(logits[None].clone(), [Row(SamplingParams(temperature=0.0, logit_bias={4: 100.0}))])
    assert out[0].token_id == 4


def test_repetition_penalty_hf_style_over_prompt_and_output():
    logits = torch.tensor([2.0, -1.0, 0.5, -0.5, 3.0, 1.0, -2.0, 0.0, 0.25, -0.25])
    row = Row(
        SamplingParams(temperature=0.0, repetition_penalty=2.0),
        prompt_token_ids=[0, 1, 0],
        output_token_ids=[4, 6],
    )
    lp = full_logprobs(Sampler(V), logits, row)
    expect = logits.clone()
    expect[0] = 1.0  # positive: divided
    expect[1] = -2.0  # negative: multiplied
    expect[4] = 1.5
    expect[6] = -4.0
    torch.testing.assert_close(lp, torch.log_softmax(expect, -1), atol=1e-5, rtol=0)


def test_presence_and_frequency_penalties_over_output_only():
    logits = torch.zeros(V)
    row = Row(
        SamplingParams(temperature=0.0, presence_penalty=0.5, frequency_penalty=0.25),
        prompt_token_ids=[1, 1, 9],  # prompt tokens are not penalised
        output_token_ids=[2, 2, 2, 5],
    )
    lp = full_logprobs(Sampler(V), logits, row)
    expect = torch.zeros(V)
    expect[2] = -0.5 - 3 * 0.25
    expect[5] = -0.5 - 0.25
    torch.testing.assert_close(lp, torch.log_softmax(expect, -1), atol=1e-5, rtol=0)


def test_min_tokens_bans_eos_and_stop_tokens_until_reached():
    logits = torch.zeros(V)
    logits[2] = 10.0  # EOS is the favourite
    logits[6] = 9.0  # a stop token next
    sampler = Sampler(V, eos_token_ids=frozenset({2}))
    params = SamplingParams(temperature=0.0, min_tokens=2, stop_token_ids=(6,))
    early = sampler(logits[None].clone(), [Row(params, output_token_ids=[5])])[0]
    assert early.token_id not in (2, 6)
    done = sampler(logits[None].clone(), [Row(params, output_token_ids=[5, 5])])[0]
    assert done.token_id == 2
    ignore = SamplingParams(temperature=0.0, min_tokens=2, ignore_eos=True)
    assert sampler(logits[None].clone(), [Row(ignore)])[0].token_id == 2  # EOS is no stop here


def test_seeded_rows_do_not_depend_on_batch_mates_or_position():
    torch.manual_seed(6)
    target = torch.randn(V)
    params = SamplingParams(temperature=1.0, seed=1234)

    def run(batch_logits: torch.Tensor, index: int, steps: int, sampler: Sampler) -> list[int]:
        out_tokens: list[int] = []
        for _ in range(steps):
            rows = [Row(SamplingParams(temperature=1.0)) for _ in range(batch_logits.shape[0])]
            rows[index] = Row(params, output_token_ids=list(out_tokens))
            logits = batch_logits.clone()
            logits[index] = target
            out_tokens.append(sampler(logits, rows)[index].token_id)
        return out_tokens

    alone = run(torch.zeros(1, V), 0, 20, Sampler(V, seed=0))
    crowded = run(torch.randn(5, V), 3, 20, Sampler(V, seed=99))
    assert alone == crowded
    assert len(set(alone)) > 1  # the step count feeds the seed: not one token repeated
    other = run(torch.zeros(2, V), 1, 20, Sampler(V, seed=5))  # another engine seed
    assert other == alone
    different_seed = SamplingParams(temperature=1.0, seed=4321)
    rows = [Row(different_seed, output_token_ids=list(alone[:k])) for k in range(20)]
    diff = [Sampler(V)(target[None].clone(), [r])[0].token_id for r in rows]
    assert diff != alone


def test_unseeded_rows_follow_the_engine_seed():
    logits = torch.randn(64, V)
    rows = [Row(SamplingParams(temperature=1.0)) for _ in range(64)]
    a = [t.token_id for t in Sampler(V, seed=7)(logits.clone(), rows)]
    b = [t.token_id for t in Sampler(V, seed=7)(logits.clone(), rows)]
    assert a == b


def test_row_seed_mixes_both_inputs():
    seeds = {row_seed(s, n) for s in range(20) for n in range(20)}
    assert len(seeds) == 400
    assert all(0 <= s < 2**64 for s in seeds)


def test_sampling_params_reject_what_the_sampler_cannot_apply():
    """Checked once, when a request's parameters are made; the sampler trusts them on every step (the
    token ids in logit_bias are checked against the vocabulary at admission: tests/scheduler/test_loop.py)."""
    with pytest.raises(ValueError, match="repetition_penalty"):
        SamplingParams(repetition_penalty=0.0)
    with pytest.raises(ValueError, match="logprobs"):
        SamplingParams(logprobs=-1)
    # Any number of top logprobs is served: the cap is the server's --max-logprobs.
    out = Sampler(64)(torch.randn(1, 64), [Row(SamplingParams(temperature=0.0, logprobs=40))])
    assert len(out[0].top_logprobs) == 40


def test_chosen_logprob_is_finite_under_truncation():
    logits = probs_logits([0.5, 0.3, 0.2])
    out = Sampler(V, seed=8)(logits[None].clone(), [Row(SamplingParams(top_k=1, logprobs=3))])[0]
    assert out.token_id == 0
    assert math.isfinite(out.logprob)
    assert all(math.isfinite(v) for _, v in out.top_logprobs)


@pytest.mark.parametrize("temperature", [1e-300, 1e-40, 1e-8])
def test_vanishing_temperature_is_greedy_with_finite_logprobs(temperature: float):
    # logits / 1e-8 overflows float32: without the greedy bound the draw and every logprob were NaN
    # (found by tests/server/test_fuzz.py: the server could not serialise the response).
    logits = torch.randn(V) * 5
    out = Sampler(V)(logits[None].clone(), [Row(SamplingParams(temperature=temperature, logprobs=3))])[0]
    assert out.token_id == int(logits.argmax())
    assert math.isfinite(out.logprob)
    assert all(math.isfinite(v) for _, v in out.top_logprobs)


def test_banned_tokens_report_a_finite_logprob_floor():
    logits = torch.zeros(V)
    params = SamplingParams(temperature=0.0, min_tokens=1, logprobs=V)
    out = Sampler(V, eos_token_ids=frozenset({2}))(logits[None].clone(), [Row(params)])[0]
    by_token = dict(out.top_logprobs)
    assert by_token[2] == LOGPROB_FLOOR  # EOS is banned (-inf) until min_tokens
    assert all(math.isfinite(v) for v in by_token.values())


def test_extreme_penalty_gives_finite_logprobs_and_a_real_token():
    # repetition_penalty=5e-324 divides a positive logit into +inf (found by tests/server/test_fuzz.py).
    logits = torch.randn(V).abs() + 0.1
    for temperature in (0.0, 0.7):
        params = SamplingParams(temperature=temperature, repetition_penalty=5e-324, logprobs=2, seed=1)
        out = Sampler(V)(logits[None].clone(), [Row(params, prompt_token_ids=[3])])[0]
        assert out.token_id == 3  # the penalised (inf) token is now the best
        assert math.isfinite(out.logprob)
        assert all(math.isfinite(v) for _, v in out.top_logprobs)
