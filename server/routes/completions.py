"""POST /v1/completions."""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass, replace
from functools import partial
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from scheduler.outputs import TokenLogprob
from server.errors import invalid
from server.generation import ChoiceDelta, LogprobEntry
from server.protocol import CompletionRequest
from server.responses import (
    ResponseMeta,
    completion_choice,
    completion_logprobs,
    completion_response,
    echo_logprobs,
    join_logprobs,
    stream_chunk,
    usage,
    vllm_prompt_logprobs,
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
    if body.prompt_logprobs is not None:
        check_limits(
            state,
            n=n,
            num_prompts=1,
            logprobs=body.prompt_logprobs,
            num_stops=0,
            max_tokens=None,
            logprobs_param="prompt_logprobs",
        )
    max_tokens = 16 if body.max_tokens is None else body.max_tokens
    if max_tokens == 0 and not body.echo:
        raise invalid("max_tokens must be at least 1 (0 is only allowed with echo).", param="max_tokens")
    prompt_k = _prompt_logprobs_k(body)

    prompts = await _prompt_ids(body, tokenizer, state.vocab_size)
    # Scoring a prompt takes one step of the model: with max_tokens 0 its token is left out.
    gen_tokens = max_tokens or (1 if prompt_k is not None else 0)
    for p in prompts:
        check_context(loop.max_model_len, len(p), gen_tokens)
    meta = ResponseMeta.new("cmpl", state.config.model_name)
    echoes = [_echo_text(body, tokenizer, i, p) for i, p in enumerate(prompts)] if body.echo else None

    if gen_tokens == 0:  # echo only: the prompt back, nothing generated or scored
        return _echo_only(meta, prompts, echoes or [], n)

    constraint = output_constraint(body)
    grammar = None
    if constraint is not None:
        assert state.grammars is not None  # set with the tokenizer
        grammar = await compile_constraint(state.grammars, *constraint)
    params = replace(
        sampling_params(body, gen_tokens, body.logprobs, state.vocab_size), prompt_logprobs=prompt_k
    )
    specs = choice_specs(
        meta.id, prompts, n, params, body.stop_strings, bool(body.skip_special_tokens), grammar
    )
    run = start_choices(state, loop, tokenizer, specs, sum(len(p) for p in prompts))
    shape = _ChoiceShape(body, tokenizer, prompts, echoes, scoring_only=max_tokens == 0)
    if body.stream:
        return stream_response(run, _stream(run, meta, body, shape))

    def build(choices: list[CollectedChoice], use: dict[str, Any]) -> dict[str, Any]:
        out = [
            shape.choice(c.index, c.text, c.logprobs, c.finish_reason, c.prompt_logprobs, True)
            for c in choices
        ]
        if shape.scoring_only:
            use = {**use, "completion_tokens": 0, "total_tokens": use["prompt_tokens"]}
        return completion_response(meta, out, use)

    return await collect_response(request, run, build)


def _prompt_logprobs_k(body: CompletionRequest) -> int | None:
    """How many top alternatives to score each prompt token with: vLLM's prompt_logprobs, or logprobs
    when echo asks for the prompt's logprobs (OpenAI), the larger when both come."""
    ks = [body.prompt_logprobs]
    if body.echo and body.logprobs is not None:
        ks.append(body.logprobs)
    given = [k for k in ks if k is not None]
    return max(given) if given else None


@dataclass
class _ChoiceShape:
    """How a completion choice (or a streamed piece of one) looks: the echoed prompt first, with its
    logprobs when echo comes with logprobs (OpenAI), and vLLM's prompt_logprobs when asked."""

    body: CompletionRequest
    tokenizer: ServerTokenizer
    prompts: list[list[int]]
    echoes: list[str] | None
    scoring_only: bool  # max_tokens 0: the prompt scored, its one generated token left out

    def choice(
        self,
        index: int,
        text: str,
        entries: list[LogprobEntry],
        finish_reason: str | None,
        prompt_logprobs: list[TokenLogprob | None] | None,
        starts: bool,
    ) -> dict[str, Any]:
        """`starts`: this piece begins the choice's text (the whole choice, or its first delta)."""
        body, n = self.body, self.body.n or 1
        prompt = self.prompts[index // n]
        echo = self.echoes[index // n] if self.echoes else ""
        if self.scoring_only:
            text, entries, finish_reason = "", [], finish_reason and "length"
        logprobs = None
        if body.logprobs is not None:
            logprobs = completion_logprobs(entries, self.tokenizer, offset_base=len(echo))
        if starts and echo:
            text = echo + text
            if body.logprobs is not None and prompt_logprobs is not None:
                logprobs = join_logprobs(echo_logprobs(prompt, prompt_logprobs, self.tokenizer), logprobs)
        out = completion_choice(index, text, logprobs, finish_reason)
        if body.prompt_logprobs is not None and prompt_logprobs is not None:
            out["prompt_logprobs"] = vllm_prompt_logprobs(prompt, prompt_logprobs, self.tokenizer)
        return out


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


def _stream(
    run: ChoiceRun, meta: ResponseMeta, body: CompletionRequest, shape: _ChoiceShape
) -> AsyncIterator[dict[str, Any]]:
    n = body.n or 1
    # With echo, each choice's prompt comes first: as a chunk of its own, or, when its logprobs come
    # with it, with the choice's first delta (which brings them).
    scores_echo = body.echo and body.logprobs is not None
    echoes = shape.echoes
    first = (
        [completion_choice(s.index, echoes[s.index // n], None, None) for s in run.specs]
        if echoes and not scores_echo
        else []
    )
    started: set[int] = set()

    def choice(d: ChoiceDelta) -> dict[str, Any]:
        starts = bool(scores_echo) and d.index not in started
        started.add(d.index)
        return shape.choice(d.index, d.text, d.logprobs, d.finish_reason, d.prompt_logprobs, starts)

    chunk = partial(stream_chunk, meta, "text_completion", with_usage=body.include_usage)
    return stream_chunks(run, first, choice, chunk, body.include_usage)
