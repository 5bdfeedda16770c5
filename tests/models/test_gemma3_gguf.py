"""A Gemma 3 GGUF file, written here as llama.cpp's converter writes one (tensor names, norms stored as
w + 1, a SentencePiece vocabulary with byte fallback, the chat template), read by our converter and
loader and by transformers' GGUF reader: the same weights, the same greedy tokens on float32
activations past the sliding window, a working tokenizer whose <end_of_turn> stops a reply, and the
settings transformers' reader drops taken from the metadata as llama.cpp takes them."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
import torch
from builders import cpu_engine_config, write_tiny_gemma3_gguf
from fakes import greedy_through_loop

from engine.executor import LocalExecutor
from engine.model_runner import read_eos_token_ids
from models.gguf.reader import has_manifest
from models.layers.native_decode import NativeDecodeLayers
from models.layers.rotary import rope_params_from_config
from models.loader import load_config, load_hf_model, load_model, load_tokenizer, resolve_model
from models.weight_packing import packable_layers
from scheduler.config import SchedulerConfig
from server.tokenizer import ServerTokenizer

# Quantized everywhere the native kernels run (Q8_0 embedding, tied head): the model packs.
TYPES = {"token_embd": "Q8_0", "attn": "Q4_0", "ffn_gate": "Q8_0", "ffn_up": "Q8_0", "ffn_down": "Q4_0"}
WINDOW = 8
END_OF_TURN = 6  # builders.GEMMA_SPECIALS


def _convert(path: Path, cache: Path) -> Path:
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("ORCA_CACHE_DIR", str(cache))
        return resolve_model(str(path))


@pytest.fixture(scope="module")
def gemma3_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("gemma3-gguf")
    write_tiny_gemma3_gguf(root / "tiny-gemma3.gguf", window=WINDOW, types=TYPES)
    return _convert(root / "tiny-gemma3.gguf", root / "cache")


def hf_generate(model, prompt: list[int], new_tokens: int) -> list[int]:
    with torch.inference_mode():
        out = model.generate(
            torch.tensor([prompt]),
            attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
            max_new_tokens=new_tokens,
            min_new_tokens=new_tokens,
            do_sample=False,
            pad_token_id=0,
        )
    return out[0, len(prompt) :].tolist()


def test_read_in_place_with_transformers_weights(gemma3_dir: Path) -> None:
    assert has_manifest(gemma3_dir)  # the GGUF's tensors are read from the file, not converted
    ours = load_model(gemma3_dir, torch.float32, "cpu", weight_packing="float32")
    hf = load_hf_model(gemma3_dir)
    layer, hf_layer = ours.model.layers[0], hf.model.layers[0]
    assert layer.self_attn.qkv_proj.packed is not None and isinstance(ours.native_decode, NativeDecodeLayers)
    # Stored as w + 1; transformers subtracts the 1 and adds it back every forward, we once.
    for ours_norm, hf_norm in [
        (layer.input_layernorm, hf_layer.input_layernorm),
        (layer.post_feedforward_layernorm, hf_layer.post_feedforward_layernorm),
        (layer.self_attn.k_norm, hf_layer.self_attn.k_norm),
        (ours.model.norm, hf.model.norm),
    ]:
        assert torch.equal(ours_norm.weight, 1.0 + hf_norm.weight.float())
    assert [x.self_attn.attn.sliding_window for x in ours.model.layers] == [WINDOW] * 5 + [None]


def test_greedy_tokens_equal_transformers_past_the_window(gemma3_dir: Path) -> None:
    """Prompts longer than the window, batched together with a short one, a long one in chunks, and
    generations that run past the window, through the engine (native decode layers, packed weights,
    float32 activations) against transformers' generate on the same file."""
    runner = LocalExecutor(
        cpu_engine_config(gemma3_dir, block_size=4, num_kv_blocks=128, weight_packing="float32")
    )
    hf = load_hf_model(gemma3_dir)
    prompts = [[7 + (i * 37 + 11 * j) % 290 for j in range(n)] for i, n in enumerate((13, 3, 30, 9))]
    sched = SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=16)  # the 30-token prompt: chunked
    got = asyncio.run(greedy_through_loop(runner, prompts, 12, sched))
    assert got == [hf_generate(hf, p, 12) for p in prompts]


# An IQ4_XS file as llama.cpp writes one for Gemma 3: rows that are not whole 256-weight super-blocks
# (64 wide here; Gemma 3 1B's are 1152) fall back to IQ4_NL, the rest (o_proj: 512 wide) stay IQ4_XS.
IQ4_TYPES = {"token_embd": "IQ4_NL", "attn_output": "IQ4_XS", "attn": "IQ4_NL", "ffn": "IQ4_NL"}


