"""OpenAI request bodies (pydantic, validated at the edge) for /v1/completions, /v1/chat/completions,
/tokenize and /detokenize. Responses are built as plain dicts in server/responses.py."""

from __future__ import annotations

import logging
import threading
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, field_validator, model_validator

# Shared bounds, as OpenAI documents them. How many choices, stop strings and top logprobs a request may
# ask for is the server's decision (ServerConfig.max_n, max_stop_strings, max_logprobs: flags that can
# raise OpenAI's caps as well as lower them), checked in server/routes/common.py:check_limits.
Temperature = Annotated[float, Field(ge=0.0, le=2.0)]
TopP = Annotated[float, Field(gt=0.0, le=1.0)]
Penalty = Annotated[float, Field(ge=-2.0, le=2.0)]


logger = logging.getLogger(__name__)


class _UnknownFieldLog:
    """Logs each unknown field name once per process. Bounded: a client inventing new names in every
    request must neither grow memory nor flood the log."""

    LIMIT = 256

    def __init__(self) -> None:
        self._seen: set[tuple[str, str]] = set()
        self._lock = threading.Lock()  # bodies are also validated in worker threads (tokenize)

    def note(self, model: str, key: str) -> None:
        entry = (model, key[:64])
        with self._lock:
            if entry in self._seen or len(self._seen) >= self.LIMIT:
                return
            self._seen.add(entry)
        logger.warning("ignoring unknown field %r in %s (logged once per field)", entry[1], model)


unknown_fields = _UnknownFieldLog()


class OpenAIModel(BaseModel):
    # Unknown fields are ignored, as vLLM does: clients send vendor extras (store, metadata, ...).
    model_config = ConfigDict(extra="ignore")

    @model_validator(mode="before")
    @classmethod
    def _log_unknown_fields(cls, data: Any) -> Any:
        if isinstance(data, dict):
            known = {f.alias for f in cls.model_fields.values() if f.alias} | set(cls.model_fields)
            for key in data:
                if isinstance(key, str) and key not in known:
                    unknown_fields.note(cls.__name__, key)
        return data


class StreamOptions(OpenAIModel):
    include_usage: bool | None = False


