"""engine.bench's GPU mode, checked on the CPU: the roofline arithmetic, model shapes with random
weights (the Llama-3-8B shape's builder at toy sizes), and the whole benchmark run end to end, with
graphs stood in for by fake_graphs.ReplayByCalling so both modes (graphs and eager) are exercised."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from fake_graphs import ReplayByCalling
from kernel_marks import needs_native_kernels

from engine import bench
from engine.config import EngineConfig
from engine.executor import LocalExecutor
from engine.model_shapes import SHAPES, parameter_count, shape_config, write_shape
from engine.roofline import DecodeBytes, measure_copy_bandwidth, routed_expert_bytes, weight_bytes_per_step
from models.errors import ModelLoadError
from models.layers.parallel import SINGLE
from models.loader import DUMMY_WEIGHT_RANGE, load_model, resolve_model


def test_roofline_is_batch_times_bandwidth_over_the_bytes_a_step_reads():
    costs = DecodeBytes(weight_bytes=16_000_000_000, kv_bytes_per_token=131072)  # Llama-3-8B in bf16
    # Batch 1 at 96 tokens of history: the weights dominate.
    assert costs.per_step(1, 96) == 16_000_000_000 + 96 * 131072
    assert costs.roofline_tok_s(1, 96, 3e12) == pytest.approx(3e12 / (16e9 + 96 * 131072))
    # Batch 256: the K/V read is now 3% of the weights' bytes; the ceiling is ~187 steps/s x 256.
    bytes_256 = 16e9 + 256 * 96 * 131072
    assert costs.roofline_tok_s(256, 96, 3e12) == pytest.approx(256 * 3e12 / bytes_256)
    assert costs.roofline_tok_s(256, 96, 3e12) < 256 * costs.roofline_tok_s(1, 96, 3e12)


def test_a_mixture_of_experts_counts_its_routed_experts_at_the_share_a_step_reads():
    from models.layers.moe import MoESizes, Routing, SparseMoE

    moe = SparseMoE(MoESizes(hidden=16, expert_inter=8), Routing(8, 2, False), torch.float32, SINGLE)
    # 8 experts of gate_up [16, 16] and down [16, 8] in float32; the router is read whatever the routing.
    assert routed_expert_bytes(moe) == (8 * (16 * 16 + 16 * 8) * 4, 0.25)
    assert routed_expert_bytes(torch.nn.Linear(4, 4)) == (0, 0.0)
    costs = DecodeBytes(weight_bytes=1000, kv_bytes_per_token=0, expert_bytes=8000, expert_share=0.25)
    assert costs.per_step(1, 0) == pytest.approx(1000 + 2000)  # one token: its 2 of 8 experts
    assert costs.per_step(2, 0) == pytest.approx(1000 + 8000 * (1 - 0.75**2))
    assert costs.per_step(64, 0) == pytest.approx(9000)  # a large batch reads nearly every expert


def test_the_shapes_have_their_published_parameter_counts():
    assert parameter_count(shape_config("llama3-8b")) == 8_030_261_248  # Meta-Llama-3-8B's count
    assert parameter_count(shape_config("smollm2-135m")) == 134_515_008  # tied: the embedding once
    assert parameter_count(shape_config("olmoe-1b-7b")) == 6_919_161_856  # 64 experts: 6.9B, 1.3B active
    assert parameter_count(shape_config("gemma-3-1b")) == 999_885_952
    assert parameter_count(shape_config("qwen3-8b")) == 8_190_735_360
    assert parameter_count(shape_config("phi-4-mini")) == 3_836_021_760


@pytest.mark.parametrize("shape", sorted(SHAPES))
def test_a_tiny_shape_loads_with_random_weights_and_counts_its_bytes(shape: str, tmp_path: Path):
    path = write_shape(shape, tmp_path / shape, tiny=True)
    with pytest.raises(ModelLoadError, match="safetensors"):
        resolve_model(str(path))  # a checkpoint needs its weights...
    assert resolve_model(str(path), need_weights=False) == path  # ...random weights do not
    model = load_model(path, torch.float32, "cpu", load_format="dummy")
    config = shape_config(shape, tiny=True)
    params = list(model.parameters())
    assert sum(p.numel() for p in params) == parameter_count(config)
    assert all(p.abs().max() <= DUMMY_WEIGHT_RANGE and p.std() > 0 for p in params)
    again = load_model(path, torch.float32, "cpu", load_format="dummy")
    assert all(torch.equal(a, b) for a, b in zip(params, again.parameters(), strict=True))  # seeded
    embed = config["vocab_size"] * config["hidden_size"]
    # A decode step reads every weight once; an untied embedding table only at its B rows.
    lookup_only = 0 if config["tie_word_embeddings"] else embed
    assert weight_bytes_per_step(model) == 4 * (parameter_count(config) - lookup_only)


def test_copy_bandwidth_is_measured():
    bandwidth = measure_copy_bandwidth(torch.device("cpu"), nbytes=1 << 20, repeats=3)
    assert 1e6 < bandwidth < 1e13


def with_fake_graphs(monkeypatch: pytest.MonkeyPatch) -> ReplayByCalling:
    """bench's executors capture their decode graphs with the CPU stand-in."""
    fake = ReplayByCalling()

    def executor(config: EngineConfig) -> LocalExecutor:
        ex = LocalExecutor(config)
        assert config.max_num_seqs is not None
        ex.runner.capture_decode_graphs(config.max_num_seqs, capturer=fake)  # and replays them
        return ex

    monkeypatch.setattr(bench, "LocalExecutor", executor)
    return fake


