"""Stop strings (scheduler.stop): the hold-back matcher against a reference, a cut that does not depend on
how the text is chunked, and in the scheduler: a stop string ends its request in the update that
completes it, with the same precedence over the other rules as the server had."""

from __future__ import annotations

import pytest
from hypothesis import example, given
from hypothesis import strategies as st

from engine.contract import SamplingParams
from scheduler.config import SchedulerConfig
from scheduler.core import Scheduler
from scheduler.fake_runner import FakeDetokenizer, FakeRunner
from scheduler.output_text import start_output
from scheduler.outputs import FinishReason
from scheduler.request import Request, RequestStatus
from scheduler.stop import StopStringMatcher


def run_matcher(stops: list[str], chunks: list[str]) -> tuple[list[str], bool]:
    m = StopStringMatcher(stops)
    out = []
    for chunk in chunks:
        out.append(m.feed(chunk))
        if m.matched is not None:
            return out, True
    out.append(m.flush())
    return out, m.matched is not None  # flush() acts on a stop that completed under a longer candidate


@given(
    text=st.text(alphabet="abc ", max_size=40),
    cuts=st.lists(st.integers(min_value=0, max_value=40), max_size=12),
    stops=st.lists(st.text(alphabet="abc ", min_size=1, max_size=4), min_size=1, max_size=4),
)
@example(text=" a", cuts=[1], stops=["a", " aa"])  # "a" completes while " aa" is pending: flush decides
def test_stop_matcher_matches_reference(text, cuts, stops):
    bounds = sorted({0, len(text), *(c for c in cuts if c <= len(text))})
    chunks = [text[a:b] for a, b in zip(bounds, bounds[1:], strict=False)]
    out, matched = run_matcher(stops, chunks)
    # Reference: cut at the earliest occurrence of any stop string.
    hits = [text.find(s) for s in stops if s in text]
    expected = text[: min(hits)] if hits else text
    assert "".join(out) == expected
    assert matched == bool(hits)
    # Never emitted: a prefix of a stop string that later completes, so the emitted text at every
    # point is a prefix of the final text.
    emitted = ""
    for piece in out:
        emitted += piece
        assert expected.startswith(emitted)


def test_stop_matcher_holds_only_what_may_match():
    m = StopStringMatcher(["</end>"])
    assert m.feed("hello </") == "hello "
    assert m.held == "</"
    assert m.feed("b>") == "</b>"
    assert m.feed("x</en") == "x"
    assert m.feed("d>tail") == "" and m.matched == "</end>"


@pytest.mark.parametrize("chunks", [["aba"], ["ab", "a"], ["a", "b", "a"], ["a", "ba"]])
def test_stop_cut_is_the_same_for_every_chunking(chunks):
    m = StopStringMatcher(["b", "aba"])
    out = "".join(m.feed(c) for c in chunks)
    assert (out, m.matched) == ("", "aba")  # "aba" starts first, though "b" completes first


def test_stop_that_completed_while_a_longer_one_was_pending_is_applied_at_the_end():
    m = StopStringMatcher(["b", "aba"])
    assert m.feed("ab") == "" and m.matched is None  # "aba" may still come
    assert m.flush() == "a" and m.matched == "b"  # the text ended: "b" it is


# ---- in the scheduler ------------------------------------------------------------------------------

A, B, C, EOS = 20, 21, 22, 2
DETOK = FakeDetokenizer({A: "a", B: "b", C: "c"})


def scheduler(runner: FakeRunner) -> Scheduler:
    return Scheduler(SchedulerConfig(), runner.num_kv_blocks, runner.block_size, 256, runner.eos_token_ids)


def run(script: list[int], stops: tuple[str, ...], max_tokens: int = 50, **params) -> tuple[Request, str]:
    """One request over a runner that says `script`; its status, and the text it hands out."""
    runner = FakeRunner(script=script)
    sched = scheduler(runner)
    prompt = [100, 101, 102]
    p = SamplingParams(max_tokens=max_tokens, stop=stops, **params)
    r = Request("r", prompt, p, output_text=start_output(DETOK, prompt, p))
    sched.add(r)
    while sched.has_work():
        step = sched.schedule()
        sched.update(step, runner.step(step.seqs))
        if r.is_finished:  # freed by the update that finished it, before any other schedule()
            assert sched.allocator.num_used == 0 and not sched.has_work()
    return r, r.output_text.take()[0]


def test_a_stop_string_ends_the_request_in_the_update_that_completes_it():
    r, text = run([A, B, C, A, B, C], ("bc",))
    assert (r.status, r.num_output_tokens, text) == (RequestStatus.FINISHED_STOPPED, 3, "a")


def test_a_stop_string_wins_over_max_tokens_on_the_same_token():
    r, text = run([A, B, C], ("bc",), max_tokens=3)
    assert (r.finish_reason, text) == (FinishReason.STOP, "a")


def test_a_held_candidate_that_never_completes_ends_with_the_length_rule():
    r, text = run([A, B, C], ("cx",), max_tokens=3)
    assert (r.finish_reason, text) == (FinishReason.LENGTH, "abc")


@pytest.mark.parametrize(("script", "max_tokens"), [([A, B], 2), ([A, B, EOS], 10)])
def test_a_stop_pending_under_a_longer_one_is_applied_when_another_rule_ends_the_text(script, max_tokens):
    # "b" completes at the 2nd token while "aba" may still come; then max_tokens, or EOS, ends the text.
    r, text = run(script, ("b", "aba"), max_tokens=max_tokens)
    assert (r.finish_reason, text) == (FinishReason.STOP, "a")


def test_the_stop_token_of_stop_token_ids_is_in_the_text_unless_special():
    r, text = run([A, B, C], (), stop_token_ids=(B,))
    assert (r.finish_reason, text) == (FinishReason.STOP, "ab")
    r, text = run([A, EOS], (), skip_special_tokens=False)
    assert (r.finish_reason, r.output_token_ids, text) == (FinishReason.STOP, [A, EOS], "a<s2>")
