"""Prompt logprobs over the API (the fake runner's made-up values; the numbers themselves are checked
against transformers in tests/engine/test_prompt_logprobs.py): OpenAI's echo with logprobs on
/v1/completions, as lm-eval's loglikelihood tasks send it, and vLLM's prompt_logprobs field."""

from __future__ import annotations

from fakes import FakeRunner, drained, error_of, make_app, parse_sse, running_app

PROMPT = [520, 33, 1500, 77, 4000, 12]


async def test_echo_with_logprobs_scores_every_prompt_token(tokenizer) -> None:
    """lm-eval's request: token ids, echo, logprobs 1, max_tokens 1. The logprobs cover the prompt
    tokens one for one (None for the first), then the generated token."""
    app = make_app(tokenizer, FakeRunner())
    async with running_app(app) as client:
        body = {"prompt": PROMPT, "echo": True, "logprobs": 1, "max_tokens": 1, "temperature": 0}
        r = await client.post("/v1/completions", json=body)
        assert r.status_code == 200, r.text
        choice = r.json()["choices"][0]
        lp = choice["logprobs"]
        n = len(PROMPT)
        assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["top_logprobs"]) == n + 1
        assert lp["tokens"][:n] == [tokenizer.token_text(t) for t in PROMPT]
        assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
        assert lp["token_logprobs"][1:n] == [-float(t % 5) / 5.0 for t in PROMPT[1:]]
        assert all(len(top) == 1 for top in lp["top_logprobs"][1:])
        echo = tokenizer.decode(PROMPT, skip_special_tokens=False)
        assert choice["text"].startswith(echo)
        # Offsets index the choice's text: the prompt's tokens from 0, the generated one after it.
        offsets = lp["text_offset"]
        assert offsets[0] == 0 and offsets == sorted(offsets) and offsets[n] == len(echo)
        for token, at in zip(lp["tokens"][:n], offsets[:n], strict=True):
            assert choice["text"][at : at + len(token)] == token
        assert r.json()["usage"]["prompt_tokens"] == n
        await drained(app)


async def test_max_tokens_0_scores_the_prompt_and_generates_nothing(tokenizer) -> None:
    app = make_app(tokenizer, FakeRunner())
    async with running_app(app) as client:
        body = {"prompt": PROMPT, "echo": True, "logprobs": 0, "max_tokens": 0}
        r = await client.post("/v1/completions", json=body)
        assert r.status_code == 200, r.text
        out = r.json()
        choice = out["choices"][0]
        assert choice["text"] == tokenizer.decode(PROMPT, skip_special_tokens=False)
        assert len(choice["logprobs"]["tokens"]) == len(PROMPT) and choice["finish_reason"] == "length"
        assert out["usage"]["completion_tokens"] == 0
        # Streamed, the same: one chunk with the prompt and its logprobs, nothing generated.
        r = await client.post("/v1/completions", json={**body, "stream": True})
        events = [e for e in parse_sse(r.text) if e != "[DONE]"]
        texts = "".join(c["text"] for e in events for c in e["choices"])
        assert texts == choice["text"]
        tokens = [t for e in events for c in e["choices"] if c["logprobs"] for t in c["logprobs"]["tokens"]]
        assert tokens == choice["logprobs"]["tokens"]
        await drained(app)


async def test_streamed_echo_with_logprobs_equals_the_whole_response(tokenizer) -> None:
    app = make_app(tokenizer, FakeRunner())
    async with running_app(app) as client:
        body = {"prompt": PROMPT, "echo": True, "logprobs": 2, "max_tokens": 5, "temperature": 0, "n": 2}
        whole = (await client.post("/v1/completions", json=body)).json()["choices"]
        r = await client.post("/v1/completions", json={**body, "stream": True})
        events = [e for e in parse_sse(r.text) if e != "[DONE]"]
        for index in range(2):
            pieces = [c for e in events for c in e["choices"] if c["index"] == index]
            assert "".join(c["text"] for c in pieces) == whole[index]["text"]
            joined = {
                k: [v for c in pieces if c["logprobs"] for v in c["logprobs"][k]]
                for k in whole[0]["logprobs"]
            }
            assert joined == whole[index]["logprobs"]
        await drained(app)


async def test_vllm_prompt_logprobs_field(tokenizer) -> None:
    app = make_app(tokenizer, FakeRunner())
    async with running_app(app) as client:
        body = {"prompt": PROMPT, "prompt_logprobs": 2, "max_tokens": 2, "temperature": 0}
        r = await client.post("/v1/completions", json=body)
        assert r.status_code == 200, r.text
        choice = r.json()["choices"][0]
        scored = choice["prompt_logprobs"]
        assert len(scored) == len(PROMPT) and scored[0] is None
        for token, entry in zip(PROMPT[1:], scored[1:], strict=True):
            assert entry[str(token)]["rank"] == 1
            assert entry[str(token)]["logprob"] == -float(token % 5) / 5.0
            assert entry[str(token)]["decoded_token"] == tokenizer.token_text(token)
        assert choice["logprobs"] is None  # prompt_logprobs alone asks for no output logprobs
        await drained(app)


async def test_prompt_logprobs_over_the_cap_is_a_400(tokenizer) -> None:
    app = make_app(tokenizer, FakeRunner(), max_logprobs=3)
    async with running_app(app) as client:
        r = await client.post("/v1/completions", json={"prompt": PROMPT, "prompt_logprobs": 4})
        assert error_of(r)["param"] == "prompt_logprobs"
        r = await client.post("/v1/completions", json={"prompt": PROMPT, "prompt_logprobs": -1})
        assert error_of(r)["param"] == "prompt_logprobs"
