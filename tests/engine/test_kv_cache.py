"""The paged KV cache: budget -> block count, shapes, views, slot mapping."""

from __future__ import annotations

import pytest
import torch

from engine.kv_cache import (
    KVCacheSpec,
    PagedKVCache,
    default_kv_budget,
    resolve_kv_format,
    slot_mapping,
    slot_of,
)
from models.layers.kv_format import kv_format


def spec(dtype: str = "float32", **kw) -> KVCacheSpec:
    args = dict(num_layers=3, num_kv_heads=2, head_dim=8, block_size=4, format=kv_format(dtype))
    args.update(kw)
    return KVCacheSpec(**args)


def test_bytes_per_block_counts_k_and_v_of_every_layer():
    # 2 (K, V) * 3 layers * 4 tokens * 2 heads * 8 dims * 4 bytes
    assert spec().bytes_per_block == 2 * 3 * 4 * 2 * 8 * 4
    assert spec("bfloat16").bytes_per_block == 2 * 3 * 4 * 2 * 8 * 2
    assert spec("float16").bytes_per_block == 2 * 3 * 4 * 2 * 8 * 2
    # q8_0: 34 bytes per 32 values (a half scale and 32 int8 codes)
    assert spec("q8_0", head_dim=64).bytes_per_block == 2 * 3 * 4 * 2 * 34 * 2


def test_smaller_kv_types_fit_more_tokens_in_the_same_memory():
    budget = 1 << 20
    tokens = {
        name: spec(name, head_dim=64).num_blocks_for(budget) * 4 for name in ("float32", "bfloat16", "q8_0")
    }
    assert tokens["bfloat16"] == 2 * tokens["float32"]
    assert tokens["q8_0"] == budget // (2 * 3 * 2 * 68) // 4 * 4  # 68 bytes a head row
    assert tokens["q8_0"] > 3.7 * tokens["float32"]


@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "q8_0"])
def test_cache_tensors_hold_the_format(dtype: str):
    s = spec(dtype, head_dim=64)
    cache = PagedKVCache(s, num_blocks=5, device="cpu")
    assert cache.k_cache.dtype == kv_format(dtype).storage
    assert cache.k_cache.shape == (3, 6, 4, 2, 68 if dtype == "q8_0" else 64)
    assert cache.k_cache.numel() * cache.k_cache.element_size() * 2 == cache.total_bytes + s.bytes_per_block
    line = cache.describe()
    assert f"KV cache: {dtype}, 5 blocks of 4 tokens = 20 tokens" in line
    f32_tokens = 4 if dtype == "q8_0" else 8  # whole float32 blocks in the same bytes
    assert f"float32 would fit {f32_tokens} tokens in these bytes" in line
    assert ("3.76x" if dtype == "q8_0" else "2.00x") in line


def test_auto_kv_dtype_is_16_bit_on_cpu_and_the_model_dtype_on_cuda():
    cpu = torch.device("cpu")
    assert resolve_kv_format("auto", cpu, torch.float32, 64).name == "float16"
    assert resolve_kv_format("auto", cpu, torch.bfloat16, 64).name == "bfloat16"
    assert resolve_kv_format("q8_0", cpu, torch.float32, 64).name == "q8_0"
    assert resolve_kv_format("float32", cpu, torch.bfloat16, 64).name == "float32"
    cuda = torch.device("cuda")  # nothing is allocated: only the decision
    assert resolve_kv_format("auto", cuda, torch.float16, 64).name == "float16"
    assert resolve_kv_format("bfloat16", cuda, torch.bfloat16, 64).name == "bfloat16"
    assert resolve_kv_format("auto", cpu, torch.float32, 64, "triton").name == "float32"  # the interpreter


