"""Random-weight Q4_K_M GGUF files at published shapes (loadtest/gguf_shapes.py), for `make
bench-peers GGUF=...`: the shapes' sizes are the checkpoints', the files carry llama.cpp's Q4_K_M
types and the metadata our converter completes the config from, and our server code loads them (at
toy sizes here) onto the native kernels."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch
from builders import single_seq_logits

from loadtest.gguf_shapes import SHAPES, main, tensors, tiny, use_more_bits, write_gguf


@pytest.mark.parametrize(
    ("name", "params", "non_embedding"),
    # The model cards say 0.6B (0.44B without the embedding), 3.8B and 1B (0.7B without it); Llama's
    # 1.24B, 3.21B and 8.03B (safetensors' counts).
    [
        ("llama-3.2-1b", 1.2358e9, 0.9732e9),
        ("llama-3.2-3b", 3.2128e9, 2.8188e9),
        ("llama-3.1-8b", 8.0301e9, 7.5047e9),
        ("qwen3-0.6b", 0.596e9, 0.4405e9),
        ("phi-4-mini", 3.836e9, 3.2214e9),
        ("gemma-3-1b", 0.9999e9, 0.6979e9),
        # 6.9B (OLMoE's card), 1.3B of them active (test_moe_shape_types_and_active_parameters).
        ("olmoe-1b-7b", 6.919e9, 6.816e9),
    ],
)
def test_full_shapes_have_the_checkpoints_sizes(name: str, params: float, non_embedding: float) -> None:
    shape = SHAPES[name]
    total = sum(int(np.prod(dims)) for _, dims, _ in tensors(shape))
    assert total == pytest.approx(params, rel=1e-3)
    assert total - shape.vocab * shape.hidden == pytest.approx(non_embedding, rel=1e-3)


def test_q4_k_m_types_follow_llama_cpp() -> None:
    types = {name: t for name, _, t in tensors(SHAPES["qwen3-0.6b"])}
    assert types["token_embd.weight"] == "Q6_K"  # tied: the embedding is the output
    assert types["blk.0.attn_q_norm.weight"] == "F32" and types["blk.5.attn_q.weight"] == "Q4_K"
    more = [i for i in range(28) if use_more_bits(i, 28)]
    assert more[:6] == [0, 1, 2, 5, 8, 11] and more[-4:] == [24, 25, 26, 27]
    assert {types[f"blk.{i}.ffn_down.weight"] for i in more} == {"Q6_K"}
    assert types["blk.3.attn_v.weight"] == types["blk.3.ffn_down.weight"] == "Q4_K"
    phi = {name: t for name, _, t in tensors(SHAPES["phi-4-mini"])}
    assert phi["blk.7.attn_qkv.weight"] == "Q5_K" and phi["blk.7.ffn_up.weight"] == "Q4_K"
    assert phi["rope_factors_long.weight"] == "F32"


def test_moe_shape_types_and_active_parameters() -> None:
    """llama.cpp's Q4_K_M for the expert stacks (ffn_down_exps follows ffn_down's rule) and an F32
    router; 8 of 64 experts per token make OLMoE's 1.3B active parameters."""
    shape = SHAPES["olmoe-1b-7b"]
    types = {name: t for name, _, t in tensors(shape)}
    assert types["blk.0.ffn_gate_inp.weight"] == "F32" and types["blk.3.ffn_gate_exps.weight"] == "Q4_K"
    assert types["blk.0.ffn_down_exps.weight"] == "Q6_K" and types["blk.3.ffn_down_exps.weight"] == "Q4_K"
    total = sum(int(np.prod(dims)) for _, dims, _ in tensors(shape))
    experts = sum(int(np.prod(dims)) for name, dims, _ in tensors(shape) if "_exps." in name)
    active = total - experts + experts * shape.experts_used // shape.experts
    assert active == pytest.approx(1.28e9, rel=1e-2)


