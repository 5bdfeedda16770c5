"""Huge-page memory for the packed weights (models/layers/huge_pages.py): aligned, the right bytes,
and a packed model's weights moved there once, side by side (a tied table stays shared)."""

from __future__ import annotations

import torch
from builders import build_hf_model, gguf_structured, tiny_llama_config
from kernel_marks import needs_native_kernels

from models.layers.huge_pages import HUGE_PAGE, huge_page_empty, huge_page_slots
from models.layers.packed_weight import FORMATS, PackedWeight, pack_components, random_components
from models.registry import model_class_for
from models.weight_packing import move_to_huge_pages, pack_model_weights, packable_layers


def test_a_huge_page_tensor_starts_on_a_huge_page_and_holds_its_bytes() -> None:
    t = huge_page_empty(3 * HUGE_PAGE + 100)
    assert t.numel() == 3 * HUGE_PAGE + 100 and t.data_ptr() % HUGE_PAGE == 0
    t.fill_(7)
    assert int(t[-1]) == 7


def test_slots_take_the_shapes_side_by_side_and_keep_copied_values() -> None:
    tensors = [torch.randn(1000, 700), torch.arange(5, dtype=torch.int64), torch.zeros(3, dtype=torch.uint8)]
    slots = huge_page_slots(tensors)
    assert slots[0].data_ptr() % HUGE_PAGE == 0 and all(s.data_ptr() % 64 == 0 for s in slots)
    for t, slot in zip(tensors, slots, strict=True):
        assert slot.shape == t.shape and slot.dtype == t.dtype
        assert torch.equal(slot.copy_(t), t)


@needs_native_kernels
def test_a_moved_weight_computes_the_same() -> None:
    c = random_components(FORMATS["Q4_K"], 4096, 1024, seed=1)  # 2.3 MB of tiles
    w = PackedWeight((pack_components(c),))
    x = torch.randn(3, 1024)
    before = w.dequantize()
    from models.kernels import cpu as cpu_kernels

    y = cpu_kernels.quant_linear(x, w)
    move_to_huge_pages([w])
    assert w.kernel_args[0][0] == w.segments[0].tiles.data_ptr()
    assert w.segments[0].tiles.data_ptr() % HUGE_PAGE == 0
    assert torch.equal(w.dequantize(), before)
    assert torch.equal(cpu_kernels.quant_linear(x, w), y)


@needs_native_kernels
def test_packing_a_model_moves_every_weight_into_one_mapping_and_a_tied_table_stays_shared() -> None:
    config = tiny_llama_config(tie_word_embeddings=True, hidden_size=512, intermediate_size=4096)
    hf = gguf_structured(build_hf_model(config))
    model = model_class_for(config)(config, dtype=torch.float32)
    model.load_weights(hf.state_dict().items())
    gate_up = model.model.layers[0].mlp.gate_up_proj
    float_weight = gate_up.weight.detach().clone()  # exactly Q4_1-structured: packs exactly
    pack_model_weights(model, "int8")
    layers = [layer for layer in packable_layers(model) if layer.packed is not None]
    tiles = {s.tiles.data_ptr(): s.nbytes for layer in layers for s in layer.packed.segments}
    start = min(tiles)
    assert len(tiles) > 3 and start % HUGE_PAGE == 0 and all(p % 64 == 0 for p in tiles)
    # Side by side: together they span no more than their bytes, each rounded up to 64.
    assert max(p + n for p, n in tiles.items()) - start <= sum(-(-n // 64) * 64 for n in tiles.values())
    embed, head = model.model.embed_tokens, model.lm_head
    assert embed.packed is head.packed
    # The moved tiles hold the weight's values (the kernel decodes them from their new place).
    assert torch.equal(gate_up.packed.dequantize(), float_weight)
