"""Loader: HF directories (single file and sharded), GGUF conversion and its cache, and one clear
ModelLoadError, naming the file, for every way a model source can be broken."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from builders import (
    build_hf_model,
    default_gguf_path,
    single_seq_logits,
    tiny_gpt2_config,
    tiny_llama_config,
    write_tiny_gguf,
)
from safetensors.torch import load_file, save_file

from models.gguf import convert as gguf_convert
from models.loader import (
    ModelLoadError,
    load_config,
    load_model,
    load_tokenizer,
    max_model_len,
    resolve_model,
)
from models.registry import SUPPORTED_ARCHITECTURES

SMALL_VOCAB = 512


def _hf_dir(tmp_path: Path, config, **save_kwargs) -> Path:
    out = tmp_path / "model"
    build_hf_model(config).save_pretrained(out, safe_serialization=True, **save_kwargs)
    return out


def _assert_same_weights(model, hf) -> None:
    ours = dict(model.named_parameters())
    for name, p in hf.state_dict().items():
        if name.endswith("q_proj.weight"):
            q = ours[name.replace("q_proj", "qkv_proj")][: p.shape[0]]
            torch.testing.assert_close(q, p, atol=0, rtol=0)
        elif name.endswith("down_proj.weight") or name == "model.norm.weight":
            torch.testing.assert_close(ours[name], p, atol=0, rtol=0)


# ---------------------------------------------------------------------------------- round trips


@pytest.mark.parametrize("fixture", ["tiny_llama_dir", "tiny_gpt2_dir"])
def test_hf_dir_round_trip(fixture: str, request) -> None:
    from transformers import AutoModelForCausalLM

    path = request.getfixturevalue(fixture)
    assert resolve_model(str(path)) == path
    model = load_model(path, torch.float32, torch.device("cpu"))
    assert not model.training
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    tokens = [5, 17, 300, 2, 9, 41, 8]
    with torch.no_grad():
        expected = hf(torch.tensor([tokens])).logits[0]
    torch.testing.assert_close(single_seq_logits(model, tokens), expected, atol=1e-4, rtol=0)


def test_sharded_hf_dir(tmp_path: Path) -> None:
    config = tiny_llama_config(vocab_size=SMALL_VOCAB, tie_word_embeddings=False)
    path = _hf_dir(tmp_path, config, max_shard_size="50KB")
    assert (path / "model.safetensors.index.json").exists()
    assert len(list(path.glob("*.safetensors"))) > 2
    model = load_model(resolve_model(str(path)), torch.float32, "cpu")
    _assert_same_weights(model, build_hf_model(config))


def test_load_in_bfloat16(tiny_llama_dir: Path) -> None:
    model = load_model(tiny_llama_dir, torch.bfloat16, "cpu")
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    assert single_seq_logits(model, [1, 2, 3]).dtype == torch.float32


def test_tokenizer_keeps_chat_template(tiny_llama_dir: Path) -> None:
    tok = load_tokenizer(tiny_llama_dir)
    assert tok.chat_template
    out = tok.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=True)
    ids = out["input_ids"] if isinstance(out, dict) or hasattr(out, "keys") else out
    assert len(ids) > 3


def test_max_model_len() -> None:
    from transformers import MistralConfig, Qwen2Config

    assert max_model_len(tiny_llama_config(max_position_embeddings=777)) == 777
    assert max_model_len(tiny_gpt2_config(n_positions=333)) == 333
    # A sliding window no longer caps the context: windowed layers attend to their last keys.
    mistral = MistralConfig(
        max_position_embeddings=32768, sliding_window=4096, architectures=["MistralForCausalLM"]
    )
    assert max_model_len(mistral) == 32768
    qwen2_windowed = Qwen2Config(
        max_position_embeddings=32768,
        sliding_window=4096,
        use_sliding_window=True,
        architectures=["Qwen2ForCausalLM"],
    )
    assert max_model_len(qwen2_windowed) == 32768


def test_layer_windows() -> None:
    from transformers import MistralConfig, Qwen2Config

    from models.registry import family_for

    def windows(config):
        return family_for(config).layer_windows(config)

    assert windows(tiny_llama_config(num_hidden_layers=3)) == (None, None, None)
    mistral = MistralConfig(num_hidden_layers=2, sliding_window=16, architectures=["MistralForCausalLM"])
    assert windows(mistral) == (16, 16)
    assert windows(
        MistralConfig(num_hidden_layers=2, sliding_window=None, architectures=["MistralForCausalLM"])
    ) == (None, None)
    # Qwen2: only with use_sliding_window, and only from max_window_layers on (transformers' layer_types).
    qwen2 = dict(
        num_hidden_layers=3, sliding_window=16, max_window_layers=1, architectures=["Qwen2ForCausalLM"]
    )
    assert windows(Qwen2Config(**qwen2)) == (None, None, None)
    assert windows(Qwen2Config(**qwen2, use_sliding_window=True)) == (None, 16, 16)

    # The window every layer shares, whose blocks behind it the scheduler gives back: Mistral's only.
    def shared(config):
        return family_for(config).shared_window(config)

    assert shared(mistral) == 16
    assert shared(Qwen2Config(**qwen2, use_sliding_window=True)) is None
    assert shared(Qwen2Config(**{**qwen2, "max_window_layers": 0}, use_sliding_window=True)) == 16
    assert shared(tiny_llama_config(num_hidden_layers=3)) is None


# --------------------------------------------------------------------------------------- errors


def _expect_error(source, *fragments: str) -> ModelLoadError:
    with pytest.raises(ModelLoadError) as info:
        load_model(resolve_model(str(source)), torch.float32, "cpu")
    for fragment in fragments:
        assert fragment in str(info.value), str(info.value)
    return info.value


def test_missing_path(tmp_path: Path) -> None:
    _expect_error(tmp_path / "nope", "nope", "no such file")


def test_dir_without_config(tmp_path: Path) -> None:
    _expect_error(tmp_path, str(tmp_path), "config.json")


def test_dir_without_safetensors(tmp_path: Path) -> None:
    tiny_llama_config(vocab_size=SMALL_VOCAB).save_pretrained(tmp_path)
    _expect_error(tmp_path, str(tmp_path), "safetensors")


def test_unreadable_config(tmp_path: Path) -> None:
    path = _hf_dir(tmp_path, tiny_llama_config(vocab_size=SMALL_VOCAB))
    (path / "config.json").write_text("{not json")
    with pytest.raises(ModelLoadError, match="config.json"):
        load_config(path)


def test_unsupported_architecture(tmp_path: Path) -> None:
    path = _hf_dir(tmp_path, tiny_llama_config(vocab_size=SMALL_VOCAB))
    config = json.loads((path / "config.json").read_text())
    config["architectures"] = ["FalconForCausalLM"]
    (path / "config.json").write_text(json.dumps(config))
    err = _expect_error(path, "FalconForCausalLM", "config.json")
    assert all(arch in str(err) for arch in SUPPORTED_ARCHITECTURES)


def test_corrupt_safetensors(tmp_path: Path) -> None:
    path = _hf_dir(tmp_path, tiny_llama_config(vocab_size=SMALL_VOCAB))
    (path / "model.safetensors").write_bytes(b"\x00garbage" * 100)
    _expect_error(path, "model.safetensors", "corrupt")


def test_truncated_safetensors(tmp_path: Path) -> None:
    path = _hf_dir(tmp_path, tiny_llama_config(vocab_size=SMALL_VOCAB))
    data = (path / "model.safetensors").read_bytes()
    (path / "model.safetensors").write_bytes(data[: len(data) // 2])
    _expect_error(path, "model.safetensors", "truncated")


def test_shard_index_naming_missing_file(tmp_path: Path) -> None:
    path = _hf_dir(tmp_path, tiny_llama_config(vocab_size=SMALL_VOCAB), max_shard_size="50KB")
    victim = sorted(path.glob("*.safetensors"))[0]
    victim.unlink()
    _expect_error(path, "model.safetensors.index.json", victim.name)


def test_misshaped_weight(tmp_path: Path) -> None:
    path = _hf_dir(tmp_path, tiny_llama_config(vocab_size=SMALL_VOCAB))
    tensors = load_file(path / "model.safetensors")
    tensors["model.layers.1.self_attn.k_proj.weight"] = torch.zeros(3, 64)
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    _expect_error(path, "model.safetensors", "model.layers.1.self_attn.k_proj.weight", "(3, 64)")


def test_missing_weight(tmp_path: Path) -> None:
    path = _hf_dir(tmp_path, tiny_llama_config(vocab_size=SMALL_VOCAB))
    tensors = load_file(path / "model.safetensors")
    del tensors["model.layers.0.mlp.up_proj.weight"]
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    err = _expect_error(path, str(path), "missing", "model.layers.0.mlp.gate_up_proj.weight[1]")
    assert "model.safetensors" not in str(err)  # the file is fine; the directory lacks a weight


def test_not_a_model_file(tmp_path: Path) -> None:
    f = tmp_path / "weights.bin"
    f.write_bytes(b"1234")
    _expect_error(f, "weights.bin", "HF directory or a .gguf")


def test_corrupt_gguf(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv("ORCA_CACHE_DIR", str(tmp_path / "cache"))
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"PK\x03\x04" + b"\x00" * 64)
    _expect_error(bad, "bad.gguf", "not a GGUF file")
    truncated = tmp_path / "truncated.gguf"
    truncated.write_bytes(b"GGUF" + b"\x03\x00\x00\x00" + b"\xff" * 20)
    _expect_error(truncated, "truncated.gguf", "truncated or corrupt")
    # A failed conversion leaves nothing behind in the cache.
    assert list((tmp_path / "cache" / "models").iterdir()) == []


# ----------------------------------------------------------------------------------- GGUF cache


def test_gguf_converted_once_and_atomically(tmp_path: Path, monkeypatch) -> None:
    """The conversion runs once; a crash midway leaves no directory that a later start would use."""
    monkeypatch.setenv("ORCA_CACHE_DIR", str(tmp_path / "cache"))
    gguf = tmp_path / "tiny.gguf"
    gguf.write_bytes(b"GGUF" + b"\x00" * 64)
    source_dir = _hf_dir(tmp_path, tiny_llama_config(vocab_size=SMALL_VOCAB))
    calls: list[str] = []

    def crash(src: Path, out: Path) -> None:
        calls.append("crash")
        (out / "config.json").write_text("{}")  # a half-written directory
        raise RuntimeError("killed mid-conversion")

    def convert(src: Path, out: Path) -> None:
        calls.append("convert")
        for f in source_dir.iterdir():
            shutil.copy(f, out / f.name)

    monkeypatch.setattr(gguf_convert, "_convert_into", crash)
    with pytest.raises(ModelLoadError, match="tiny.gguf"):
        resolve_model(str(gguf))
    assert list((tmp_path / "cache" / "models").iterdir()) == []

    monkeypatch.setattr(gguf_convert, "_convert_into", convert)
    first = resolve_model(str(gguf))
    second = resolve_model(str(gguf))
    assert (
        first == second and first.parent == tmp_path / "cache" / "models" and first.name.startswith("tiny-")
    )
    assert calls == ["crash", "convert"]
    load_model(second, torch.float32, "cpu")


def test_tiny_gguf_converts_and_matches_transformers(tmp_path: Path, monkeypatch) -> None:
    """A real conversion through transformers' GGUF reader: config, tokenizer, chat template and the
    tensor manifest land in the cache (the weights stay in the GGUF file); the second resolve
    converts nothing."""
    from transformers import AutoModelForCausalLM

    monkeypatch.setenv("ORCA_CACHE_DIR", str(tmp_path / "cache"))
    gguf_file = tmp_path / "tiny-llama.gguf"
    write_tiny_gguf(gguf_file)
    path = resolve_model(str(gguf_file))
    assert {"config.json", "gguf_weights.json", "tokenizer.json"} <= {f.name for f in path.iterdir()}

    def must_not_run(src: Path, out: Path) -> None:
        raise AssertionError("converted again instead of using the cache")

    monkeypatch.setattr(gguf_convert, "_convert_into", must_not_run)
    assert resolve_model(str(gguf_file)) == path

    model = load_model(path, torch.float32, "cpu")
    tok = load_tokenizer(path)
    assert tok.chat_template and tok.eos_token == "<|im_end|>"
    ids = tok("the cat sat")["input_ids"]
    hf = AutoModelForCausalLM.from_pretrained(tmp_path, gguf_file=gguf_file.name, dtype=torch.float32).eval()
    with torch.no_grad():
        expected = hf(torch.tensor([ids])).logits[0]
    torch.testing.assert_close(single_seq_logits(model, ids), expected, atol=1e-4, rtol=0)


@pytest.mark.slow
def test_default_model_converts_and_matches_transformers(tmp_path: Path, monkeypatch) -> None:
    """The real default model: GGUF -> cached HF dir -> our model equals transformers' on a chat prompt."""
    from transformers import AutoModelForCausalLM

    monkeypatch.setenv("ORCA_CACHE_DIR", str(tmp_path / "cache"))
    assert default_gguf_path().is_file()
    path = resolve_model("default")
    assert resolve_model("default") == path  # second start: from the cache
    assert {"config.json", "gguf_weights.json", "tokenizer.json"} <= {f.name for f in path.iterdir()}
    model = load_model(path, torch.float32, "cpu", weight_packing="float32")  # the parity reference
    tok = load_tokenizer(path)
    ids = tok.apply_chat_template([{"role": "user", "content": "What is 2+2?"}], add_generation_prompt=True)
    ids = list(ids["input_ids"] if hasattr(ids, "keys") else ids)
    gguf = default_gguf_path()
    hf = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32).eval()
    with torch.no_grad():
        expected = hf(torch.tensor([ids])).logits[0]
    torch.testing.assert_close(single_seq_logits(model, ids), expected, atol=1e-3, rtol=0)