@pytest.mark.parametrize("name", ["qwen3-0.6b", "phi-4-mini", "gemma-3-1b", "llama-3.2-1b", "olmoe-1b-7b"])
def test_tiny_files_load_on_the_native_kernels(name: str, tmp_path: Path, monkeypatch) -> None:
    from gguf import GGUFReader

    from models.loader import load_config, load_model, resolve_model

    monkeypatch.setenv("ORCA_CACHE_DIR", str(tmp_path / "cache"))
    shape = tiny(SHAPES[name])
    path = write_gguf(shape, tmp_path / f"{name}.gguf", name=name)
    written = {t.name: t.tensor_type.name for t in GGUFReader(path).tensors}
    assert written == {n: t for n, _, t in tensors(shape)}
    model_dir = resolve_model(str(path))
    config = load_config(model_dir)
    if name == "qwen3-0.6b":
        assert config.head_dim == 64 and config.tie_word_embeddings
    elif name == "olmoe-1b-7b":  # 8 experts of 256, 4 per token
        assert (config.num_experts, config.num_experts_per_tok, config.intermediate_size) == (8, 4, 256)
    elif name == "llama-3.2-1b":
        assert config.rope_parameters["rope_theta"] == 500000.0 and config.tie_word_embeddings
    elif name == "gemma-3-1b":  # the 2 layers local (every sixth is global), with their window
        assert config.sliding_window == 512 and config.layer_types == ["sliding_attention"] * 2
        assert config.vocab_size == shape.vocab  # the SentencePiece vocabulary, read back whole
    else:  # 48 of 64 head dims turn, as Phi-4-mini's 96 of 128; LongRoPE from 1024 tokens
        rope = config.rope_parameters
        assert rope["partial_rotary_factor"] == 0.75 and rope["rope_type"] == "longrope"
        assert rope["original_max_position_embeddings"] == 1024 and config.sliding_window is None
    model = load_model(model_dir, torch.float32, "cpu")
    formats = {f for m in model.modules() if getattr(m, "packed", None) is not None for f in m.packed.formats}
    assert formats == {t for _, _, t in tensors(shape) if t != "F32"}
    assert model.native_decode is not None  # experts too: orca_moe in the fused call
    logits = single_seq_logits(model, [1, 5, 400, 2000, 3000])
    assert torch.isfinite(logits).all() and logits.std() > 0.1


def test_cli_writes_once_and_prints_the_path(tmp_path: Path, monkeypatch, capsys) -> None:
    monkeypatch.setenv("ORCA_CACHE_DIR", str(tmp_path / "cache"))
    assert main(["qwen3-0.6b", "--tiny"]) == 0
    path = Path(capsys.readouterr().out.strip())
    assert path == tmp_path / "cache" / "bench-gguf" / "qwen3-0.6b-tiny-Q4_K_M.gguf" and path.is_file()
    mtime = path.stat().st_mtime_ns
    assert main(["qwen3-0.6b", "--tiny"]) == 0 and path.stat().st_mtime_ns == mtime  # reused


def test_iq4_xs_mix_falls_back_to_iq4_nl_and_loads_packed(tmp_path: Path, monkeypatch) -> None:
    """llama.cpp's IQ4_XS mix: IQ4_NL for rows that are not whole super-blocks (Gemma 3 1B's 1152
    columns), a Q6_K head (Q8_0 where 1152 wide); a file in it loads with every matrix packed."""
    from models.loader import load_model, resolve_model

    types = {name: t for name, _, t in tensors(SHAPES["gemma-3-1b"], "IQ4_XS")}
    assert types["blk.0.attn_q.weight"] == types["blk.0.ffn_up.weight"] == "IQ4_NL"  # 1152 columns
    assert (
        types["blk.0.ffn_down.weight"] == "IQ4_XS" and types["token_embd.weight"] == "Q8_0"
    )  # 6912; tied head
    monkeypatch.setenv("ORCA_CACHE_DIR", str(tmp_path / "cache"))
    shape = replace(tiny(SHAPES["gemma-3-1b"]), hidden=288)  # 288 columns: IQ4_NL, as 1152 are
    path = write_gguf(shape, tmp_path / "gemma.gguf", name="gemma-3-1b", mix="IQ4_XS")
    model = load_model(resolve_model(str(path)), torch.float32, "cpu")
    formats = {f for m in model.modules() if getattr(m, "packed", None) is not None for f in m.packed.formats}
    assert formats == {"IQ4_NL", "IQ4_XS", "Q8_0"} and model.native_decode is not None
    logits = single_seq_logits(model, [1, 5, 400, 2000, 3000])
    assert torch.isfinite(logits).all() and logits.std() > 0.1


