"""The soak script, briefly, against the fake runner: it reports, and leaves no KV block in use."""

from __future__ import annotations

from fakes import (
    MODEL,
    FakeRunner,
    live_server,
    make_app,
)


async def test_soak_reports_and_leaves_no_blocks(tokenizer, smollm2_tokenizer_dir):
    from loadtest.soak import Soak, build_parser

    runner = FakeRunner(num_kv_blocks=512)
    app = make_app(tokenizer, runner)
    async with live_server(app) as url:
        args = build_parser().parse_args(
            ["--duration", "1.5", "--concurrency", "6", "--tokenizer", str(smollm2_tokenizer_dir)]
            + ["--input-max", "64", "--output-max", "24", "--disconnect", "0.4"]
        )
        report = await Soak(args, url, None, MODEL).run()
    assert report.requests_served > 0 and report.disconnects > 0
    assert report.requests_sent >= report.requests_served + report.disconnects
    assert report.errors == {}
    assert report.kv_blocks_used_end == 0 and report.requests_running_end == 0
    # Repeated prompts hit the prefix cache; what it keeps at the end is cached, not held.
    assert report.kv_blocks_cached_end and report.kv_blocks_cached_end > 0
    assert report.prefix_cache_hit_rate and report.prefix_cache_hit_rate > 0
    assert any(line.startswith("KV blocks in use at the end: 0") for line in report.lines())
