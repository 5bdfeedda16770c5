"""A decode step's layers in one native call (models/layers/native_decode.py): bit-identical to the
module-by-module forward, taken only by the steps and models it fits, and batch invariant."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from builders import GGUF_MIXES, write_tiny_gguf
from kernel_marks import native_calls, needs_native_kernels
from paged_cache import PagedCacheHarness

from models.layers.native_decode import NativeDecodeLayers
from models.loader import load_model, resolve_model

pytestmark = needs_native_kernels


def _run(
    model, steps: list[list[list[int]]], native: bool, kv_cache_dtype: str = "float32"
) -> tuple[list[torch.Tensor], PagedCacheHarness]:
    """Hidden states of every step (prompts first, then decode tokens) with or without the native call."""
    saved = model.native_decode
    model.native_decode = saved if native else None
    harness = PagedCacheHarness(model, num_seqs=len(steps[0]), kv_cache_dtype=kv_cache_dtype)
    outs = []
    try:
        with torch.no_grad():
            for tokens in steps:
                batch = harness.step(tokens)
                outs.append(model(batch.input_ids, batch.positions, harness.kv_caches, batch.metadata))
    finally:
        model.native_decode = saved
    return outs, harness


def _decode_steps(prompts: list[list[int]], n: int) -> list[list[list[int]]]:
    return [prompts] + [[[(7 * s + 3 * i) % 200 + 1] for i in range(len(prompts))] for s in range(n)]


# Mixtures of experts as llama.cpp writes them (8 experts, 2 per token): Qwen3-MoE (per-head q/k
# norms), Qwen2-MoE (q/k/v biases, a gated shared expert), OLMoE (norms over the whole q and k
# projections, clipping that bites) and Mixtral (a llama file with experts).
MOE_FILES = {
    "qwen2moe": dict(arch="qwen2moe", heads=2, kv_heads=1, ff=512, expert_ff=256, shared_ff=512),
    "qwen3moe": dict(arch="qwen3moe", hidden=256, heads=2, kv_heads=1, head_dim=128, ff=512, expert_ff=256),
    "olmoe": dict(
        arch="olmoe", heads=4, kv_heads=4, ff=512, expert_ff=256, metadata={"attention.clamp_kqv": 0.5}
    ),
    "mixtral": dict(arch="llama", heads=4, kv_heads=2, ff=256),
}


@pytest.fixture(params=["llama", "gemma3", *MOE_FILES])
def packed_dir(request, tmp_path: Path, monkeypatch) -> Path:
    """GGUF-structured tiny models: Llama's layout, Gemma 3's (q/k norms, sandwich norms, GELU, local
    layers with a window of 8 tokens and their own rotary table), and the mixtures of experts."""
    if request.param in MOE_FILES:
        monkeypatch.setenv("ORCA_CACHE_DIR", str(tmp_path / "cache"))
        gguf = tmp_path / f"{request.param}.gguf"
        sizes = {"hidden": 256, "experts": 8, **MOE_FILES[request.param]}
        write_tiny_gguf(gguf, seed=4, layers=2, types=GGUF_MIXES["Q4_K_M"], tied=False, **sizes)
        return resolve_model(str(gguf))
    return request.getfixturevalue(
        {"llama": "tiny_gguf_llama_dir", "gemma3": "tiny_gemma3_dir"}[request.param]
    )


@pytest.mark.parametrize("precision", ["int8", "float32"])
def test_native_layers_equal_the_modules(packed_dir: Path, precision: str) -> None:
    model = load_model(packed_dir, torch.float32, "cpu", weight_packing=precision)
    assert isinstance(model.native_decode, NativeDecodeLayers)
    # Three sequences of different lengths crossing block boundaries (and Gemma's window), then 9
    # decode steps.
    steps = _decode_steps([[5, 9, 12, 40, 41], [3] * 11, [77, 78]], 9)
    fast, fast_cache = _run(model, steps, native=True)
    slow, slow_cache = _run(model, steps, native=False)
    for a, b in zip(fast, slow, strict=True):
        assert torch.equal(a, b)
    for (k1, v1), (k2, v2) in zip(fast_cache.kv_caches, slow_cache.kv_caches, strict=True):
        assert torch.equal(k1, k2) and torch.equal(v1, v2)


@pytest.mark.parametrize("kv_cache_dtype", ["float16", "bfloat16", "q8_0"])
def test_native_layers_equal_the_modules_with_a_smaller_kv_cache(
    tmp_path: Path, monkeypatch, kv_cache_dtype: str
) -> None:
    """The fused call writes and reads a 16-bit or q8_0 cache in place, bit-identical to the modules.
    (Torch's cache write stores the same bytes as the native one: tests/models/test_kv_dtypes.py.)"""
    monkeypatch.setenv("ORCA_CACHE_DIR", str(tmp_path / "cache"))
    gguf_file = tmp_path / "llama-d32.gguf"
    types = {"attn": "Q8_0", "ffn": "Q4_1", "token_embd": "Q8_0"}
    write_tiny_gguf(gguf_file, hidden=128, ff=256, layers=2, heads=4, kv_heads=2, types=types)  # head_dim 32
    model = load_model(resolve_model(str(gguf_file)), torch.float32, "cpu")
    assert isinstance(model.native_decode, NativeDecodeLayers)
    taken = native_calls(monkeypatch)
    steps = _decode_steps([[5, 9, 12, 40, 41], [3] * 11, [77, 78]], 9)
    fast, fast_cache = _run(model, steps, native=True, kv_cache_dtype=kv_cache_dtype)
    assert taken == [False] + [True] * 9
    slow, slow_cache = _run(model, steps, native=False, kv_cache_dtype=kv_cache_dtype)
    for a, b in zip(fast, slow, strict=True):
        assert torch.equal(a, b)
    for (k1, v1), (k2, v2) in zip(fast_cache.kv_caches, slow_cache.kv_caches, strict=True):
        assert k1.dtype != torch.float32
        assert torch.equal(k1, k2) and torch.equal(v1, v2)


def test_native_layers_are_batch_invariant(packed_dir: Path) -> None:
    model = load_model(packed_dir, torch.float32, "cpu")
    prompts = [[5, 9, 12, 40, 41], [3] * 11, [77, 78], [100, 101, 102]]
    together, _ = _run(model, _decode_steps(prompts, 6), native=True)
    for i, prompt in enumerate(prompts):
        alone_steps = [[prompt]] + [[[(7 * s + 3 * i) % 200 + 1]] for s in range(6)]
        alone, _ = _run(model, alone_steps, native=True)
        for step in range(1, 7):  # the decode steps
            assert torch.equal(alone[step][0], together[step][i])


def test_a_step_with_a_prompt_runs_the_modules(tiny_gguf_llama_dir: Path, monkeypatch) -> None:
    model = load_model(tiny_gguf_llama_dir, torch.float32, "cpu")
    calls = native_calls(monkeypatch)
    harness = PagedCacheHarness(model, num_seqs=2)
    with torch.no_grad():
        for tokens in ([[1, 2, 3], [4, 5]], [[6], [7]], [[8], [9, 10, 11]]):
            batch = harness.step(tokens)
            model(batch.input_ids, batch.positions, harness.kv_caches, batch.metadata)
    assert calls == [False, True, False]  # only the decode-only step is native


def test_models_it_does_not_fit(
    tiny_gguf_llama_dir: Path, tiny_llama_dir: Path, tmp_path: Path, monkeypatch
) -> None:
    # Float weights (nothing packed), unpacked GGUF weights, and a fused projection whose formats
    # the kernels lack (one layer falls back to floats) keep the modules.
    assert load_model(tiny_llama_dir, torch.float32, "cpu").native_decode is None
    assert load_model(tiny_gguf_llama_dir, torch.float32, "cpu", weight_packing="off").native_decode is None
    monkeypatch.setenv("ORCA_CACHE_DIR", str(tmp_path / "cache"))
    gguf_file = tmp_path / "fallback.gguf"
    types = {"attn": "Q4_K", "ffn_gate": "Q4_K", "ffn_up": "IQ3_S", "ffn_down": "Q6_K", "token_embd": "Q8_0"}
    write_tiny_gguf(gguf_file, hidden=256, ff=512, heads=4, kv_heads=2, layers=2, types=types)
    assert load_model(resolve_model(str(gguf_file)), torch.float32, "cpu").native_decode is None
    # Tensor parallelism needs an all-reduce inside the layer: never native.
    model = load_model(tiny_gguf_llama_dir, torch.float32, "cpu")
    parts = [model.family.native_decode(layer) for layer in model.decoder_layers()]
    assert (
        NativeDecodeLayers.build(parts, tp_size=2) is None and NativeDecodeLayers.build(parts, 1) is not None
    )


def test_k_quant_segments(tmp_path: Path, monkeypatch) -> None:
    """q/k/v in different K-quant formats: one fused weight of two segments, still bit-identical."""
    monkeypatch.setenv("ORCA_CACHE_DIR", str(tmp_path / "cache"))
    gguf_file = tmp_path / "kquants.gguf"
    types = {
        "attn_q": "Q4_K",
        "attn_k": "Q4_K",
        "attn_v": "Q6_K",
        "attn_output": "Q5_K",
        "ffn": "Q4_K",
        "token_embd": "Q8_0",
    }
    write_tiny_gguf(gguf_file, hidden=256, ff=512, heads=4, kv_heads=2, layers=2, types=types)
    model = load_model(resolve_model(str(gguf_file)), torch.float32, "cpu")
    assert model.native_decode is not None
    assert len(model.model.layers[0].self_attn.qkv_proj.packed.segments) == 2
    steps = _decode_steps([[5, 9, 12], [3] * 6], 5)
    fast, _ = _run(model, steps, native=True)
    slow, _ = _run(model, steps, native=False)
    assert all(torch.equal(a, b) for a, b in zip(fast, slow, strict=True))


@pytest.mark.parametrize("precision", ["int8", "float32"])
@pytest.mark.parametrize("arch", ["qwen3", "phi3"])
def test_new_families_native_layers_equal_the_modules(
    tmp_path: Path, monkeypatch, arch: str, precision: str
) -> None:
    """Qwen3's per-head q/k norms and Phi-4-mini's partial rotary (32 of 64 dims) run inside the fused
    call, bit-identical to the modules; the low-bit K-quants and IQ4_XS are in the fused weights."""
    monkeypatch.setenv("ORCA_CACHE_DIR", str(tmp_path / "cache"))
    gguf_file = tmp_path / f"{arch}.gguf"
    types = {"attn": "Q3_K", "attn_v": "IQ4_XS", "ffn": "Q2_K", "ffn_down": "Q4_K", "token_embd": "Q8_0"}
    shape = (
        dict(heads=4, kv_heads=2, head_dim=64)
        if arch == "qwen3"
        else dict(heads=4, kv_heads=2, rotary_dim=32)
    )
    write_tiny_gguf(gguf_file, hidden=256, ff=512, layers=2, types=types, arch=arch, **shape)
    model = load_model(resolve_model(str(gguf_file)), torch.float32, "cpu", weight_packing=precision)
    native = model.native_decode
    assert native is not None
    if arch == "qwen3":
        assert all(s.q_norm and s.k_norm for s in native.structs)
    else:
        assert native.shape.rotary_dim == 32 and native.shape.head_dim == 64
    taken = native_calls(monkeypatch)
    steps = _decode_steps([[5, 9, 12, 40, 41], [3] * 11, [77, 78]], 7)
    fast, fast_cache = _run(model, steps, native=True)
    assert taken == [False] + [True] * 7  # the prompt step runs the modules, every decode step is native
    slow, slow_cache = _run(model, steps, native=False)
    for a, b in zip(fast, slow, strict=True):
        assert torch.equal(a, b)
    for (k1, v1), (k2, v2) in zip(fast_cache.kv_caches, slow_cache.kv_caches, strict=True):
        assert torch.equal(k1, k2) and torch.equal(v1, v2)


def test_the_fused_call_and_the_experts_are_named_in_the_profiler(tmp_path: Path, monkeypatch) -> None:
    """engine.bench --profile labels the calls made straight into the library, so a decode step's
    profile accounts for its time (only inside labelled_for_profiler: nothing is recorded outside)."""
    from torch.profiler import ProfilerActivity, profile

    from models.kernels import cpu as cpu_kernels

    monkeypatch.setenv("ORCA_CACHE_DIR", str(tmp_path / "cache"))
    gguf = tmp_path / "olmoe.gguf"
    sizes = {"hidden": 256, "experts": 8, **MOE_FILES["olmoe"]}
    write_tiny_gguf(gguf, seed=4, layers=2, types=GGUF_MIXES["Q4_K_M"], tied=False, **sizes)
    model = load_model(resolve_model(str(gguf)), torch.float32, "cpu")
    steps = _decode_steps([[5, 9, 12], [3] * 4], 1)
    with profile(activities=[ProfilerActivity.CPU]) as prof, cpu_kernels.labelled_for_profiler():
        _run(model, steps, native=True)  # a prompt step (the experts' module call), then a fused one
    names = {e.key for e in prof.key_averages()}
    assert {"native::decode_layers", "native::moe"} <= names
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        _run(model, steps, native=True)
    assert not any(e.key.startswith("native::") for e in prof.key_averages())
