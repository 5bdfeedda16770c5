"""The triton attention backend (models/layers/triton_attention.py) against sdpa.

Without a GPU the kernels run in Triton's interpreter (tests/conftest.py sets TRITON_INTERPRET=1
before triton is imported), on small shapes; with one, the same tests run the compiled kernels, and
the `cuda` test adds real shapes. Separately, the kernels are compiled for an H100 here (Triton's
compiler and ptxas run on any machine), which the interpreter alone would not check: types in
compiled mode, dot shapes, registers, spills, shared memory.
"""

from __future__ import annotations

import dataclasses
import importlib.util
from types import SimpleNamespace

import pytest
import torch
from builders import build_hf_model, tiny_llama_config
from paged_cache import PagedCacheHarness

from models.layers import attention
from models.layers.attention import (
    available_backends,
    select_attention_backend,
    triton_available,
    triton_imports,
)
from models.layers.metadata import AttentionMetadata
from models.registry import model_class_for


def _triton_device() -> tuple[str | None, str]:
    if torch.cuda.is_available() and triton_available("cuda"):
        return "cuda", ""
    if triton_available("cpu"):
        return "cpu", ""
    if importlib.util.find_spec("triton") is None:
        return None, "triton is not installed (`make install` adds it on Linux)"
    if not triton_imports():
        return None, "triton is installed but does not import"
    return None, (
        "no CUDA GPU, and Triton's interpreter is off or cannot run here (TRITON_INTERPRET=1 must be "
        "set before triton is first imported; tests/conftest.py does that)"
    )


DEVICE, WHY_NOT = _triton_device()
needs_triton = pytest.mark.skipif(DEVICE is None, reason=WHY_NOT)
INTERPRETED = DEVICE == "cpu"
TOLERANCE = {torch.float32: 2e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}


def _dtype_or_skip(dtype: torch.dtype) -> None:
    if dtype == torch.bfloat16 and INTERPRETED:
        # triton 3.7's interpreter keeps bf16 as uint16 and its tl.dot multiplies those bit patterns as
        # integers; fp16 covers the 16-bit path here and bf16 runs compiled on a GPU.
        pytest.skip("Triton's interpreter computes tl.dot on bf16 bit patterns, not values")


def _to(md: AttentionMetadata, device: str) -> AttentionMetadata:
    return dataclasses.replace(
        md,
        **{
            f.name: getattr(md, f.name).to(device) for f in dataclasses.fields(md) if f.type == "torch.Tensor"
        },
    )


