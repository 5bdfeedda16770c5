"""The fused small ops of a decoder layer on a GPU (models/layers/triton_fused.py): RMSNorm with the
residual add, SiLU/GELU-and-mul, and rotary with the cache write, each against the torch ops it
replaces, row by row independent of the batch; the layers that pick them; and each kernel compiled for
an H100 without spills.

Without a GPU the kernels run in Triton's interpreter (tests/conftest.py sets TRITON_INTERPRET=1); the
layers pick them only on CUDA, so here the tests point `fused_ops` at the CPU tensors.
"""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F

from models.kernels import cpu as cpu_kernels
from models.layers import activation, attention, norm
from models.layers.activation import GeluTanhAndMul, SiluAndMul
from models.layers.attention import triton_available
from models.layers.kv_format import write_kv
from models.layers.norm import RMSNorm
from models.layers.rotary import RopeParams, RotaryEmbedding

needs_triton = pytest.mark.skipif(
    not triton_available("cuda" if torch.cuda.is_available() else "cpu"),
    reason="triton is not installed, or neither a GPU nor its interpreter is on",
)
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
pytestmark = needs_triton


def fused():
    from models.layers import triton_fused

    return triton_fused


def offer_fused_ops(monkeypatch) -> list[str]:
    """Point the layers' `fused_ops` at triton_fused for every tensor (the CPU kernels off, which come
    first); returns the names of the kernel functions the layers then look up, in order."""
    calls: list[str] = []
    module = fused()

    class Spy:
        def __getattr__(self, name):
            calls.append(name)
            return getattr(module, name)

    for where in (norm, activation, attention):
        monkeypatch.setattr(where, "fused_ops", lambda x: Spy())
    monkeypatch.setattr(cpu_kernels, "fits_rowwise", lambda *args: False)
    return calls


