"""Tool calling: the request's tools and tool_choice checked, the conversation rendered for the model,
and the grammar that enforces `required` and named choices.

Rendering: a chat template that handles tools (it reads `tools`, as Hermes/Qwen, Llama 3.1+ and Mistral
templates do) gets them through transformers' `apply_chat_template(..., tools=...)`, and the history's
calls and results as the OpenAI messages they are. Any other template (the default model's included)
gets the generic fallback (after llama.cpp's generic handler): the tool definitions and the reply format
go into the system prompt, and earlier calls and results are rendered as text, so every template can
run a tool conversation.

`tool_choice`: `none` renders no tools and parses nothing; `auto` renders them and parses the reply
(server/tool_parsers.py), leaving the choice to the model; `required` and a named function constrain the
reply with a grammar, so it is always a call to an offered tool with arguments valid for its schema.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from engine.grammar import GrammarSpec
from server.errors import invalid
from server.protocol import ChatCompletionRequest, ChatMessage, NamedToolChoice, Tool
from server.tool_parsers import TOOL_FORMATS, ToolFormat

FALLBACK_INSTRUCTIONS = (
    "You can call the tools listed below. To call one or more tools, reply with only a JSON object of "
    'the form {"tool_calls": [{"name": <tool name>, "arguments": <arguments object>}]}, with arguments '
    "that follow the tool's parameters schema. Otherwise, reply to the user normally.\n\nTools:\n"
)


@dataclass(frozen=True)
class ToolPlan:
    """How one request uses its tools."""

    tools: list[Tool]
    choice: str  # "auto" | "required" | "function" (a named one)
    function: str | None  # the named function
    parallel: bool
    fmt: ToolFormat
    native: bool  # the chat template renders the tools itself

    @property
    def constrained(self) -> bool:
        return self.choice != "auto"

    def definitions(self) -> list[dict[str, Any]]:
        return [t.model_dump(exclude_none=True) for t in self.tools]


def template_format(chat_template: str | None) -> tuple[ToolFormat, bool]:
    """The tool-call format a chat template teaches its model, and whether it renders tools at all."""
    t = chat_template or ""
    if "tools" not in t:
        return TOOL_FORMATS["generic"], False
    if "<tool_call>" in t:
        return TOOL_FORMATS["hermes"], True
    if "[TOOL_CALLS]" in t:
        return TOOL_FORMATS["mistral"], True
    if "<|python_tag|>" in t or "<|start_header_id|>" in t:
        return TOOL_FORMATS["llama3"], True
    return TOOL_FORMATS["hermes"], True  # the most common among other tool-aware templates


def plan_tools(body: ChatCompletionRequest, chat_template: str | None) -> ToolPlan | None:
    """The request's tool plan (None: no tools in play, or tool_choice none). Raises a 400 for a
    tool_choice that names no offered tool or comes without tools, and for duplicate names."""
    choice = body.tool_choice
    tools = body.tools or []
    if choice is not None and not tools and choice != "none":
        raise invalid("tool_choice is only allowed when tools are given.", param="tool_choice")
    names = [t.function.name for t in tools]
    dup = next((n for n in names if names.count(n) > 1), None)
    if dup is not None:
        raise invalid(f"Two tools are named {dup!r}; tool names must be unique.", param="tools")
    function = None
    if isinstance(choice, NamedToolChoice):
        function = choice.function.name
        if function not in names:
            raise invalid(
                f"tool_choice names the function {function!r}, which is not among the tools "
                f"({', '.join(names) or 'none'}).",
                param="tool_choice",
            )
    if not tools or choice == "none":
        return None
    fmt, native = template_format(chat_template)
    mode = "function" if function is not None else (choice if isinstance(choice, str) else "auto")
    parallel = body.parallel_tool_calls is not False and function is None
    return ToolPlan(tools, mode, function, parallel, fmt, native)


def check_tool_history(messages: list[ChatMessage]) -> None:
    """Every tool message answers a call an earlier assistant message made (400 otherwise)."""
    ids: set[str] = set()
    for i, m in enumerate(messages):
        if m.role == "assistant" and m.tool_calls:
            ids.update(c.id for c in m.tool_calls)
        elif m.role == "tool" and m.tool_call_id not in ids:
            raise invalid(
                f"messages[{i}] is a tool result for {m.tool_call_id!r}, but no earlier assistant message "
                "made a tool call with that id.",
                param=f"messages.{i}.tool_call_id",
            )


def parameters_schema(tool: Tool) -> dict[str, Any]:
    return tool.function.parameters or {"type": "object", "properties": {}}


def call_grammar(plan: ToolPlan) -> GrammarSpec:
    """The grammar of a reply that is only calls (required, or the named function), in the plan's format."""
    tools = [t for t in plan.tools if plan.function is None or t.function.name == plan.function]
    key = plan.fmt.args_key
    calls = [
        {
            "type": "object",
            "properties": {"name": {"const": t.function.name}, key: parameters_schema(t)},
            "required": ["name", key],
            "additionalProperties": False,
        }
        for t in tools
    ]
    one = calls[0] if len(calls) == 1 else {"anyOf": calls}
    array: dict[str, Any] = {"type": "array", "items": one, "minItems": 1}
    if not plan.parallel:
        array["maxItems"] = 1
    name = plan.fmt.name
    if name == "generic":
        schema = {
            "type": "object",
            "properties": {"tool_calls": array},
            "required": ["tool_calls"],
            "additionalProperties": False,
        }
        return GrammarSpec.json_schema(schema)
    if name == "mistral":
        return GrammarSpec.json_schema(array)
    if name == "llama3":
        return GrammarSpec.json_schema(one)
    # hermes: <tool_call> blocks around each call's JSON.
    block = f'"<tool_call>\\n" %json {json.dumps(one)} "\\n</tool_call>"'
    rule = 'start: call ("\\n" call)*' if plan.parallel else "start: call"
    return GrammarSpec("lark", f"{rule}\ncall: {block}\n")


