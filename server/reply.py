"""One choice's reply read as what it says: thinking, answer text and tool calls, streamed or whole.

Every chat-shaped API (chat completions, Responses, Messages) reads replies through `ReplyParser`; only
how the pieces are written out differs. The thinking is split off first (server/reasoning.py), so tool
calls are parsed from the answer only (server/tool_parsers.py).

A reply the token limit cut inside a tool call still returns the call as far as it went (its
arguments as written so far, and the API's "length" finish): dropping it, or returning its raw text as
the answer, loses what the model did. Under a named tool_choice (or `required` with one tool) the
call's name is known before the model writes it, so a call cut before its name is complete is still
returned under that name.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from server.reasoning import ReasoningSplitter, Thinking
from server.tool_parsers import ToolArgsDelta, ToolCallParser, ToolCallStart, ToolEvent, new_call_id
from server.tools import ToolPlan


@dataclass
class TextPiece:
    kind: Literal["reasoning", "content"]
    text: str


ReplyEvent = TextPiece | ToolCallStart | ToolArgsDelta


@dataclass
class Reply:
    """A whole reply: None for a part it does not have."""

    reasoning: str | None
    content: str | None
    calls: list[tuple[str, str, str]] = field(default_factory=list)  # (id, name, arguments)


class ReplyParser:
    """Events for one choice's reply as its text grows; `feed` the text deltas, then `finish` once."""

    def __init__(self, thinking: Thinking | None, plan: ToolPlan | None) -> None:
        self._split = ReasoningSplitter(thinking) if thinking is not None else None
        self._tools = ToolCallParser(plan.fmt) if plan is not None else None
        self._plan = plan
        self._calls: dict[int, list[str]] = {}  # index -> [id, name, arguments]

    @property
    def num_calls(self) -> int:
        return len(self._calls)

    def feed(self, text: str) -> list[ReplyEvent]:
        reasoning, answer = self._split.feed(text) if self._split is not None else ("", text)
        return self._events(reasoning, answer, final=False, cut=False)

    def finish(self, finish_reason: str | None) -> list[ReplyEvent]:
        """The held text at the end of the reply; `finish_reason` "length" means it was cut."""
        reasoning, answer = self._split.finish() if self._split is not None else ("", "")
        return self._events(reasoning, answer, final=True, cut=finish_reason == "length")

    def parse_all(self, text: str, finish_reason: str | None) -> Reply:
        events = self.feed(text) + self.finish(finish_reason)
        reasoning = "".join(e.text for e in events if isinstance(e, TextPiece) and e.kind == "reasoning")
        content = "".join(e.text for e in events if isinstance(e, TextPiece) and e.kind == "content")
        calls = [(c[0], c[1], c[2]) for _, c in sorted(self._calls.items())]
        return Reply(reasoning or None, content if content or not calls else None, calls)

    def _events(self, reasoning: str, answer: str, final: bool, cut: bool) -> list[ReplyEvent]:
        events: list[ReplyEvent] = []
        if reasoning:
            events.append(TextPiece("reasoning", reasoning))
        if self._tools is None:
            if answer:
                events.append(TextPiece("content", answer))
            return events
        content, calls = self._tools.feed(answer) if answer else ("", [])
        if final:
            tail, more = self._tools.finish(cut)
            content, calls = content + tail, calls + more
            if cut and not calls and not self._calls and self._named_call_cut(content):
                content, calls = "", self._named_call_start()
        if content:
            events.append(TextPiece("content", content))
        for e in calls:
            self._track(e)
        events.extend(calls)
        return events

    def _forced_name(self) -> str | None:
        """The function a constrained reply must call, when the plan leaves only one."""
        plan = self._plan
        if plan is None or not plan.constrained:
            return None
        if plan.function is not None:
            return plan.function
        return plan.tools[0].function.name if len(plan.tools) == 1 else None

    def _named_call_cut(self, held: str) -> bool:
        """The reply was a call to the one function it could call (the grammar made it one), cut before
        its name was complete."""
        return self._forced_name() is not None and bool(held.strip())

    def _named_call_start(self) -> list[ToolEvent]:
        name = self._forced_name()
        assert name is not None
        return [ToolCallStart(0, new_call_id(), name)]

    def _track(self, e: ToolEvent) -> None:
        if isinstance(e, ToolCallStart):
            self._calls[e.index] = [e.id, e.name, ""]
        else:
            self._calls[e.index][2] += e.text
