"""Model-level parity: our selective-batching models against transformers, plus backend agreement.

Several sequences of different lengths run flat in ONE forward over a paged KV cache built here, and
every position's logits must match transformers' per-sequence forward (float32, atol 1e-4). A second
forward with one decode token per sequence against the cached history must match too.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from builders import (
    TINY_CONFIGS,
    build_hf_model,
    single_seq_logits,
    tiny_gemma3_config,
    tiny_phi4_mini_config,
    tiny_qwen3_moe_config,
)
from paged_cache import PagedCacheHarness, reference_attention

from models.layers.attention import available_backends, select_attention_backend
from models.layers.metadata import AttentionMetadata
from models.registry import model_class_for

ATOL = 1e-4
SMALL_VOCAB = 512  # the tokenizer doesn't matter here; small vocab keeps the tests fast


def build_pair(config, seed: int = 0):
    """A random HF model and our model loaded from its state dict."""
    hf = build_hf_model(config, seed)
    ours = model_class_for(config)(config, dtype=torch.float32)
    ours.load_weights(hf.state_dict().items())
    return hf, ours.eval()


def hf_logits(hf, tokens: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return hf(torch.tensor([tokens])).logits[0].float()  # [len, vocab]


def small(family: str, **overrides: Any) -> Callable[[], Any]:
    """The family's tiny config (builders.TINY_CONFIGS) with the small vocabulary and `overrides`,
    built when called."""
    return partial(TINY_CONFIGS[family], **{"vocab_size": SMALL_VOCAB, **overrides})


CONFIGS = {
    "llama-gqa-tied": small("llama"),
    "llama-untied-attn-bias": small("llama", tie_word_embeddings=False, attention_bias=True, mlp_bias=True),
    "llama3-rope-scaling": small(
        "llama",
        rope_theta=500000.0,
        rope_scaling={
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,
        },
    ),
    "qwen2-qkv-bias": small("qwen2"),
    "qwen3-qk-norm": small("qwen3"),
    "qwen3-tied-attn-bias": small("qwen3", tie_word_embeddings=True, attention_bias=True),
    "phi3-fused-qkv-gqa": small("phi3"),
    # Sequences here stay within the original context (64): transformers' short factors throughout.
    "phi4-mini-partial-longrope": small("phi4_mini"),
    "mistral": small("mistral"),
    # Windows shorter than the prompts below: every attention path must drop the older keys.
    "mistral-window-5": small("mistral", sliding_window=5),
    "qwen2-window-6-from-layer-1": small(
        "qwen2",
        use_sliding_window=True,
        sliding_window=6,
        max_window_layers=1,
        num_hidden_layers=3,
    ),
    "gpt2": small("gpt2"),
    # Mixtures of experts: every prompt's tokens spread over the experts, grouped by expert in the
    # flat batch of all four prompts.
    "qwen3-moe": small("qwen3_moe"),
    "qwen3-moe-unnormalised-every-second-layer": small(
        "qwen3_moe", norm_topk_prob=False, mlp_only_layers=[], decoder_sparse_step=2
    ),
    "mixtral": small("mixtral"),
    "olmoe": small("olmoe"),
    "qwen2-moe-shared-expert": small("qwen2_moe"),
    # Local layers with a window of 5 (prompts below run to 14 tokens) and global ones.
    "gemma3": small("gemma3", sliding_window=5),
    # Linear rope scaling on the global layers only, an untied head, a final logit soft-cap, a
    # query_pre_attn_scalar that is not head_dim, MQA, every third layer global.
    "gemma3-scaled-softcap": small(
        "gemma3",
        sliding_window=6,
        rope_scaling={"rope_type": "linear", "factor": 8.0},
        tie_word_embeddings=False,
        final_logit_softcapping=3.0,
        query_pre_attn_scalar=24,
        num_key_value_heads=1,
        num_hidden_layers=3,
        sliding_window_pattern=3,
    ),
}


def test_every_family_has_a_tiny_config_and_a_parity_case() -> None:
    from models.registry import FAMILIES, FAMILY_MODULES, family_for

    assert set(FAMILY_MODULES) <= set(TINY_CONFIGS)
    assert {family_for(config()).name for config in CONFIGS.values()} == {f.name for f in FAMILIES}


@pytest.mark.parametrize("name", list(CONFIGS))
@pytest.mark.parametrize("backend", ["sdpa", "cpu-decode"])
def test_flat_batch_matches_transformers(name: str, backend: str) -> None:
    hf, ours = build_pair(CONFIGS[name]())
    ours.set_attention_backend(backend)
    g = torch.Generator().manual_seed(1)
    lengths = [7, 1, 13, 4]  # different lengths; 13 spans several blocks
    prompts = [torch.randint(0, SMALL_VOCAB, (n,), generator=g).tolist() for n in lengths]
    harness = PagedCacheHarness(ours, len(prompts))

    batch = harness.step(prompts)
    with torch.no_grad():
        logits = ours.compute_logits(
            ours(batch.input_ids, batch.positions, harness.kv_caches, batch.metadata)
        )
    assert logits.shape == (sum(lengths), SMALL_VOCAB) and logits.dtype == torch.float32
    start = 0
    for prompt in prompts:
        torch.testing.assert_close(
            logits[start : start + len(prompt)], hf_logits(hf, prompt), atol=ATOL, rtol=0
        )
        start += len(prompt)

    # One decode token per sequence, attending to the history cached by the first forward.
    next_tokens = [[int(t)] for t in torch.randint(0, SMALL_VOCAB, (len(prompts),), generator=g)]
    batch = harness.step(next_tokens)
    assert batch.metadata.is_decode_only
    with torch.no_grad():
        logits = ours.compute_logits(
            ours(batch.input_ids, batch.positions, harness.kv_caches, batch.metadata)
        )
    for i, prompt in enumerate(prompts):
        expected = hf_logits(hf, prompt + next_tokens[i])[-1]
        torch.testing.assert_close(logits[i], expected, atol=ATOL, rtol=0)


@pytest.mark.parametrize(
    "name", ["llama-gqa-tied", "mistral-window-5", "qwen2-window-6-from-layer-1", "gemma3"]
)
@pytest.mark.parametrize("backend", ["sdpa", "cpu-decode"])
def test_chunked_prefill_mixed_with_decodes(backend: str, name: str) -> None:
    """A step that mixes decodes (first) with prompt chunks whose queries are the LAST positions of a
    longer cached history: the causal mask must be aligned bottom-right (and, with a window, start
    where each query's window does)."""
    hf, ours = build_pair(CONFIGS[name]())
    ours.set_attention_backend(backend)
    g = torch.Generator().manual_seed(2)
    full = [torch.randint(0, SMALL_VOCAB, (n,), generator=g).tolist() for n in (9, 5, 11)]
    harness = PagedCacheHarness(ours, 3)
    with torch.no_grad():
        b = harness.step([full[0][:8], full[1][:4], full[2][:3]])
        ours(b.input_ids, b.positions, harness.kv_caches, b.metadata)
        # seq 0 and 1 decode one token; seq 2 runs a chunk of 8 against 3 cached tokens.
        b = harness.step([full[0][8:], full[1][4:], full[2][3:]])
        logits = ours.compute_logits(ours(b.input_ids, b.positions, harness.kv_caches, b.metadata))
    torch.testing.assert_close(logits[0], hf_logits(hf, full[0])[-1], atol=ATOL, rtol=0)
    torch.testing.assert_close(logits[1], hf_logits(hf, full[1])[-1], atol=ATOL, rtol=0)
    torch.testing.assert_close(logits[2:], hf_logits(hf, full[2])[3:], atol=ATOL, rtol=0)


def _random_step(model, seed: int, decode_only: bool):
    """Random cache contents and a random step (decodes first, then prompt chunks)."""
    g = torch.Generator().manual_seed(seed)
    harness = PagedCacheHarness(model, 5, seed)
    for k, v in harness.kv_caches:
        k.normal_(generator=g)
        v.normal_(generator=g)
    cached = [6, 1, 17, 3, 9]
    harness.step([[0] * n for n in cached])  # allocates blocks; contents stay random
    q_lens = [1] * 5 if decode_only else [1, 1, 5, 2, 9]
    batch = harness.step([[0] * n for n in q_lens])
    t = batch.input_ids.shape[0]
    h_q, h_kv, d = 4, model.num_kv_heads, model.head_dim
    q = torch.randn(t, h_q, d, generator=g)
    return harness, batch, q, h_kv


@pytest.mark.parametrize("window", [None, 1, 4, 11])
@pytest.mark.parametrize("decode_only", [True, False])
def test_sdpa_matches_the_definition(decode_only: bool, window: int | None) -> None:
    """The reference backend against attention written from its definition (tests/paged_cache.py),
    with and without a sliding window: histories of 7 to 26 keys, chunks of up to 9 queries."""
    _, ours = build_pair(CONFIGS["llama-gqa-tied"]())
    harness, batch, q, _ = _random_step(ours, 3, decode_only)
    k_cache, v_cache = harness.kv_caches[0]
    sdpa = select_attention_backend("sdpa")
    md = batch.metadata
    out = sdpa.forward(q, k_cache, v_cache, md, sdpa.plan(md), 0.25, window)
    torch.testing.assert_close(out, reference_attention(q, k_cache, v_cache, md, 0.25, window))


@pytest.mark.parametrize("backend", [b for b in available_backends("cpu") if b != "sdpa"])
@pytest.mark.parametrize("window", [None, 4, 11])
@pytest.mark.parametrize("decode_only", [True, False])
def test_backend_matches_sdpa(backend: str, decode_only: bool, window: int | None) -> None:
    _, ours = build_pair(CONFIGS["llama-gqa-tied"]())
    harness, batch, q, _ = _random_step(ours, 3, decode_only)
    k_cache, v_cache = harness.kv_caches[0]
    ref_backend = select_attention_backend("sdpa")
    other = select_attention_backend(backend)
    md = batch.metadata
    ref = ref_backend.forward(q, k_cache, v_cache, md, ref_backend.plan(md), 0.25, window)
    plan = other.plan(md)
    out = other.forward(q, k_cache, v_cache, md, plan, 0.25, window)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    # One plan serves layers of both kinds in a step (a Gemma 3 step's local and global layers).
    full = other.forward(q, k_cache, v_cache, md, plan, 0.25)
    torch.testing.assert_close(full, ref_backend.forward(q, k_cache, v_cache, md, ref_backend.plan(md), 0.25))


cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.mark.cuda
@cuda
@pytest.mark.parametrize("backend", ["torch-varlen", "flash-attn"])
@pytest.mark.parametrize("decode_only", [True, False])
def test_cuda_backend_matches_sdpa(backend: str, decode_only: bool) -> None:
    if backend not in available_backends("cuda"):
        pytest.skip(f"{backend} is not available here")
    _, ours = build_pair(CONFIGS["llama-gqa-tied"]())
    harness, batch, q, _ = _random_step(ours, 4, decode_only)
    dev = torch.device("cuda")
    md = batch.metadata
    md_cuda = AttentionMetadata(
        **{
            k: (getattr(md, k).to(dev) if isinstance(getattr(md, k), torch.Tensor) else getattr(md, k))
            for k in md.__dataclass_fields__
        }
    )
    k_cache, v_cache = (c.to(dev, torch.bfloat16) for c in harness.kv_caches[0])
    qc = q.to(dev, torch.bfloat16)
    ref_backend = select_attention_backend("sdpa", dev)
    other = select_attention_backend(backend, dev)
    ref = ref_backend.forward(qc, k_cache, v_cache, md_cuda, ref_backend.plan(md_cuda), 0.25)
    out = other.forward(qc, k_cache, v_cache, md_cuda, other.plan(md_cuda), 0.25)
    torch.testing.assert_close(out.float(), ref.float(), atol=2e-2, rtol=2e-2)


# ------------------------------------------------------------------------------- tensor parallel


def test_tp_shards_partition_the_checkpoint() -> None:
    """Loading for rank r of n takes rank r's heads / rows / columns: the shards of all ranks put back
    together are the full HF weights (KV heads replicated when there are fewer than ranks)."""
    from models.layers.parallel import TPContext

    config = CONFIGS["llama-gqa-tied"]()  # 4 query heads, 2 KV heads, head_dim 16
    hf = build_hf_model(config)
    full = hf.state_dict()
    d = 16
    for size in (2, 4):
        ranks = []
        for rank in range(size):
            model = model_class_for(config)(config, dtype=torch.float32, tp=TPContext(rank, size))
            model.load_weights(full.items())
            ranks.append(dict(model.named_parameters()))
        pre = "model.layers.1."
        q_rows = 4 // size * d
        kv_rows = max(2 // size, 1) * d
        qkv = [r[pre + "self_attn.qkv_proj.weight"] for r in ranks]
        assert torch.equal(torch.cat([w[:q_rows] for w in qkv]), full[pre + "self_attn.q_proj.weight"])
        for rank, w in enumerate(qkv):
            kv_head = rank * 2 // size  # with 4 ranks and 2 KV heads, ranks 0,1 share head 0
            k_full = full[pre + "self_attn.k_proj.weight"]
            assert torch.equal(w[q_rows : q_rows + kv_rows], k_full[kv_head * d : kv_head * d + kv_rows])
        o = torch.cat([r[pre + "self_attn.o_proj.weight"] for r in ranks], dim=1)
        assert torch.equal(o, full[pre + "self_attn.o_proj.weight"])
        inter = config.intermediate_size // size
        up = torch.cat([r[pre + "mlp.gate_up_proj.weight"][inter:] for r in ranks])
        assert torch.equal(up, full[pre + "mlp.up_proj.weight"])
        emb = torch.cat([r["model.embed_tokens.weight"] for r in ranks])
        assert torch.equal(emb, full["model.embed_tokens.weight"])


def test_tp_ranks_hold_a_slice_of_every_expert() -> None:
    """Each rank holds its share of EVERY expert's intermediate columns (gate/up rows, down columns;
    models/layers/moe.py says why) and the whole router: the ranks' shards put back together are the
    checkpoint's experts."""
    from models.layers.parallel import TPContext

    config = tiny_qwen3_moe_config(vocab_size=SMALL_VOCAB)  # 8 experts of 32
    full = build_hf_model(config).state_dict()
    ranks = []
    for rank in range(2):
        model = model_class_for(config)(config, dtype=torch.float32, tp=TPContext(rank, 2))
        model.load_weights(full.items())
        ranks.append(dict(model.named_parameters()))
    pre, inter = "model.layers.0.mlp.", config.moe_intermediate_size
    gate_up, down = (
        full[pre + "experts.gate_up_proj"],
        full[pre + "experts.down_proj"],
    )  # [E, 2I, H], [E, H, I]
    for e in range(config.num_experts):
        shards = [r[f"{pre}experts.{e}.gate_up_proj.weight"] for r in ranks]  # [gate_r | up_r] each
        half = inter // 2
        assert torch.equal(torch.cat([s[:half] for s in shards]), gate_up[e, :inter])
        assert torch.equal(torch.cat([s[half:] for s in shards]), gate_up[e, inter:])
        cols = torch.cat([r[f"{pre}experts.{e}.down_proj.weight"] for r in ranks], dim=1)
        assert torch.equal(cols, down[e])
    assert all(torch.equal(r[pre + "gate.weight"], full[pre + "gate.weight"]) for r in ranks)


def _tp_worker(rank: int, world: int, port: int, name: str) -> None:
    import torch.distributed as dist

    from models.layers.parallel import TPContext

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        config = TP_CONFIGS[name]()
        hf = build_hf_model(config)  # same seed on every rank: same weights
        ours = model_class_for(config)(config, dtype=torch.float32, tp=TPContext(rank, world))
        ours.load_weights(hf.state_dict().items())
        ours.set_attention_backend("sdpa")
        prompts = [[3, 1, 4, 1, 5, 9, 2], [6, 5], [3, 5, 8, 9, 7]]
        harness = PagedCacheHarness(ours, len(prompts))
        batch = harness.step(prompts)
        with torch.no_grad():
            hidden = ours(batch.input_ids, batch.positions, harness.kv_caches, batch.metadata)
            logits = ours.compute_logits(hidden)
        expected = torch.cat([hf_logits(hf, p) for p in prompts])
        torch.testing.assert_close(logits, expected, atol=ATOL, rtol=0)
    finally:
        dist.destroy_process_group()


TP_CONFIGS = {
    "llama": small("llama", tie_word_embeddings=False),
    "gemma3-window": small("gemma3", sliding_window=4),
    "qwen3": small("qwen3"),
    "phi4-mini": small("phi4_mini", tie_word_embeddings=False),
    "gpt2-odd-vocab": small("gpt2", vocab_size=SMALL_VOCAB - 3),  # padded vocab shards
    # Every expert sliced across the ranks (models/layers/moe.py says why), routed alike on both.
    "qwen3-moe": small("qwen3_moe"),
    "mixtral": small("mixtral"),
    "qwen2-moe-shared-expert": small("qwen2_moe"),
    # q/k norms over whole projections whose heads are split (sums of squares all-reduced); with one
    # KV head, replicated on both ranks.
    "olmoe": small("olmoe"),
    "olmoe-one-kv-head": small("olmoe", num_key_value_heads=1),
}


@pytest.mark.slow
@pytest.mark.parametrize("name", list(TP_CONFIGS))
def test_tensor_parallel_forward_matches_transformers(name: str) -> None:
    """Two gloo ranks on the CPU: column/row-parallel linears, all-reduce and the gathered vocab give
    the same logits as the unsharded transformers model."""
    import socket

    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(_tp_worker, args=(2, port, name), nprocs=2, join=True)


# ------------------------------------------------------------------------- layers and selection


def test_llama3_inverse_frequencies_match_transformers() -> None:
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from models.layers.rotary import inverse_frequencies, rope_params_from_config

    config = CONFIGS["llama3-rope-scaling"]()
    params = rope_params_from_config(config)
    assert params.rope_type == "llama3" and params.theta == 500000.0 and params.factor == 8.0
    expected, _ = ROPE_INIT_FUNCTIONS["llama3"](config, "cpu")
    ours = inverse_frequencies(params, 16, config.max_position_embeddings)
    torch.testing.assert_close(ours, expected.float(), atol=0, rtol=1e-6)


def test_longrope_table_matches_transformers_on_both_sides_of_the_original_context() -> None:
    """Positions below the original context get transformers' short-factor cos/sin, positions from it
    on the long-factor ones (what transformers computes for a forward whose longest position is past
    it), both times the attention factor; only the first rotary_dim dims turn."""
    from transformers.models.phi3.modeling_phi3 import Phi3RotaryEmbedding

    from models.layers.rotary import RotaryEmbedding, longrope_attention_factor, rope_params_from_config

    config = tiny_phi4_mini_config(original=64, max_position_embeddings=512)
    params = rope_params_from_config(config)
    assert params.rope_type == "longrope" and params.partial_rotary_factor == 0.5
    ours = RotaryEmbedding(64, config.max_position_embeddings, params)
    assert ours.rotary_dim == 32 and ours.cos_sin_cache.shape == (512, 32)
    hf = Phi3RotaryEmbedding(config)
    assert longrope_attention_factor(params, 512) == pytest.approx(hf.attention_scaling)
    x = torch.zeros(1, 1, 64)
    for positions in (torch.arange(0, 64), torch.arange(64, 512)):
        cos, sin = hf(x, positions.unsqueeze(0))  # [1, n, 32]: the halves repeated
        expect = torch.cat([cos[0, :, :16], sin[0, :, :16]], dim=-1)
        torch.testing.assert_close(ours.cos_sin_cache[positions], expect, atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize(
    ("attrs", "theta", "rope_type"),
    [
        ({"rope_theta": 5e5, "rope_scaling": None}, 5e5, "default"),  # transformers 4 style
        ({"rope_theta": 1e4, "rope_scaling": {"type": "linear", "factor": 2.0}}, 1e4, "linear"),
        ({"rope_parameters": {"rope_type": "default", "rope_theta": 1e5}}, 1e5, "default"),  # 5 style
    ],
)
def test_rope_params_old_and_new_config_styles(attrs: dict, theta: float, rope_type: str) -> None:
    from types import SimpleNamespace

    from models.layers.rotary import rope_params_from_config

    params = rope_params_from_config(SimpleNamespace(**attrs))
    assert (params.theta, params.rope_type) == (theta, rope_type)


def test_unsupported_rope_type_is_a_clear_error() -> None:
    from types import SimpleNamespace

    from models.errors import ModelLoadError
    from models.layers.rotary import rope_params_from_config

    with pytest.raises(ModelLoadError, match="yarn"):
        rope_params_from_config(SimpleNamespace(rope_parameters={"rope_type": "yarn", "rope_theta": 1e4}))


def test_backend_selection() -> None:
    assert select_attention_backend("auto", "cpu").name == "cpu-decode"
    assert select_attention_backend("sdpa", "cpu").name == "sdpa"
    with pytest.raises(ValueError, match="sdpa"):  # the message lists the valid names
        select_attention_backend("paged-magic", "cpu")
    with pytest.raises(ValueError, match="CUDA"):
        select_attention_backend("flash-attn", "cpu")
    # triton joins on a CPU only under Triton's interpreter (test_triton_attention.py)
    assert [b for b in available_backends("cpu") if b != "triton"] == ["sdpa", "cpu-decode"]


def _reference_varlen(q, k, v, cu_q, cu_k, max_q, max_k, scale, window_size=(-1, 0)):
    """Per-sequence bottom-right-causal attention over contiguous cu_seqlens layouts, with
    flash-attn's window_size=(left, right): query i sees keys i + sk - sq - left .. i + sk - sq."""
    left, right = window_size
    assert right == 0
    outs = []
    for i in range(len(cu_q) - 1):
        qi = q[cu_q[i] : cu_q[i + 1]].transpose(0, 1)
        ki = k[cu_k[i] : cu_k[i + 1]].transpose(0, 1)
        vi = v[cu_k[i] : cu_k[i + 1]].transpose(0, 1)
        ql, sl = qi.shape[1], ki.shape[1]
        mask = torch.ones(ql, sl, dtype=torch.bool).tril(sl - ql)
        if left >= 0:
            mask &= torch.ones(ql, sl, dtype=torch.bool).triu(sl - ql - left)
        o = torch.nn.functional.scaled_dot_product_attention(
            qi, ki, vi, attn_mask=mask, scale=scale, enable_gqa=True
        )
        outs.append(o.transpose(0, 1))
    return torch.cat(outs)


@pytest.mark.parametrize("window", [None, 5])
@pytest.mark.parametrize("decode_only", [True, False])
def test_varlen_backends_gather_and_arguments(decode_only: bool, window: int | None) -> None:
    """The CUDA backends' CPU-side plumbing (history gather to the cu_seqlens_k layout, argument order,
    the sliding window in flash-attn's (left, right) convention) with the kernel replaced by a
    reference implementation, so it is checked on any machine."""
    from models.layers.attention_backends import FlashAttnBackend, TorchVarlenBackend

    _, ours = build_pair(CONFIGS["llama-gqa-tied"]())
    harness, batch, q, _ = _random_step(ours, 5, decode_only)
    k_cache, v_cache = harness.kv_caches[0]
    md = batch.metadata
    sdpa = select_attention_backend("sdpa")
    ref = sdpa.forward(q, k_cache, v_cache, md, sdpa.plan(md), 0.25, window)

    varlen = TorchVarlenBackend.__new__(TorchVarlenBackend)
    varlen._causal, varlen._gqa = {"window_size": (-1, 0)}, {"enable_gqa": True}
    varlen.supports_sliding_window = True

    def fake_varlen(q, k, v, cu_q, cu_k, max_q, max_k, *, scale, window_size, enable_gqa):
        assert enable_gqa
        assert (max_q, max_k) == (md.max_query_len, md.max_seq_len)
        return _reference_varlen(q, k, v, cu_q, cu_k, max_q, max_k, scale, window_size)

    varlen._attn = fake_varlen
    out = varlen.forward(q, k_cache, v_cache, md, varlen.plan(md), 0.25, window)
    torch.testing.assert_close(out, ref)

    flash = FlashAttnBackend.__new__(FlashAttnBackend)

    def fake_flash(
        q, k, v, *, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale, causal, **kw
    ):
        assert causal and set(kw) <= {"window_size"}
        return _reference_varlen(
            q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale,
            kw.get("window_size", (-1, 0)),
        )  # fmt: skip

    flash._attn = fake_flash
    plan = flash.plan(md)
    assert plan.slots is not None  # block size 4: not a multiple of 256, so the history is gathered
    torch.testing.assert_close(flash.forward(q, k_cache, v_cache, md, plan, 0.25, window), ref)


def test_varlen_without_window_size_refuses_windows() -> None:
    from models.layers.attention_backends import TorchVarlenBackend

    varlen = TorchVarlenBackend.__new__(TorchVarlenBackend)
    varlen._causal, varlen.supports_sliding_window = {"is_causal": True}, False  # an older torch
    md = PagedCacheHarness(SimpleNamespace(num_layers=1, num_kv_heads=1, head_dim=8), 1).step([[0]]).metadata
    with pytest.raises(ValueError, match="window"):
        varlen.forward(torch.zeros(1, 1, 8), None, None, md, None, 1.0, 4)


# ------------------------------------------------------------------------------------- Gemma 3


def _tiny_gemma3_multimodal_config():
    from transformers import Gemma3Config, SiglipVisionConfig

    vision = SiglipVisionConfig(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        image_size=28,
        patch_size=14,
    )
    text = tiny_gemma3_config(vocab_size=SMALL_VOCAB, sliding_window=5)
    return Gemma3Config(
        text_config=text.to_dict(),
        vision_config=vision.to_dict(),
        mm_tokens_per_image=4,
        architectures=["Gemma3ForConditionalGeneration"],
    )


def test_gemma3_multimodal_checkpoint_runs_its_language_model(tmp_path) -> None:
    """A Gemma3ForConditionalGeneration checkpoint: its language model, under transformers 5's names
    (model.language_model.*) and under the hub files' (language_model.model.*, as save_pretrained
    writes them), gives transformers' text-only logits; the vision tower is skipped."""
    from models.loader import load_model, max_model_len

    config = _tiny_gemma3_multimodal_config()
    hf = build_hf_model(config)
    assert type(hf).__name__ == "Gemma3ForConditionalGeneration"
    assert any(k.startswith("model.vision_tower.") for k in hf.state_dict())
    ours = model_class_for(config)(config, dtype=torch.float32)
    ours.load_weights(hf.state_dict().items())
    prompt = torch.randint(0, SMALL_VOCAB, (13,), generator=torch.Generator().manual_seed(4)).tolist()
    expected = hf_logits(hf, prompt)
    torch.testing.assert_close(single_seq_logits(ours.eval(), prompt), expected, atol=ATOL, rtol=0)

    hf.save_pretrained(tmp_path)
    loaded = load_model(tmp_path, torch.float32, "cpu")
    assert max_model_len(loaded.config) == 512  # the text config's
    torch.testing.assert_close(single_seq_logits(loaded, prompt), expected, atol=ATOL, rtol=0)


def test_gemma3_settings_no_backend_runs_are_refused() -> None:
    for setting in ({"attn_logit_softcapping": 50.0}, {"use_bidirectional_attention": True}):
        config = tiny_gemma3_config(vocab_size=SMALL_VOCAB, **setting)
        with pytest.raises(ValueError, match=next(iter(setting))):
            model_class_for(config)(config)


def test_gemma3_rope_per_layer_type() -> None:
    """Local layers rotate with rope_local_base_freq and no scaling, global ones with rope_theta and
    the scaling: transformers 5 nests them per layer type, and nothing falls back to 10000."""
    from types import SimpleNamespace

    from models.errors import ModelLoadError
    from models.layers.rotary import rope_params_from_config

    config = CONFIGS["gemma3-scaled-softcap"]()
    local = rope_params_from_config(config, "sliding_attention")
    full = rope_params_from_config(config, "full_attention")
    assert (local.theta, local.rope_type, local.factor) == (10_000.0, "default", 1.0)
    assert (full.theta, full.rope_type, full.factor) == (1_000_000.0, "linear", 8.0)
    with pytest.raises(ModelLoadError, match="per layer type"):
        rope_params_from_config(config)
    nested_without_theta = SimpleNamespace(rope_parameters={"full_attention": {"rope_type": "default"}})
    with pytest.raises(ModelLoadError, match="rope_theta"):
        rope_params_from_config(nested_without_theta, "full_attention")
