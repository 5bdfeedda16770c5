"""The web UI's routes: pages and static files (public, with a strict CSP), the live event stream
(behind the key), --no-webui, and a live stream that ends when the server drains."""

from __future__ import annotations

import json

import httpx
import pytest
from fakes import FakeRunner, error_of, live_server, make_app, parse_sse, running_app

from server.cli import parse_args

ASSETS = ("api.js", "chat.js", "live.js", "markdown.js", "style.css", "favicon.svg")


async def test_pages_and_their_files_are_served_with_a_strict_policy(tokenizer):
    async with running_app(make_app(tokenizer)) as client:
        for path, script in (("/", "/webui/chat.js"), ("/live", "/webui/live.js")):
            r = await client.get(path)
            assert r.status_code == 200 and r.headers["content-type"].startswith("text/html")
            assert f'<script type="module" src="{script}">' in r.text
            csp = r.headers["content-security-policy"]
            assert "script-src 'self'" in csp and "default-src 'none'" in csp and "unsafe-inline" not in csp
            assert r.headers["x-content-type-options"] == "nosniff"
        for name in ASSETS:
            r = await client.get(f"/webui/{name}")
            assert r.status_code == 200 and r.content, name
        assert (
            (await client.get("/webui/chat.js"))
            .headers["content-type"]
            .startswith(("text/javascript", "application/javascript"))
        )
        assert (await client.get("/webui/nope.js")).status_code == 404
        # The pages are not part of the API's schema.
        assert "/live/events" not in (await client.get("/openapi.json")).json()["paths"]


async def test_with_a_key_the_pages_are_public_and_the_event_stream_is_not(tokenizer):
    async with running_app(make_app(tokenizer, api_key="s3cret")) as client:
        for path in ("/", "/live", *(f"/webui/{name}" for name in ASSETS)):
            assert (await client.get(path)).status_code == 200, path
        assert error_of(await client.get("/live/events"), 401)["code"] == "invalid_api_key"
        # The public prefix leads nowhere else.
        for path in ("/webui/../v1/models", "/webui/%2e%2e/v1/models", "/webuiX"):
            r = await client.get(path)
            assert r.status_code in (401, 404) and "fake-model" not in r.text, path


async def test_no_webui_serves_the_api_only(tokenizer):
    assert parse_args(["--no-webui"]).webui is False and parse_args([]).webui is True
    app = make_app(tokenizer, webui=False)
    assert app.state.server.live_feed is None  # no listener on the loop at all
    async with running_app(app) as client:
        for path in ("/", "/live", "/live/events", "/webui/chat.js"):
            assert (await client.get(path)).status_code == 404, path
        assert (await client.get("/health")).status_code == 200


class EventReader:
    """(event, data) pairs of an open SSE response, read as far as a test asks."""

    def __init__(self, response: httpx.Response) -> None:
        self._chunks = response.aiter_text()
        self._buffer = ""
        self.events: list[tuple[str, dict]] = []

    async def until(self, done) -> bool:
        """Read until done(events) holds (True), or the stream ends (False)."""
        async for chunk in self._chunks:
            self._buffer += chunk.replace("\r\n", "\n")
            while "\n\n" in self._buffer:
                block, self._buffer = self._buffer.split("\n\n", 1)
                lines = [line for line in block.split("\n") if line and not line.startswith(":")]
                fields = dict(line.split(": ", 1) for line in lines)
                if "data" in fields:
                    self.events.append((fields.get("event", "message"), json.loads(fields["data"])))
            if done(self.events):
                return True
        return False


@pytest.mark.timeout(60)
async def test_live_events_show_a_request_step_by_step_and_end_when_the_server_drains(tokenizer):
    app = make_app(tokenizer, FakeRunner(step_delay_s=0.002), max_num_seqs=8, max_num_batched_tokens=64)
    async with live_server(app) as url, httpx.AsyncClient(base_url=url, timeout=30) as client:
        async with client.stream("GET", "/live/events") as stream:
            assert stream.headers["content-type"].startswith("text/event-stream")
            body = {"model": "fake-model", "prompt": "hello there", "max_tokens": 5, "stream": True}
            completion = await client.post("/v1/completions", json=body)
            request_id = parse_sse(completion.text)[0]["id"] + "-0"

            def finished(events):
                return any(request_id in s["finished"] for e, d in events if e == "steps" for s in d["steps"])

            reader = EventReader(stream)
            assert await reader.until(finished)
            events = reader.events
            assert events[0][0] == "hello"
            assert events[0][1]["max_num_seqs"] == 8 and events[0][1]["model"] == "fake-model"
            steps = [s for e, d in events if e == "steps" for s in d["steps"] if request_id in s["ids"]]
            assert len(steps) == 5  # the prompt, then four decodes
            assert steps[0]["starts"] == [0] and steps[0]["decode"] == [False] and steps[0]["tokens"][0] > 1
            assert all(s["decode"] == [True] and s["tokens"] == [1] for s in steps[1:])
            assert [s["step"] for s in steps] == list(range(steps[0]["step"], steps[0]["step"] + 5))
            assert steps[-1]["finished"] == [request_id]
            # Draining (SIGTERM) ends the stream, so an open view never holds up the shutdown.
            app.state.server.start_draining()
            assert not await reader.until(lambda events: False)  # the server closed it
