"""Reasoning ("thinking") models: where the thinking starts in a reply, how it is split from the answer as
the text streams, and the grammar that constrains only the answer after it.

`--reasoning-parser` names the format (`REASONING_FORMATS`). Both formats served today write the thinking
between `<think>` and `</think>`; they differ in where a reply starts:

- `qwen3`: the reply may open with `<think>` (Qwen3's template leaves that to the model); a template that
  turned thinking off writes an empty `<think>\\n\\n</think>` itself (`enable_thinking=False`).
- `deepseek_r1`: the reply starts inside the thinking whether or not it writes `<think>` (R1's template
  ends the prompt with `<think>\\n`; its distills' older templates did not, and the model thinks anyway).

Whatever the format, the rendered prompt decides (`thinking_mode`): a prompt that ends with an open
`<think>` starts the reply inside the thinking, one that ends with a closed `</think>` turns it off.

The split works on the decoded text, so the tags must reach the text: they do for Qwen3's and DeepSeek
R1's tokenizers (non-special added tokens). A tokenizer that marks them special would have them dropped
from the text (skip_special_tokens); `special_tag_problem` says so at start-up.
"""

from __future__ import annotations

import enum
import json
from dataclasses import dataclass
from typing import Any

from engine.grammar import GrammarSpec, llguidance_grammar

_WS = " \t\r\n"


@dataclass(frozen=True)
class ReasoningFormat:
    name: str
    start: str = "<think>"
    end: str = "</think>"
    starts_open: bool = False  # the reply starts inside the thinking unless the prompt closed it


REASONING_FORMATS = {
    f.name: f for f in (ReasoningFormat("qwen3"), ReasoningFormat("deepseek_r1", starts_open=True))
}


class ThinkingMode(enum.Enum):
    OFF = "off"  # the reply is all answer (the template closed the thinking)
    OPTIONAL = "optional"  # the reply may open with the start tag
    OPEN = "open"  # the reply starts inside the thinking (a leading start tag is dropped)


@dataclass(frozen=True)
class Thinking:
    """One request's reasoning format and where its reply starts."""

    fmt: ReasoningFormat
    mode: ThinkingMode


def thinking_mode(fmt: ReasoningFormat, prompt_text: str) -> ThinkingMode:
    tail = prompt_text.rstrip(_WS)
    if tail.endswith(fmt.start):
        return ThinkingMode.OPEN
    if tail.endswith(fmt.end):
        return ThinkingMode.OFF
    return ThinkingMode.OPEN if fmt.starts_open else ThinkingMode.OPTIONAL


def special_tag_problem(fmt: ReasoningFormat, special_tokens: set[str]) -> str | None:
    """Why this tokenizer cannot be split by text, or None."""
    tags = [t for t in (fmt.start, fmt.end) if t in special_tokens]
    if not tags:
        return None
    return (
        f"--reasoning-parser {fmt.name}: the tokenizer marks {', '.join(tags)} as special tokens, which are "
        "left out of the decoded text, so the thinking cannot be told from the answer"
    )


# --- splitting a reply as it streams -------------------------------------------------------------


class _State(enum.Enum):
    START = "start"  # OPTIONAL: waiting to see whether the reply opens with the start tag
    LEAD = "lead"  # OPEN: a start tag may still come first (it is dropped)
    OPENED = "opened"  # just past the start tag: whitespace before the thinking is dropped
    THINKING = "thinking"
    AFTER = "after"  # just past the end tag: whitespace before the answer is dropped
    ANSWER = "answer"


