"""Flags: size parsing and how command-line flags reach the server's config."""

from __future__ import annotations

import pytest

from engine.cli_args import parse_size
from engine.config import EngineConfig
from scheduler.config import SchedulerConfig
from server.cli import parse_args
from server.config import ServerConfig


@pytest.mark.parametrize(
    ("text", "value"),
    [
        ("4096", 4096),
        ("2GiB", 2 * 2**30),
        ("512MiB", 512 * 2**20),
        ("1GB", 10**9),
        ("1.5 KiB", 1536),
        ("3g", 3 * 10**9),
    ],
)
def test_parse_size(text, value):
    assert parse_size(text) == value


@pytest.mark.parametrize("text", ["", "lots", "2XB", "-1GiB", "0"])
def test_parse_size_rejects(text):
    with pytest.raises(ValueError):
        parse_size(text)


def test_cli_flags():
    c = parse_args(
        "--model m.gguf --served-model-name x --port 9000 --kv-cache-memory 2GiB --scheduling request "
        "--kv-policy reserve --no-chunked-prefill --api-key k --max-num-seqs 8 --max-num-batched-tokens 256".split()
    )
    assert (c.engine.model, c.model_name, c.port, c.engine.kv_cache_memory) == (
        "m.gguf",
        "x",
        9000,
        2 * 2**30,
    )
    s = c.scheduler
    assert (s.scheduling, s.kv_policy, s.chunked_prefill, c.api_key) == ("request", "reserve", False, "k")
    assert (s.max_num_seqs, s.max_num_batched_tokens) == (8, 256)
    d = parse_args([])
    assert (d.engine.model, d.model_name, d.host, d.port, d.scheduler.chunked_prefill) == (
        "default",
        "default",
        "127.0.0.1",
        8000,
        True,
    )
    with pytest.raises(SystemExit):
        parse_args(["--kv-cache-memory", "lots"])
    with pytest.raises(SystemExit):
        parse_args(["--kv-cache-memory", "1GiB", "--num-kv-blocks", "10"])


def test_no_flags_is_the_default_config():
    """Every default is written once, in the dataclass that holds it; the flags only read it."""
    assert parse_args([]) == ServerConfig()


def test_flags_that_conflict_are_refused_by_the_parser(capsys):
    with pytest.raises(SystemExit):
        parse_args(["--max-num-seqs", "64", "--max-num-batched-tokens", "32"])
    assert "max_num_batched_tokens (32) must be >= max_num_seqs (64)" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        parse_args(["-tp", "0"])


def test_benchmarks_take_the_servers_engine_and_scheduler_flags():
    from engine import bench as engine_bench
    from engine import parallel_bench
    from loadtest import inprocess as scheduler_bench

    flags = ["--model", "m", "--dtype", "float32", "--block-size", "32", "--max-num-seqs", "4"]
    for module in (engine_bench, parallel_bench, scheduler_bench):
        parser = module.build_parser()
        a, _ = parser.parse_known_args(flags)
        # The engine reads the scheduler's --max-num-seqs and --max-num-batched-tokens where the parser
        # has them (they size CUDA graphs).
        has_scheduler = module is scheduler_bench
        assert EngineConfig.from_cli_args(a) == EngineConfig(
            model="m",
            dtype="float32",
            block_size=32,
            max_num_seqs=4 if has_scheduler else None,
            max_num_batched_tokens=SchedulerConfig().max_num_batched_tokens if has_scheduler else None,
        )
    a = scheduler_bench.build_parser().parse_args(flags)
    assert SchedulerConfig.from_cli_args(a) == SchedulerConfig(max_num_seqs=4)


def test_the_engine_gets_the_schedulers_step_bounds():
    """One flag, one default: the server passes the scheduler's max_num_seqs and max_num_batched_tokens
    down to the engine (its decode graphs' largest batch, its piecewise graphs' most tokens), and
    refuses two configs that disagree."""
    assert parse_args([]).engine.max_num_seqs == SchedulerConfig().max_num_seqs
    assert parse_args([]).engine.max_num_batched_tokens == SchedulerConfig().max_num_batched_tokens
    parsed = parse_args(["--max-num-seqs", "8", "--max-num-batched-tokens", "512"]).engine
    assert (parsed.max_num_seqs, parsed.max_num_batched_tokens) == (8, 512)
    assert parse_args(["--cuda-graphs", "decode"]).engine.cuda_graphs == "decode"
    built = ServerConfig(scheduler=SchedulerConfig(max_num_seqs=16, max_num_batched_tokens=128))
    assert (built.engine.max_num_seqs, built.engine.max_num_batched_tokens) == (16, 128)
    with pytest.raises(ValueError, match="max_num_seqs .* differs"):
        ServerConfig(engine=EngineConfig(max_num_seqs=8), scheduler=SchedulerConfig(max_num_seqs=16))
    with pytest.raises(ValueError, match="max_num_batched_tokens .* differs"):
        ServerConfig(engine=EngineConfig(max_num_batched_tokens=64), scheduler=SchedulerConfig())


def test_reasoning_and_responses_store_flags(monkeypatch, tmp_path):
    c = parse_args(
        "--reasoning-parser deepseek_r1 --responses-store /data/r.sqlite --responses-store-max-entries 5 "
        "--responses-store-max-age 60".split()
    )
    assert c.reasoning_parser == "deepseek_r1" and str(c.responses_store_path) == "/data/r.sqlite"
    assert (c.responses_store_max_entries, c.responses_store_max_age_s) == (5, 60.0)
    # By default the store is a file in the cache directory ($ORCA_CACHE_DIR, as models/ uses it).
    monkeypatch.setenv("ORCA_CACHE_DIR", str(tmp_path))
    assert parse_args([]).responses_store_path == tmp_path / "responses.sqlite"
    assert parse_args([]).reasoning_parser is None
    for bad in (["--reasoning-parser", "nope"], ["--responses-store-max-entries", "-1"]):
        with pytest.raises(SystemExit):
            parse_args(bad)


def test_overlap_schedule_flag(capsys):
    assert parse_args([]).scheduler.overlap_schedule is None  # auto: the loop decides by device
    assert parse_args(["--overlap-schedule", "auto"]).scheduler.overlap_schedule is None
    assert parse_args(["--overlap-schedule", "off"]).scheduler.overlap_schedule is False
    assert parse_args(["--overlap-schedule", "ON"]).scheduler.overlap_schedule is True
    with pytest.raises(SystemExit):
        parse_args(["--overlap-schedule", "maybe"])
    assert "expected auto, on or off" in capsys.readouterr().err


def test_speculative_decoding_flags(capsys):
    c = parse_args(
        "--speculative draft --draft-model small.gguf --num-speculative-tokens 3 --speculative-max-batch 2 "
        "--speculative-token-cost 0.3".split()
    )
    s = c.scheduler
    assert (s.speculative, s.num_speculative_tokens, s.speculative_max_batch) == ("draft", 3, 2)
    assert s.speculative_token_cost == 0.3 and c.engine.draft_model == "small.gguf"
    assert parse_args([]).scheduler.speculative == "auto" and parse_args([]).engine.draft_model is None
    # A draft model's speculation without one is refused before any model loads.
    with pytest.raises(SystemExit):
        parse_args(["--speculative", "draft"])
    assert "--speculative draft needs a --draft-model" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        parse_args(["--speculative", "eagle"])