def random_step(
    ctx_lens: list[int],
    q_lens: list[int],
    num_q_heads: int,
    num_kv_heads: int,
    head_dim: int,
    block_size: int,
    dtype: torch.dtype = torch.float32,
    seed: int = 0,
):
    """A step where sequence i has ctx_lens[i] tokens cached and runs q_lens[i] new ones, over a cache
    full of random K/V (unused blocks too: reading outside a table would show) whose blocks are
    handed out shuffled. Returns q, the caches and the metadata, all on DEVICE."""
    spec = SimpleNamespace(num_layers=1, num_kv_heads=num_kv_heads, head_dim=head_dim)
    needed = sum(-(-(c + q) // block_size) for c, q in zip(ctx_lens, q_lens, strict=True))
    harness = PagedCacheHarness(
        spec, len(q_lens), seed, block_size=block_size, num_blocks=needed + 4, dtype=dtype
    )
    harness.step([[0] * n for n in ctx_lens])
    md = harness.step([[0] * n for n in q_lens]).metadata
    g = torch.Generator().manual_seed(seed)
    k_cache, v_cache = harness.kv_caches[0]
    k_cache.copy_(torch.randn(k_cache.shape, generator=g))
    v_cache.copy_(torch.randn(v_cache.shape, generator=g))
    q = torch.randn(sum(q_lens), num_q_heads, head_dim, generator=g).to(dtype)
    return q.to(DEVICE), k_cache.to(DEVICE), v_cache.to(DEVICE), _to(md, DEVICE)


def sdpa_reference(q, k_cache, v_cache, md, scale, window: int | None = None) -> torch.Tensor:
    """The sdpa backend in float32 over the same (possibly 16-bit) values."""
    sdpa = select_attention_backend("sdpa", q.device)
    q, k_cache, v_cache = q.float(), k_cache.float(), v_cache.float()
    return sdpa.forward(q, k_cache, v_cache, md, sdpa.plan(md), scale, window)


def run_backend(q, k_cache, v_cache, md, scale) -> torch.Tensor:
    backend = select_attention_backend("triton", q.device)
    return backend.forward(q, k_cache, v_cache, md, backend.plan(md), scale)


STEPS = {
    # decodes first, then prompt chunks over cached prefixes and a fresh prompt, like the scheduler
    "mixed-gqa4": ([5, 40, 9, 0, 33], [1, 1, 7, 3, 20], 8, 2, 64, 16),
    # MHA: 64 query tokens per program, so the 70-token chunk takes two
    "mha-two-query-tiles": ([30, 10], [1, 70], 4, 4, 32, 32),
    # SmolLM2's 9 query heads on 3 KV heads: 3 per KV head, not a power of two
    "gqa3-two-query-tiles": ([17, 25, 0], [1, 40, 2], 9, 3, 64, 16),
    # MQA, head_dim 128, one 256-token block holds a whole history
    "mqa-d128-block256": ([300, 5, 0], [1, 12, 1], 4, 1, 128, 256),
    # a head_dim the tiles pad (24 -> 32) and blocks smaller than a key tile
    "padded-head-dim-block8": ([10, 22], [3, 1], 4, 2, 24, 8),
    "decode-only": ([0, 3, 15, 16, 17, 100], [1] * 6, 4, 2, 64, 16),
}


@needs_triton
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("name", list(STEPS))
def test_matches_sdpa(name: str, dtype: torch.dtype) -> None:
    _dtype_or_skip(dtype)
    ctx, q_lens, hq, hkv, d, bs = STEPS[name]
    q, k_cache, v_cache, md = random_step(ctx, q_lens, hq, hkv, d, bs, dtype, seed=len(name))
    out = run_backend(q, k_cache, v_cache, md, d**-0.5)
    assert out.shape == q.shape and out.dtype == dtype
    tol = TOLERANCE[dtype]
    torch.testing.assert_close(
        out.float(), sdpa_reference(q, k_cache, v_cache, md, d**-0.5), atol=tol, rtol=tol
    )


def _paged_attention(
    q, k_cache, v_cache, md, scale, num_splits: int, window: int | None = None
) -> torch.Tensor:
    from models.layers import triton_attention

    config = triton_attention.launch_config(
        num_tokens=q.shape[0],
        num_seqs=md.num_seqs,
        max_query_len=md.max_query_len,
        max_seq_len=md.max_seq_len,
        num_q_heads=q.shape[1],
        num_kv_heads=k_cache.shape[2],
        device=q.device,
    )
    config = dataclasses.replace(config, num_splits=num_splits)
    return triton_attention.paged_attention(
        q, k_cache, v_cache, md.block_tables, md.seq_lens, md.query_start_loc, scale, config, window=window
    )


@needs_triton
@pytest.mark.parametrize("num_splits", [1, 4])
@pytest.mark.parametrize("window", [1, 16, 37])
def test_sliding_window_matches_sdpa(window: int, num_splits: int) -> None:
    """Decodes over histories longer than the window (the key tiles before it are never read), a
    70-token chunk over a 40-token prefix (two query tiles, each starting at its own first row's
    window) and a fresh prompt; split or not (a split may hold no visible key at all)."""
    q, k_cache, v_cache, md = random_step([130, 3, 40, 0], [1, 1, 70, 33], 4, 2, 32, 16, seed=window)
    out = _paged_attention(q, k_cache, v_cache, md, 0.2, num_splits, window)
    expect = sdpa_reference(q, k_cache, v_cache, md, 0.2, window)
    torch.testing.assert_close(out, expect, atol=2e-5, rtol=2e-5)


@needs_triton
@pytest.mark.parametrize("num_splits", [2, 4, 16])
def test_split_keys_decode_matches_sdpa(num_splits: int) -> None:
    """Decode histories split over several programs and merged; 16 splits leave most of them empty
    for these lengths (a split with no keys must weigh nothing in the merge)."""
    q, k_cache, v_cache, md = random_step([0, 7, 31, 32, 64, 200], [1] * 6, 8, 2, 64, 16, seed=num_splits)
    out = _paged_attention(q, k_cache, v_cache, md, 0.125, num_splits)
    torch.testing.assert_close(out, sdpa_reference(q, k_cache, v_cache, md, 0.125), atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("heads", [(9, 3), (32, 8), (8, 1), (4, 4)])
def test_every_config_a_step_can_choose_is_warmed_up(monkeypatch: pytest.MonkeyPatch, heads) -> None:
    """Whatever a step's sizes, launch_config picks one of every_launch_config's configs (what start-up
    compiles): on an H100's 132 multiprocessors, short and long histories, decodes and prompt chunks."""
    pytest.importorskip("triton")
    from models.layers import triton_attention

    monkeypatch.setattr(triton_attention, "_multiprocessor_count", lambda device: 132)
    warmed = set(triton_attention.every_launch_config(*heads))
    chosen = {
        triton_attention.launch_config(
            num_tokens=num_seqs * query_len,
            num_seqs=num_seqs,
            max_query_len=query_len,
            max_seq_len=seq_len,
            num_q_heads=heads[0],
            num_kv_heads=heads[1],
            device=torch.device("cuda"),
        )
        for num_seqs in (1, 2, 3, 8, 16, 33, 64, 256, 1024)
        for query_len in (1, 2, 64)
        for seq_len in (1, 63, 64, 65, 200, 300, 1000, 4096, 131072)
    }
    assert chosen <= warmed
    assert {c.num_splits for c in chosen if c.decode_only} == {1, 2, 4, 8, 16}  # the sweep reaches them all


@needs_triton
def test_warm_up_runs_each_config_once_per_kind_of_layer() -> None:
    """The backend's warm-up runs every config on the scratch block, once for layers the kernel sees
    alike (here two full-attention layers, and one windowed layer of its own), and leaves the cache's
    real blocks untouched."""
    from models.layers import triton_attention
    from models.layers.attention_backends import WarmUpLayer

    _, k_cache, v_cache, _ = random_step([5], [1], 4, 2, 32, 16, seed=3)
    before = k_cache.clone(), v_cache.clone()
    scratch = k_cache.shape[0] - 1
    backend = select_attention_backend("triton", k_cache.device)
    layers = [WarmUpLayer(4, None, k_cache, v_cache), WarmUpLayer(4, None, k_cache, v_cache)]
    layers.append(WarmUpLayer(4, 8, k_cache, v_cache))
    ran = backend.warm_up(layers, k_cache.dtype, scratch)
    assert ran == 2 * len(triton_attention.every_launch_config(4, 2))
    assert torch.equal(k_cache, before[0]) and torch.equal(v_cache, before[1])


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_after_warm_up_no_step_compiles_the_kernel() -> None:
    """On a GPU: once every config is compiled, decodes of any history length and prompt chunks of any
    size (eager, as with --enforce-eager or past the largest CUDA graph) compile nothing more."""
    from models.layers import triton_attention

    kernel = triton_attention._paged_attention_kernel

    def compiled() -> int:
        return sum(len(caches[0]) for caches in kernel.device_caches.values())

    _, k_cache, v_cache, _ = random_step([5], [1], 8, 2, 64, 16, torch.float16, seed=1)
    triton_attention.compile_every_config(torch.float16, k_cache, v_cache, 8, None, k_cache.shape[0] - 1)
    torch.cuda.synchronize()
    warmed = compiled()
    for ctx, q_lens in [([0, 3, 40], [1, 1, 1]), ([700, 2], [1, 1]), ([30, 0], [1, 45]), ([200], [9])]:
        q, k, v, md = random_step(ctx, q_lens, 8, 2, 64, 16, torch.float16, seed=len(ctx))
        run_backend(q, k, v, md, 0.125)
    torch.cuda.synchronize()
    assert compiled() == warmed


@needs_triton
def test_split_keys_over_prompt_chunks_matches_sdpa() -> None:
    """launch_config splits only decode steps, but the kernel takes any split count: here a chunk's
    early rows see no key at all in the later splits (max -inf, sum 0), which the merge must drop."""
    q, k_cache, v_cache, md = random_step([3, 0, 40], [1, 70, 9], 4, 2, 32, 16, seed=5)
    out = _paged_attention(q, k_cache, v_cache, md, 0.2, num_splits=4)
    torch.testing.assert_close(out, sdpa_reference(q, k_cache, v_cache, md, 0.2), atol=2e-5, rtol=2e-5)


@needs_triton
@pytest.mark.parametrize("num_splits", [1, 4])
def test_large_scores_stay_finite(num_splits: int) -> None:
    """Scores in the hundreds: the online softmax (and the merge of splits) must rescale, not overflow."""
    q, k_cache, v_cache, md = random_step([90, 3], [1, 1], 4, 2, 32, 16, seed=7)
    q = q * 40
    out = _paged_attention(q, k_cache, v_cache, md, 1.0, num_splits)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out, sdpa_reference(q, k_cache, v_cache, md, 1.0), atol=1e-4, rtol=1e-4)


@needs_triton
def test_query_view_and_output_buffer() -> None:
    """q as the model passes it (a view into the fused qkv projection, rows strided past its heads),
    written into a caller's output buffer, as a CUDA graph will need."""
    ctx, q_lens, hq, hkv, d = [12, 0], [1, 9], 4, 2, 32
    q, k_cache, v_cache, md = random_step(ctx, q_lens, hq, hkv, d, 16, seed=3)
    qkv = torch.randn(q.shape[0], (hq + 2 * hkv) * d, device=q.device)
    qkv[:, : hq * d] = q.reshape(q.shape[0], -1)
    q_view = qkv[:, : hq * d].view(q.shape[0], hq, d)
    assert not q_view.is_contiguous()
    from models.layers import triton_attention

    config = triton_attention.launch_config(
        num_tokens=q.shape[0],
        num_seqs=2,
        max_query_len=9,
        max_seq_len=13,
        num_q_heads=hq,
        num_kv_heads=hkv,
        device=q.device,
    )
    out = torch.full_like(q, float("nan"))
    got = triton_attention.paged_attention(
        q_view, k_cache, v_cache, md.block_tables, md.seq_lens, md.query_start_loc, d**-0.5, config, out=out
    )
    assert got is out
    torch.testing.assert_close(out, sdpa_reference(q, k_cache, v_cache, md, d**-0.5), atol=2e-5, rtol=2e-5)


@needs_triton
def test_tiny_llama_matches_transformers() -> None:
    """The backend inside a model's forward (rotary on the fused qkv, the cache write, then attention)
    against transformers: prompts of several lengths in one step, then decodes beside a prompt chunk
    over its cached prefix."""
    config = tiny_llama_config(vocab_size=512)
    hf = build_hf_model(config)
    model = model_class_for(config)(config, dtype=torch.float32)
    model.load_weights(hf.state_dict().items())
    model = model.eval().to(DEVICE)
    model.set_attention_backend("triton", DEVICE)
    g = torch.Generator().manual_seed(11)
    full = [torch.randint(0, 512, (n,), generator=g).tolist() for n in (9, 5, 30)]
    harness = PagedCacheHarness(model, 3, block_size=16)
    harness.kv_caches = [(k.to(DEVICE), v.to(DEVICE)) for k, v in harness.kv_caches]

    def forward(tokens: list[list[int]]) -> torch.Tensor:
        b = harness.step(tokens)
        with torch.no_grad():
            hidden = model(
                b.input_ids.to(DEVICE), b.positions.to(DEVICE), harness.kv_caches, _to(b.metadata, DEVICE)
            )
            return model.compute_logits(hidden).cpu()

    first = forward([full[0][:8], full[1][:4], full[2][:11]])
    last = forward([full[0][8:], full[1][4:], full[2][11:]])  # two decodes, then a 19-token chunk
    with torch.no_grad():
        expected = [hf(torch.tensor([f])).logits[0] for f in full]
    torch.testing.assert_close(first[:8], expected[0][:8], atol=1e-4, rtol=0)
    torch.testing.assert_close(first[12:], expected[2][:11], atol=1e-4, rtol=0)
    torch.testing.assert_close(last[0], expected[0][8], atol=1e-4, rtol=0)
    torch.testing.assert_close(last[1], expected[1][4], atol=1e-4, rtol=0)
    torch.testing.assert_close(last[2:], expected[2][11:], atol=1e-4, rtol=0)


# ------------------------------------------------------------------------------------- selection


def test_selection(monkeypatch: pytest.MonkeyPatch) -> None:
    # triton first on CUDA, flash-attn installed or not (graphs capture triton's steps, not flash-attn's);
    # then flash-attn, then torch-varlen.
    monkeypatch.setattr(attention, "triton_available", lambda device: True)
    monkeypatch.setattr(attention, "torch_varlen_available", lambda: True)
    monkeypatch.setattr(attention, "flash_attn_available", lambda: True)
    assert attention.auto_backend_name("cuda") == "triton"
    monkeypatch.setattr(attention, "triton_available", lambda device: False)
    assert attention.auto_backend_name("cuda") == "flash-attn"
    monkeypatch.setattr(attention, "flash_attn_available", lambda: False)
    assert attention.auto_backend_name("cuda") == "torch-varlen"
    assert attention.auto_backend_name("cpu") == "cpu-decode"  # never the interpreter
    with pytest.raises(ValueError, match="CUDA device.*interpreter"):
        select_attention_backend("triton", "cpu")


def test_cpu_needs_the_interpreter(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    assert not triton_available("cpu")
    assert "triton" not in available_backends("cpu")


@needs_triton
def test_listed_where_it_runs() -> None:
    assert "triton" in available_backends(DEVICE)
    assert select_attention_backend("triton", DEVICE).name == "triton"


# ------------------------------------------------------------------------------ compiled for H100

# What launch_config picks for these, compiled for sm_90 the way Triton's launcher specialises real
# tensors: Llama-3-8B's heads (32 on 8, head_dim 128) and SmolLM2's (9 on 3, 64); decode and prompt
# chunks; both 16-bit types and float32 (no TF32); block sizes 16 and 256; the split path and its merge.
H100_CASES = [
    dict(dtype="bfloat16", num_q_heads=32, num_kv_heads=8, head_dim=128, block_size=16, num_tokens=2048, num_seqs=8, max_query_len=512),
    dict(dtype="bfloat16", num_q_heads=32, num_kv_heads=8, head_dim=128, block_size=256, num_tokens=64, num_seqs=64, max_query_len=1),
    dict(dtype="bfloat16", num_q_heads=32, num_kv_heads=8, head_dim=128, block_size=16, num_tokens=4, num_seqs=4, max_query_len=1, num_splits=16),
    dict(dtype="float16", num_q_heads=9, num_kv_heads=3, head_dim=64, block_size=16, num_tokens=512, num_seqs=3, max_query_len=500),
    dict(dtype="float32", num_q_heads=4, num_kv_heads=2, head_dim=16, block_size=16, num_tokens=40, num_seqs=5, max_query_len=20),
]  # fmt: skip
H100_SHARED_MEMORY = 227 * 1024  # the most one block may use on an H100


def test_kernels_compile_for_h100_without_spills() -> None:
    if not triton_imports():
        pytest.skip("triton is not installed or does not import")
    from triton_sm90_build import compile_for_h100

    for report in compile_for_h100(H100_CASES):
        for kernel in (report, report.get("merge")):
            if kernel is None:
                continue
            assert kernel["shared"] <= H100_SHARED_MEMORY, report
            if "registers" in kernel:  # read from the cubin with the cuobjdump Triton ships
                assert kernel["stack"] == 0 and kernel["local"] == 0, f"spills: {report}"


# ----------------------------------------------------------------------------- real shapes, GPU


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available() or DEVICE != "cuda", reason="needs a CUDA GPU and triton")
@pytest.mark.parametrize("block_size", [16, 256])
@pytest.mark.parametrize(("num_q_heads", "num_kv_heads", "head_dim"), [(32, 8, 128), (9, 3, 64)])
def test_real_shapes_match_sdpa_on_cuda(
    block_size: int, num_q_heads: int, num_kv_heads: int, head_dim: int
) -> None:
    """A serving-sized mixed step in bf16: 48 decodes over histories up to 3000 tokens, a 512-token
    prompt chunk over a 1500-token prefix, and a fresh 700-token prompt; then the decodes alone with
    the split-keys path the launch config picks for them."""
    g = torch.Generator().manual_seed(block_size + head_dim)
    decode_ctx = torch.randint(1, 3000, (48,), generator=g).tolist()
    ctx, q_lens = [*decode_ctx, 1500, 0], [1] * 48 + [512, 700]
    scale = head_dim**-0.5
    q, k_cache, v_cache, md = random_step(
        ctx, q_lens, num_q_heads, num_kv_heads, head_dim, block_size, torch.bfloat16
    )
    out = run_backend(q, k_cache, v_cache, md, scale)
    torch.testing.assert_close(
        out.float(), sdpa_reference(q, k_cache, v_cache, md, scale), atol=1.6e-2, rtol=1.6e-2
    )

    q, k_cache, v_cache, md = random_step(
        decode_ctx, [1] * 48, num_q_heads, num_kv_heads, head_dim, block_size, torch.bfloat16
    )
    out = run_backend(q, k_cache, v_cache, md, scale)
    torch.testing.assert_close(
        out.float(), sdpa_reference(q, k_cache, v_cache, md, scale), atol=1.6e-2, rtol=1.6e-2
    )
