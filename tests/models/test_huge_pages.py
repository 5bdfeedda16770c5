"""Huge-page memory for the packed weights (models/layers/huge_pages.py): aligned, the right bytes,
only whole huge pages advised, and a packed model's weights moved there once (a tied table stays
shared)."""

from __future__ import annotations

import torch
from builders import build_hf_model, gguf_structured, tiny_llama_config
from kernel_marks import needs_native_kernels

from models.layers.huge_pages import HUGE_PAGE, MIN_BYTES, huge_page_empty, in_huge_pages
from models.layers.packed_weight import FORMATS, PackedWeight, pack_components, random_components
from models.registry import model_class_for
from models.weight_packing import pack_model_weights, packable_layers


def test_a_huge_page_tensor_starts_on_a_huge_page_and_holds_its_bytes() -> None:
    t = huge_page_empty(3 * HUGE_PAGE + 100, torch.uint8)
    assert t.numel() == 3 * HUGE_PAGE + 100 and t.data_ptr() % HUGE_PAGE == 0
    t.fill_(7)
    assert int(t[-1]) == 7
    f = huge_page_empty(4 * 1000, torch.float32)
    assert f.dtype == torch.float32 and f.numel() == 1000


def test_copies_keep_values_and_small_tensors_stay_where_they_are() -> None:
    big = torch.randn(MIN_BYTES // 4 + 17)
    moved = in_huge_pages(big)
    assert torch.equal(moved, big) and moved.data_ptr() % HUGE_PAGE == 0
    assert in_huge_pages(moved) is moved  # already there
    small = torch.randn(10)
    assert in_huge_pages(small) is small


@needs_native_kernels
def test_a_moved_weight_computes_the_same() -> None:
    c = random_components(FORMATS["Q4_K"], 4096, 1024, seed=1)  # 2.3 MB of tiles
    w = PackedWeight((pack_components(c),))
    x = torch.randn(3, 1024)
    before = w.dequantize()
    from models.kernels import cpu as cpu_kernels

    y = cpu_kernels.quant_linear(x, w)
    w.move_to_huge_pages()
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
