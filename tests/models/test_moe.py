"""The mixture-of-experts layer (models/layers/moe.py) on its own: each chosen expert runs once per
step over all the tokens that chose it, an expert nobody chose is never run, a token's output does not
depend on the tokens it is batched with, and routing variants this layer does not run are refused."""

from __future__ import annotations

import re

import pytest
import torch
from builders import (
    build_hf_model,
    gguf_roundtrip,
    tiny_mixtral_config,
    tiny_qwen2_moe_config,
    tiny_qwen3_moe_config,
)
from kernel_marks import needs_native_kernels

from models.errors import ModelLoadError
from models.layers.moe import Routing, SparseMoE
from models.registry import model_class_for


def moe_layer(config, index: int = 0) -> SparseMoE:
    """Layer `index`'s experts of our model loaded from a random transformers model."""
    hf = build_hf_model(config)
    ours = model_class_for(config)(config, dtype=torch.float32)
    ours.load_weights(hf.state_dict().items())
    layer = ours.model.layers[index].mlp
    assert isinstance(layer, SparseMoE)
    return layer


def expert_calls(layer: SparseMoE, x: torch.Tensor) -> tuple[torch.Tensor, list[tuple[int, int]]]:
    """The layer's output and (expert, tokens) of every expert call, in order."""
    calls: list[tuple[int, int]] = []
    hooks = [
        e.register_forward_hook(lambda m, args, out, i=i: calls.append((i, args[0].shape[0])))
        for i, e in enumerate(layer.experts)
    ]
    try:
        with torch.no_grad():
            return layer(x), calls
    finally:
        for h in hooks:
            h.remove()


def test_one_token_runs_only_its_chosen_experts() -> None:
    layer = moe_layer(tiny_qwen3_moe_config(vocab_size=64))
    x = torch.randn(1, 64, generator=torch.Generator().manual_seed(0))
    _, chosen = layer.routing.route(layer.gate(x))
    _, calls = expert_calls(layer, x)
    assert sorted(calls) == sorted((int(e), 1) for e in chosen[0])


def test_each_chosen_expert_runs_once_per_step_over_all_its_tokens() -> None:
    layer = moe_layer(tiny_qwen3_moe_config(vocab_size=64))
    x = torch.randn(40, 64, generator=torch.Generator().manual_seed(1))
    _, chosen = layer.routing.route(layer.gate(x))
    _, calls = expert_calls(layer, x)
    per_expert = torch.bincount(chosen.reshape(-1), minlength=8)
    assert calls == [(e, int(n)) for e, n in enumerate(per_expert) if n]
    assert sum(n for _, n in calls) == 40 * layer.routing.top_k


