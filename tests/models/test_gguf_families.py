"""Qwen3, Qwen3-MoE and Phi-3 GGUF files in the common quantization mixes, through our converter, loader and
engine: transformers' weights and greedy tokens on float32 activations (the native kernels running
every K-quant and IQ4_XS weight at its file's size), the config completed from the metadata where
transformers' GGUF reader leaves it out (Qwen3's head_dim, Qwen3-MoE's expert width, Phi-4-mini's partial
rotary and LongRoPE), a mixture of experts' 3-D expert stacks packed one weight per expert,
generation stopped by every end-of-turn id, BOS only where the file asks for it, and bad files
failing with one clear error before anything is cached."""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pytest
import torch
from builders import CHATML_TEMPLATE, GGUF_MIXES, cpu_engine_config, single_seq_logits, write_tiny_gguf
from kernel_marks import needs_native_kernels

from engine.contract import SamplingParams, ScheduledSequence
from engine.executor import LocalExecutor
from engine.model_runner import read_eos_token_ids
from models.errors import ModelLoadError
from models.layers.packed_weight import FORMATS
from models.loader import load_config, load_model, load_tokenizer, resolve_model
from models.weight_packing import packable_layers

# Phi-3's chat tokens, as its files list them (control tokens after the vocabulary).
PHI3_TOKENS = ("<|end|>", "<|user|>", "<|assistant|>")
END, ASSISTANT = 261, 263  # their ids: 3 specials, 256 bytes, 2 merges, then these
SIZES = {
    # transformers' qwen3 reader ignores attention.key_length and takes Qwen3Config's head_dim, 128:
    # files it reads right have that head_dim (every published Qwen3 does).
    "qwen3": dict(hidden=256, heads=2, kv_heads=1, head_dim=128, ff=512),
    "phi3": dict(hidden=256, heads=4, kv_heads=2, ff=512, extra_tokens=PHI3_TOKENS, eos=0, eot=END),
    # 8 experts of 256 (expert_feed_forward_length; transformers' reader leaves Qwen3MoeConfig's 768),
    # 2 per token.
    "qwen3moe": dict(hidden=256, heads=2, kv_heads=1, head_dim=128, ff=512, experts=8, expert_ff=256),
    # 8 experts of 256 and a shared expert of 512 (both widths left at Qwen2MoeConfig's defaults by
    # transformers' reader), q/k/v biases.
    "qwen2moe": dict(hidden=256, heads=2, kv_heads=1, ff=512, experts=8, expert_ff=256, shared_ff=512),
    # Mixtral as llama.cpp writes it: the llama architecture, q/k rows permuted, experts of
    # feed_forward_length (no expert_feed_forward_length).
    # OLMoE as llama.cpp writes it: MHA, q/k norms over the whole projections, experts of
    # expert_feed_forward_length.
    "olmoe": dict(hidden=256, heads=4, kv_heads=4, ff=512, experts=8, expert_ff=256),
    "mixtral": dict(arch="llama", hidden=256, heads=4, kv_heads=2, ff=256, experts=8),
}
PROMPT = [1, 70, 80, 90, 100, 7, 8, 200, 2, 3, 44]


@pytest.fixture
def cache(tmp_path: Path, monkeypatch) -> Path:
    root = tmp_path / "cache"
    monkeypatch.setenv("ORCA_CACHE_DIR", str(root))
    return root


def write(tmp_path: Path, arch: str, mix: str, name: str | None = None, **overrides) -> Path:
    path = tmp_path / (name or f"{arch}-{mix}.gguf")
    kwargs = {"arch": arch, **SIZES[arch], **overrides}
    write_tiny_gguf(path, seed=4, layers=2, types=GGUF_MIXES[mix], tied=False, **kwargs)
    return path


def transformers_model(gguf: Path, config=None):
    from transformers import AutoModelForCausalLM

    extra = {"config": config} if config is not None else {}
    return AutoModelForCausalLM.from_pretrained(
        gguf.parent, gguf_file=gguf.name, dtype=torch.float32, **extra
    ).eval()


