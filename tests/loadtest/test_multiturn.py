"""The multi-turn chat workload (loadtest.conversation, loadtest.multiturn) against the real app over a
fake runner: each turn resends the history with the server's previous reply, and the report reads TTFT
and cached tokens per turn."""

from __future__ import annotations

import json

import numpy as np
import pytest
from fakes import FakeRunner, live_server, make_app

from loadtest import multiturn
from loadtest.conversation import ConversationShape, make_conversation
from loadtest.prompts import PromptBuilder
from loadtest.tokenizer import HFTokenizer


@pytest.fixture(scope="module")
def builder(smollm2_tokenizer_dir) -> PromptBuilder:
    return PromptBuilder(HFTokenizer(smollm2_tokenizer_dir))


def test_conversations_are_the_same_for_every_configuration(builder):
    shape = ConversationShape(turns=3, system_len=120, user_len=20, output_len=8, think_time=0.5)
    a, again, other = (make_conversation(builder, shape, seed=1, index=i) for i in (0, 0, 1))
    assert a == again and a.system != other.system
    assert builder.count(a.system) == 120 and [builder.count(u) for u in a.user_messages] == [20] * 3
    assert len(a.think_times) == 2 and all(t >= 0 for t in a.think_times)
    assert make_conversation(builder, ConversationShape(think_time=0.0), 1, 0).think_times == (0.0,) * 4
    with pytest.raises(ValueError):
        ConversationShape(turns=0)


async def test_turns_resend_the_history_and_hit_the_prefix_cache(tokenizer, smollm2_tokenizer_dir, tmp_path):
    runner = FakeRunner(num_kv_blocks=512, max_model_len=2048)
    args = multiturn.build_parser().parse_args(
        ["--num-conversations", "3", "--turns", "3", "--system-len", "100", "--user-len", "12"]
        + ["--output-len", "6", "--think-time", "0.01", "--start-spread", "0.01"]
        + ["--tokenizer", str(smollm2_tokenizer_dir), "--output", str(tmp_path / "mt.json")]
    )
    async with live_server(make_app(tokenizer, runner)) as url:
        result = await multiturn.measure(url, args, multiturn.make_console(), "caching", None)
    assert [(t.turn, t.ok, t.requests) for t in result.turns] == [(1, 3, 3), (2, 3, 3), (3, 3, 3)]
    by_conv: dict[int, list] = {}
    for t in result.records:
        by_conv.setdefault(t.conversation, []).append(t.record)
    for records in by_conv.values():
        prompts = [r.prompt_tokens_reported for r in records]
        # Each turn adds the previous reply (6 tokens + template) and a 12-token message.
        assert prompts[0] > 100 and all(b > a + 18 for a, b in zip(prompts, prompts[1:], strict=False))
        cached = [r.cached_tokens_reported for r in records]
        assert cached[0] == 0 and all(
            c is not None and c >= p // 16 * 16 - 16 for c, p in zip(cached[1:], prompts, strict=False)
        )
    assert result.turns[1].cached_tokens and result.turns[1].cached_tokens > 100
    assert result.server["prefix_cache_hits"] > 0
    assert not np.isnan(result.ttft_later_ms.p50)
    lines = multiturn.comparison_lines([result, result])
    assert lines[0].startswith("caching: TTFT p50 turn 1") and "hit rate" in lines[0]
    assert lines[-1] == "TTFT p50 turns >= 2: caching / caching = 1.00"


def test_the_command_line_writes_results(tokenizer, smollm2_tokenizer_dir, tmp_path, monkeypatch):
    out = tmp_path / "mt.json"

    async def fake_measure(base_url, args, console, label, command):
        records = []
        return multiturn.result_of(label, command, "m", records, args.turns)

    monkeypatch.setattr(multiturn, "measure", fake_measure)
    rc = multiturn.main(["--turns", "2", "--output", str(out)])
    data = json.loads(out.read_text())
    assert rc == 0 and data["config"]["shape"]["turns"] == 2 and data["results"][0]["label"] == "server"
    with pytest.raises(SystemExit):
        multiturn.main(["--launch", "a", "--launch", "b", "--label", "x"])  # one label per launch
    with pytest.raises(SystemExit):
        multiturn.main(["--base-url", "http://10.0.0.1:8000"])  # not loopback
