"""A model-free OpenAI-compatible server that simulates batched generation, for testing the harness.

It keeps the shape of a real server's timing without a model: the real iteration loop
(scheduler.loop.IterationLoop, with its scheduler and policies) drives the fake executor
(scheduler.fake_runner.FakeRunner), whose step takes `step_ms` (plus `per_token_ms` for each token in the
step). `--scheduling iteration` admits waiting requests at every step; `request` admits a new batch only
when the whole running batch has finished and returns results when it ends (the baseline the ORCA paper
compares against), so a sweep over both shows the paper's gap with no model at all. The HTTP layer is
its own, deliberately not the server's: it speaks a plain subset of the API and injects failures
(`fail_every`, `break_every`, refused token-id prompts) to exercise the load tester's error accounting.

    python -m loadtest.fakeserver --port 8001 --scheduling request --step-ms 5
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

from engine.cli_args import from_flags
from engine.contract import SamplingParams
from loadtest.tokenizer import HFTokenizer, PromptTokenizer, default_model_tokenizer_path
from scheduler.config import SchedulerConfig
from scheduler.fake_runner import FIRST_PLAIN_TOKEN, FakeRunner
from scheduler.loop import IterationLoop


@dataclass
class FakeConfig:
    model: str = "fake-model"
    scheduling: str = "iteration"  # or "request"
    max_batch: int = 16
    step_ms: float = 2.0  # time of one iteration
    per_token_ms: float = 0.0  # extra time per token in the step (prompt tokens of new requests count)
    tokenizer: PromptTokenizer | None = None  # counts text prompts and serves /tokenize
    accept_token_ids: bool = True  # False: answer 400 to token-id prompts, as some servers do
    fail_every: int = 0  # every n-th request gets HTTP 503 (0: never)
    break_every: int = 0  # every n-th request's stream ends with an error event mid-way (0: never)
    api_key: str | None = None  # required as `Authorization: Bearer <key>` on generation routes


# Enough KV blocks of 16 tokens for max_batch sequences of this many tokens.
SIM_CONTEXT = 8192
SIM_BLOCK_SIZE = 16


def simulated_loop(config: FakeConfig) -> IterationLoop:
    """The real iteration loop over an executor whose steps only take time."""
    executor = FakeRunner(
        num_kv_blocks=config.max_batch * SIM_CONTEXT // SIM_BLOCK_SIZE,
        block_size=SIM_BLOCK_SIZE,
        max_model_len=SIM_CONTEXT,
        step_delay_s=config.step_ms / 1000.0,
        per_token_delay_s=config.per_token_ms / 1000.0,
        simulate_kv=False,
    )
    scheduler = SchedulerConfig(
        max_num_seqs=config.max_batch,
        max_num_batched_tokens=max(SIM_CONTEXT, config.max_batch),  # prompts are never chunked
        scheduling=config.scheduling,  # type: ignore[arg-type]
    )
    return IterationLoop(executor, scheduler)


def _error(status: int, message: str) -> JSONResponse:
    return JSONResponse(
        {"error": {"message": message, "type": "invalid_request_error", "code": status}}, status_code=status
    )


def create_app(config: FakeConfig) -> FastAPI:
    loop = simulated_loop(config)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        yield
        await loop.shutdown()

    app = FastAPI(lifespan=lifespan)
    counter = itertools.count(1)
    app.state.loop = loop

    def prompt_ids(prompt: Any) -> list[int] | None:
        if isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt):
            return prompt if config.accept_token_ids else None
        if isinstance(prompt, str) and prompt:
            if config.tokenizer is not None:
                return config.tokenizer.encode(prompt, add_special_tokens=True)
            return [FIRST_PLAIN_TOKEN] * len(prompt.split())  # words are tokens
        return None

    @app.get("/health")
    async def health() -> dict[str, str]:
        return {"status": "ok"}

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [{"id": config.model, "object": "model", "owned_by": "fake"}]}

    @app.post("/tokenize")
    async def tokenize(request: Request) -> Any:
        if config.tokenizer is None:
            return _error(404, "no tokenizer")
        body = await request.json()
        ids = config.tokenizer.encode(body["prompt"], add_special_tokens=body.get("add_special_tokens", True))
        return {"tokens": ids, "count": len(ids)}

    @app.post("/detokenize")
    async def detokenize(request: Request) -> Any:
        if config.tokenizer is None:
            return _error(404, "no tokenizer")
        body = await request.json()
        return {"prompt": config.tokenizer.decode(body["tokens"])}

    async def generate(request: Request, chat: bool) -> Any:
        if config.api_key and request.headers.get("authorization") != f"Bearer {config.api_key}":
            return _error(401, "invalid API key")
        body = await request.json()
        n = next(counter)
        if config.fail_every and n % config.fail_every == 0:
            return _error(503, "injected failure")
        if chat:
            messages = body.get("messages") or []
            prompt: Any = " ".join(str(m.get("content", "")) for m in messages)
        else:
            prompt = body.get("prompt")
        ids = prompt_ids(prompt)
        if ids is None:
            return _error(400, "prompt must be a non-empty string (or token ids, where accepted)")
        prompt_tokens = len(ids)
        max_tokens = int(body.get("max_completion_tokens") or body.get("max_tokens") or 16)
        rid = f"fake-{n}"
        try:
            deltas = loop.generate(
                ids, SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True), rid
            )
        except ValueError as exc:
            return _error(400, str(exc))
        usage = {
            "prompt_tokens": prompt_tokens,
            "completion_tokens": max_tokens,
            "total_tokens": prompt_tokens + max_tokens,
        }
        obj = "chat.completion" if chat else "text_completion"
        breaks = bool(config.break_every and n % config.break_every == 0)

        def choice(token: int | None, finish: str | None) -> dict[str, Any]:
            text = "" if token is None else f" t{token}"
            if chat:
                return {"index": 0, "delta": {"content": text} if text else {}, "finish_reason": finish}
            return {"index": 0, "text": text, "finish_reason": finish}

        if not body.get("stream"):
            async for _ in deltas:
                pass
            text = "".join(f" t{i}" for i in range(1, max_tokens + 1))
            answer = {"message": {"role": "assistant", "content": text}} if chat else {"text": text}
            return {
                "id": rid,
                "object": obj,
                "created": int(time.time()),
                "model": config.model,
                "choices": [{"index": 0, **answer, "finish_reason": "length"}],
                "usage": usage,
            }

        async def events() -> AsyncIterator[str]:
            head = {"id": rid, "object": obj + ("" if not chat else ".chunk"), "model": config.model}
            token = 0
            async with contextlib.aclosing(deltas):  # leaving early aborts the request
                async for delta in deltas:
                    for _ in delta.token_ids:  # one event per token, as a real server streams them
                        token += 1
                        if breaks and token > max_tokens // 2:
                            yield f"data: {json.dumps({'error': {'message': 'injected stream error'}})}\n\n"
                            return
                        yield f"data: {json.dumps({**head, 'choices': [choice(token, None)]})}\n\n"
            yield f"data: {json.dumps({**head, 'choices': [choice(None, 'length')]})}\n\n"
            if (body.get("stream_options") or {}).get("include_usage"):
                yield f"data: {json.dumps({**head, 'choices': [], 'usage': usage})}\n\n"
            yield "data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream")

    @app.post("/v1/completions")
    async def completions(request: Request) -> Any:
        return await generate(request, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Any:
        return await generate(request, chat=True)

    return app


def main(argv: list[str] | None = None) -> int:
    import uvicorn

    p = argparse.ArgumentParser(prog="python -m loadtest.fakeserver", description=__doc__)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--model", default="fake-model")
    p.add_argument("--scheduling", choices=("iteration", "request"), default="iteration")
    p.add_argument("--max-batch", type=int, default=16)
    p.add_argument("--step-ms", type=float, default=2.0)
    p.add_argument("--per-token-ms", type=float, default=0.0)
    p.add_argument(
        "--tokenizer",
        default=None,
        help="HF tokenizer dir, or 'default' for the default model's (without one, words are tokens)",
    )
    p.add_argument("--reject-token-ids", action="store_true")
    p.add_argument("--fail-every", type=int, default=0)
    p.add_argument("--break-every", type=int, default=0)
    args = p.parse_args(argv)
    tokenizer_path = default_model_tokenizer_path() if args.tokenizer == "default" else args.tokenizer
    if args.tokenizer and tokenizer_path is None:
        p.error("the default model's tokenizer is not available (models.loader.resolve_model failed)")
    config = from_flags(
        FakeConfig,
        args,
        tokenizer=HFTokenizer(Path(tokenizer_path)) if tokenizer_path else None,
        accept_token_ids=not args.reject_token_ids,
    )
    uvicorn.run(create_app(config), host=args.host, port=args.port, log_level="warning")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
