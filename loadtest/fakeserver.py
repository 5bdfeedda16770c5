"""A model-free OpenAI-compatible server that simulates batched generation, for testing the harness.

It keeps the shape of a real server's timing without a model: an iteration loop takes a step every
`step_ms` (plus `per_token_ms` for each token in the step), and every running request gets one token
per step. `--scheduling iteration` admits waiting requests at every step; `request` admits a new
batch only when the whole running batch has finished (the baseline the ORCA paper compares against),
so a sweep over both shows the paper's gap with no model at all. Failure injection (`fail_every`,
`break_every`) exercises the error accounting.

    python -m loadtest.fakeserver --port 8001 --scheduling request --step-ms 5
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

from loadtest.tokenizer import HFTokenizer, PromptTokenizer, default_model_tokenizer_path


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


@dataclass
class _Sequence:
    prompt_tokens: int
    max_tokens: int
    queue: asyncio.Queue[int | None] = field(default_factory=asyncio.Queue)
    generated: int = 0
    prefilled: bool = False


class FakeEngine:
    """The simulated iteration loop. `steps` counts iterations, for tests that reason about order."""

    def __init__(self, config: FakeConfig) -> None:
        self.config = config
        self.waiting: list[_Sequence] = []
        self.running: list[_Sequence] = []
        self.steps = 0
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None

    def submit(self, seq: _Sequence) -> None:
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._loop())
        self.waiting.append(seq)
        self._wake.set()

    def _admit(self) -> list[_Sequence]:
        cfg = self.config
        if cfg.scheduling == "request" and self.running:
            return []  # request-level batching: the batch runs until its longest request is done
        room = cfg.max_batch - len(self.running)
        admitted, self.waiting = self.waiting[:room], self.waiting[room:]
        self.running.extend(admitted)
        return admitted

    async def _loop(self) -> None:
        cfg = self.config
        while True:
            if not self.waiting and not self.running:
                self._wake.clear()
                await self._wake.wait()
            self._admit()
            tokens = sum(1 if s.prefilled else s.prompt_tokens for s in self.running)
            await asyncio.sleep((cfg.step_ms + cfg.per_token_ms * tokens) / 1000.0)
            self.steps += 1
            for seq in self.running:
                seq.prefilled = True
                if seq.generated < seq.max_tokens:
                    seq.generated += 1
                    seq.queue.put_nowait(seq.generated)
                    if seq.generated == seq.max_tokens:
                        seq.queue.put_nowait(None)
            if cfg.scheduling == "request":
                # Finished requests stay in the batch (their slots idle) until every one is done.
                if all(s.generated >= s.max_tokens for s in self.running):
                    self.running = []
            else:
                self.running = [s for s in self.running if s.generated < s.max_tokens]


def _error(status: int, message: str) -> JSONResponse:
    return JSONResponse(
        {"error": {"message": message, "type": "invalid_request_error", "code": status}}, status_code=status
    )


def create_app(config: FakeConfig) -> FastAPI:
    app = FastAPI()
    engine = FakeEngine(config)
    counter = itertools.count(1)
    app.state.engine = engine

    def count_prompt(prompt: Any) -> int | None:
        if isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt):
            return len(prompt) if config.accept_token_ids else None
        if isinstance(prompt, str) and prompt:
            if config.tokenizer is not None:
                return len(config.tokenizer.encode(prompt, add_special_tokens=True))
            return len(prompt.split())
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
        prompt_tokens = count_prompt(prompt)
        if prompt_tokens is None:
            return _error(400, "prompt must be a non-empty string (or token ids, where accepted)")
        max_tokens = int(body.get("max_completion_tokens") or body.get("max_tokens") or 16)
        seq = _Sequence(prompt_tokens, max_tokens)
        engine.submit(seq)
        rid = f"fake-{n}"
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
            while await seq.queue.get() is not None:
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
            while (token := await seq.queue.get()) is not None:
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
    config = FakeConfig(
        model=args.model,
        scheduling=args.scheduling,
        max_batch=args.max_batch,
        step_ms=args.step_ms,
        per_token_ms=args.per_token_ms,
        tokenizer=HFTokenizer(Path(tokenizer_path)) if tokenizer_path else None,
        accept_token_ids=not args.reject_token_ids,
        fail_every=args.fail_every,
        break_every=args.break_every,
    )
    uvicorn.run(create_app(config), host=args.host, port=args.port, log_level="warning")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