def tolerance(expect: torch.Tensor) -> float:
    """float32 logits in another summation order (torch's matmuls change theirs with the thread
    count) differ by ~1e-6 of their scale per element: 1e-5 of it, or 1e-4 if that is more."""
    return max(1e-4, 1e-5 * float(expect.abs().max()))


def transformers_greedy(hf, prompt: list[int], n: int) -> list[int]:
    """Greedy tokens by full forwards (no generate: its EOS handling is not what is compared)."""
    seq = list(prompt)
    with torch.no_grad():
        for _ in range(n):
            seq.append(int(hf(torch.tensor([seq])).logits[0, -1].argmax()))
    return seq[len(prompt) :]


def assert_same_as(hf, model, gguf: Path) -> None:
    """Our model's logits of PROMPT are transformers' (float32 summation order aside), and the
    engine's greedy tokens from the file are its."""
    with torch.no_grad():
        expect = hf(torch.tensor([PROMPT])).logits[0]
    torch.testing.assert_close(single_seq_logits(model, PROMPT), expect, atol=tolerance(expect), rtol=1e-4)
    assert engine_greedy(gguf, PROMPT, 12) == transformers_greedy(hf, PROMPT, 12)


def engine_greedy(source: Path, prompt: list[int], n: int) -> list[int]:
    """Greedy tokens through the engine (the server's runner): the prompt, then one decode step per
    token (the fused native decode call where it applies), float32 activations."""
    runner = LocalExecutor(
        cpu_engine_config(source, block_size=4, num_kv_blocks=64, weight_packing="float32")
    )
    table, params, out = list(range(16)), SamplingParams(temperature=0.0), []
    while len(out) < n:
        tokens, start = (prompt, 0) if not out else ([out[-1]], len(prompt) + len(out) - 1)
        [res] = runner.step([ScheduledSequence("r", tokens, start, table, True, params, prompt, out)])
        out.append(res.token_id)
    return out


@needs_native_kernels
@pytest.mark.parametrize(
    ("arch", "mix"), [("qwen3", "Q4_K_M"), ("qwen3", "Q2_K"), ("phi3", "Q3_K_M"), ("phi3", "IQ4_XS")]
)
def test_gguf_matches_transformers(tmp_path: Path, cache: Path, arch: str, mix: str) -> None:
    gguf = write(tmp_path, arch, mix)
    path = resolve_model(str(gguf))
    model = load_model(path, torch.float32, "cpu", weight_packing="float32")
    # Every linear weight packed from the file's blocks, in the file's formats, and the decode
    # steps' layers (q/k norms and all) in one native call.
    formats = {
        f for layer in packable_layers(model) if layer.packed is not None for f in layer.packed.formats
    }
    assert formats == {t for t in GGUF_MIXES[mix].values() if t in FORMATS}
    assert all(layer.packed is not None for layer in packable_layers(model))
    assert model.native_decode is not None
    hf = transformers_model(gguf)
    with torch.no_grad():
        expect = hf(torch.tensor([PROMPT])).logits[0]
    torch.testing.assert_close(single_seq_logits(model, PROMPT), expect, atol=tolerance(expect), rtol=1e-4)
    assert engine_greedy(gguf, PROMPT, 12) == transformers_greedy(hf, PROMPT, 12)


def test_qwen3_head_dim_comes_from_the_file(tmp_path: Path, cache: Path) -> None:
    """attention.key_length (64 here, where Qwen3Config's default is 128) sizes the heads."""
    gguf = write(tmp_path, "qwen3", "Q4_K_M", heads=4, kv_heads=2, head_dim=64)
    path = resolve_model(str(gguf))
    config = load_config(path)
    assert config.head_dim == 64 and config.architectures == ["Qwen3ForCausalLM"]
    model = load_model(path, torch.float32, "cpu", weight_packing="float32")
    hf = transformers_model(gguf, config)  # transformers given the completed config
    with torch.no_grad():
        expect = hf(torch.tensor([PROMPT])).logits[0]
    torch.testing.assert_close(single_seq_logits(model, PROMPT), expect, atol=tolerance(expect), rtol=1e-4)


