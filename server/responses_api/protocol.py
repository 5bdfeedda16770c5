"""The Responses API's request body (POST /v1/responses), as the OpenAI API reference defines the parts
this server runs: input as text or items (messages with text parts, function calls and their outputs,
reasoning), instructions, function tools, tool_choice, text.format, sampling, storage and continuation.

Items and tools this server cannot run (images, files, hosted tools such as web search) are refused with
a 400 naming them, never ignored: a reply that silently skipped an input would be wrong.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BeforeValidator, Discriminator, Field, Tag, ValidationInfo, field_validator

from server.protocol import FunctionName, OpenAIModel, ReasoningEffort, Temperature, TopP

ITEM_TYPES = ("message", "function_call", "function_call_output", "reasoning")
PART_TYPES = ("input_text", "output_text", "text", "refusal")


class TextPart(OpenAIModel):
    """input_text (user, system, developer), output_text (an earlier assistant turn), refusal."""

    type: Literal["input_text", "output_text", "text", "refusal"]
    text: str | None = None
    refusal: str | None = None

    def value(self) -> str:
        return (self.refusal if self.type == "refusal" else self.text) or ""


def _check_parts(parts: Any, info: ValidationInfo) -> Any:
    where = info.field_name
    if isinstance(parts, list):
        for i, part in enumerate(parts):
            kind = part.get("type") if isinstance(part, dict) else None
            if kind not in PART_TYPES:
                raise ValueError(
                    f"{where}[{i}] is a content part of type {kind!r}; this server reads text parts only "
                    f"({', '.join(PART_TYPES)})"
                )
    return parts


# A message's content or a tool output: a string, or text parts (other kinds of part are refused).
TextContent = Annotated[str | list[TextPart], BeforeValidator(_check_parts)]


def joined_text(content: str | list[TextPart]) -> str:
    return content if isinstance(content, str) else "".join(p.value() for p in content)


class MessageItem(OpenAIModel):
    type: Literal["message"] = "message"
    role: Literal["user", "assistant", "system", "developer"]
    content: TextContent
    id: str | None = None
    status: str | None = None

    def text(self) -> str:
        return joined_text(self.content)


class FunctionCallItem(OpenAIModel):
    type: Literal["function_call"]
    call_id: str
    name: str
    arguments: str
    id: str | None = None
    status: str | None = None


class FunctionCallOutputItem(OpenAIModel):
    type: Literal["function_call_output"]
    call_id: str
    output: TextContent
    id: str | None = None
    status: str | None = None

    def text(self) -> str:
        return joined_text(self.output)


class ReasoningText(OpenAIModel):
    type: str
    text: str


class ReasoningItem(OpenAIModel):
    type: Literal["reasoning"]
    id: str | None = None
    summary: list[ReasoningText] = []
    content: list[ReasoningText] | None = None
    encrypted_content: str | None = None  # another provider's; nothing here can read it

    def text(self) -> str:
        parts = self.content if self.content else self.summary
        return "".join(p.text for p in parts)


def _item_type(v: Any) -> str | None:
    # A message may leave its type out (the reference's EasyInputMessage).
    if isinstance(v, dict):
        return v.get("type", "message")
    return getattr(v, "type", None)


InputItem = Annotated[
    Annotated[MessageItem, Tag("message")]
    | Annotated[FunctionCallItem, Tag("function_call")]
    | Annotated[FunctionCallOutputItem, Tag("function_call_output")]
    | Annotated[ReasoningItem, Tag("reasoning")],
    Discriminator(_item_type),
]


class FunctionTool(OpenAIModel):
    type: Literal["function"]
    name: FunctionName
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class FunctionChoice(OpenAIModel):
    type: Literal["function"]
    name: str


class TextFormat(OpenAIModel):
    type: Literal["text", "json_object", "json_schema"]
    name: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    description: str | None = None
    strict: bool | None = None


class TextConfig(OpenAIModel):
    format: TextFormat | None = None
    verbosity: str | None = None  # a hint for OpenAI's models; nothing to do here


class ReasoningConfig(OpenAIModel):
    effort: ReasoningEffort | None = None
    summary: str | None = None  # summaries are OpenAI's; the thinking itself is returned instead
    generate_summary: str | None = None


class ResponsesRequest(OpenAIModel):
    model: str | None = None
    input: str | list[InputItem]
    instructions: str | None = None
    tools: list[FunctionTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | FunctionChoice | None = None
    parallel_tool_calls: bool | None = None
    text: TextConfig | None = None
    reasoning: ReasoningConfig | None = None
    max_output_tokens: Annotated[int, Field(ge=1)] | None = None
    temperature: Temperature | None = None
    top_p: TopP | None = None
    stream: bool | None = False
    store: bool | None = True  # OpenAI's default
    background: bool | None = False
    previous_response_id: str | None = None
    metadata: dict[str, str] | None = None
    include: list[str] | None = None
    top_logprobs: Annotated[int, Field(ge=0)] | None = None
    truncation: Literal["auto", "disabled"] | None = None
    user: str | None = None
    # vLLM's extras
    chat_template_kwargs: dict[str, Any] | None = None
    seed: int | None = None
    top_k: Annotated[int, Field(ge=-1)] | None = None

    @field_validator("input", mode="before")
    @classmethod
    def _known_items(cls, v: Any) -> Any:
        if isinstance(v, list):
            if not v:
                raise ValueError("input must not be empty")
            for i, item in enumerate(v):
                kind = _item_type(item)
                if kind not in ITEM_TYPES:
                    raise ValueError(
                        f"input[{i}] is an item of type {kind!r}, which this server does not support "
                        f"(it takes {', '.join(ITEM_TYPES)} items)"
                    )
        return v

    @field_validator("tools", mode="before")
    @classmethod
    def _function_tools(cls, v: Any) -> Any:
        if not isinstance(v, list):  # None, or not a list: pydantic's own type error says so (a 400)
            return v
        for i, tool in enumerate(v):
            kind = tool.get("type") if isinstance(tool, dict) else None
            if kind != "function":
                raise ValueError(f"tools[{i}] is a {kind!r} tool; this server runs function tools only")
        return v

    @field_validator("tool_choice", mode="before")
    @classmethod
    def _function_choice(cls, v: Any) -> Any:
        if isinstance(v, dict) and v.get("type") != "function":
            raise ValueError(
                f"tool_choice of type {v.get('type')!r} is not supported; use none, auto, required or "
                '{"type": "function", "name": ...}'
            )
        return v

    @field_validator("metadata")
    @classmethod
    def _metadata(cls, v: dict[str, str] | None) -> dict[str, str] | None:
        # OpenAI's limits: 16 pairs, keys up to 64 characters, values up to 512.
        if v is not None and (
            len(v) > 16 or any(len(k) > 64 for k in v) or any(len(x) > 512 for x in v.values())
        ):
            raise ValueError(
                "metadata holds at most 16 pairs, keys of at most 64 and values of 512 characters"
            )
        return v
