"""The model's tokenizer as the server uses it: encode, chat templates, incremental decoding, and the
per-token strings and bytes that logprobs report."""

from __future__ import annotations

import functools
import re
from collections.abc import Mapping, Sequence
from typing import Any

from tokenizers import Tokenizer
from tokenizers.decoders import ByteLevel, DecodeStream

# Prompt tokens handed to DecodeStream as context: enough for decoders whose output depends on the
# previous token (SentencePiece's leading-space rule), cheap for long prompts.
_DECODE_CONTEXT_TOKENS = 8
_BYTE_FALLBACK_RE = re.compile(r"^<0x([0-9A-Fa-f]{2})>$")
# apply_chat_template's own arguments, which a request's chat_template_kwargs may not set (the server
# sets them, or they would change what the call returns).
RESERVED_TEMPLATE_KWARGS = frozenset(
    {
        "conversation",
        "messages",
        "tools",
        "documents",
        "chat_template",
        "add_generation_prompt",
        "continue_final_message",
        "tokenize",
        "padding",
        "truncation",
        "max_length",
        "return_tensors",
        "return_dict",
        "return_assistant_tokens_mask",
        "tokenizer_kwargs",
    }
)


@functools.cache
def _byte_level_decoder() -> dict[str, int]:
    """GPT-2's printable-character alphabet for raw bytes, reversed (char -> byte)."""
    printable = (
        list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAC + 1)) + list(range(0xAE, 0xFF + 1))
    )
    chars = printable[:]
    extra = 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + extra)
            extra += 1
    return {chr(c): b for b, c in zip(printable, chars, strict=True)}


class ServerTokenizer:
    """Wraps a transformers tokenizer (fast, with a `tokenizers.Tokenizer` backend)."""

    def __init__(self, hf_tokenizer: Any) -> None:
        self.hf = hf_tokenizer
        self.backend: Tokenizer = hf_tokenizer.backend_tokenizer
        self._byte_level = isinstance(self.backend.decoder, ByteLevel)
        self._special_ids = {i: t.content for i, t in self.backend.get_added_tokens_decoder().items()}
        self.vocab_size: int = self.backend.get_vocab_size(with_added_tokens=True)

    @classmethod
    def from_pretrained(cls, path: str) -> ServerTokenizer:
        from transformers import AutoTokenizer

        return cls(AutoTokenizer.from_pretrained(path))

    # --- encoding ---
    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self.backend.encode(text, add_special_tokens=add_special_tokens).ids

    @property
    def has_chat_template(self) -> bool:
        return bool(getattr(self.hf, "chat_template", None))

    @property
    def chat_template(self) -> str | None:
        template = getattr(self.hf, "chat_template", None)
        return template if isinstance(template, str) else None

    def render_chat(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool = True,
        tools: list[dict[str, Any]] | None = None,
        template_kwargs: Mapping[str, Any] | None = None,
    ) -> str:
        """The prompt text; raises ValueError (template missing or rejecting the conversation).
        `tools` go to templates that render tools themselves (server/tools.py decides);
        `template_kwargs` are the template's own variables (a request's chat_template_kwargs)."""
        if not self.has_chat_template:
            raise ValueError("This model's tokenizer has no chat template; use /v1/completions instead.")
        reserved = sorted(RESERVED_TEMPLATE_KWARGS & set(template_kwargs or ()))
        if reserved:
            raise ValueError(f"chat_template_kwargs may not set {', '.join(reserved)}")
        extra = {**(template_kwargs or {}), **({"tools": tools} if tools else {})}
        try:
            return self.hf.apply_chat_template(
                messages, tokenize=False, add_generation_prompt=add_generation_prompt, **extra
            )
        except Exception as exc:  # jinja raises TemplateError / its own `raise_exception` messages
            raise ValueError(f"The chat template rejected the messages: {exc}") from exc

    def encode_chat(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool = True,
        tools: list[dict[str, Any]] | None = None,
        template_kwargs: Mapping[str, Any] | None = None,
    ) -> list[int]:
        # The template writes BOS/role tokens itself, so no special tokens are added on top (vLLM too).
        text = self.render_chat(messages, add_generation_prompt, tools, template_kwargs)
        return self.encode(text, add_special_tokens=False)

    # --- decoding ---
    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self.backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def decode_stream(self, prompt_ids: Sequence[int], skip_special_tokens: bool) -> IncrementalDetokenizer:
        return IncrementalDetokenizer(self.backend, prompt_ids, skip_special_tokens)

    # --- logprob token strings ---
    @functools.lru_cache(maxsize=65536)  # noqa: B019 - one tokenizer per server, lives as long
    def token_bytes(self, token_id: int) -> bytes:
        """The raw bytes one token stands for (a part of a UTF-8 character for byte-level BPE)."""
        if token_id in self._special_ids:
            return self._special_ids[token_id].encode()
        piece = self.backend.id_to_token(token_id)
        if piece is None:
            return b""
        if self._byte_level:
            table = _byte_level_decoder()
            if all(ch in table for ch in piece):
                return bytes(table[ch] for ch in piece)
        match = _BYTE_FALLBACK_RE.match(piece)
        if match:  # SentencePiece byte fallback
            return bytes([int(match.group(1), 16)])
        return piece.replace("\u2581", " ").encode()

    def token_text(self, token_id: int) -> str:
        """The token as text; a token that is only part of a character reads `bytes:\\xe2\\x80` (OpenAI)."""
        raw = self.token_bytes(token_id)
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError:
            return "bytes:" + "".join(f"\\x{b:02x}" for b in raw)


class IncrementalDetokenizer:
    """New text per new token; never splits a multi-byte character (DecodeStream holds partial bytes)."""

    def __init__(self, tokenizer: Tokenizer, prompt_ids: Sequence[int], skip_special_tokens: bool) -> None:
        self._tokenizer = tokenizer
        context = list(prompt_ids[-_DECODE_CONTEXT_TOKENS:])
        self._stream = DecodeStream(ids=context, skip_special_tokens=skip_special_tokens)

    def step(self, token_id: int) -> str:
        return self._stream.step(self._tokenizer, token_id) or ""
