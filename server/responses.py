"""OpenAI response shapes (completions, chat, their stream chunks, usage, both logprobs formats)."""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass
from typing import Any

from scheduler.outputs import TokenLogprob
from server.generation import LogprobEntry
from server.tokenizer import ServerTokenizer

SYSTEM_FINGERPRINT = "fp_orca_serve_0_1"


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


@dataclass
class ResponseMeta:
    """What every object and chunk of one response repeats."""

    id: str
    model: str
    created: int

    @classmethod
    def new(cls, prefix: str, model: str) -> ResponseMeta:
        return cls(new_id(prefix), model, int(time.time()))

    def header(self, obj: str) -> dict[str, Any]:
        return {
            "id": self.id,
            "object": obj,
            "created": self.created,
            "model": self.model,
            "system_fingerprint": SYSTEM_FINGERPRINT,
        }


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> dict[str, Any]:
    """OpenAI's usage object; cached_tokens: prompt tokens served from the prefix cache."""
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached_tokens},
    }


# --- logprobs ---
def completion_logprobs(
    entries: list[LogprobEntry], tokenizer: ServerTokenizer, offset_base: int = 0
) -> dict[str, Any]:
    """The legacy shape: parallel lists; top_logprobs holds the top k and the chosen token (OpenAI)."""
    tops: list[dict[str, float]] = []
    for e in entries:
        top = {tokenizer.token_text(tid): lp for tid, lp in e.top}
        top.setdefault(e.token, e.logprob)
        tops.append(top)
    return {
        "tokens": [e.token for e in entries],
        "token_logprobs": [e.logprob for e in entries],
        "top_logprobs": tops,
        "text_offset": [offset_base + e.text_offset for e in entries],
    }


def echo_logprobs(
    prompt_ids: list[int], scored: list[TokenLogprob | None], tokenizer: ServerTokenizer
) -> dict[str, Any]:
    """The legacy logprobs of an echoed prompt (OpenAI's echo with logprobs): every prompt token, None
    for the first (nothing precedes it), text offsets into the prompt's decoded text."""
    detok = tokenizer.decode_stream([], skip_special_tokens=False)
    offsets, at = [], 0
    for token_id in prompt_ids:
        offsets.append(at)
        at += len(detok.step(token_id))
    tops: list[dict[str, float] | None] = []
    for token_id, lp in zip(prompt_ids, scored, strict=True):
        if lp is None:
            tops.append(None)
            continue
        top = {tokenizer.token_text(tid): v for tid, v in lp.top_logprobs}
        top.setdefault(tokenizer.token_text(token_id), lp.logprob)
        tops.append(top)
    return {
        "tokens": [tokenizer.token_text(t) for t in prompt_ids],
        "token_logprobs": [None if lp is None else lp.logprob for lp in scored],
        "top_logprobs": tops,
        "text_offset": offsets,
    }


def join_logprobs(first: dict[str, Any], then: dict[str, Any] | None) -> dict[str, Any]:
    """Two legacy logprobs objects as one (the echoed prompt's, then the generated text's)."""
    if then is None:
        return first
    return {key: [*first[key], *then[key]] for key in first}


def vllm_prompt_logprobs(
    prompt_ids: list[int], scored: list[TokenLogprob | None], tokenizer: ServerTokenizer
) -> list[dict[str, dict[str, Any]] | None]:
    """vLLM's `prompt_logprobs`: per prompt token (None for the first), token id -> {logprob, rank,
    decoded_token} for the prompt token itself and the top-k there."""
    out: list[dict[str, dict[str, Any]] | None] = []
    for token_id, lp in zip(prompt_ids, scored, strict=True):
        if lp is None:
            out.append(None)
            continue
        entry = {
            str(tid): {"logprob": v, "rank": rank, "decoded_token": tokenizer.token_text(tid)}
            for rank, (tid, v) in enumerate(lp.top_logprobs, start=1)
        }
        entry[str(token_id)] = {
            "logprob": lp.logprob,
            "rank": lp.rank,
            "decoded_token": tokenizer.token_text(token_id),
        }
        out.append(entry)
    return out


def chat_logprobs(entries: list[LogprobEntry], tokenizer: ServerTokenizer) -> dict[str, Any]:
    def item(token_id: int, logprob: float) -> dict[str, Any]:
        return {
            "token": tokenizer.token_text(token_id),
            "logprob": logprob,
            "bytes": list(tokenizer.token_bytes(token_id)),
        }

    content = []
    for e in entries:
        entry = item(e.token_id, e.logprob)
        entry["top_logprobs"] = [item(tid, lp) for tid, lp in e.top]
        content.append(entry)
    return {"content": content, "refusal": None}


# --- completions ---
def completion_choice(
    index: int, text: str, logprobs: dict[str, Any] | None, finish_reason: str | None
) -> dict[str, Any]:
    return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish_reason}


def completion_response(
    meta: ResponseMeta, choices: list[dict[str, Any]], use: dict[str, Any]
) -> dict[str, Any]:
    return {**meta.header("text_completion"), "choices": choices, "usage": use}


def stream_chunk(
    meta: ResponseMeta,
    object_type: str,  # "text_completion" or "chat.completion.chunk"
    choices: list[dict[str, Any]],
    use: dict[str, Any] | None = None,
    with_usage: bool = False,
) -> dict[str, Any]:
    """One streamed chunk of a completion or a chat completion."""
    chunk = {**meta.header(object_type), "choices": choices}
    if with_usage:  # OpenAI sends "usage": null on every chunk once include_usage is on
        chunk["usage"] = use
    return chunk


# --- chat ---
def chat_choice(
    index: int,
    text: str | None,
    logprobs: dict[str, Any] | None,
    finish_reason: str | None,
    tool_calls: list[dict[str, Any]] | None = None,
    reasoning: str | None = None,
) -> dict[str, Any]:
    message: dict[str, Any] = {"role": "assistant", "content": text, "refusal": None}
    if reasoning is not None:  # under vLLM's name and under the name vLLM's newer releases and Ollama use
        message["reasoning_content"] = message["reasoning"] = reasoning
    if tool_calls:
        message["tool_calls"] = tool_calls
    return {"index": index, "message": message, "logprobs": logprobs, "finish_reason": finish_reason}


def tool_call(call_id: str, name: str, arguments: str) -> dict[str, Any]:
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}


def tool_call_delta(
    index: int, *, call_id: str | None = None, name: str | None = None, arguments: str = ""
) -> dict[str, Any]:
    """One streamed piece of a call: the first carries id, type and name; the rest argument text."""
    if call_id is not None:
        return {
            "index": index,
            "id": call_id,
            "type": "function",
            "function": {"name": name, "arguments": arguments},
        }
    return {"index": index, "function": {"arguments": arguments}}


def chat_response(meta: ResponseMeta, choices: list[dict[str, Any]], use: dict[str, Any]) -> dict[str, Any]:
    return {**meta.header("chat.completion"), "choices": choices, "usage": use}


def chat_chunk_choice(
    index: int,
    delta: dict[str, Any],
    logprobs: dict[str, Any] | None = None,
    finish_reason: str | None = None,
) -> dict[str, Any]:
    return {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}