@needs_native_kernels
@pytest.mark.parametrize("mix", ["Q4_K_M", "Q3_K_M"])
def test_qwen3_moe_gguf_stays_packed_and_matches_transformers(tmp_path: Path, cache: Path, mix: str) -> None:
    """Every expert of the file's 3-D stacks (ffn_gate_exps, ffn_up_exps, ffn_down_exps) packed from
    its own blocks, in the file's formats: the weights in memory within the kernels' storage of
    those formats of the file's size, and transformers' logits and greedy tokens on float32
    activations (transformers given the config completed from the metadata: its reader leaves the
    experts' width at Qwen3MoeConfig's default)."""
    from models.layers.moe import SparseMoE
    from models.weight_packing import describe_cpu_setup, weight_memory_bytes

    gguf = write(tmp_path, "qwen3moe", mix)
    path = resolve_model(str(gguf))
    config = load_config(path)
    assert config.architectures == ["Qwen3MoeForCausalLM"]
    assert (config.num_experts, config.num_experts_per_tok, config.moe_intermediate_size) == (8, 2, 256)
    assert config.norm_topk_prob and config.head_dim == 128
    model = load_model(path, torch.float32, "cpu", weight_packing="float32")
    moe = [layer.mlp for layer in model.model.layers]
    assert all(isinstance(m, SparseMoE) and len(m.experts) == 8 for m in moe)
    experts = [linear for m in moe for e in m.experts for linear in (e.gate_up_proj, e.down_proj)]
    assert all(linear.packed is not None and linear.weight is None for linear in experts)
    assert {f for linear in experts for f in linear.packed.formats} == {
        GGUF_MIXES[mix]["ffn_gate"],
        GGUF_MIXES[mix]["ffn_down"],
    }
    assert all(layer.packed is not None for layer in packable_layers(model))
    # The kernels keep 4-bit formats at ~4.6 bits and 5- and 6-bit ones in 8-bit codes (8.6 bits).
    file_bytes = gguf.stat().st_size
    assert weight_memory_bytes(model) < 1.6 * file_bytes
    assert f"the {file_bytes / 1e6:.1f} MB weight file" in describe_cpu_setup(model)
    hf = transformers_model(gguf, config)
    assert_same_as(hf, model, gguf)


def moe_from_file(gguf: Path, config, permuted: bool):
    """transformers' model for `config` with the file's weights as llama.cpp's converter wrote them
    back: gguf-py's dequantized values, q/k rows un-permuted where `permuted` (a llama file: with
    transformers' own LlamaTensorProcessor), each layer's gate and up stacks side by side in
    gate_up_proj. transformers' GGUF loader cannot read these files (it takes a llama file with
    experts for a dense Llama, and has no olmoe reader), so this is the reference."""
    from gguf import GGUFReader, quants
    from transformers import AutoModelForCausalLM
    from transformers.modeling_gguf_pytorch_utils import LlamaTensorProcessor

    def value(t) -> torch.Tensor:
        shape = tuple(reversed([int(d) for d in t.shape]))
        return torch.from_numpy(np.array(quants.dequantize(t.data, t.tensor_type), np.float32).reshape(shape))

    file = {t.name: value(t) for t in GGUFReader(gguf).tensors}
    heads, kv = config.num_attention_heads, config.num_key_value_heads
    unpermute = LlamaTensorProcessor()._reverse_permute_weights if permuted else lambda w, *_: w
    state = {
        "model.embed_tokens.weight": file["token_embd.weight"],
        "model.norm.weight": file["output_norm.weight"],
        "lm_head.weight": file["output.weight"],
    }
    for i in range(config.num_hidden_layers):
        blk, layer = f"blk.{i}.", f"model.layers.{i}."
        state |= {
            layer + "input_layernorm.weight": file[blk + "attn_norm.weight"],
            layer + "post_attention_layernorm.weight": file[blk + "ffn_norm.weight"],
            layer + "self_attn.q_proj.weight": unpermute(file[blk + "attn_q.weight"].numpy(), heads, heads),
            layer + "self_attn.k_proj.weight": unpermute(file[blk + "attn_k.weight"].numpy(), heads, kv),
            layer + "self_attn.v_proj.weight": file[blk + "attn_v.weight"],
            layer + "self_attn.o_proj.weight": file[blk + "attn_output.weight"],
            layer + "mlp.gate.weight": file[blk + "ffn_gate_inp.weight"],
            layer + "mlp.experts.gate_up_proj": torch.cat(
                [file[blk + "ffn_gate_exps.weight"], file[blk + "ffn_up_exps.weight"]], dim=1
            ),
            layer + "mlp.experts.down_proj": file[blk + "ffn_down_exps.weight"],
        }
        if blk + "attn_q_norm.weight" in file:
            state[layer + "self_attn.q_norm.weight"] = file[blk + "attn_q_norm.weight"]
            state[layer + "self_attn.k_norm.weight"] = file[blk + "attn_k_norm.weight"]
    hf = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    hf.load_state_dict({k: torch.as_tensor(v) for k, v in state.items()}, strict=True)
    return hf.eval()