class ReasoningSplitter:
    """Splits one reply into (reasoning, answer) text as it grows. Text that may be the start of a tag
    is held until the next piece decides, so the pieces of a stream join to `split_all`'s result."""

    def __init__(self, thinking: Thinking) -> None:
        self._fmt = thinking.fmt
        self._state = {
            ThinkingMode.OFF: _State.ANSWER,
            ThinkingMode.OPTIONAL: _State.START,
            ThinkingMode.OPEN: _State.LEAD,
        }[thinking.mode]
        self._buf = ""

    def feed(self, text: str) -> tuple[str, str]:
        self._buf += text
        return self._advance(final=False)

    def finish(self) -> tuple[str, str]:
        return self._advance(final=True)

    def _advance(self, final: bool) -> tuple[str, str]:
        reasoning, answer = "", ""
        fmt = self._fmt
        while True:
            buf = self._buf
            if self._state in (_State.START, _State.LEAD):
                lead = buf.lstrip(_WS)
                if lead.startswith(fmt.start):
                    self._buf = lead[len(fmt.start) :]
                    self._state = _State.OPENED
                    continue
                if not final and fmt.start.startswith(lead):  # undecided (also: only whitespace so far)
                    return reasoning, answer
                self._state = _State.ANSWER if self._state is _State.START else _State.THINKING
                if self._state is _State.THINKING:
                    self._buf = lead
                continue
            if self._state is _State.THINKING:
                at = buf.find(fmt.end)
                if at >= 0:
                    reasoning += buf[:at]
                    self._buf = buf[at + len(fmt.end) :]
                    self._state = _State.AFTER
                    continue
                keep = 0 if final else _partial_suffix(buf, fmt.end)
                reasoning += buf[: len(buf) - keep]
                self._buf = buf[len(buf) - keep :]
                break
            if self._state in (_State.OPENED, _State.AFTER):
                rest = buf.lstrip(_WS)
                if not rest:
                    self._buf = ""
                    break
                self._buf = rest
                self._state = _State.THINKING if self._state is _State.OPENED else _State.ANSWER
                continue
            answer += buf
            self._buf = ""
            break
        return reasoning, answer


def split_all(thinking: Thinking, text: str) -> tuple[str, str]:
    """A whole reply's (reasoning, answer)."""
    splitter = ReasoningSplitter(thinking)
    r1, a1 = splitter.feed(text)
    r2, a2 = splitter.finish()
    return r1 + r2, a1 + a2


def _partial_suffix(text: str, tag: str) -> int:
    """Length of the longest suffix of text that is a proper prefix of tag."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0


# --- the grammar: free thinking, then the constrained answer ---------------------------------------


def thinking_grammar(answer: GrammarSpec, thinking: Thinking) -> GrammarSpec:
    """`answer`'s grammar behind the thinking the reply may (OPTIONAL) or must (OPEN) start with: free
    text up to the end tag (a lazy lexeme: the first end tag closes it), whitespace, then the answer as
    a sub-grammar. OFF: the answer's grammar as it is."""
    if thinking.mode is ThinkingMode.OFF:
        return answer
    fmt = thinking.fmt
    start, end = json.dumps(fmt.start), json.dumps(fmt.end)
    if thinking.mode is ThinkingMode.OPTIONAL:
        top = f"start: think? @answer\nthink: {start} body /[ \\t\\r\\n]*/\n"
    else:  # a start tag the model writes anyway is allowed (and dropped by the splitter)
        top = f"start: {start}? body /[ \\t\\r\\n]*/ @answer\n"
    lark = f"%llguidance {{}}\n{top}body[suffix={end}]: /(.|\\n)*/\n"
    subs = _grammars_of(llguidance_grammar(answer))
    subs[0] = {**subs[0], "name": "answer"}
    return GrammarSpec("llguidance", json.dumps({"grammars": [{"lark_grammar": lark}, *subs]}))


def _grammars_of(grammar: str) -> list[dict[str, Any]]:
    """llguidance_grammar's result as a list of grammars: it is either a TopLevelGrammar (JSON) or the
    text of a Lark grammar (which never starts with `{`)."""
    if grammar.lstrip().startswith("{"):
        return [dict(g) for g in json.loads(grammar)["grammars"]]
    return [{"lark_grammar": grammar}]