@pytest.mark.parametrize("config", [tiny_qwen3_moe_config, tiny_mixtral_config])
def test_a_tokens_output_does_not_depend_on_its_batch(config) -> None:
    layer = moe_layer(config(vocab_size=64))
    x = torch.randn(24, 64, generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        together = layer(x)
        alone = torch.cat([layer(x[i : i + 1]) for i in range(24)])
        reversed_ = layer(x.flip(0)).flip(0)
    torch.testing.assert_close(together, alone, atol=1e-6, rtol=0)
    torch.testing.assert_close(together, reversed_, atol=1e-6, rtol=0)


def test_the_shared_expert_takes_every_token_through_its_gate() -> None:
    """Qwen2-MoE's shared expert runs once over all the step's tokens, besides the routed ones, and
    its sigmoid gate scales it per token."""
    layer = moe_layer(tiny_qwen2_moe_config(vocab_size=64), index=1)
    assert layer.shared_expert is not None and layer.shared_expert_gate is not None
    x = torch.randn(10, 64, generator=torch.Generator().manual_seed(4))
    shared_calls: list[int] = []
    hook = layer.shared_expert.register_forward_hook(
        lambda m, args, out: shared_calls.append(args[0].shape[0])
    )
    try:
        out, calls = expert_calls(layer, x)
    finally:
        hook.remove()
    assert shared_calls == [10] and sum(n for _, n in calls) == 10 * 2
    with torch.no_grad():
        gate = torch.sigmoid(x @ layer.shared_expert_gate.weight.t())
        routed = out - gate * layer.shared_expert(x)
        layer.shared_expert_gate.weight.zero_()  # sigmoid(0): half the shared expert
        torch.testing.assert_close(layer(x), routed + 0.5 * layer.shared_expert(x), atol=1e-5, rtol=0)


@needs_native_kernels
@pytest.mark.parametrize("precision", ["float32", "int8"])
def test_the_native_expert_call_is_bit_identical_to_the_module_loop(precision: str) -> None:
    """Packed experts run in one native call (moe.c's orca_moe, the native router and routing the
    module also runs, then the chosen experts): the same kernels in the same order as the module's
    loop, so the same bits, for one token and for many: the threads taking whole experts (up to 2048
    token-expert pairs) and each expert split over the threads (past that: 1100 tokens x 2)."""
    from models.weight_packing import pack_model_weights

    layer = moe_layer(tiny_qwen3_moe_config(vocab_size=64))
    with torch.no_grad():
        for expert in layer.experts:  # block-structured weights, so they pack
            for linear in (expert.gate_up_proj, expert.down_proj):
                linear.weight.copy_(gguf_roundtrip(linear.weight, "Q4_1"))
    pack_model_weights(layer, precision)
    assert layer.native_experts() is not None
    g = torch.Generator().manual_seed(5)
    for tokens in (1, 3, 40, 1100):
        x = torch.randn(tokens, 64, generator=g)
        with torch.no_grad():
            native, calls = expert_calls(layer, x)
            layer._native = (layer.experts[0].gate_up_proj.packed.kernel_args, None)  # the module loop
            loop, loop_calls = expert_calls(layer, x)
            layer._native = None
        assert calls == [] and loop_calls  # the native call ran no expert module
        assert torch.equal(native, loop)


@needs_native_kernels
def test_the_native_call_runs_the_shared_expert_through_its_gate() -> None:
    """Qwen2-MoE's shared expert and its sigmoid gate are in the native call too (no expert module
    runs); the gate's sigmoid is C's, so the layer matches the module loop's torch one to rounding."""
    from models.weight_packing import pack_model_weights

    # A shared expert 64 wide: its down projection's rows in whole blocks of 32, so it packs.
    layer = moe_layer(tiny_qwen2_moe_config(vocab_size=64, shared_expert_intermediate_size=64), index=1)
    with torch.no_grad():
        for expert in [*layer.experts, layer.shared_expert]:
            for linear in (expert.gate_up_proj, expert.down_proj):
                linear.weight.copy_(gguf_roundtrip(linear.weight, "Q4_1"))
    pack_model_weights(layer, "float32")
    assert layer.native_experts() is not None and layer.native_struct() is not None
    x = torch.randn(12, 64, generator=torch.Generator().manual_seed(6))
    shared_calls: list[int] = []
    hook = layer.shared_expert.register_forward_hook(lambda m, args, out: shared_calls.append(1))
    try:
        with torch.no_grad():
            native, calls = expert_calls(layer, x)
            assert calls == [] and shared_calls == []
            layer._native = (layer.experts[0].gate_up_proj.packed.kernel_args, None)  # the module loop
            loop, _ = expert_calls(layer, x)
            layer._native = None
    finally:
        hook.remove()
    assert shared_calls == [1]  # the loop ran it
    torch.testing.assert_close(native, loop, atol=1e-5, rtol=1e-5)


def test_softmax_over_the_top_k_equals_renormalised_softmax_first() -> None:
    logits = torch.randn(50, 8, generator=torch.Generator().manual_seed(3))
    first_w, first_e = Routing(8, 2, normalize=True).route(logits)
    after_w, after_e = Routing(8, 2, normalize=False, softmax_first=False).route(logits)
    assert torch.equal(first_e, after_e)
    torch.testing.assert_close(first_w, after_w)
    plain_w, _ = Routing(8, 2, normalize=False).route(logits)
    assert bool((plain_w.sum(-1) < 1).all())  # without normalising, the k keep their softmax share


@pytest.mark.parametrize(
    ("overrides", "named"),
    [
        ({"scoring_func": "sigmoid"}, "scoring_func='sigmoid'"),
        ({"n_group": 4, "topk_group": 2}, "n_group=4"),
        ({"routed_scaling_factor": 2.5}, "routed_scaling_factor=2.5"),
        ({"hidden_act": "gelu"}, "hidden_act='gelu'"),
        ({"num_experts_per_tok": 9}, "9 experts per token out of 8"),
    ],
)
def test_unsupported_routing_is_refused_naming_it(overrides: dict, named: str) -> None:
    config = tiny_qwen3_moe_config(vocab_size=64)
    for key, value in overrides.items():
        setattr(config, key, value)
    with pytest.raises(ModelLoadError, match=re.escape(named)):
        model_class_for(config)(config, dtype=torch.float32)


def test_an_expert_stack_of_the_wrong_rank_is_refused_naming_it() -> None:
    config = tiny_qwen3_moe_config(vocab_size=64)
    ours = model_class_for(config)(config, dtype=torch.float32)
    state = build_hf_model(config).state_dict()
    name = "model.layers.0.mlp.experts.down_proj"
    state[name] = state[name].reshape(-1, state[name].shape[-1])  # 2-D: the experts' rows stacked
    with pytest.raises(ModelLoadError, match=f"{name}.*3-D"):
        ours.load_weights(state.items())
