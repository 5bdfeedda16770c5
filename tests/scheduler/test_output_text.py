"""OutputText (scheduler.output_text): a request's tokens as text, held back and cut at stop strings, and
the logprobs of exactly the tokens whose text is emitted, with their text offsets."""

from __future__ import annotations

import pytest

from engine.contract import SamplingParams
from scheduler.fake_runner import FakeDetokenizer
from scheduler.output_text import OutputText, start_output

PIECES = {10: "hello", 11: " </", 12: "b>", 13: "x", 14: "</en", 15: "d>tail", 20: "a", 21: "b", 22: "c"}
DETOK = FakeDetokenizer(PIECES)


def output(*stops: str, skip_special_tokens: bool = True) -> OutputText:
    params = SamplingParams(stop=stops, skip_special_tokens=skip_special_tokens)
    return start_output(DETOK, [1, 2, 3], params)


def feed(out: OutputText, *tokens: int) -> tuple[str, list[tuple[int, int]]]:
    """Add tokens (each with a logprob); what is ready now as (text, [(token, text_offset)])."""
    for t in tokens:
        out.add(t, -0.5, [(t, -0.5)])
    text, logprobs = out.take()
    return text, [(lp.token_id, lp.text_offset) for lp in logprobs]


def test_without_stops_every_token_is_ready_at_once_with_its_offset():
    out = output()
    assert feed(out, 10) == ("hello", [(10, 0)])
    assert feed(out, 11, 12) == (" </b>", [(11, 5), (12, 8)])
    assert not out.stopped and not out.close() and out.take() == ("", [])


def test_a_token_waits_while_its_text_may_begin_a_stop_string():
    out = output("</end>")
    # " </": the space is emitted, "</" is held; the token's text starts before the held part.
    assert feed(out, 10, 11) == ("hello ", [(10, 0), (11, 5)])
    assert feed(out, 14) == ("</", [])  # "</</en": the first "</" is decided; "</en" is held, and its token
    assert feed(out, 12) == ("</enb>", [(14, 8), (12, 12)])  # "b>" decides it: not a stop string


def test_the_tokens_of_a_stop_string_are_never_reported():
    out = output("</end>")
    assert feed(out, 13, 14) == ("x", [(13, 0)])
    assert feed(out, 15) == ("", [])  # "</end>" completes: the text ends at 1, "tail" never comes
    assert out.stopped and out.matched == "</end>"
    assert out.close() and out.take() == ("", [])


def test_a_stop_that_completed_under_a_longer_candidate_is_applied_when_the_text_ends():
    out = output("b", "aba")
    assert feed(out, 20, 21) == ("", []) and not out.stopped  # "ab": "aba" may still come
    assert out.close() and out.matched == "b"
    text, logprobs = out.take()
    assert (text, [lp.token_id for lp in logprobs]) == ("a", [20])


def test_the_longer_candidate_wins_when_it_completes():
    out = output("b", "aba")
    assert feed(out, 20, 21, 20) == ("", []) and out.matched == "aba"  # starts first


def test_a_candidate_that_never_completes_is_released_when_the_text_ends():
    out = output("</end>")
    assert feed(out, 10, 11) == ("hello ", [(10, 0), (11, 5)])
    assert not out.close()
    assert out.take() == ("</", [])


def test_a_token_with_no_text_yet_is_ready_when_nothing_is_held():
    # A piece of "" is a token that ends inside a character: nothing to emit, nothing to hold.
    out = start_output(FakeDetokenizer({30: "", 31: "é"}), [], SamplingParams(stop=("zz",)))
    assert feed(out, 30) == ("", [(30, 0)])
    assert feed(out, 31) == ("é", [(31, 0)])


def test_special_tokens_follow_skip_special_tokens():
    assert feed(output(), 20, 2) == ("a", [(20, 0), (2, 1)])
    assert feed(output(skip_special_tokens=False), 20, 2) == ("a<s2>", [(20, 0), (2, 1)])


def test_tokens_without_logprobs_only_move_the_text():
    out = output("c")
    for t in (20, 21, 22, 20):
        out.add(t)
    assert out.stopped and out.take() == ("ab", [])


def test_stop_strings_need_a_detokenizer():
    with pytest.raises(ValueError, match="detokenizer"):
        start_output(None, [1], SamplingParams(stop=("x",)))
    tokens_only = start_output(None, [1], SamplingParams(logprobs=0))
    tokens_only.add(20, -1.0)
    text, logprobs = tokens_only.take()
    assert text == "" and [(lp.token_id, lp.text_offset) for lp in logprobs] == [(20, 0)]


@pytest.mark.parametrize("stop", [("",), ["x"], ("x", 3)])
def test_sampling_params_refuse_bad_stop_strings(stop):
    with pytest.raises(ValueError, match="stop"):
        SamplingParams(stop=stop)
