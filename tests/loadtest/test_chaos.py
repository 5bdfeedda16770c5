"""The chaos run, short (a few seconds against the real app over the fake runner on a real socket):
disconnects, malformed, oversized and truncated bodies, huge n and max_tokens, and the engine going
down (the fake runner's kill(), as a dead worker) while under load. Every request is answered or
cleanly refused, no KV block is left in use, /health ends 200."""

from __future__ import annotations

from fakes import FakeRunner, live_server, make_app

from loadtest.chaos import Chaos


async def test_a_short_chaos_run_ends_clean(tokenizer) -> None:
    runner = FakeRunner(can_restart=True, step_delay_s=0.002)
    app = make_app(tokenizer, runner, max_body_bytes=64 * 1024, max_worker_restarts=100)

    def kill() -> bool:
        runner.kill()
        return True

    async with live_server(app) as url:
        chaos = Chaos(
            url, "fake-model", 4.0, 6, seed=1, kill_worker=kill, kill_every_s=1.0, max_body_bytes=64 * 1024
        )
        report = await chaos.run()
    assert report.passed, "\n".join(report.lines())
    assert report.unclean == {}
    assert report.workers_killed >= 1 and report.worker_restarts == report.workers_killed
    assert report.kv_blocks_used_end == 0 and report.health_end == 200
    assert report.outcomes.get("ok", 0) > 0 and report.outcomes.get("refused_400", 0) > 0
    # Over the 64 KiB limit: the oversized bodies and the million-token prompts.
    assert report.outcomes.get("refused_413", 0) == report.actions.get("oversized", 0) + report.actions.get(
        "too_long", 0
    )
    print("\n".join(report.lines()))
    assert set(report.actions) >= {"normal", "stream", "disconnect", "malformed"}