def test_iq4_xs_file_with_iq4_nl_rows_stays_packed(tmp_path: Path) -> None:
    """Every linear of such a file packed in the file's two types (none read as float), and greedy
    tokens past the window as transformers' on the same file (float32 activations)."""
    write_tiny_gemma3_gguf(tmp_path / "iq4.gguf", window=WINDOW, types=IQ4_TYPES)
    path = _convert(tmp_path / "iq4.gguf", tmp_path / "cache")
    model = load_model(path, torch.float32, "cpu", weight_packing="float32")
    layers = packable_layers(model)
    assert layers and all(m.packed is not None for m in layers)
    assert {f for m in layers for f in m.packed.formats} == {"IQ4_NL", "IQ4_XS"}
    runner = LocalExecutor(cpu_engine_config(path, block_size=4, num_kv_blocks=64, weight_packing="float32"))
    hf = load_hf_model(path)
    prompts = [[7 + (i * 37 + 11 * j) % 290 for j in range(n)] for i, n in enumerate((13, 4))]
    got = asyncio.run(greedy_through_loop(runner, prompts, 10, SchedulerConfig(max_num_seqs=4)))
    assert got == [hf_generate(hf, p, 10) for p in prompts]


def test_tokenizer_chat_template_and_end_of_turn(gemma3_dir: Path) -> None:
    tok = load_tokenizer(gemma3_dir)
    text = tok.apply_chat_template(
        [{"role": "user", "content": "hi there"}], add_generation_prompt=True, tokenize=False
    )
    assert text == "<bos><start_of_turn>user\nhi there<end_of_turn>\n<start_of_turn>model\n"
    ids = tok(text, add_special_tokens=False)["input_ids"]
    assert ids[:2] == [2, 5] and ids.count(END_OF_TURN) == 1  # special tokens stay whole
    assert tok.decode(tok("the hit", add_special_tokens=False)["input_ids"]) == "the hit"
    assert len(tok) == load_config(gemma3_dir).vocab_size  # no token past the model's vocabulary
    # The server's tokenizer: a completion prompt starts with <bos>, and a streamed reply with bytes
    # split over byte-fallback tokens decodes whole, its <end_of_turn> and <eos> left out.
    server_tok = ServerTokenizer.from_pretrained(str(gemma3_dir))
    reply = server_tok.encode("the hit é ✓ or", add_special_tokens=False)
    assert server_tok.encode("the")[0] == 2 and len(reply) > len("the hit é ✓ or".split())
    stream = server_tok.decode_stream(ids, skip_special_tokens=True)
    assert "".join(stream.step(i) or "" for i in [*reply, END_OF_TURN, 1]) == "the hit é ✓ or"
    # A reply stops at <end_of_turn> (the GGUF's EOS is <eos>), as llama.cpp stops on it.
    assert read_eos_token_ids(gemma3_dir, load_config(gemma3_dir)) == {1, END_OF_TURN}


def test_metadata_transformers_drops(tmp_path: Path) -> None:
    """Gemma 3 4B and up scale the global layers' rotary (linear, factor 8) and 27B scales attention
    by 1/sqrt(hidden / heads): llama.cpp reads both from the file; transformers' GGUF reader neither."""
    scaled = tmp_path / "scaled.gguf"
    write_tiny_gemma3_gguf(
        scaled, head_dim=32, metadata={"rope.scaling.type": "linear", "rope.scaling.factor": 8.0}
    )
    config = load_config(_convert(scaled, tmp_path / "cache"))
    full, local = (
        rope_params_from_config(config, "full_attention"),
        rope_params_from_config(config, "sliding_attention"),
    )
    assert (full.rope_type, full.factor, full.theta) == ("linear", 8.0, 1_000_000.0)
    assert (local.rope_type, local.factor, local.theta) == ("default", 1.0, 10_000.0)
    assert config.query_pre_attn_scalar == 32  # head_dim, not transformers' default of 256

    # The 27B shape (62 layers), its config as transformers reads it from the file: the hook alone.
    from builders import tiny_gemma3_config

    from models.families.gemma3 import gemma3_gguf_config

    class NoMetadata:  # a file that states nothing transformers' reader leaves out
        architecture = "gemma3"

        def arch_value(self, name: str, default: object = None) -> object:
            return default

    big = tiny_gemma3_config(num_hidden_layers=62, hidden_size=64, num_attention_heads=4, head_dim=32)
    assert gemma3_gguf_config(NoMetadata(), big) == {"query_pre_attn_scalar": 64 // 4}
