"""A streamed message's events as Anthropic's API sends them: message_start, a ping, then per content
block content_block_start, its deltas (thinking_delta, text_delta, input_json_delta: the tool input's
JSON text as written) and content_block_stop, then message_delta (stop_reason, stop_sequence, usage)
and message_stop. An error mid-stream is an `error` event."""

from __future__ import annotations

from typing import Any

from server.anthropic.convert import content_block
from server.reply_blocks import Block, BlockOp, Closed, Grew, Opened


def block_events(ops: list[BlockOp]) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    for op in ops:
        index = op.block.position
        if isinstance(op, Opened):
            block = content_block(op.block, started=True)
            out.append({"type": "content_block_start", "index": index, "content_block": block})
        elif isinstance(op, Grew):
            out.append({"type": "content_block_delta", "index": index, "delta": _delta(op.block, op.text)})
        elif isinstance(op, Closed):
            out.append({"type": "content_block_stop", "index": index})
    return out


def _delta(block: Block, text: str) -> dict[str, Any]:
    if block.kind == "reasoning":
        return {"type": "thinking_delta", "thinking": text}
    if block.kind == "text":
        return {"type": "text_delta", "text": text}
    return {"type": "input_json_delta", "partial_json": text}


def message_delta(reason: str, stop: str | None, usage: dict[str, Any]) -> dict[str, Any]:
    return {"type": "message_delta", "delta": {"stop_reason": reason, "stop_sequence": stop}, "usage": usage}
