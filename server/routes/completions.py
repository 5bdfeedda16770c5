"""POST /v1/completions."""

from __future__ import annotations

from collections.abc import AsyncIterator
from functools import partial
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from server.errors import invalid
from server.generation import ChoiceDelta, LogprobEntry
from server.protocol import CompletionRequest
from server.responses import (
    ResponseMeta,
    completion_choice,
    completion_chunk,
    completion_logprobs,
    completion_response,
    usage,
)
from server.routes.common import (
    check_context,
    check_limits,
    check_token_ids,
    choice_specs,
    offload,
    ready_for,
    sampling_params,
)
from server.routes.fanout import (
    ChoiceRun,
    CollectedChoice,
    collect_response,
    start_choices,
    stream_chunks,
    stream_response,
)
from server.state import ServerState
from server.structured import compile_constraint, output_constraint
from server.tokenizer import ServerTokenizer

router = APIRouter()  # the API key is checked by server.middleware.APIKeyMiddleware


async def _prompt_ids(
    body: CompletionRequest, tokenizer: ServerTokenizer, vocab_size: int
) -> list[list[int]]:
    """Every accepted prompt form as lists of token ids."""
    prompt = body.prompt
    if isinstance(prompt, str):
        texts: list[str] | None = [prompt]
    elif all(isinstance(p, str) for p in prompt):
        texts = list(prompt)  # type: ignore[arg-type]
    else:
        texts = None
    if texts is not None:
        ids = [await offload(tokenizer.encode, t, size=len(t)) for t in texts]
    elif all(isinstance(p, int) for p in prompt):
        ids = [list(prompt)]  # type: ignore[arg-type]
    else:
        ids = [list(p) for p in prompt]  # type: ignore[union-attr]
    for p in ids:
        if not p:
            raise invalid("The prompt is empty (it encodes to no tokens).", param="prompt")
        check_token_ids(p, vocab_size, "prompt")
    return ids


@router.post("/v1/completions", response_model=None)
async def create_completion(body: CompletionRequest, request: Request) -> Response:
    state, loop, tokenizer = ready_for(request, body.model)
    n = body.n or 1
    check_limits(
        state,
        n=n,
        num_prompts=_num_prompts(body),
        logprobs=body.logprobs,
        num_stops=len(body.stop_strings),
        max_tokens=body.max_tokens,
    )
    if body.suffix:
        raise invalid("suffix is not supported by this server.", param="suffix")
    if body.best_of is not None and body.best_of > n:
        raise invalid("best_of greater than n is not supported by this server.", param="best_of")
    if body.echo and body.logprobs is not None:
        raise invalid(
            "echo together with logprobs (prompt logprobs) is not supported by this server.", param="echo"
        )
    max_tokens = 16 if body.max_tokens is None else body.max_tokens
    if max_tokens == 0 and not body.echo:
        raise invalid("max_tokens must be at least 1 (0 is only allowed with echo).", param="max_tokens")

    prompts = await _prompt_ids(body, tokenizer, state.vocab_size)
    for p in prompts:
        check_context(loop.max_model_len, len(p), max_tokens)
    meta = ResponseMeta.new("cmpl", state.config.model_name)
    echoes = [_echo_text(body, tokenizer, i, p) for i, p in enumerate(prompts)] if body.echo else None

    if max_tokens == 0:  # echo only: the prompt back, nothing generated (OpenAI's prompt-scoring form)
        return _echo_only(meta, prompts, echoes or [], n)

    constraint = output_constraint(body)
    grammar = None
    if constraint is not None:
        assert state.grammars is not None  # set with the tokenizer
        grammar = await compile_constraint(state.grammars, *constraint)
    params = sampling_params(body, max_tokens, body.logprobs, state.vocab_size)
    specs = choice_specs(
        meta.id, prompts, n, params, body.stop_strings, bool(body.skip_special_tokens), grammar
    )
    run = start_choices(state, loop, tokenizer, specs, sum(len(p) for p in prompts))
    if body.stream:
        return stream_response(run, _stream(state, run, meta, body, echoes))

    def build(choices: list[CollectedChoice], use: dict[str, Any]) -> dict[str, Any]:
        out = []
        for c in choices:
            prefix = echoes[c.index // n] if echoes else ""
            out.append(
                completion_choice(
                    c.index, prefix + c.text, _logprobs_of(state, body, c.logprobs), c.finish_reason
                )
            )
        return completion_response(meta, out, use)

    return await collect_response(request, run, build)


def _num_prompts(body: CompletionRequest) -> int:
    """How many prompts the body holds, from its shape alone (before any tokenization)."""
    prompt = body.prompt
    if isinstance(prompt, str) or all(isinstance(p, int) for p in prompt):
        return 1
    return len(prompt)


def _echo_text(body: CompletionRequest, tokenizer: ServerTokenizer, index: int, prompt_ids: list[int]) -> str:
    prompt = body.prompt
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], str):
        return prompt[index]  # type: ignore[return-value]
    return tokenizer.decode(prompt_ids, skip_special_tokens=False)


def _echo_only(meta: ResponseMeta, prompts: list[list[int]], echoes: list[str], n: int) -> Response:
    choices = [
        completion_choice(p * n + j, echoes[p], None, "length") for p in range(len(prompts)) for j in range(n)
    ]
    return JSONResponse(completion_response(meta, choices, usage(sum(len(p) for p in prompts), 0)))


def _logprobs_of(
    state: ServerState, body: CompletionRequest, entries: list[LogprobEntry]
) -> dict[str, Any] | None:
    if body.logprobs is None:
        return None
    assert state.tokenizer is not None
    return completion_logprobs(entries, state.tokenizer)


def _stream(
    state: ServerState,
    run: ChoiceRun,
    meta: ResponseMeta,
    body: CompletionRequest,
    echoes: list[str] | None,
) -> AsyncIterator[dict[str, Any]]:
    n = body.n or 1
    # With echo, each choice's prompt comes first, as a chunk of its own.
    first = (
        [completion_choice(s.index, echoes[s.index // n], None, None) for s in run.specs] if echoes else []
    )

    def choice(d: ChoiceDelta) -> dict[str, Any]:
        return completion_choice(d.index, d.text, _logprobs_of(state, body, d.logprobs), d.finish_reason)

    chunk = partial(completion_chunk, meta, with_usage=body.include_usage)
    return stream_chunks(run, first, choice, chunk, body.include_usage)