@needs_native_kernels
def test_qwen2_moe_gguf_shared_expert(tmp_path: Path, cache: Path) -> None:
    """The shared expert's tensors (ffn_*_shexp) packed, its gate read from a vector, the widths from
    the metadata; transformers' logits and greedy tokens."""
    gguf = write(tmp_path, "qwen2moe", "Q4_K_M")
    path = resolve_model(str(gguf))
    config = load_config(path)
    assert config.architectures == ["Qwen2MoeForCausalLM"]
    assert (config.moe_intermediate_size, config.shared_expert_intermediate_size) == (256, 512)
    model = load_model(path, torch.float32, "cpu", weight_packing="float32")
    moe = model.model.layers[1].mlp
    assert moe.shared_expert.gate_up_proj.packed is not None and moe.shared_expert_gate.weight.shape == (
        1,
        256,
    )
    assert all(layer.packed is not None for layer in packable_layers(model))
    hf = transformers_model(gguf, config)
    assert_same_as(hf, model, gguf)


@needs_native_kernels
def test_a_llama_file_with_experts_is_a_mixtral(tmp_path: Path, cache: Path) -> None:
    """llama.cpp writes Mixtral under the llama architecture: the expert_count makes it one (the llama
    family's declaration), its experts are packed per expert, and it matches transformers' Mixtral
    holding the file's weights."""
    from models.layers.moe import SparseMoE

    gguf = write(tmp_path, "mixtral", "Q4_K_M")
    path = resolve_model(str(gguf))
    config = load_config(path)
    assert config.architectures == ["MixtralForCausalLM"]
    assert (config.num_local_experts, config.num_experts_per_tok, config.intermediate_size) == (8, 2, 256)
    model = load_model(path, torch.float32, "cpu", weight_packing="float32")
    assert all(isinstance(layer.mlp, SparseMoE) for layer in model.model.layers)
    assert all(layer.packed is not None for layer in packable_layers(model))
    hf = moe_from_file(gguf, config, permuted=True)
    assert_same_as(hf, model, gguf)
    # A llama file without experts stays a Llama.
    dense = resolve_model(str(write(tmp_path, "mixtral", "Q4_K_M", name="dense.gguf", experts=0)))
    assert load_config(dense).architectures == ["LlamaForCausalLM"]


