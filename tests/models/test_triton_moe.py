"""The fused Triton experts (models/layers/triton_moe.py): the pairs' grouping by expert, the two expert
matmuls against a plain torch reference, batch invariance, and the MoE layer running them in place of
its module loop (with the shared expert, under a CUDA-graph capture policy that now allows it).

Without a GPU the kernel runs in Triton's interpreter (tests/conftest.py sets TRITON_INTERPRET=1); the
layer picks the fused kernels only on CUDA, so here the tests point `fused_experts_run_on` at the CPU.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from builders import tiny_qwen2_moe_config, tiny_qwen3_moe_config
from test_moe import moe_layer

from models.layers import moe as moe_module
from models.layers.activation import SiluAndMul
from models.layers.attention import triton_available, triton_imports
from models.layers.moe import SparseMoE

needs_triton = pytest.mark.skipif(
    not triton_available("cuda" if torch.cuda.is_available() else "cpu"),
    reason="triton is not installed, or neither a GPU nor its interpreter is on",
)
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _routing(tokens: int, experts: int, k: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Random routing: k distinct experts per token and weights that sum to 1."""
    g = torch.Generator().manual_seed(seed)
    chosen = torch.stack([torch.randperm(experts, generator=g)[:k] for _ in range(tokens)])
    weights = torch.softmax(torch.randn(tokens, k, generator=g), dim=-1)
    return weights, chosen


def _reference(x, gate_up, down, weights, chosen) -> torch.Tensor:
    """Token by token, expert by expert, in float64."""
    out = torch.zeros(x.shape, dtype=torch.float64)
    for t in range(x.shape[0]):
        for w, e in zip(weights[t].tolist(), chosen[t].tolist(), strict=True):
            gate, up = (x[t].double() @ gate_up[e].double().T).chunk(2)
            out[t] += w * (down[e].double() @ (F.silu(gate) * up))
    return out