def _rows(t: int, h: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    return (torch.randn(t, h, generator=torch.Generator().manual_seed(seed)) * 2).to(DEVICE, dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("hidden", [64, 576, 1000])  # a power of two, SmolLM2's width, neither
def test_rms_norm_with_and_without_the_residual_matches_torch(dtype: torch.dtype, hidden: int) -> None:
    norm_layer = RMSNorm(hidden, 1e-5, dtype).to(DEVICE)
    norm_layer.weight.data = _rows(1, hidden, dtype, seed=1)[0]
    x, residual = _rows(5, hidden, dtype, seed=2), _rows(5, hidden, dtype, seed=3)
    tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(fused().rms_norm(x, norm_layer.weight, 1e-5), norm_layer._norm(x), **tol)
    stream = residual.clone()
    out = fused().rms_norm(x, norm_layer.weight, 1e-5, stream)
    summed = x + residual
    if DEVICE == "cuda" or dtype == torch.float32:
        assert torch.equal(stream, summed), "the residual stream is x + residual, rounded as torch rounds"
    else:  # Triton's interpreter truncates to bfloat16 where a GPU rounds to nearest
        torch.testing.assert_close(stream, summed, atol=0, rtol=2**-7)
    torch.testing.assert_close(out, norm_layer._norm(summed), **tol)


def test_gemma_norm_scales_in_float32_before_the_cast() -> None:
    from models.families.gemma3 import GemmaRMSNorm

    layer = GemmaRMSNorm(96, 1e-6).to(DEVICE)
    layer.weight.data = _rows(1, 96, torch.float32, seed=4)[0] + 1
    x = _rows(3, 96, torch.bfloat16, seed=5)
    got = fused().rms_norm(x, layer.weight, 1e-6, scale_in_float32=True)
    torch.testing.assert_close(got, layer._norm(x), atol=2e-2, rtol=1e-2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gemma_sandwich_norms_in_one_launch_match_the_two_norms(dtype: torch.dtype) -> None:
    """Gemma 3's post-attention norm, the residual add and its pre-feedforward norm in one launch, and
    its post-feedforward norm with the residual add after it: as the norm layers (torch's ops) do."""
    from models.families.gemma3 import GemmaRMSNorm

    post, pre = GemmaRMSNorm(1152, 1e-6).to(DEVICE), GemmaRMSNorm(1152, 1e-6).to(DEVICE)
    post.weight.data = _rows(1, 1152, torch.float32, seed=30)[0].abs() + 0.5
    pre.weight.data = _rows(1, 1152, torch.float32, seed=31)[0].abs() + 0.5
    x, residual = _rows(5, 1152, dtype, seed=32), _rows(5, 1152, dtype, seed=33)
    expect, expect_stream = pre(post(x), residual=residual.clone())
    stream = residual.clone()
    got = fused().rms_norm(x, pre.weight, 1e-6, stream, scale_in_float32=True, pre_weight=post.weight)
    # bfloat16: the interpreter truncates where torch rounds (the first norm's output, the sum).
    tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=6e-2, rtol=2e-2)
    torch.testing.assert_close(stream, expect_stream, **tol)
    torch.testing.assert_close(got, expect, **tol)
    stream = residual.clone()
    out = fused().add_rms_normed(x, post.weight, 1e-6, stream, scale_in_float32=True)
    assert out is stream
    torch.testing.assert_close(stream, residual + post(x), **tol)


@pytest.mark.parametrize("gelu", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_activation_and_mul_matches_torch(gelu: bool, dtype: torch.dtype) -> None:
    x = _rows(4, 2 * 2100, dtype, seed=6)  # 2100 columns: two programs of 2048, the second masked
    gate, up = x.chunk(2, dim=-1)
    expect = (F.gelu(gate, approximate="tanh") if gelu else F.silu(gate)) * up
    tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(fused().act_and_mul(x, gelu_tanh=gelu), expect, **tol)


def _rope_case(rotary_dim: int, head_dim: int, cache_dtype: torch.dtype, dtype: torch.dtype = torch.float32):
    hq, hkv, t, block_size, blocks = 4, 2, 6, 4, 5
    params = RopeParams(theta=10000.0, partial_rotary_factor=rotary_dim / head_dim)
    rotary = RotaryEmbedding(head_dim, 64, params, dtype).to(DEVICE)
    qkv = _rows(t, (hq + 2 * hkv) * head_dim, dtype, seed=7)
    positions = torch.tensor([0, 3, 17, 5, 63, 8], device=DEVICE)
    slots = torch.tensor([0, 7, 12, 1, 19, 6], device=DEVICE)
    cache = lambda: torch.zeros(blocks, block_size, hkv, head_dim, dtype=cache_dtype, device=DEVICE)  # noqa: E731
    return hq, hkv, rotary, qkv, positions, slots, cache


@pytest.mark.parametrize(
    ("rotary_dim", "head_dim", "cache_dtype"),
    [(64, 64, torch.float32), (48, 64, torch.float32), (96, 128, torch.bfloat16)],  # full, partial (Phi-4)
)
def test_rope_and_cache_matches_rotary_then_the_cache_write(
    rotary_dim: int, head_dim: int, cache_dtype: torch.dtype
) -> None:
    hq, hkv, rotary, qkv, positions, slots, cache = _rope_case(rotary_dim, head_dim, cache_dtype)
    t, d = qkv.shape[0], head_dim
    qk = rotary(positions, qkv[:, : (hq + hkv) * d].view(t, hq + hkv, d))
    k_expect, v_expect = cache(), cache()
    write_kv(k_expect, slots, qk[:, hq:])
    write_kv(v_expect, slots, qkv[:, (hq + hkv) * d :].view(t, hkv, d))
    k_cache, v_cache = cache(), cache()
    got = qkv.clone()
    fused().rope_and_cache(got, positions, rotary.cos_sin_cache, slots, k_cache, v_cache, hq)
    torch.testing.assert_close(got[:, : (hq + hkv) * d].view(t, hq + hkv, d), qk, atol=1e-5, rtol=1e-5)
    assert torch.equal(got[:, (hq + hkv) * d :], qkv[:, (hq + hkv) * d :]), "v heads stay as they were"
    # Triton's interpreter truncates to bfloat16 where torch (and a GPU) round to nearest.
    tol = dict(atol=1e-5, rtol=1e-5) if cache_dtype == torch.float32 else dict(atol=1e-5, rtol=2**-7)
    torch.testing.assert_close(k_cache, k_expect, **tol)
    torch.testing.assert_close(v_cache, v_expect, **tol)


@pytest.mark.parametrize("gemma", [False, True])
@pytest.mark.parametrize(
    ("rotary_dim", "head_dim", "dtype"),
    [(64, 64, torch.float32), (48, 64, torch.float32), (96, 128, torch.bfloat16)],
)
def test_rope_and_cache_with_qk_norm_matches_the_norms_then_rotary(
    rotary_dim: int, head_dim: int, dtype: torch.dtype, gemma: bool
) -> None:
    """Qwen3's and Gemma 3's per-head q/k norms in the rotary launch: as the norm layers (torch's ops)
    followed by the plain rotary + cache kernel, the dims past a partial rotary normalised too."""
    from models.families.gemma3 import GemmaRMSNorm
    from models.layers.norm import qk_rms_norm

    hq, hkv, rotary, qkv, positions, slots, cache = _rope_case(rotary_dim, head_dim, dtype, dtype)
    if gemma:
        q_norm, k_norm = GemmaRMSNorm(head_dim, 1e-6).to(DEVICE), GemmaRMSNorm(head_dim, 1e-6).to(DEVICE)
    else:
        q_norm, k_norm = (RMSNorm(head_dim, 1e-6, dtype).to(DEVICE) for _ in range(2))
    q_norm.weight.data = _rows(1, head_dim, q_norm.weight.dtype, seed=20)[0].abs() + 0.5
    k_norm.weight.data = _rows(1, head_dim, k_norm.weight.dtype, seed=21)[0].abs() + 0.5
    expect, k_expect, v_expect = qk_rms_norm(qkv.clone(), q_norm, k_norm, hq, hkv), cache(), cache()
    fused().rope_and_cache(expect, positions, rotary.cos_sin_cache, slots, k_expect, v_expect, hq)
    got, k_cache, v_cache = qkv.clone(), cache(), cache()
    assert q_norm.pairs_with(k_norm) and q_norm.scale_in_float32 == gemma
    fused().rope_and_cache(
        got, positions, rotary.cos_sin_cache, slots, k_cache, v_cache, hq, (q_norm, k_norm)
    )
    # bfloat16: the interpreter truncates where the GPU rounds, and the sum of squares runs in
    # another order, so a normalised value may land a bfloat16 step away (1/64 at 2-4), which
    # rotary's difference carries to a value near zero.
    tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=5e-2, rtol=2e-2)
    torch.testing.assert_close(got, expect, **tol)
    torch.testing.assert_close(k_cache, k_expect, **tol)
    assert torch.equal(v_cache, v_expect)


def test_rows_do_not_depend_on_the_batch() -> None:
    """Each row's result, bit for bit, alone and among others."""
    x, residual = _rows(7, 576, torch.bfloat16, seed=8), _rows(7, 576, torch.bfloat16, seed=9)
    w = _rows(1, 576, torch.bfloat16, seed=10)[0]
    batched = fused().rms_norm(x, w, 1e-5, residual.clone())
    assert torch.equal(fused().rms_norm(x[3:4], w, 1e-5, residual[3:4].clone()), batched[3:4])
    gu = _rows(7, 2 * 1536, torch.bfloat16, seed=11)
    assert torch.equal(fused().act_and_mul(gu[2:3]), fused().act_and_mul(gu)[2:3])


def test_layers_pick_the_fused_kernels_where_they_run(monkeypatch) -> None:
    """RMSNorm (3-D q/k norms included), the gated activations and rotary attention go through the fused
    kernels where `fused_ops` offers them, with torch's results; otherwise through torch's ops."""
    calls = offer_fused_ops(monkeypatch)
    layer = RMSNorm(64, 1e-6).to(DEVICE)
    layer.weight.data = _rows(1, 64, torch.float32, seed=12)[0]
    x3 = _rows(6, 64, torch.float32, seed=13).view(3, 2, 64)
    expect = layer._norm(x3)
    torch.testing.assert_close(layer(x3), expect, atol=1e-5, rtol=1e-5)
    x, res = _rows(3, 64, torch.float32, seed=14), _rows(3, 64, torch.float32, seed=15)
    out, stream = layer(x, res.clone())
    torch.testing.assert_close(out, layer._norm(x + res), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(stream, x + res)
    gu = _rows(3, 128, torch.float32, seed=16)
    gate, up = gu.chunk(2, dim=-1)
    torch.testing.assert_close(SiluAndMul()(gu), F.silu(gate) * up, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(
        GeluTanhAndMul()(gu), F.gelu(gate, approximate="tanh") * up, atol=1e-5, rtol=1e-5
    )
    assert calls.count("rms_norm") == 2 and calls.count("act_and_mul") == 2


H100_CASES = [
    {"kernel": "rms_norm", "dtype": "bfloat16", "hidden": 4096},
    {"kernel": "rms_norm", "dtype": "bfloat16", "hidden": 8192},
    {"kernel": "rms_norm", "dtype": "bfloat16", "hidden": 16384, "residual": False},
    {"kernel": "rms_norm", "dtype": "bfloat16", "hidden": 1152, "gemma": True},
    {"kernel": "rms_norm", "dtype": "bfloat16", "hidden": 5376, "gemma": True, "pre_norm": True},
    {
        "kernel": "rms_norm",
        "dtype": "bfloat16",
        "hidden": 5376,
        "gemma": True,
        "pre_norm": True,
        "norm_out": False,
    },
    {"kernel": "rms_norm", "dtype": "float32", "hidden": 576},
    {"kernel": "act_and_mul", "dtype": "bfloat16"},
    {"kernel": "act_and_mul", "dtype": "bfloat16", "gelu": True},
    {"kernel": "rope_and_cache", "dtype": "bfloat16", "rotary_dim": 128, "head_dim": 128},
    {"kernel": "rope_and_cache", "dtype": "bfloat16", "rotary_dim": 96, "head_dim": 128},
    {"kernel": "rope_and_cache", "dtype": "bfloat16", "rotary_dim": 128, "head_dim": 128, "qk_norm": "llama"},
    {"kernel": "rope_and_cache", "dtype": "bfloat16", "rotary_dim": 256, "head_dim": 256, "qk_norm": "gemma"},
]


def test_kernels_compile_for_an_h100_without_spills() -> None:
    from triton_sm90_build import compile_for_h100

    for report in compile_for_h100(H100_CASES):
        if "registers" in report:  # read from the cubin with the cuobjdump Triton ships
            assert report["stack"] == 0 and report["local"] == 0, f"spills: {report}"


# A layer's fused norm launches: Llama's two; Qwen3's two (its q/k norms run in the rotary launch);
# Gemma 3's input norm and its post-attention + pre-feedforward pair (q/k norms in the rotary launch,
# the post-feedforward norm with its residual add in add_rms_normed).
NORMS_PER_LAYER = {"tiny_llama_dir": 2, "tiny_qwen3_dir": 2, "tiny_gemma3_dir": 2}


@pytest.mark.parametrize("model", sorted(NORMS_PER_LAYER))
def test_a_model_step_with_the_fused_ops_matches_torchs(monkeypatch, request, model: str) -> None:
    """A tiny model's prompt and decode steps (the triton attention backend, float32): every token's
    logits with the fused kernels as with torch's ops, the fused kernels run in every layer."""
    from engine.config import EngineConfig
    from engine.contract import SamplingParams, ScheduledSequence
    from engine.executor import LocalExecutor

    greedy = SamplingParams(temperature=0.0)
    path = request.getfixturevalue(model)
    config = EngineConfig(
        model=str(path), dtype="float32", device=DEVICE, block_size=4, num_kv_blocks=8,
        attention_backend="triton", enforce_eager=True,
    )  # fmt: skip

    monkeypatch.setattr(cpu_kernels, "fits_rowwise", lambda *args: False)  # the CPU kernels come first
    monkeypatch.setattr(cpu_kernels, "fits_rope_and_cache", lambda *args: False)
    prompt, table = list(range(40, 57)), list(range(8))

    def run() -> list[torch.Tensor]:
        ex = LocalExecutor(config)
        out = [ex.runner.logits([ScheduledSequence("a", prompt, 0, table, True, greedy)], all_tokens=True)]
        for i, token in enumerate((3, 9, 27)):
            step = ScheduledSequence("a", [token], len(prompt) + i, table, True, greedy, prompt)
            out.append(ex.runner.logits([step]))
        return out

    plain = run()
    module = fused()
    monkeypatch.setattr(module, "runs_on", lambda x: x.dtype in module.FLOAT_TYPES)  # CPU tensors too
    calls = offer_fused_ops(monkeypatch)
    with_fused = run()
    for a, b in zip(with_fused, plain, strict=True):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)
    steps = 4  # a prompt and three decode steps
    layers = steps * json.loads((path / "config.json").read_text())["num_hidden_layers"]
    assert calls.count("rope_and_cache") == layers and calls.count("act_and_mul") == layers
    assert calls.count("rms_norm") == NORMS_PER_LAYER[model] * layers + steps  # and the final norm
    assert calls.count("add_rms_normed") == (layers if model == "tiny_gemma3_dir" else 0)