def test_the_gpu_benchmark_runs_end_to_end_on_a_tiny_shape(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
):
    fake = with_fake_graphs(monkeypatch)
    out = tmp_path / "results" / "bench.json"
    bench.main(
        [
            "--shape",
            "llama3-8b",
            "--tiny",
            "--device",
            "cpu",
            "--dtype",
            "float32",
            "--kv-cache-dtype",
            "float32",
            "--batch-sizes",
            "1,3",
            "--new-tokens",
            "5",
            "--prompt-len",
            "8",
            "--prefill-lens",
            "8,16",
            "--prefill-tokens",
            "32",
            "--bandwidth-bytes",
            "65536",
            "--json",
            str(out),
        ]  # fmt: skip
    )
    result = json.loads(out.read_text())
    setup = result["setup"]
    assert setup["model"] == "llama3-8b (tiny)" and setup["weights"].startswith("random")
    assert setup["cuda_graphs"]["sizes"] == [1, 2, 3]  # up to the largest batch
    assert setup["copy_bandwidth_gb_s"] > 0 and setup["kv_bytes_per_token"] == 2 * 2 * 1 * 16 * 4
    assert [r["batch_size"] for r in result["rows"]] == [1, 3]
    for row in result["rows"]:
        assert set(row["engine_by_mode"]) == {"graphs", "eager"}
        assert row["engine"] == row["engine_by_mode"]["graphs"]
        assert len(row["engine"]["decode_steps_ms"]) == 5 - 1 - bench.WARMUP_STEPS
        assert row["hf"]["decode_tok_s"] > 0 and row["graph_speedup"] > 0
        assert 0 < row["roofline_fraction"] and row["bytes_per_step"] > setup["weight_bytes_per_step"]
    assert sum(fake.replays.values()) > 0, "the graph mode never replayed a graph"
    assert [(p["prompt_len"], p["num_prompts"]) for p in result["prefill"]] == [(8, 4), (16, 2)]
    assert all(p["engine_tok_s"] > 0 and p["hf_tok_s"] > 0 for p in result["prefill"])
    printed = capsys.readouterr().out
    assert "graphs / eager" in printed and "of roofline" in printed and "prefill throughput" in printed


@needs_native_kernels
def test_the_kv_cache_benchmark_runs_every_type(tmp_path: Path, capsys) -> None:
    from engine import kv_bench

    out = tmp_path / "kv.json"
    kv_bench.main(
        ["--context", "70", "--rounds", "1", "--memory", "64MiB", "--read-bytes", "8MiB", "--json", str(out)]
    )
    result = json.loads(out.read_text())
    rows = result["rows"]
    assert [r["dtype"] for r in rows] == ["float32", "float16", "bfloat16", "q8_0"]
    assert all(r["gb_s"] > 0 and r["context"] == 70 for r in rows)
    # K and V of 30 layers x 3 heads for 70 tokens: 64 floats, 64 halves, or two q8_0 blocks a row.
    assert [round(r["kv_gb_per_step"] * 1e9) for r in rows] == [
        70 * 2 * 30 * 3 * b for b in (256, 128, 128, 68)
    ]
    fit = result["tokens_that_fit"]
    assert fit["float16"] == fit["bfloat16"] == 2 * fit["float32"] and fit["q8_0"] > 3.7 * fit["float32"]
    assert "tokens that fit in 64MiB" in capsys.readouterr().out