@needs_native_kernels
def test_olmoe_gguf_which_transformers_does_not_read(tmp_path: Path, cache: Path) -> None:
    """An `olmoe` file: the config from its metadata (the family's, as llama.cpp reads it), the
    tokenizer from its tokenizer metadata, experts packed per expert, q/k norms over the whole
    projections; transformers' OLMoE holding the file's weights gives the same logits and greedy
    tokens. The clipping bound is read (30: above these activations; clipping that bites is held to
    transformers in test_models.py, where a clipped model's logits move with the summation order
    more than this file's tolerance allows)."""
    gguf = write(tmp_path, "olmoe", "Q4_K_M", metadata={"attention.clamp_kqv": 30.0})
    path = resolve_model(str(gguf))
    config = load_config(path)
    assert config.architectures == ["OlmoeForCausalLM"] and not config.tie_word_embeddings
    assert (config.num_experts, config.num_experts_per_tok, config.intermediate_size) == (8, 2, 256)
    assert config.clip_qkv == 30.0 and config.norm_topk_prob is False
    tok = load_tokenizer(path)
    assert tok.chat_template == CHATML_TEMPLATE and tok("the")["input_ids"] == [86, 260]
    assert read_eos_token_ids(path, config) == {0, 2}
    model = load_model(path, torch.float32, "cpu", weight_packing="float32")
    assert all(layer.packed is not None for layer in packable_layers(model))
    hf = moe_from_file(gguf, config, permuted=False)
    assert_same_as(hf, model, gguf)


@pytest.mark.parametrize(
    ("key", "value", "named"),
    [
        ("expert_gating_func", 2, "scoring_func='sigmoid'"),
        ("expert_shared_count", 1, "n_shared_experts=1"),
        ("expert_weights_scale", 2.5, "routed_scaling_factor=2.5"),
    ],
)
def test_qwen3_moe_gguf_routing_this_server_does_not_run(
    tmp_path: Path, cache: Path, key: str, value: float, named: str
) -> None:
    source = write(tmp_path, "qwen3moe", "Q4_K_M", metadata={key: value})
    with pytest.raises(ModelLoadError, match=re.escape(named)):
        load_model(resolve_model(str(source)), torch.float32, "cpu")


def test_experts_stored_one_tensor_each_are_refused_naming_the_layout(tmp_path: Path, cache: Path) -> None:
    """Mixtral files from llama.cpp before its expert stacks held one tensor per expert
    (blk.N.ffn_gate.E.weight): not read here, and said so before anything is cached."""
    import gguf as gguf_py

    real = gguf_py.GGUFWriter.add_tensor

    def per_expert(self, name, tensor, *args, **kwargs):
        return real(self, name.replace("_exps.weight", ".0.weight"), tensor, *args, **kwargs)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(gguf_py.GGUFWriter, "add_tensor", per_expert)
        source = write(tmp_path, "mixtral", "Q4_K_M")
    _expect_error(
        source,
        cache,
        "unsupported expert tensor layout: 8 experts",
        "blk.N.ffn_gate_exps.weight",
        "blk.0.ffn_gate.0.weight",
    )


def test_qwen3_moe_gguf_expert_count_that_disagrees_with_its_stacks(tmp_path: Path, cache: Path) -> None:
    """A file whose expert_count says 4 where its router and stacks hold 8 experts fails naming the
    first tensor that disagrees."""
    import gguf as gguf_py

    real = gguf_py.GGUFWriter.add_expert_count
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(gguf_py.GGUFWriter, "add_expert_count", lambda self, n: real(self, 4))
        source = write(tmp_path, "qwen3moe", "Q4_K_M")
    with pytest.raises(
        ModelLoadError, match=re.escape("mlp.gate.weight' has shape (8, 256), expected (4, 256)")
    ):
        load_model(resolve_model(str(source)), torch.float32, "cpu")


