"""Tool calls out of generated text, in the formats models are trained on, streamed or not.

Formats (`TOOL_FORMATS`; server/tools.py picks one from the chat template):
- `generic` (the fallback for templates without tool support, after llama.cpp's generic handler): the
  whole reply is `{"tool_calls": [{"name": ..., "arguments": {...}}, ...]}` (or `{"tool_call": {...}}`).
- `hermes` (Hermes, Qwen 2/2.5/3): `<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`, one
  block per call, possibly after some text.
- `llama3` (Llama 3.1-3.3 JSON tool calling): the reply is `{"name": ..., "parameters": {...}}`
  (`<|python_tag|>` before it is a special token, gone from the text).
- `mistral`: `[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]` (the marker is a special token in
  recent tokenizers, so the text may start at `[`).

`ToolCallParser` reads the reply as it grows. Text that cannot be part of a call is content at once;
text that may open a call is held until it is clear. A call is announced (`ToolCallStart`) once its name
is complete and its arguments stream as they grow (`ToolArgsDelta`), as raw text: the fragments of a
call join to exactly the `arguments` string of the non-streamed reply. JSON that turns out to hold no
call is handed back as content at the end.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field

_WS = " \t\r\n"
_LITERAL = re.compile(r"[-+0-9.eEtruefalsn]*")


@dataclass(frozen=True)
class ToolFormat:
    name: str
    args_key: str  # "arguments" or "parameters"
    open_tag: str = ""  # opens a call anywhere in the reply (hermes)
    close_tag: str = ""
    starts_with: str = ""  # the calls are the whole reply, which starts with this character
    marker: str = ""  # an optional literal before the calls (mistral's [TOOL_CALLS])


TOOL_FORMATS = {
    f.name: f
    for f in (
        ToolFormat("generic", "arguments", starts_with="{"),
        ToolFormat("hermes", "arguments", open_tag="<tool_call>", close_tag="</tool_call>"),
        ToolFormat("llama3", "parameters", starts_with="{"),
        ToolFormat("mistral", "arguments", starts_with="[", marker="[TOOL_CALLS]"),
    )
}


@dataclass
class ToolCallStart:
    index: int
    id: str
    name: str


@dataclass
class ToolArgsDelta:
    index: int
    text: str


ToolEvent = ToolCallStart | ToolArgsDelta


@dataclass
class ParsedReply:
    """A whole reply: its content (None when it is only tool calls) and its calls."""

    content: str | None
    calls: list[tuple[str, str, str]] = field(default_factory=list)  # (id, name, arguments)


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


# --- JSON that may be cut short, with the spans of its values -------------------------------------


@dataclass
class _Node:
    kind: str  # "obj" | "arr" | "str" | "lit"
    start: int
    end: int | None = None  # None: cut short
    value: str | None = None  # a complete string's value
    items: list[tuple[str | None, _Node | None]] = field(default_factory=list)  # (key, value)


class _Malformed(Exception):
    pass


def _skip(text: str, i: int) -> int:
    while i < len(text) and text[i] in _WS:
        i += 1
    return i


def _parse(text: str, i: int) -> _Node | None:
    """The JSON value at i (after whitespace), possibly cut short; None if it has not started."""
    i = _skip(text, i)
    if i >= len(text):
        return None
    c = text[i]
    if c == '"':
        j = i + 1
        while j < len(text):
            if text[j] == "\\":
                j += 2
                continue
            if text[j] == '"':
                try:
                    return _Node("str", i, j + 1, json.loads(text[i : j + 1]))
                except json.JSONDecodeError:
                    raise _Malformed() from None
            j += 1
        return _Node("str", i)
    if c in "{[":
        return _parse_container(text, i)
    m = _LITERAL.match(text, i)
    j = m.end() if m else i
    if j == i:
        raise _Malformed()
    if j == len(text):
        return _Node("lit", i)  # may go on
    try:
        json.loads(text[i:j])
    except json.JSONDecodeError:
        raise _Malformed() from None
    return _Node("lit", i, j)


def _parse_container(text: str, i: int) -> _Node:
    is_obj = text[i] == "{"
    node = _Node("obj" if is_obj else "arr", i)
    close = "}" if is_obj else "]"
    j = _skip(text, i + 1)
    if j < len(text) and text[j] == close:
        node.end = j + 1
        return node
    while True:
        key: str | None = None
        if is_obj:
            j = _skip(text, j)
            if j >= len(text):
                return node
            if text[j] != '"':
                raise _Malformed()
            k = _parse(text, j)
            assert k is not None
            if k.end is None:
                return node
            key = k.value
            j = _skip(text, k.end)
            if j >= len(text):
                return node
            if text[j] != ":":
                raise _Malformed()
            j += 1
        value = _parse(text, j)
        node.items.append((key, value))
        if value is None or value.end is None:
            return node
        j = _skip(text, value.end)
        if j >= len(text):
            return node
        if text[j] == ",":
            j += 1
            continue
        if text[j] == close:
            node.end = j + 1
            return node
        raise _Malformed()


def _calls_in(
    node: _Node | None, text: str, args_key: str, out: list[tuple[str, str, bool]], cut: bool = False
) -> None:
    """(name, arguments so far, complete) of every call object in the tree, in order. `cut`: the reply
    ended mid-object (the token limit), so an object cut after its name is a call whose arguments never
    came; otherwise the arguments key must appear, or `{"name": "Bob", "age": 3}` would be a call."""
    if node is None or node.kind not in ("obj", "arr"):
        return
    if node.kind == "obj":
        fields = dict(node.items)
        name = fields.get("name")
        cut_short = cut and node.end is None
        if (
            name is not None
            and name.kind == "str"
            and name.end is not None
            and (args_key in fields or cut_short)
        ):
            args = fields.get(args_key)
            if args is None:
                out.append((name.value or "", "", False))
            else:
                end = args.end if args.end is not None else len(text)
                out.append((name.value or "", text[args.start : end].rstrip(_WS), args.end is not None))
            return
    for _, child in node.items:
        _calls_in(child, text, args_key, out, cut)


# --- the streaming parser -------------------------------------------------------------------------


class ToolCallParser:
    """Splits one choice's reply into content and tool calls as it is generated."""

    def __init__(self, fmt: ToolFormat) -> None:
        self.fmt = fmt
        self._text = ""
        self._content_sent = 0  # characters of _text handed out as content
        self._region: int | None = None  # where the calls start in _text
        self._plain = False  # decided: the reply is content only
        self._ids: list[str] = []
        self._names: list[str] = []
        self._args_sent: list[int] = []
        self._args: list[str] = []

    @property
    def num_calls(self) -> int:
        return len(self._ids)

    def feed(self, delta: str) -> tuple[str, list[ToolEvent]]:
        """New content and tool-call events for `delta`, the reply's next piece of text."""
        self._text += delta
        return self._advance(final=False)

    def finish(self, cut: bool = False) -> tuple[str, list[ToolEvent]]:
        """What was held back, at the end of the reply. `cut`: the token limit ended it, so a call cut
        right after its name is still a call (with the arguments it got: none)."""
        return self._advance(final=True, cut=cut)

    def parse_all(self, text: str, cut: bool = False) -> ParsedReply:
        """A whole reply at once (non-streamed responses)."""
        content, _ = self.feed(text)
        tail, _ = self.finish(cut)
        content += tail
        calls = list(zip(self._ids, self._names, self._args, strict=True))
        return ParsedReply(content if content or not calls else None, calls)

    def _advance(self, final: bool, cut: bool = False) -> tuple[str, list[ToolEvent]]:
        if self._plain:
            return self._content_up_to(len(self._text)), []
        if self._region is None:
            content = self._find_region(final)
            if self._region is None:
                return content, []
        else:
            content = ""
        try:
            calls = self._scan(cut)
        except (_Malformed, RecursionError):
            calls = None
        if calls is None or (final and not calls and not self._ids):
            # Not calls after all (or a malformed tail after some): the held text is content.
            if not self._ids:
                self._plain = True
                self._region = None
                return content + self._content_up_to(len(self._text)), []
            return content, []
        return content, self._events(calls)

    def _find_region(self, final: bool) -> str:
        text, fmt = self._text, self.fmt
        if fmt.open_tag:
            at = text.find(fmt.open_tag, self._content_sent)
            if at >= 0:
                content = self._content_up_to(at)
                self._region = at
                return content
            hold = 0 if final else _partial_suffix(text, fmt.open_tag)
            return self._content_up_to(len(text) - hold)
        start = _skip(text, 0)
        if start == len(text):
            return self._content_up_to(len(text)) if final else ""
        rest = text[start:]
        if fmt.marker and (rest.startswith(fmt.marker) or (fmt.marker.startswith(rest) and not final)):
            if len(rest) >= len(fmt.marker):
                self._region = start
            return ""
        if rest[0] == fmt.starts_with:
            self._region = start
            return ""
        self._plain = True
        return self._content_up_to(len(text))

    def _scan(self, cut: bool = False) -> list[tuple[str, str, bool]] | None:
        assert self._region is not None
        region = self._text[self._region :]
        fmt = self.fmt
        out: list[tuple[str, str, bool]] = []
        if fmt.open_tag:
            for block in region.split(fmt.open_tag)[1:]:
                body = block.split(fmt.close_tag)[0] if fmt.close_tag else block
                _calls_in(_parse(body, 0), body, fmt.args_key, out, cut)
            return out
        if fmt.marker and region.startswith(fmt.marker):
            region = region[len(fmt.marker) :]
        _calls_in(_parse(region, 0), region, fmt.args_key, out, cut)
        return out

    def _events(self, calls: list[tuple[str, str, bool]]) -> list[ToolEvent]:
        events: list[ToolEvent] = []
        for index, (name, args, _complete) in enumerate(calls):
            if index >= len(self._ids):
                self._ids.append(new_call_id())
                self._names.append(name)
                self._args_sent.append(0)
                self._args.append("")
                events.append(ToolCallStart(index, self._ids[index], name))
            # Raw text of a longer reply extends the old (trailing whitespace aside, which is cut).
            if len(args) > self._args_sent[index] and args.startswith(self._args[index]):
                events.append(ToolArgsDelta(index, args[self._args_sent[index] :]))
                self._args_sent[index] = len(args)
                self._args[index] = args
        return events

    def _content_up_to(self, end: int) -> str:
        if end <= self._content_sent:
            return ""
        out = self._text[self._content_sent : end]
        self._content_sent = end
        return out


def _partial_suffix(text: str, tag: str) -> int:
    """Length of the longest suffix of text that is a proper prefix of tag (held back: a tag may come)."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0
