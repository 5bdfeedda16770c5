"""Anthropic's Messages API request bodies (POST /v1/messages and /v1/messages/count_tokens), as its API
reference defines the parts this server runs: system, messages of content blocks (text, tool_use,
tool_result, thinking), custom tools, tool_choice, stop_sequences, sampling, thinking, and output_config
(structured output and effort).

Blocks and tools this server cannot run (images, documents, Anthropic's server tools) are refused with a
400 naming them, never skipped. redacted_thinking blocks are accepted and left out of the prompt: they
hold another model's encrypted thinking, which nothing here can read.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import Discriminator, Field, Tag, field_validator

from server.protocol import FunctionName, OpenAIModel

BLOCK_TYPES = ("text", "tool_use", "tool_result", "thinking", "redacted_thinking")


class TextBlock(OpenAIModel):
    type: Literal["text"]
    text: str


class ToolUseBlock(OpenAIModel):
    type: Literal["tool_use"]
    id: str
    name: str
    input: dict[str, Any]


class ToolResultBlock(OpenAIModel):
    type: Literal["tool_result"]
    tool_use_id: str
    content: str | list[TextBlock] = ""
    is_error: bool | None = None

    @field_validator("content", mode="before")
    @classmethod
    def _text_only(cls, v: Any) -> Any:
        for i, block in enumerate(v if isinstance(v, list) else []):
            kind = block.get("type") if isinstance(block, dict) else None
            if kind != "text":
                raise ValueError(f"content[{i}] is a {kind!r} block; tool results may hold text blocks only")
        return v

    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "".join(b.text for b in self.content)


class ThinkingBlock(OpenAIModel):
    type: Literal["thinking"]
    thinking: str
    signature: str | None = None


class RedactedThinkingBlock(OpenAIModel):
    type: Literal["redacted_thinking"]
    data: str


def _block_type(v: Any) -> str | None:
    return v.get("type") if isinstance(v, dict) else getattr(v, "type", None)


ContentBlock = Annotated[
    Annotated[TextBlock, Tag("text")]
    | Annotated[ToolUseBlock, Tag("tool_use")]
    | Annotated[ToolResultBlock, Tag("tool_result")]
    | Annotated[ThinkingBlock, Tag("thinking")]
    | Annotated[RedactedThinkingBlock, Tag("redacted_thinking")],
    Discriminator(_block_type),
]


class Message(OpenAIModel):
    role: Literal["user", "assistant"]
    content: str | list[ContentBlock]

    @field_validator("content", mode="before")
    @classmethod
    def _known_blocks(cls, v: Any) -> Any:
        for i, block in enumerate(v if isinstance(v, list) else []):
            kind = _block_type(block)
            if kind not in BLOCK_TYPES:
                raise ValueError(
                    f"content[{i}] is a block of type {kind!r}, which this server does not support "
                    f"(it takes {', '.join(BLOCK_TYPES)} blocks)"
                )
        return v


class Tool(OpenAIModel):
    name: FunctionName
    description: str | None = None
    input_schema: dict[str, Any]
    type: Literal["custom"] | None = None
    strict: bool | None = None


class ToolChoice(OpenAIModel):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool | None = None


class ThinkingConfig(OpenAIModel):
    type: Literal["enabled", "disabled", "adaptive"]
    budget_tokens: int | None = None  # not enforced: the chat template decides how the model thinks


class OutputFormat(OpenAIModel):
    type: Literal["json_schema"]
    schema_: dict[str, Any] = Field(alias="schema")


class OutputConfig(OpenAIModel):
    effort: Literal["low", "medium", "high", "xhigh", "max"] | None = None
    format: OutputFormat | None = None


class CountTokensRequest(OpenAIModel):
    model: str | None = None
    messages: Annotated[list[Message], Field(min_length=1)]
    system: str | list[TextBlock] | None = None
    tools: list[Tool] | None = None
    tool_choice: ToolChoice | None = None
    thinking: ThinkingConfig | None = None
    output_config: OutputConfig | None = None

    @field_validator("tools", mode="before")
    @classmethod
    def _custom_tools(cls, v: Any) -> Any:
        if not isinstance(v, list):  # not a list: pydantic's own type error says so (a 400)
            return v
        for i, tool in enumerate(v):
            kind = tool.get("type") if isinstance(tool, dict) else None
            if kind not in (None, "custom"):
                raise ValueError(
                    f"tools[{i}] is a {kind!r} tool; this server runs custom (client) tools only"
                )
        return v

    def system_text(self) -> str | None:
        if self.system is None or isinstance(self.system, str):
            return self.system
        return "".join(b.text for b in self.system)


class MessagesRequest(CountTokensRequest):
    max_tokens: Annotated[int, Field(ge=1)]
    stop_sequences: list[Annotated[str, Field(min_length=1)]] | None = None
    stream: bool | None = False
    temperature: Annotated[float, Field(ge=0.0, le=1.0)] | None = None
    top_p: Annotated[float, Field(gt=0.0, le=1.0)] | None = None
    top_k: Annotated[int, Field(ge=0)] | None = None
    metadata: dict[str, Any] | None = None