# --- rendering -----------------------------------------------------------------------------------


def render_messages(messages: list[ChatMessage], plan: ToolPlan | None) -> list[dict[str, Any]]:
    """The conversation as chat-template messages: OpenAI's tool messages kept for a template that
    renders tools, rewritten as text otherwise."""
    native = plan is not None and plan.native
    out: list[dict[str, Any]] = []
    names: dict[str, str] = {}  # tool_call_id -> function name, for results
    for m in messages:
        role = "system" if m.role == "developer" else m.role  # OpenAI's new name; templates know system
        text = m.text()
        if m.role == "assistant" and m.tool_calls:
            names.update((c.id, c.function.name) for c in m.tool_calls)
            if native:
                calls = [
                    {
                        "id": c.id,
                        "type": "function",
                        "function": {"name": c.function.name, "arguments": _arguments(c.function.arguments)},
                    }
                    for c in m.tool_calls
                ]
                out.append(_with_thinking({"role": "assistant", "content": text, "tool_calls": calls}, m))
                continue
            payload = {
                "tool_calls": [
                    {"name": c.function.name, "arguments": _arguments(c.function.arguments)}
                    for c in m.tool_calls
                ]
            }
            text = (text + "\n" if text else "") + json.dumps(payload, ensure_ascii=False)
        elif m.role == "tool" and not native:
            result = {
                "tool_call_id": m.tool_call_id,
                "name": names.get(m.tool_call_id or ""),
                "content": text,
            }
            role, text = "user", json.dumps({"tool_response": result}, ensure_ascii=False)
        elif m.role == "tool":
            out.append({"role": "tool", "content": text, "tool_call_id": m.tool_call_id})
            continue
        out.append(_with_thinking({"role": role, "content": text}, m))
    if plan is not None and not plan.native:
        _add_system(out, FALLBACK_INSTRUCTIONS + json.dumps(plan.definitions(), ensure_ascii=False, indent=1))
    return out


def _with_thinking(message: dict[str, Any], source: ChatMessage) -> dict[str, Any]:
    """An assistant turn's thinking, for templates that read it (as `reasoning_content`)."""
    if source.role == "assistant" and source.thinking:
        message["reasoning_content"] = source.thinking
    return message


def _arguments(arguments: str) -> Any:
    """A call's arguments as templates expect them (an object), or the string if it is not JSON."""
    try:
        return json.loads(arguments)
    except (json.JSONDecodeError, TypeError):
        return arguments


def _add_system(messages: list[dict[str, Any]], text: str) -> None:
    if messages and messages[0]["role"] == "system":
        messages[0] = {**messages[0], "content": f"{messages[0]['content']}\n\n{text}".lstrip()}
    else:
        messages.insert(0, {"role": "system", "content": text})
