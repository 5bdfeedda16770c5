"""Between the Responses API and the shared chat path (server/routes/chat_job.py): a request's input
items as chat messages, its options as a ChatCompletionRequest, and a reply's blocks as output items
and the response object.

Input items become chat messages the chat template renders: a message item by its role (instructions
first, as a system message), function calls as an assistant turn's tool_calls (calls that follow an
assistant message join it), function call outputs as tool messages, and a reasoning item as the
reasoning_content of the assistant turn after it.
"""

from __future__ import annotations

import time
import uuid
from typing import Any

from server.errors import APIError, invalid
from server.protocol import ChatCompletionRequest
from server.reply import Reply
from server.reply_blocks import Block
from server.responses_api.protocol import (
    FunctionCallItem,
    FunctionCallOutputItem,
    MessageItem,
    ReasoningItem,
    ResponsesRequest,
)
from server.translate import validated

# Chat request fields -> the Responses fields they came from, for the `param` of a 400.
PARAMS = {
    "messages": "input",
    "max_tokens": "max_output_tokens",
    "max_completion_tokens": "max_output_tokens",
    "response_format": "text.format",
    "reasoning_effort": "reasoning.effort",
}


def new_response_id() -> str:
    return f"resp_{uuid.uuid4().hex}"


def check_supported(body: ResponsesRequest) -> None:
    """400s for what the reference defines and this server does not run."""
    wants_logprobs = body.top_logprobs or "message.output_text.logprobs" in (body.include or [])
    if wants_logprobs:
        raise invalid(
            "Logprobs are not returned by /v1/responses on this server; use /v1/chat/completions.",
            param="top_logprobs" if body.top_logprobs else "include",
        )
    if body.truncation == "auto":
        raise invalid(
            "truncation 'auto' is not supported: a conversation longer than the context is refused.",
            param="truncation",
        )
    if body.background and body.store is False:
        raise invalid("Background responses must be stored: set store to true.", param="background")
    if body.background and body.stream:
        raise invalid("Streaming a background response is not supported; poll it instead.", param="stream")


def input_messages(body: ResponsesRequest) -> list[dict[str, Any]]:
    """The request's input as chat messages (without the instructions)."""
    if isinstance(body.input, str):
        return [{"role": "user", "content": body.input}]
    out: list[dict[str, Any]] = []
    thinking: list[str] = []  # reasoning items waiting for the assistant turn they belong to

    def assistant(content: str | None) -> dict[str, Any]:
        msg: dict[str, Any] = {"role": "assistant", "content": content}
        if thinking:
            msg["reasoning_content"] = "".join(thinking)
            thinking.clear()
        return msg

    for item in body.input:
        if isinstance(item, ReasoningItem):
            thinking.append(item.text())
        elif isinstance(item, MessageItem):
            out.append(
                assistant(item.text())
                if item.role == "assistant"
                else {"role": item.role, "content": item.text()}
            )
        elif isinstance(item, FunctionCallItem):
            call = {
                "id": item.call_id,
                "type": "function",
                "function": {"name": item.name, "arguments": item.arguments},
            }
            if not (out and out[-1]["role"] == "assistant") or thinking:
                out.append(assistant(None))
            out[-1].setdefault("tool_calls", []).append(call)
        elif isinstance(item, FunctionCallOutputItem):
            out.append({"role": "tool", "tool_call_id": item.call_id, "content": item.text()})
    return out


def chat_request(body: ResponsesRequest, conversation: list[dict[str, Any]]) -> ChatCompletionRequest:
    """The request as the chat path runs it: the instructions, then `conversation` (that of
    previous_response_id, if any, then input_messages)."""
    messages = [{"role": "system", "content": body.instructions}] if body.instructions else []
    messages += conversation
    fmt = body.text.format if body.text is not None else None
    tools = [
        {"type": "function", "function": t.model_dump(exclude={"type"}, exclude_none=True)}
        for t in body.tools or []
    ]
    choice: Any = body.tool_choice
    if choice is not None and not isinstance(choice, str):
        choice = {"type": "function", "function": {"name": choice.name}}
    fields = {
        "model": body.model,
        "messages": messages,
        "max_completion_tokens": body.max_output_tokens,
        "temperature": body.temperature,
        "top_p": body.top_p,
        "top_k": body.top_k,
        "seed": body.seed,
        "user": body.user,
        "tools": tools or None,
        "tool_choice": choice,
        "parallel_tool_calls": body.parallel_tool_calls,
        # A forced call writes no text, so text.format has nothing to shape in this turn (OpenAI accepts
        # both, e.g. the Agents SDK with an output type and a tool_choice); the chat path would refuse it.
        "response_format": _response_format(fmt) if fmt is not None and not _forces_call(choice) else None,
        "reasoning_effort": body.reasoning.effort if body.reasoning is not None else None,
        "chat_template_kwargs": body.chat_template_kwargs,
    }
    return validated(ChatCompletionRequest, fields, PARAMS)


