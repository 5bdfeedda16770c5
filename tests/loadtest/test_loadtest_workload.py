"""Workload generation: length distributions, arrival processes, exact-length prompts."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

from loadtest.prompts import PromptBuilder
from loadtest.sweep import SweepOptions
from loadtest.tokenizer import HFTokenizer
from loadtest.workload import (
    UniformLengths,
    Workload,
    arrival_times,
    load_jsonl,
    random_lengths,
    ratio_bounds,
)


@pytest.fixture(scope="module")
def builder(smollm2_tokenizer_dir) -> PromptBuilder:
    return PromptBuilder(HFTokenizer(smollm2_tokenizer_dir))


def test_orca_lengths_are_uniform_within_inclusive_bounds():
    rng = np.random.default_rng(0)
    sampler = UniformLengths()  # the paper's trace
    pairs = np.array([sampler.sample(rng) for _ in range(20_000)])
    ins, outs = pairs[:, 0], pairs[:, 1]
    assert ins.min() == 32 and ins.max() == 512  # both ends reachable
    assert outs.min() == 1 and outs.max() == 128
    assert ins.mean() == pytest.approx((32 + 512) / 2, rel=0.02)
    assert outs.mean() == pytest.approx((1 + 128) / 2, rel=0.02)
    # Uniform: each quarter of the range holds about a quarter of the draws.
    quarters = np.histogram(ins, bins=4, range=(32, 513))[0] / ins.size
    assert quarters == pytest.approx([0.25] * 4, abs=0.02)


def test_length_bounds_are_validated_and_settable():
    with pytest.raises(ValueError):
        UniformLengths(input_min=100, input_max=50)
    with pytest.raises(ValueError):
        UniformLengths(output_min=0)
    rng = np.random.default_rng(1)
    fixed = UniformLengths(7, 7, 3, 3)
    assert {fixed.sample(rng) for _ in range(50)} == {(7, 3)}


def test_random_workload_range_ratio():
    assert ratio_bounds(100, 0.0) == (100, 100)
    assert ratio_bounds(100, 0.25) == (75, 125)
    assert ratio_bounds(1, 0.5) == (1, 2)
    lengths = random_lengths(200, 20, 0.1)
    bounds = (lengths.input_min, lengths.input_max, lengths.output_min, lengths.output_max)
    assert bounds == (180, 220, 18, 22)
    with pytest.raises(ValueError):
        ratio_bounds(10, 1.0)


def gaps(times: list[float]) -> np.ndarray:
    return np.diff(np.asarray(times))


def test_poisson_arrivals_have_mean_gap_one_over_rate_and_cv_one():
    times = arrival_times(4.0, np.random.default_rng(0), num_requests=20_000)
    assert times[0] == 0.0 and len(times) == 20_000
    g = gaps(times)
    assert g.mean() == pytest.approx(0.25, rel=0.03)
    assert g.std() / g.mean() == pytest.approx(1.0, rel=0.05)  # exponential gaps


@pytest.mark.parametrize("burstiness", [0.25, 4.0])
def test_gamma_arrivals_keep_the_rate_and_set_cv_by_burstiness(burstiness):
    g = gaps(arrival_times(2.0, np.random.default_rng(1), num_requests=20_000, burstiness=burstiness))
    assert g.mean() == pytest.approx(0.5, rel=0.04)
    assert g.std() / g.mean() == pytest.approx(1 / math.sqrt(burstiness), rel=0.06)


def test_duration_bounds_arrivals_and_infinite_rate_sends_at_once():
    times = arrival_times(50.0, np.random.default_rng(2), duration=20.0)
    assert all(t < 20.0 for t in times)
    assert len(times) == pytest.approx(1000, rel=0.1)
    assert len(arrival_times(50.0, np.random.default_rng(2), num_requests=5, duration=1000.0)) == 5
    assert arrival_times(math.inf, np.random.default_rng(0), num_requests=3) == [0.0, 0.0, 0.0]
    with pytest.raises(ValueError):
        arrival_times(1.0, np.random.default_rng(0))  # unbounded
    with pytest.raises(ValueError):
        arrival_times(math.inf, np.random.default_rng(0), duration=1.0)


def test_token_prompts_have_exact_lengths_of_real_text(builder):
    rng = np.random.default_rng(0)
    for length in (1, 2, 32, 257, 512, 3000):
        ids = builder.token_prompt(length, rng)
        assert len(ids) == length
    text = builder.tokenizer.decode(builder.token_prompt(64, rng))
    assert sum(c.isalpha() for c in text) > 100  # prose, not noise


def test_text_prompts_re_encode_to_exact_lengths(builder):
    rng = np.random.default_rng(3)
    for length in (1, 5, 32, 100, 333, 512):
        text = builder.text_prompt(length, rng)
        assert isinstance(text, str)
        assert len(builder.tokenizer.encode(text, add_special_tokens=True)) == length


def test_workload_requests_are_the_same_whatever_the_run(builder):
    a = Workload("orca", builder, seed=7, as_text=False, lengths=UniformLengths())
    b = Workload("orca", builder, seed=7, as_text=False, lengths=UniformLengths())
    other_seed = Workload("orca", builder, seed=8, as_text=False, lengths=UniformLengths())
    assert [a.spec(i) for i in range(5)] == [b.spec(i) for i in reversed(range(5))][::-1]
    assert a.spec(3) != other_seed.spec(3)
    for i in range(20):
        spec = a.spec(i)
        assert 32 <= spec.prompt_len <= 512 and 1 <= spec.output_len <= 128
        assert len(spec.prompt) == spec.prompt_len
    text = a.with_text_prompts().spec(4)
    assert isinstance(text.prompt, str) and builder.count(text.prompt) == text.prompt_len


def test_each_round_keeps_the_lengths_and_changes_the_prompts(builder):
    """A sweep's later rates send new tokens (a prefix cache must not serve them from the first rate's
    requests) at the same lengths; every server at one rate gets the same requests."""
    w = Workload("orca", builder, seed=7, as_text=False, lengths=UniformLengths())
    for i in range(5):
        first, second = w.spec(i, 0), w.spec(i, 1)
        assert (first.prompt_len, first.output_len) == (second.prompt_len, second.output_len)
        assert first.prompt[4:] != second.prompt[4:]  # past a possible shared start (BOS)
        assert w.spec(i, 1) == second
    assert w.spec(2) == w.spec(2, 0)  # round 0 is what a single run sends
    text = w.with_text_prompts()
    assert text.spec(1, 2).prompt != text.spec(1, 0).prompt
    assert builder.count(text.spec(1, 2).prompt) == text.spec(1, 0).prompt_len


def test_a_sweep_sends_each_rate_its_own_round():
    opts = SweepOptions(rates=[4.0, 16.0, 64.0], num_requests=10, duration=None)
    assert [opts.run_config(r).prompt_round for r in opts.rates] == [0, 1, 2]


def test_each_turn_of_a_sliced_rate_has_its_own_round_and_share():
    opts = SweepOptions(rates=[4.0, 16.0], num_requests=10, duration=None, slices=3)
    turns = [opts.run_config(r, s) for r in opts.rates for s in range(3)]
    assert [t.prompt_round for t in turns] == [0, 1, 2, 3, 4, 5]  # no turn resends another's prompts
    assert [t.num_requests for t in turns[:3]] == [4, 3, 3]  # the 10 requests, split
    timed = SweepOptions(rates=[float("inf")], num_requests=None, duration=45.0, max_concurrency=1, slices=3)
    assert timed.run_config(float("inf"), 2).duration == 15.0


def test_file_workload(tmp_path, builder):
    path = tmp_path / "prompts.jsonl"
    lines = [
        {"prompt": "Tell me about the sea.", "output_len": 5},
        {"prompt": "Hello there", "max_tokens": 9},
    ]
    path.write_text("\n".join(json.dumps(x) for x in lines) + "\n\n" + json.dumps({"prompt": "Bye"}))
    entries = load_jsonl(path)
    assert [e.output_len for e in entries] == [5, 9, None]
    wl = Workload("file", builder, 0, as_text=False, entries=entries, default_output_len=11)
    first, third, cycled = wl.spec(0), wl.spec(2), wl.spec(3)
    assert first.prompt == builder.tokenizer.encode("Tell me about the sea.", add_special_tokens=True)
    assert first.prompt_len == len(first.prompt) and first.output_len == 5
    assert third.output_len == 11
    assert cycled.prompt == first.prompt  # a short file is cycled
    assert wl.with_text_prompts().spec(1).prompt == "Hello there"
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "no prompt key"}\n')
    with pytest.raises(ValueError, match="bad.jsonl:1"):
        load_jsonl(bad)
