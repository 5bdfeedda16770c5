"""A streamed response's typed events, numbered by `sequence_number` as the reference defines them:
response.created and response.in_progress; per output item, output_item.added, then for a message or
reasoning item content_part.added, its text deltas, the text's .done and content_part.done, for a
function call its arguments' deltas and .done; output_item.done; and one of response.completed,
response.incomplete (the token limit) or response.failed."""

from __future__ import annotations

from typing import Any

from server.reply_blocks import Block, BlockOp, Closed, Grew, Opened
from server.responses_api.convert import item_id, output_item, output_part


class ResponseEvents:
    def __init__(self, response_id: str) -> None:
        self.response_id = response_id
        self._seq = 0

    def event(self, kind: str, **fields: Any) -> dict[str, Any]:
        out = {"type": kind, "sequence_number": self._seq, **fields}
        self._seq += 1
        return out

    def lifecycle(self, kind: str, response: dict[str, Any]) -> dict[str, Any]:
        """response.created / .in_progress / .completed / .incomplete / .failed."""
        return self.event(f"response.{kind}", response=response)

    def ops(self, ops: list[BlockOp]) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = []
        for op in ops:
            if isinstance(op, Opened):
                out += self._opened(op.block)
            elif isinstance(op, Grew):
                out.append(self._grew(op.block, op.text))
            elif isinstance(op, Closed):
                out += self._closed(op.block)
        return out

    def _where(self, block: Block) -> dict[str, Any]:
        return {"item_id": item_id(self.response_id, block), "output_index": block.position}

    def _opened(self, block: Block) -> list[dict[str, Any]]:
        item = output_item(self.response_id, block, started=True)
        out = [self.event("response.output_item.added", output_index=block.position, item=item)]
        if block.kind != "call":
            part = output_part(block, "")
            out.append(
                self.event("response.content_part.added", **self._where(block), content_index=0, part=part)
            )
        return out

    def _grew(self, block: Block, text: str) -> dict[str, Any]:
        where = self._where(block)
        if block.kind == "call":
            return self.event("response.function_call_arguments.delta", **where, delta=text)
        if block.kind == "reasoning":
            return self.event("response.reasoning_text.delta", **where, content_index=0, delta=text)
        return self.event("response.output_text.delta", **where, content_index=0, delta=text, logprobs=[])

    def _closed(self, block: Block) -> list[dict[str, Any]]:
        where = self._where(block)
        out = []
        if block.kind == "call":
            out.append(
                self.event(
                    "response.function_call_arguments.done", **where, name=block.name, arguments=block.text
                )
            )
        else:
            if block.kind == "reasoning":
                out.append(
                    self.event("response.reasoning_text.done", **where, content_index=0, text=block.text)
                )
            else:
                done = self.event(
                    "response.output_text.done", **where, content_index=0, text=block.text, logprobs=[]
                )
                out.append(done)
            part = output_part(block)
            out.append(self.event("response.content_part.done", **where, content_index=0, part=part))
        item = output_item(self.response_id, block)
        out.append(self.event("response.output_item.done", output_index=block.position, item=item))
        return out