def test_low_bit_mixes_follow_llama_cpp() -> None:
    """llama.cpp's Q3_K_M and Q2_K mixes (llama_tensor_get_type): more bits for attn_v, ffn_down and
    attn_output, a Q6_K head, and Q4_0 for rows that are not whole super-blocks."""
    q3 = {name: t for name, _, t in tensors(SHAPES["llama-3.2-1b"], "Q3_K_M")}  # 16 layers, tied
    assert (
        q3["token_embd.weight"] == "Q6_K" and q3["blk.5.attn_q.weight"] == q3["blk.5.ffn_up.weight"] == "Q3_K"
    )
    assert q3["blk.1.attn_v.weight"] == "Q5_K" and q3["blk.2.attn_v.weight"] == "Q4_K"
    assert q3["blk.0.ffn_down.weight"] == "Q5_K" and q3["blk.1.ffn_down.weight"] == "Q4_K"
    assert q3["blk.9.attn_output.weight"] == "Q4_K"
    phi = {name: t for name, _, t in tensors(SHAPES["phi-4-mini"], "Q3_K_M")}
    assert phi["blk.3.attn_qkv.weight"] == "Q4_K"
    q2 = {name: t for name, _, t in tensors(SHAPES["llama-3.2-1b"], "Q2_K")}  # 32 heads on 8 KV heads
    assert (
        q2["blk.5.attn_q.weight"] == q2["blk.5.ffn_gate.weight"] == "Q2_K"
        and q2["blk.5.attn_v.weight"] == "Q4_K"
    )
    assert q2["blk.5.ffn_down.weight"] == q2["blk.5.attn_output.weight"] == "Q3_K"
    gemma = {name: t for name, _, t in tensors(SHAPES["gemma-3-1b"], "Q3_K_M")}  # 1152 columns
    assert gemma["blk.0.attn_q.weight"] == "Q4_0" and gemma["blk.0.ffn_down.weight"] == "Q5_K"


@pytest.mark.parametrize("mix", ["Q3_K_M", "Q2_K"])
def test_low_bit_files_load_packed_at_their_size(mix: str, tmp_path: Path, monkeypatch) -> None:
    """A file in a low-bit mix loads with every matrix packed in its own type, in about the file's
    bytes (2- and 3-bit codes in planes of their own bits, not a nibble each)."""
    from models.loader import load_model, resolve_model

    monkeypatch.setenv("ORCA_CACHE_DIR", str(tmp_path / "cache"))
    shape = replace(tiny(SHAPES["llama-3.2-1b"]), hidden=512, ff=1024)
    path = write_gguf(shape, tmp_path / f"llama-{mix}.gguf", name="llama-3.2-1b", mix=mix)
    model = load_model(resolve_model(str(path)), torch.float32, "cpu")
    packed = [m.packed for m in model.modules() if getattr(m, "packed", None) is not None]
    formats = {f for p in packed for f in p.formats}
    assert formats == {t for _, _, t in tensors(shape, mix) if t != "F32"} and model.native_decode is not None
    from gguf import GGUFReader

    file_bytes = sum(int(t.n_bytes) for t in GGUFReader(path).tensors if t.tensor_type.name != "F32")
    held = sum(p.nbytes for p in {id(p): p for p in packed}.values())
    assert held < 1.08 * file_bytes  # 1.02x and 1.06x; with a nibble per 2- or 3-bit code 1.11x and 1.32x
    logits = single_seq_logits(model, [1, 5, 400, 2000, 3000])
    assert torch.isfinite(logits).all() and logits.std() > 0.1
