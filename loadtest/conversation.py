"""Multi-turn chat conversations: what each turn sends, and clients that hold a conversation each.

A conversation is a system prompt (a long context: instructions, a document, an agent's tools) and K
user messages. Turn k sends the system prompt, the first k user messages and the assistant's k - 1
replies as the server returned them (as a chat frontend resends the whole history), streams the reply,
and waits a think time before the next turn. Conversation i is drawn from its own generator seeded
with (seed, i), so every configuration gets the same conversations; the replies are the servers' own.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import httpx
import numpy as np

from loadtest.client import Target, send_request
from loadtest.prompts import PromptBuilder
from loadtest.records import RequestRecord
from loadtest.workload import RequestSpec

_THINK_STREAM = 0x7A1C  # think times draw from their own stream, so they do not shift the texts


@dataclass(frozen=True)
class ConversationShape:
    turns: int = 5
    system_len: int = 1000  # tokens of the system prompt every turn starts with
    user_len: int = 64  # tokens of each user message
    output_len: int = 64  # tokens of each reply (max_tokens = min_tokens, EOS ignored)
    think_time: float = 1.0  # mean seconds between a reply and the next message (exponential); 0: none

    def __post_init__(self) -> None:
        if self.turns < 1 or self.system_len < 1 or self.user_len < 1 or self.output_len < 1:
            raise ValueError(f"turns and lengths must be >= 1: {self}")
        if self.think_time < 0:
            raise ValueError(f"think time must be >= 0, got {self.think_time}")


@dataclass(frozen=True)
class Conversation:
    index: int
    system: str
    user_messages: tuple[str, ...]
    think_times: tuple[float, ...]  # after each turn but the last


def make_conversation(
    builder: PromptBuilder, shape: ConversationShape, seed: int, index: int
) -> Conversation:
    rng = np.random.default_rng([seed, index])
    system = builder.text_prompt(shape.system_len, rng)
    users = tuple(builder.text_prompt(shape.user_len, rng) for _ in range(shape.turns))
    think_rng = np.random.default_rng([seed, index, _THINK_STREAM])
    thinks = tuple(
        float(think_rng.exponential(shape.think_time)) if shape.think_time > 0 else 0.0
        for _ in range(shape.turns - 1)
    )
    return Conversation(index, system, users, thinks)


@dataclass
class TurnRecord:
    """One turn of one conversation: its request's timeline (times from the run's start)."""

    conversation: int
    turn: int  # 1-based
    record: RequestRecord

    def to_dict(self) -> dict[str, Any]:
        return {"conversation": self.conversation, "turn": self.turn, **self.record.to_dict()}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> TurnRecord:
        data = dict(data)
        conversation, turn = data.pop("conversation"), data.pop("turn")
        return cls(conversation, turn, RequestRecord.from_dict(data))


async def hold_conversation(
    client: httpx.AsyncClient,
    target: Target,
    conv: Conversation,
    shape: ConversationShape,
    t0: float,
    start_delay: float = 0.0,
    on_turn: Callable[[TurnRecord], None] | None = None,
) -> list[TurnRecord]:
    """Play one conversation to its end (or its first failed turn: a chat cannot go on without the
    reply). Turn k's prompt length is what the server reported, when it did."""
    await asyncio.sleep(start_delay)
    messages: list[dict[str, str]] = [{"role": "system", "content": conv.system}]
    out: list[TurnRecord] = []
    for k, user in enumerate(conv.user_messages, start=1):
        messages.append({"role": "user", "content": user})
        spec = RequestSpec(conv.index, "", 0, shape.output_len, messages=tuple(messages))
        record = RequestRecord(conv.index, 0, shape.output_len, scheduled_time=time.perf_counter() - t0)
        reply: list[str] = []
        await send_request(client, target, spec, record, t0, text_sink=reply)
        record.prompt_len = record.prompt_tokens_reported or 0
        turn = TurnRecord(conv.index, k, record)
        out.append(turn)
        if on_turn is not None:
            on_turn(turn)
        if not record.ok:
            break
        messages.append({"role": "assistant", "content": "".join(reply)})
        if k < shape.turns:
            await asyncio.sleep(conv.think_times[k - 1])
    return out


async def run_conversations(
    client: httpx.AsyncClient,
    target: Target,
    conversations: list[Conversation],
    shape: ConversationShape,
    start_spread: float,
    on_turn: Callable[[TurnRecord], None] | None = None,
) -> list[TurnRecord]:
    """All conversations at once (one client each), the i-th starting at i/n of `start_spread` seconds
    so that their turns do not stay in lockstep."""
    t0 = time.perf_counter()
    n = len(conversations)
    results = await asyncio.gather(
        *(
            hold_conversation(client, target, c, shape, t0, start_spread * i / n, on_turn)
            for i, c in enumerate(conversations)
        )
    )
    return [t for conv in results for t in conv]
