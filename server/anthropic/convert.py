"""Between Anthropic's Messages API and the shared chat path (server/routes/chat_job.py): a request as a
ChatCompletionRequest, and a reply's blocks as content blocks, stop_reason and usage.

Messages become chat messages: `system` first; an assistant message's text as its content, its tool_use
blocks as tool_calls (the input re-serialized as the arguments), its thinking as reasoning_content; a user
message's tool_result blocks as tool messages (in order, before the user's own text). `thinking`
turns the template's enable_thinking on or off (budget_tokens is not enforced); `output_config.format`
is a strict JSON schema for the answer, `output_config.effort` the template's reasoning_effort.
"""

from __future__ import annotations

import json
import uuid
from typing import Any

from pydantic_core import from_json

from server.anthropic.protocol import (
    CountTokensRequest,
    MessagesRequest,
    RedactedThinkingBlock,
    TextBlock,
    ThinkingBlock,
    ToolResultBlock,
    ToolUseBlock,
)
from server.protocol import ChatCompletionRequest
from server.reply_blocks import Block
from server.translate import validated

# Chat request fields -> the Messages fields they came from, for the errors' messages.
PARAMS = {
    "max_completion_tokens": "max_tokens",
    "stop": "stop_sequences",
    "response_format": "output_config.format",
    "reasoning_effort": "output_config.effort",
}
_CHOICES = {"auto": "auto", "any": "required", "none": "none"}


def new_message_id() -> str:
    return f"msg_{uuid.uuid4().hex}"


def chat_messages(body: CountTokensRequest) -> list[dict[str, Any]]:
    system = body.system_text()
    out: list[dict[str, Any]] = [{"role": "system", "content": system}] if system else []
    for m in body.messages:
        if isinstance(m.content, str):
            out.append({"role": m.role, "content": m.content})
            continue
        text = "".join(b.text for b in m.content if isinstance(b, TextBlock))
        if m.role == "assistant":
            msg: dict[str, Any] = {"role": "assistant", "content": text}
            calls = [
                {
                    "id": b.id,
                    "type": "function",
                    "function": {"name": b.name, "arguments": json.dumps(b.input)},
                }
                for b in m.content
                if isinstance(b, ToolUseBlock)
            ]
            if calls:
                msg["tool_calls"] = calls
            thinking = "".join(b.thinking for b in m.content if isinstance(b, ThinkingBlock))
            if thinking:
                msg["reasoning_content"] = thinking
            out.append(msg)
            continue
        for b in m.content:
            if isinstance(b, ToolResultBlock):
                result = ("Error: " if b.is_error else "") + b.text()
                out.append({"role": "tool", "tool_call_id": b.tool_use_id, "content": result})
        if any(isinstance(b, TextBlock) for b in m.content) or not any(
            isinstance(b, (ToolResultBlock, RedactedThinkingBlock)) for b in m.content
        ):
            out.append({"role": "user", "content": text})
    return out


def chat_request(body: CountTokensRequest) -> ChatCompletionRequest:
    tools = [
        {
            "type": "function",
            "function": {"name": t.name, "description": t.description, "parameters": t.input_schema},
        }
        for t in body.tools or []
    ]
    choice = body.tool_choice
    tool_choice: Any = None
    parallel = None
    if choice is not None:
        if choice.type == "tool":
            tool_choice = {"type": "function", "function": {"name": choice.name or ""}}
        else:
            tool_choice = _CHOICES[choice.type]
        parallel = False if choice.disable_parallel_tool_use else None
    kwargs = {}
    if body.thinking is not None and body.thinking.type != "adaptive":
        kwargs["enable_thinking"] = body.thinking.type == "enabled"
    out = body.output_config
    fields: dict[str, Any] = {
        "model": body.model,
        "messages": chat_messages(body),
        "tools": tools or None,
        "tool_choice": tool_choice,
        "parallel_tool_calls": parallel,
        "chat_template_kwargs": kwargs or None,
    }
    if out is not None and out.format is not None:
        schema = {"name": "output", "schema": out.format.schema_, "strict": True}
        fields["response_format"] = {"type": "json_schema", "json_schema": schema}
    if out is not None and out.effort is not None:
        fields["reasoning_effort"] = "xhigh" if out.effort == "max" else out.effort
    if isinstance(body, MessagesRequest):
        fields.update(
            max_completion_tokens=body.max_tokens,
            stop=body.stop_sequences,
            temperature=body.temperature,
            top_p=body.top_p,
            top_k=body.top_k,
        )
    return validated(ChatCompletionRequest, fields, PARAMS)


# --- output ---------------------------------------------------------------------------------------


def tool_use_id(call_id: str) -> str:
    return "toolu_" + call_id.removeprefix("call_")


def tool_input(arguments: str) -> dict[str, Any]:
    """A call's arguments as the object `input` must be. A call cut by max_tokens has a JSON prefix:
    it reads as far as it goes (an unfinished string is kept as written so far, as the SDKs' own
    partial-JSON readers do). Arguments that are not an object are kept under "arguments"."""
    if not arguments.strip():
        return {}
    try:
        value = from_json(arguments, allow_partial="trailing-strings")
    except ValueError:
        return {"arguments": arguments}
    return value if isinstance(value, dict) else {"arguments": value}


def content_block(block: Block, started: bool = False) -> dict[str, Any]:
    """A block as Anthropic writes it; `started`: as content_block_start announces it (empty)."""
    text = "" if started else block.text
    if block.kind == "reasoning":
        # Anthropic signs its thinking so that it can check it when sent back; there is nothing to sign.
        return {"type": "thinking", "thinking": text, "signature": ""}
    if block.kind == "text":
        return {"type": "text", "text": text}
    arguments = {} if started else tool_input(block.text)
    return {"type": "tool_use", "id": tool_use_id(block.call_id), "name": block.name, "input": arguments}


def stop_reason(finish_reason: str | None, called: bool, stop_sequence: str | None) -> str:
    if finish_reason == "length":
        return "max_tokens"
    if called:
        return "tool_use"
    return "stop_sequence" if stop_sequence is not None else "end_turn"


def usage_of(use: dict[str, Any]) -> dict[str, Any]:
    """Anthropic counts cache reads apart from input_tokens. The prefix cache is automatic: what it
    served is a cache read, and nothing is reported as a cache write (there is no cache_control)."""
    cached = use["prompt_tokens_details"]["cached_tokens"]
    return {
        "input_tokens": use["prompt_tokens"] - cached,
        "output_tokens": use["completion_tokens"],
        "cache_read_input_tokens": cached,
        "cache_creation_input_tokens": 0,
    }


def message_object(
    message_id: str,
    model: str,
    content: list[dict[str, Any]],
    reason: str | None,
    stop: str | None,
    usage: dict,
) -> dict[str, Any]:
    return {
        "id": message_id,
        "type": "message",
        "role": "assistant",
        "model": model,
        "content": content,
        "stop_reason": reason,
        "stop_sequence": stop,
        "usage": usage,
    }