class ResponseFormat(OpenAIModel):
    """OpenAI's response_format; json_schema is {"name", "description"?, "schema"?, "strict"?}."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: dict[str, Any] | None = None


class SamplingFields(OpenAIModel):
    """Fields both endpoints share, with OpenAI's bounds and vLLM's extras."""

    model: str | None = None
    temperature: Temperature | None = None
    top_p: TopP | None = None
    n: Annotated[int, Field(ge=1)] | None = 1
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    presence_penalty: Penalty | None = None
    frequency_penalty: Penalty | None = None
    logit_bias: dict[str, Annotated[float, Field(ge=-100.0, le=100.0)]] | None = None
    seed: int | None = None
    user: str | None = None
    # vLLM's extras
    top_k: Annotated[int, Field(ge=-1)] | None = None
    min_p: Annotated[float, Field(ge=0.0, le=1.0)] | None = None
    repetition_penalty: Annotated[float, Field(gt=0.0, le=10.0)] | None = None
    min_tokens: Annotated[int, Field(ge=0)] | None = 0
    ignore_eos: bool | None = False
    stop_token_ids: list[Annotated[int, Field(ge=0)]] | None = None
    skip_special_tokens: bool | None = True
    # Structured outputs: OpenAI's response_format, vLLM's guided_* fields (before v0.12) and its
    # structured_outputs object ({"json" | "regex" | "choice" | "grammar" | "json_object": ...,
    # "disable_any_whitespace"?}); at most one of them (server/structured.py).
    response_format: ResponseFormat | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    guided_decoding_backend: str | None = None  # accepted and ignored: there is one backend
    guided_whitespace_pattern: str | None = None  # accepted and ignored
    structured_outputs: dict[str, Any] | None = None

    @field_validator("stop")
    @classmethod
    def _check_stop(cls, v: str | list[str] | None) -> list[str] | None:
        if v is None:
            return None
        stops = [v] if isinstance(v, str) else v
        if any(s == "" for s in stops):
            raise ValueError("stop sequences must not be empty strings")
        return stops

    @field_validator("logit_bias")
    @classmethod
    def _check_logit_bias(cls, v: dict[str, float] | None) -> dict[str, float] | None:
        for key in v or {}:
            if not key.lstrip("-").isdigit() or int(key) < 0:
                raise ValueError(f"keys must be token ids (non-negative integers as strings), got {key!r}")
        return v

    @property
    def stop_strings(self) -> list[str]:
        return list(self.stop or [])  # normalised to a list by _check_stop

    @property
    def include_usage(self) -> bool:
        return bool(self.stream and self.stream_options and self.stream_options.include_usage)


class CompletionRequest(SamplingFields):
    prompt: str | list[str] | list[Annotated[int, Field(ge=0)]] | list[list[Annotated[int, Field(ge=0)]]]
    max_tokens: Annotated[int, Field(ge=0)] | None = 16
    logprobs: Annotated[int, Field(ge=0)] | None = None
    echo: bool | None = False
    # vLLM's: the prompt tokens' logprobs (and the top-k at each), in the choice's `prompt_logprobs`.
    prompt_logprobs: Annotated[int, Field(ge=0)] | None = None
    suffix: str | None = None
    best_of: Annotated[int, Field(ge=1)] | None = None

    @field_validator("prompt")
    @classmethod
    def _check_prompt(cls, v: Any) -> Any:
        if isinstance(v, list) and len(v) == 0:
            raise ValueError("prompt must not be empty")
        if isinstance(v, list) and any(isinstance(p, list) and len(p) == 0 for p in v):
            raise ValueError("token id prompts must not be empty")
        return v


class TextPart(OpenAIModel):
    type: str
    text: str | None = None

    @model_validator(mode="after")
    def _only_text(self) -> TextPart:
        if self.type != "text":
            raise ValueError(f"content parts of type {self.type!r} are not supported; only 'text' is")
        if self.text is None:
            raise ValueError("a text content part needs a 'text' field")
        return self


FunctionName = Annotated[str, Field(pattern=r"^[a-zA-Z0-9_.-]{1,64}$")]
ReasoningEffort = Literal["none", "minimal", "low", "medium", "high", "xhigh"]
# apply_chat_template's own arguments, which a request's chat_template_kwargs may not set (the server
# sets them, or they would change what the call returns).
RESERVED_TEMPLATE_KWARGS = frozenset(
    {
        "conversation",
        "messages",
        "tools",
        "documents",
        "chat_template",
        "add_generation_prompt",
        "continue_final_message",
        "tokenize",
        "padding",
        "truncation",
        "max_length",
        "return_tensors",
        "return_dict",
        "return_assistant_tokens_mask",
        "tokenizer_kwargs",
    }
)


def _check_template_kwargs(v: dict[str, Any] | None) -> dict[str, Any] | None:
    taken = sorted(set(v or {}) & RESERVED_TEMPLATE_KWARGS)
    if taken:
        raise ValueError(f"{', '.join(taken)} cannot be set through chat_template_kwargs")
    return v


# A request's variables for the chat template (vLLM's chat_template_kwargs), the reserved ones refused.
TemplateKwargs = Annotated[dict[str, Any] | None, AfterValidator(_check_template_kwargs)]


class FunctionDefinition(OpenAIModel):
    name: FunctionName
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema; checked by compiling it
    strict: bool | None = None


class Tool(OpenAIModel):
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(OpenAIModel):
    name: str


class NamedToolChoice(OpenAIModel):
    type: Literal["function"]
    function: NamedFunction


class FunctionCall(OpenAIModel):
    name: str
    arguments: str  # JSON text, as the model wrote it


class ToolCall(OpenAIModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(OpenAIModel):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None  # assistant messages
    tool_call_id: str | None = None  # tool messages: the call they answer
    # An assistant turn's thinking, as this server (and vLLM) returns it; templates that show earlier
    # thinking (or drop it on purpose, as Qwen3's does) read `reasoning_content`. vLLM and Ollama also
    # call it `reasoning`.
    reasoning_content: str | None = None
    reasoning: str | None = None

    @model_validator(mode="after")
    def _check(self) -> ChatMessage:
        if self.tool_calls and self.role != "assistant":
            raise ValueError("only assistant messages may have tool_calls")
        if (self.reasoning_content or self.reasoning) and self.role != "assistant":
            raise ValueError("only assistant messages may have reasoning_content")
        if self.role == "tool" and not self.tool_call_id:
            raise ValueError("a tool message needs 'tool_call_id'")
        if self.content is None and not (self.role == "assistant" and self.tool_calls):
            raise ValueError(f"a {self.role} message needs 'content'")
        return self

    def text(self) -> str:
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text or "" for part in self.content or [])

    @property
    def thinking(self) -> str | None:
        return self.reasoning_content or self.reasoning


class ChatCompletionRequest(SamplingFields):
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_tokens: Annotated[int, Field(ge=1)] | None = None
    max_completion_tokens: Annotated[int, Field(ge=1)] | None = None
    logprobs: bool | None = False
    top_logprobs: Annotated[int, Field(ge=0)] | None = None
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None
    # Passed to the chat template: OpenAI's reasoning_effort (templates such as gpt-oss's read it) and
    # vLLM's chat_template_kwargs (e.g. {"enable_thinking": false} for Qwen3).
    reasoning_effort: ReasoningEffort | None = None
    chat_template_kwargs: TemplateKwargs = None

    @property
    def requested_max_tokens(self) -> int | None:
        # max_completion_tokens replaces the deprecated max_tokens; either may come.
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


class TokenizeCompletionRequest(OpenAIModel):
    model: str | None = None
    prompt: str
    add_special_tokens: bool = True


class TokenizeChatRequest(OpenAIModel):
    model: str | None = None
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    add_generation_prompt: bool = True
    chat_template_kwargs: TemplateKwargs = None


class DetokenizeRequest(OpenAIModel):
    model: str | None = None
    tokens: list[Annotated[int, Field(ge=0)]]