def test_kv_dtypes_a_device_cannot_run_are_refused_with_the_reason():
    cuda = torch.device("cuda")
    with pytest.raises(
        ValueError, match="q8_0 is read by the native CPU kernels only.*auto \\(here bfloat16\\)"
    ):
        resolve_kv_format("q8_0", cuda, torch.bfloat16, 64)
    with pytest.raises(
        ValueError, match="model's dtype \\(float16\\): --kv-cache-dtype bfloat16 needs --dtype"
    ):
        resolve_kv_format("bfloat16", cuda, torch.float16, 64)
    with pytest.raises(ValueError, match="with the triton attention backend the KV cache holds the model's"):
        resolve_kv_format("float16", torch.device("cpu"), torch.float32, 64, "triton")
    with pytest.raises(ValueError, match="multiple of 32; this model's is 48"):
        resolve_kv_format("q8_0", torch.device("cpu"), torch.float32, 48)


def test_budget_to_block_count_rounds_down():
    s = spec()
    assert s.num_blocks_for(10 * s.bytes_per_block) == 10
    assert s.num_blocks_for(10 * s.bytes_per_block + s.bytes_per_block - 1) == 10
    assert s.num_blocks_for(s.bytes_per_block - 1) == 0


def test_budget_too_small_is_an_error():
    with pytest.raises(ValueError, match="blocks"):
        PagedKVCache(spec(), 0, "cpu")


def test_shapes_views_and_size():
    s = spec()
    cache = PagedKVCache(s, num_blocks=5, device="cpu")
    # 5 blocks for the scheduler and the scratch block (6th) for graph steps' padding rows.
    assert cache.k_cache.shape == (3, 6, 4, 2, 8)
    assert cache.v_cache.shape == (3, 6, 4, 2, 8)
    assert cache.scratch_block == 5
    assert cache.num_slots == 20
    assert cache.total_bytes == 5 * s.bytes_per_block
    assert cache.k_cache.numel() * 4 * 2 == cache.total_bytes + s.bytes_per_block
    assert len(cache.layers) == 3
    k1, v1 = cache.layers[1]
    assert k1.shape == (6, 4, 2, 8)
    # Views, not copies: a write through the layer view lands in the big tensor.
    k1[2, 3].fill_(7.0)
    v1[0, 0].fill_(-1.0)
    assert torch.all(cache.k_cache[1, 2, 3] == 7.0)
    assert torch.all(cache.v_cache[1, 0, 0] == -1.0)
    assert cache.k_cache.sum() == 7.0 * 2 * 8


def test_slot_of():
    table = [7, 2, 9]
    assert slot_of(table, 0, 4) == 28
    assert slot_of(table, 3, 4) == 31
    assert slot_of(table, 4, 4) == 8
    assert slot_of(table, 10, 4) == 38


def test_slot_mapping_writes_land_in_the_right_block():
    cache = PagedKVCache(
        spec(num_layers=1, num_kv_heads=1, head_dim=1), num_blocks=6, device="cpu"
    )  # float32
    tables = torch.tensor([[4, 1, 0], [2, 5, 3]], dtype=torch.int32)  # two sequences
    # Sequence 0: positions 3..5 (crosses its first block boundary); sequence 1: position 9.
    seq_index = torch.tensor([0, 0, 0, 1])
    positions = torch.tensor([3, 4, 5, 9])
    slots = slot_mapping(tables, seq_index, positions, block_size=4)
    assert slots.tolist() == [4 * 4 + 3, 1 * 4 + 0, 1 * 4 + 1, 3 * 4 + 1]
    for s, (i, p) in zip(
        slots.tolist(), zip(seq_index.tolist(), positions.tolist(), strict=True), strict=True
    ):
        assert s == slot_of(tables[i].tolist(), p, 4)

    k, _ = cache.layers[0]  # [num_blocks, block_size, 1, 1]
    values = torch.tensor([10.0, 11.0, 12.0, 13.0])
    k.view(-1, 1, 1).index_copy_(0, slots, values.view(-1, 1, 1))
    assert k[4, 3].item() == 10.0
    assert k[1, 0].item() == 11.0
    assert k[1, 1].item() == 12.0
    assert k[3, 1].item() == 13.0
    assert (k != 0).sum().item() == 4


def test_default_budget_on_cpu_is_the_fixed_one():
    assert default_kv_budget(torch.device("cpu"), cpu_budget=123, cuda_fraction=0.9) == 123