def _forces_call(choice: Any) -> bool:
    return choice == "required" or isinstance(choice, dict)


def _response_format(fmt: Any) -> dict[str, Any]:
    if fmt.type != "json_schema":
        return {"type": fmt.type}
    schema = {
        "name": fmt.name or "response",
        "schema": fmt.schema_ or {"type": "object"},
        "strict": fmt.strict,
    }
    return {"type": "json_schema", "json_schema": schema}


def assistant_turn(reply: Reply) -> dict[str, Any]:
    """The reply as the chat message a continuation (previous_response_id) replays."""
    msg: dict[str, Any] = {
        "role": "assistant",
        "content": reply.content if reply.content or reply.calls else "",
    }
    if reply.calls:
        msg["tool_calls"] = [
            {"id": i, "type": "function", "function": {"name": n, "arguments": a}} for i, n, a in reply.calls
        ]
    if reply.reasoning:
        msg["reasoning_content"] = reply.reasoning
    return msg


def reply_of(blocks: list[Block]) -> Reply:
    reasoning = "".join(b.text for b in blocks if b.kind == "reasoning")
    content = "".join(b.text for b in blocks if b.kind == "text")
    calls = [(b.call_id, b.name, b.text) for b in blocks if b.kind == "call"]
    return Reply(reasoning or None, content if content or not calls else None, calls)


# --- output ---------------------------------------------------------------------------------------


def item_id(response_id: str, block: Block) -> str:
    if block.kind == "call":
        return "fc_" + block.call_id.removeprefix("call_")
    prefix = "rs" if block.kind == "reasoning" else "msg"
    return f"{prefix}_{response_id.removeprefix('resp_')}_{block.position}"


def _status(block: Block) -> str:
    if not block.closed:
        return "in_progress"
    return "completed" if block.complete else "incomplete"


def output_part(block: Block, text: str | None = None) -> dict[str, Any]:
    """The content part of a reasoning or message item (`text`: as streamed so far, else the whole)."""
    value = block.text if text is None else text
    if block.kind == "reasoning":
        return {"type": "reasoning_text", "text": value}
    return {"type": "output_text", "text": value, "annotations": [], "logprobs": []}


def output_item(response_id: str, block: Block, started: bool = False) -> dict[str, Any]:
    """The output item of a block; `started`: as output_item.added announces it (nothing in it yet)."""
    item_id_ = item_id(response_id, block)
    status = "in_progress" if started else _status(block)
    if block.kind == "call":
        arguments = "" if started else block.text
        return {
            "id": item_id_,
            "type": "function_call",
            "call_id": block.call_id,
            "name": block.name,
            "arguments": arguments,
            "status": status,
        }
    parts = [] if started else [output_part(block)]
    if block.kind == "reasoning":
        return {"id": item_id_, "type": "reasoning", "summary": [], "content": parts, "status": status}
    return {"id": item_id_, "type": "message", "role": "assistant", "content": parts, "status": status}


def usage_of(use: dict[str, Any], reasoning_tokens: int) -> dict[str, Any]:
    """A chat usage object as the Responses API reports it."""
    return {
        "input_tokens": use["prompt_tokens"],
        "input_tokens_details": {"cached_tokens": use["prompt_tokens_details"]["cached_tokens"]},
        "output_tokens": use["completion_tokens"],
        "output_tokens_details": {"reasoning_tokens": reasoning_tokens},
        "total_tokens": use["total_tokens"],
    }


def response_object(
    response_id: str,
    created_at: float,
    body: ResponsesRequest,
    model: str,
    status: str,
    output: list[dict[str, Any]],
    usage: dict[str, Any] | None = None,
    error: APIError | None = None,
) -> dict[str, Any]:
    fmt = body.text.format if body.text is not None and body.text.format is not None else None
    choice: Any = body.tool_choice or "auto"
    return {
        "id": response_id,
        "object": "response",
        "created_at": created_at,
        "status": status,
        "background": bool(body.background),
        "error": None if error is None else {"code": error.code or error.type, "message": error.message},
        "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
        "instructions": body.instructions,
        "max_output_tokens": body.max_output_tokens,
        "max_tool_calls": None,
        "metadata": body.metadata or {},
        "model": model,
        "output": output,
        "parallel_tool_calls": body.parallel_tool_calls is not False,
        "previous_response_id": body.previous_response_id,
        "reasoning": {"effort": body.reasoning.effort if body.reasoning else None, "summary": None},
        "store": body.store is not False,
        "temperature": 1.0 if body.temperature is None else body.temperature,
        "text": {"format": fmt.model_dump(by_alias=True, exclude_none=True) if fmt else {"type": "text"}},
        "tool_choice": choice if isinstance(choice, str) else choice.model_dump(),
        "tools": [t.model_dump(exclude_none=True) for t in body.tools or []],
        "top_p": 1.0 if body.top_p is None else body.top_p,
        "truncation": "disabled",
        "usage": usage,
        "user": body.user,
        "completed_at": time.time() if status in ("completed", "incomplete") else None,
    }