def test_phi4_mini_rotary_and_longrope_come_from_the_file(tmp_path: Path, cache: Path) -> None:
    """As llama.cpp writes Phi-4-mini: rope.dimension_count (32 of 64 head dims turn), the original
    context and attention factor as metadata, the LongRoPE factors as tensors; Phi-4's window 0."""
    longrope = {
        "original": 32,
        "short": [1.0 + 0.05 * i for i in range(16)],
        "long": [1.5 + 0.4 * i for i in range(16)],
        "attn_factor": 1.19,
    }
    gguf = write(tmp_path, "phi3", "Q4_K_M", rotary_dim=32, longrope=longrope, context=256, sliding_window=0)
    path = resolve_model(str(gguf))
    config = load_config(path)
    rope = config.rope_parameters
    assert rope["rope_type"] == "longrope" and rope["partial_rotary_factor"] == 0.5
    assert rope["original_max_position_embeddings"] == 32 and config.max_position_embeddings == 256
    np.testing.assert_allclose(rope["short_factor"], longrope["short"], rtol=1e-6)
    np.testing.assert_allclose(rope["long_factor"], longrope["long"], rtol=1e-6)
    assert rope["attention_factor"] == pytest.approx(1.19) and config.sliding_window is None
    model = load_model(path, torch.float32, "cpu", weight_packing="float32")
    assert model.model.layers[0].self_attn.rotary.rotary_dim == 32
    hf = transformers_model(gguf, config)
    with torch.no_grad():
        expect = hf(torch.tensor([PROMPT])).logits[0]
    torch.testing.assert_close(single_seq_logits(model, PROMPT), expect, atol=tolerance(expect), rtol=1e-4)
    # Greedy within the original context (transformers switches the whole sequence past it).
    assert engine_greedy(gguf, PROMPT, 12) == transformers_greedy(hf, PROMPT, 12)
    # Phi-3-mini-4k's window is in force (the context capped at it until sliding windows land).
    mini = write(tmp_path, "phi3", "Q4_K_M", name="phi3-mini.gguf", context=4096, sliding_window=2047)
    assert load_config(resolve_model(str(mini))).sliding_window == 2047


def test_end_of_turn_ids_bos_and_chat_template(tmp_path: Path, cache: Path) -> None:
    # qwen3: eos <|im_end|> (2); <|endoftext|> (0) ends a turn too.
    qwen3 = resolve_model(str(write(tmp_path, "qwen3", "Q4_K_M")))
    assert read_eos_token_ids(qwen3, load_config(qwen3)) == {0, 2}
    # phi3: eos <|endoftext|>, eot <|end|>, and <|im_end|> is in the vocabulary: each one stops.
    template = "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}<|end|>{% endfor %}<|assistant|>"
    phi3 = resolve_model(str(write(tmp_path, "phi3", "Q4_K_M", chat_template=template)))
    generation = json.loads((phi3 / "generation_config.json").read_text())
    assert generation["eos_token_id"] == [0, 2, END]
    assert read_eos_token_ids(phi3, load_config(phi3)) == {0, 2, END}
    tok = load_tokenizer(phi3)
    assert tok.chat_template == template
    rendered = tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False)
    assert rendered == "<|user|>hi<|end|><|assistant|>"
    assert tok.convert_tokens_to_ids(["<|end|>", "<|assistant|>"]) == [END, ASSISTANT]
    # BOS (id 1) only where tokenizer.ggml.add_bos_token says so.
    assert tok("the")["input_ids"] == [86, 260]
    qwen3_tok = load_tokenizer(qwen3)
    assert qwen3_tok.chat_template == CHATML_TEMPLATE and qwen3_tok("the")["input_ids"] == [86, 260]
    with_bos = resolve_model(str(write(tmp_path, "qwen3", "Q4_K_M", name="bos.gguf", add_bos=True)))
    assert load_tokenizer(with_bos)("the")["input_ids"] == [1, 86, 260]


def _expect_error(source: Path, cache: Path, *fragments: str) -> None:
    with pytest.raises(ModelLoadError) as info:
        resolve_model(str(source))
    for fragment in fragments:
        assert fragment in str(info.value), str(info.value)
    # Nothing half-written is left for a later start to find.
    models = cache / "models"
    assert not models.exists() or list(models.iterdir()) == []


def test_unsupported_architectures(tmp_path: Path, cache: Path) -> None:
    # One transformers reads (as a class no family here serves), and one it does not read at all.
    falcon = tmp_path / "falcon.gguf"
    write_tiny_gguf(falcon, arch="falcon")
    _expect_error(falcon, cache, "falcon.gguf", "'falcon'", "FalconForCausalLM", "qwen3", "Phi3ForCausalLM")
    rwkv = tmp_path / "rwkv.gguf"
    write_tiny_gguf(rwkv, arch="rwkv7")
    _expect_error(
        rwkv, cache, "rwkv.gguf", "unsupported GGUF architecture 'rwkv7'", "llama, qwen2, qwen3, phi3"
    )