@needs_triton
def test_pairs_are_grouped_by_expert_in_blocks_of_one_expert() -> None:
    from models.layers.triton_moe import align_by_expert

    experts, k, block_m = 8, 2, 16
    _, chosen = _routing(37, experts, k, seed=0)
    chosen[:, 0] = torch.where(chosen[:, 0] == 5, 6, chosen[:, 0])  # some tokens avoid expert 5...
    chosen[:, 1] = torch.where(chosen[:, 1] == 5, 7, chosen[:, 1])
    chosen[chosen[:, 0] == chosen[:, 1], 1] = 0  # ...while keeping two distinct experts a token
    blocks = align_by_expert(chosen, experts, block_m)
    flat = chosen.reshape(-1)
    pairs = blocks.sorted_pairs[: int(blocks.num_padded)].view(-1, block_m)
    seen = []
    for b, row in enumerate(pairs.tolist()):
        real = [p for p in row if p < blocks.num_pairs]
        assert real, "a block with no pair"
        assert row[: len(real)] == real, "padding comes after a block's pairs"
        assert {int(flat[p]) for p in real} == {int(blocks.block_expert[b])}
        seen += real
    assert sorted(seen) == list(range(flat.numel()))
    for e in range(experts):  # each group in token order; expert 5 has no block at all
        group = [p for p in seen if int(flat[p]) == e]
        assert group == sorted(group)
    assert 5 not in blocks.block_expert[: pairs.shape[0]].tolist()
    counts = torch.bincount(flat, minlength=experts)
    assert int(blocks.num_padded) == int(((counts + block_m - 1) // block_m * block_m).sum())


@needs_triton
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("tokens", [1, 7, 40])
def test_fused_experts_match_a_reference(dtype: torch.dtype, tokens: int) -> None:
    """hidden 48 and intermediate 40: neither a multiple of the 64-wide tiles (masked edges)."""
    from models.layers.triton_moe import fused_experts

    experts, k, hidden, inter = 8, 2, 48, 40
    g = torch.Generator().manual_seed(tokens)
    x = torch.randn(tokens, hidden, generator=g)
    gate_up = torch.randn(experts, 2 * inter, hidden, generator=g) * hidden**-0.5
    down = torch.randn(experts, hidden, inter, generator=g) * inter**-0.5
    weights, chosen = _routing(tokens, experts, k, seed=tokens + 1)
    out = fused_experts(
        *(t.to(DEVICE, dtype) for t in (x, gate_up, down)),
        weights.to(DEVICE),
        chosen.to(DEVICE),
        SiluAndMul(),
    )
    assert out.shape == x.shape and out.dtype == dtype
    tol = 2e-5 if dtype == torch.float32 else 4e-3
    expected = _reference(x.to(dtype), gate_up.to(dtype), down.to(dtype), weights, chosen)
    torch.testing.assert_close(out.cpu().double(), expected, atol=tol, rtol=tol)


@needs_triton
def test_a_tokens_experts_do_not_depend_on_its_batch() -> None:
    from models.layers.triton_moe import fused_experts

    experts, k, hidden, inter = 8, 2, 32, 32
    g = torch.Generator().manual_seed(3)
    x = torch.randn(20, hidden, generator=g).to(DEVICE)
    gate_up = (torch.randn(experts, 2 * inter, hidden, generator=g) * 0.2).to(DEVICE)
    down = (torch.randn(experts, hidden, inter, generator=g) * 0.2).to(DEVICE)
    weights, chosen = (t.to(DEVICE) for t in _routing(20, experts, k, seed=4))
    act = SiluAndMul()
    together = fused_experts(x, gate_up, down, weights, chosen, act)
    for i in (0, 7, 19):
        alone = fused_experts(x[i : i + 1], gate_up, down, weights[i : i + 1], chosen[i : i + 1], act)
        if DEVICE == "cuda":
            assert torch.equal(alone[0], together[i])
        else:
            # Triton's interpreter runs tl.dot as numpy's matmul, whose BLAS may round a row by its place
            # in the tile (numpy's OpenBLAS on a Zen 5: rows 6-15 of a 16-row sgemm differ from row 0 in
            # the last bits), so on a CPU the tokens' blocks are checked for the right rows and experts.
            torch.testing.assert_close(alone[0], together[i], rtol=1e-6, atol=1e-6)


def _layer(config, index: int = 0) -> tuple[SparseMoE, torch.Tensor]:
    layer = moe_layer(config, index)
    x = torch.randn(24, config.hidden_size, generator=torch.Generator().manual_seed(5))
    return layer.to(DEVICE), x.to(DEVICE)


@needs_triton
@pytest.mark.parametrize(("config", "index"), [(tiny_qwen3_moe_config, 0), (tiny_qwen2_moe_config, 1)])
def test_the_layer_runs_the_fused_experts_as_its_loop_does(config, index: int, monkeypatch) -> None:
    """Qwen3-MoE, and Qwen2-MoE with its gated shared expert: the fused kernels in place of the loop,
    over the experts' own (now stacked) parameters."""
    layer, x = _layer(config(vocab_size=64), index)
    with torch.no_grad():
        monkeypatch.setattr(moe_module, "fused_experts_run_on", lambda device: False)
        loop = layer(x)
        monkeypatch.setattr(moe_module, "fused_experts_run_on", lambda device: True)
        fused = layer(x)
    torch.testing.assert_close(fused, loop, atol=2e-5, rtol=2e-5)
    stacked = layer.stacked_experts()
    assert stacked is not None and stacked.current(layer.experts)
    # The experts' parameters are views of the stack: the weights are held once.
    assert layer.experts[3].gate_up_proj.weight.data_ptr() == stacked.gate_up[3].data_ptr()
    assert layer.experts[3].down_proj.weight.data_ptr() == stacked.down[3].data_ptr()


def test_only_the_module_loop_stops_a_cuda_graph(monkeypatch) -> None:
    layer, _ = _layer(tiny_qwen3_moe_config(vocab_size=64))
    cuda = torch.device("cuda")
    monkeypatch.setattr(moe_module, "fused_experts_run_on", lambda device: False)
    assert "experts" in (layer.capture_blocker(cuda) or "")
    monkeypatch.setattr(moe_module, "fused_experts_run_on", lambda device: True)
    assert layer.capture_blocker(cuda) is None


# The fused experts' matmul compiled for an H100 the way Triton's launcher specialises real tensors:
# both launches (x gathered by token, k = 8; the pairs' own rows times their routing weights), both
# 16-bit types and float32 (no TF32).
H100_CASES = [
    dict(kernel="expert_matmul", dtype=dtype, pairs_per_a_row=rows, mul_weight=mul)
    for dtype in ("bfloat16", "float16", "float32")
    for rows, mul in ((8, False), (1, True))
]
H100_SHARED_MEMORY = 227 * 1024  # the most one block may use on an H100


def test_the_expert_matmul_compiles_for_h100_without_spills() -> None:
    if not triton_imports():
        pytest.skip("triton is not installed or does not import")
    from triton_sm90_build import compile_for_h100

    for report in compile_for_h100(H100_CASES):
        assert report["shared"] <= H100_SHARED_MEMORY, report
        if "registers" in report:  # read from the cubin with the cuobjdump Triton ships
            assert report["stack"] == 0 and report["local"] == 0, f"spills: {report}"


@needs_triton
def test_experts_stacked_inside_a_step_still_take_new_weights(monkeypatch) -> None:
    """The stack is built on the first step, under the runner's inference mode; the parameters that
    became views of it load new values afterwards as before."""
    layer, x = _layer(tiny_qwen3_moe_config(vocab_size=64))
    monkeypatch.setattr(moe_module, "fused_experts_run_on", lambda device: True)
    with torch.inference_mode():
        layer(x)
    weight = layer.experts[0].down_proj.weight
    part = torch.zeros((2, *weight.shape))[1]  # a view: copied into the parameter, not adopted
    weight.weight_loader(weight, part, None)
    stacked = layer.stacked_experts()
    assert stacked.current(layer.experts) and stacked.down[0].abs().sum() == 0
    assert not stacked.gate_up.is_inference() and not stacked.down.is_inference()
    stacked.down[1].zero_()  # in place, outside inference mode: allowed on a normal tensor
