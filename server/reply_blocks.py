"""A reply as an ordered list of blocks (thinking, answer text, one per tool call), opened, grown and
closed as its events stream: the shape both the Responses API (output items) and Anthropic's Messages
API (content blocks) stream and return. Each writes its own events from the same operations.

One block is open at a time: a new kind of piece closes the open block and opens the next. The tool-call
parser finishes a call's arguments before it announces the next call (server/tool_parsers.py), so
argument text always belongs to the open block.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from server.reply import Reply, ReplyEvent, TextPiece
from server.tool_parsers import ToolCallStart

BlockKind = Literal["reasoning", "text", "call"]


@dataclass
class Block:
    kind: BlockKind
    position: int  # among the reply's blocks: the output index / content block index
    text: str = ""  # the thinking, the answer text, or the call's arguments so far
    call_id: str = ""
    name: str = ""
    closed: bool = False
    complete: bool = False  # closed before the reply ended, or by its natural end (not a length cut)


@dataclass
class Opened:
    block: Block


@dataclass
class Grew:
    block: Block
    text: str


@dataclass
class Closed:
    block: Block


BlockOp = Opened | Grew | Closed


class BlockSequencer:
    """Turns a reply's events into block operations, in order."""

    def __init__(self) -> None:
        self.blocks: list[Block] = []

    @property
    def _open(self) -> Block | None:
        return self.blocks[-1] if self.blocks and not self.blocks[-1].closed else None

    def push(self, events: list[ReplyEvent]) -> list[BlockOp]:
        ops: list[BlockOp] = []
        for e in events:
            if isinstance(e, TextPiece):
                kind: BlockKind = "reasoning" if e.kind == "reasoning" else "text"
                block = self._current(kind, ops)
                if e.text:
                    block.text += e.text
                    ops.append(Grew(block, e.text))
            elif isinstance(e, ToolCallStart):
                self._close(ops)
                block = Block("call", len(self.blocks), call_id=e.id, name=e.name)
                self.blocks.append(block)
                ops.append(Opened(block))
            else:
                block = self.blocks[-1]
                assert block.kind == "call" and block is self._open, (
                    "arguments of a call that is not the last"
                )
                block.text += e.text
                ops.append(Grew(block, e.text))
        return ops

    def close(self, finish_reason: str | None) -> list[BlockOp]:
        """The end of the reply: the open block closes, complete unless the token limit cut it."""
        block = self._open
        if block is None:
            return []
        block.closed, block.complete = True, finish_reason != "length"
        return [Closed(block)]

    def _current(self, kind: BlockKind, ops: list[BlockOp]) -> Block:
        block = self._open
        if block is not None and block.kind == kind:
            return block
        self._close(ops)
        block = Block(kind, len(self.blocks))
        self.blocks.append(block)
        ops.append(Opened(block))
        return block

    def _close(self, ops: list[BlockOp]) -> None:
        block = self._open
        if block is not None:
            block.closed = block.complete = True
            ops.append(Closed(block))


def blocks_of(reply: Reply, finish_reason: str | None) -> list[Block]:
    """A whole reply's blocks: the thinking, the answer text, then the calls; the last one is
    incomplete when the token limit cut the reply."""
    blocks: list[Block] = []
    if reply.reasoning is not None:
        blocks.append(Block("reasoning", 0, reply.reasoning))
    if reply.content:
        blocks.append(Block("text", len(blocks), reply.content))
    for call_id, name, arguments in reply.calls:
        blocks.append(Block("call", len(blocks), arguments, call_id, name))
    for b in blocks:
        b.closed = b.complete = True
    if blocks and finish_reason == "length":
        blocks[-1].complete = False
    return blocks