def test_a_ggml_type_nothing_reads(tmp_path: Path, cache: Path, monkeypatch) -> None:
    """A tensor in a type neither the kernels nor gguf-py's dequantizer read (Q8_1: an activation
    format) is named, with what is supported."""
    import builders

    real = builders.gguf_blocks

    def q8_1_ffn_down(values, qtype_name, rng):
        if qtype_name != "Q8_1":
            return real(values, qtype_name, rng)
        from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

        rows, cols = values.shape
        block, size = GGML_QUANT_SIZES[GGMLQuantizationType.Q8_1]
        return rng.integers(0, 256, (rows, cols // block * size), dtype=np.uint8)

    monkeypatch.setattr(builders, "gguf_blocks", q8_1_ffn_down)
    gguf = tmp_path / "q8_1.gguf"
    write_tiny_gguf(gguf, arch="qwen3", head_dim=128, hidden=256, heads=2, ff=512, types={"ffn_down": "Q8_1"})
    _expect_error(
        gguf, cache, "'blk.0.ffn_down.weight'", "ggml type Q8_1", "IQ4_NL, F16, BF16 on the native kernels"
    )


def test_truncated_files(tmp_path: Path, cache: Path) -> None:
    whole = write(tmp_path, "qwen3", "Q4_K_M").read_bytes()
    cut = tmp_path / "cut.gguf"
    # In the header, the metadata (the vocabulary), the tensor table, and the tensor data.
    for size in (12, 300, 7000, len(whole) // 2, len(whole) - 1):
        cut.write_bytes(whole[:size])
        _expect_error(cut, cache, "cut.gguf", "truncated or corrupt GGUF file")


def test_llama3_rope_freqs_come_from_the_file(tmp_path: Path, cache: Path) -> None:
    """A Llama 3.1-style file: its llama3 rope scaling as the per-frequency divisors llama.cpp
    writes (rope_freqs), which transformers' GGUF reader drops. Our model turns with them, and so
    matches transformers' Llama run with the llama3 parameters the divisors came from."""
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    rope = {
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 16,
    }
    llama3 = LlamaConfig(
        hidden_size=256,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        rope_scaling={"rope_type": "llama3", "rope_theta": 10000.0, **rope},
    )
    scaled, _ = ROPE_INIT_FUNCTIONS["llama3"](llama3, "cpu")
    plain = 1.0 / (10000.0 ** (torch.arange(0, 64, 2, dtype=torch.int64).float() / 64))
    divisors = (plain / scaled).tolist()  # what llama.cpp's converter writes: up to 8 per frequency
    assert max(divisors) == pytest.approx(8.0) and min(divisors) < 2.0
    gguf = tmp_path / "llama31.gguf"
    write_tiny_gguf(gguf, seed=4, hidden=256, ff=512, heads=4, kv_heads=2, layers=2, rope_freqs=divisors)
    path = resolve_model(str(gguf))
    assert load_config(path).rope_parameters["rope_type"] == "longrope"
    model = load_model(path, torch.float32, "cpu")
    reference = transformers_model(gguf)  # transformers' reading: no rope scaling at all
    original = reference.config.to_dict()
    original.pop("quantization_config", None)  # transformers' GGUF marker; it sets its own again
    original["rope_parameters"] = {"rope_type": "llama3", "rope_theta": 10000.0, **rope}
    hf = transformers_model(gguf, type(reference.config).from_dict(original))
    with torch.no_grad():
        expect = hf(torch.tensor([PROMPT])).logits[0]
        unscaled = reference(torch.tensor([PROMPT])).logits[0]
    ours = single_seq_logits(model, PROMPT)
    torch.testing.assert_close(ours, expect, atol=tolerance(expect), rtol=1e-4)
    assert (ours - unscaled).abs().max() > 1e-2  # the scaling matters at these positions
