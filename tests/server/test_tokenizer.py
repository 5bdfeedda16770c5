"""The server's tokenizer: token bytes and text for logprobs."""

from __future__ import annotations

from server.tokenizer import ServerTokenizer


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
