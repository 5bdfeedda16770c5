"""The server's pure parts: stop-string hold-back, size parsing, CLI flags, token bytes."""

from __future__ import annotations

import pytest
from hypothesis import example, given
from hypothesis import strategies as st

from server.cli import parse_args
from server.config import parse_size
from server.stop import StopStringMatcher
from server.tokenizer import ServerTokenizer


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


@pytest.mark.parametrize(
    ("text", "value"),
    [
        ("4096", 4096),
        ("2GiB", 2 * 2**30),
        ("512MiB", 512 * 2**20),
        ("1GB", 10**9),
        ("1.5 KiB", 1536),
        ("3g", 3 * 10**9),
    ],
)
def test_parse_size(text, value):
    assert parse_size(text) == value


@pytest.mark.parametrize("text", ["", "lots", "2XB", "-1GiB", "0"])
def test_parse_size_rejects(text):
    with pytest.raises(ValueError):
        parse_size(text)


def test_cli_flags():
    c = parse_args(
        "--model m.gguf --served-model-name x --port 9000 --kv-cache-memory 2GiB --scheduling request "
        "--kv-policy reserve --no-chunked-prefill --api-key k --max-num-seqs 8 --max-num-batched-tokens 256".split()
    )
    assert (c.model, c.model_name, c.port, c.kv_cache_memory) == ("m.gguf", "x", 9000, 2 * 2**30)
    assert (c.scheduling, c.kv_policy, c.chunked_prefill, c.api_key) == ("request", "reserve", False, "k")
    assert (c.max_num_seqs, c.max_num_batched_tokens) == (8, 256)
    d = parse_args([])
    assert (d.model, d.model_name, d.host, d.port, d.chunked_prefill) == (
        "default",
        "default",
        "127.0.0.1",
        8000,
        True,
    )
    with pytest.raises(SystemExit):
        parse_args(["--kv-cache-memory", "lots"])
    with pytest.raises(SystemExit):
        parse_args(["--kv-cache-memory", "1GiB", "--num-kv-blocks", "10"])


def test_token_bytes_and_text(smollm2_tokenizer_dir):
    tok = ServerTokenizer.from_pretrained(str(smollm2_tokenizer_dir))
    text = "naïve 你好 🎉"
    ids = tok.encode(text, add_special_tokens=False)
    assert b"".join(tok.token_bytes(i) for i in ids) == text.encode()
    assert tok.token_text(2) == "<|im_end|>"
    partial = [i for i in ids if tok.token_text(i).startswith("bytes:")]
    assert partial  # some tokens hold only part of a character
    # Incremental decoding yields the same text, never a broken character.
    detok = tok.decode_stream([], skip_special_tokens=True)
    pieces = [detok.step(i) for i in ids]
    assert "".join(pieces) == text and not any("\ufffd" in p for p in pieces)
