"""`python -m loadtest.gguf_shapes SHAPE [--mix Q4_K_M|Q3_K_M|Q2_K|IQ4_XS]`: a GGUF file at a published
model's shape, with random weights in llama.cpp's Q4_K_M mix (or its Q3_K_M, Q2_K or IQ4_XS mix: `MIXES`),
for comparing servers on it without the checkpoint:

    make bench-peers GGUF=$(python -m loadtest.gguf_shapes qwen3-0.6b)

What a decode step costs depends on a model's shapes and its tensors' types, not on their values, so
orca-serve and llama-server measured on such a file run what they would on the real one. The file
is what llama.cpp's converter and `llama-quantize ... Q4_K_M` write for the model: its metadata
(Qwen3's head_dim, Phi-4-mini's partial rotary, LongRoPE keys and factor tensors), its tensors under
their GGUF names and its Q4_K_M types (Q6_K for the output (or the tied embedding) and for attn_v and
ffn_down in the layers llama.cpp's use_more_bits picks, Q5_K for a fused attn_qkv, Q4_K elsewhere,
norms F32). The weights are random K-quant blocks (random codes and sub-scales, small super-block
scales) written by models/gguf/encode.py. The tokenizer is the default model's byte-level BPE
vocabulary (SmolLM2's 49152 tokens and merges, so prompts tokenize as real text), padded with unused
tokens to the shape's vocabulary size (the embedding and LM head keep their real cost) and given the
model's chat tokens; the LongRoPE factors are synthetic.

Shapes are data (gguf_shapes.json, read into `SHAPES`: one `GGUFShape` each) and tensor layouts one
function per GGUF architecture (`LAYER_TENSORS`), so a family's shape is one entry in each. Files go to
$ORCA_CACHE_DIR/bench-gguf/ (written atomically; an existing file is reused) unless --out says where.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:  # torch is imported only when weights are written
    from models.layers.packed_weight import BlockComponents, BlockFormat

CHATML_TEMPLATE = (
    "{%- for m in messages %}{{- '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' }}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
PHI_TEMPLATE = (
    "{%- for m in messages %}{{- '<|' + m.role + '|>' + m.content + '<|end|>' }}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|assistant|>' }}{%- endif %}"
)
GEMMA_TEMPLATE = (
    "{{ bos_token }}{%- for m in messages %}{{- '<start_of_turn>' + ('model' if m.role == 'assistant' else "
    "'user') + '\n' + m.content + '<end_of_turn>\n' }}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<start_of_turn>model\n' }}{%- endif %}"
)
LLAMA3_TEMPLATE = (
    "{{- bos_token }}{%- for m in messages %}{{- '<|start_header_id|>' + m.role + '<|end_header_id|>\n\n' "
    "+ m.content + '<|eot_id|>' }}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{%- endif %}"
)
MOSTLY_Q4_K_M = 15  # general.file_type (llama.cpp's LLAMA_FTYPE_MOSTLY_Q4_K_M)
ROWS_PER_CHUNK = 4096  # rows of a tensor encoded at a time (bounds the codes' memory)


@dataclass(frozen=True)
class GGUFShape:
    """A model's shape as its GGUF file states it."""

    arch: str  # general.architecture (a key of LAYER_TENSORS)
    hidden: int
    ff: int
    layers: int
    heads: int
    kv_heads: int
    vocab: int
    context: int
    head_dim: int | None = None  # written as attention.key_length where it is not hidden / heads
    rotary_dim: int | None = None  # rope.dimension_count (default: the head)
    rope_theta: float = 10000.0
    rms_eps: float = 1e-6
    tied: bool = True
    chat_template: str = CHATML_TEMPLATE
    chat_tokens: tuple[str, ...] = ()  # control tokens added after the base vocabulary
    eos: str = "<|im_end|>"
    eot: str | None = None
    longrope_original: int | None = None  # LongRoPE: the original context; factors are synthetic
    base_vocab: int | None = None  # only the base vocabulary's first tokens (toy shapes: fast to convert)
    # "bpe": the default model's byte-level BPE (tokenizer model gpt2); "spm": the same pieces as a
    # SentencePiece vocabulary with scores and byte fallback (tokenizer model llama: Gemma's kind, the
    # one transformers' GGUF reader expects of a gemma3 file).
    tokenizer: str = "bpe"
    metadata: dict[str, Any] = field(default_factory=dict)  # more "<arch>.<key>" values
    # A mixture of experts (qwen3moe, olmoe): `experts` of `expert_ff` each, `experts_used` per token.
    experts: int = 0
    experts_used: int = 0
    expert_ff: int = 0

    @property
    def d(self) -> int:
        return self.head_dim or self.hidden // self.heads


# The published shapes are data (gguf_shapes.json: one object of GGUFShape's fields each, with a
# "source" saying which config the numbers come from); a template is named there, its text is here.
SHAPES_FILE = Path(__file__).with_name("gguf_shapes.json")
CHAT_TEMPLATES = {
    "chatml": CHATML_TEMPLATE,
    "phi": PHI_TEMPLATE,
    "gemma": GEMMA_TEMPLATE,
    "llama3": LLAMA3_TEMPLATE,
}


def load_shapes(path: Path = SHAPES_FILE) -> dict[str, GGUFShape]:
    """The shapes in `path`, by name, in the file's order (JSON's lists become the dataclass's tuples)."""
    shapes: dict[str, GGUFShape] = {}
    for name, entry in json.loads(path.read_text(encoding="utf-8")).items():
        fields = {k: v for k, v in entry.items() if k != "source"}  # the source is for readers only
        fields["chat_template"] = CHAT_TEMPLATES[fields.get("chat_template", "chatml")]
        fields["chat_tokens"] = tuple(fields.get("chat_tokens", ()))
        shapes[name] = GGUFShape(**fields)
    return shapes


SHAPES: dict[str, GGUFShape] = load_shapes()

# One layer's tensors: (name, shape in HF orientation: (rows, cols) for a linear, (experts, rows, cols)
# for an expert stack, (size,) for a norm).
Tensors = list[tuple[str, tuple[int, ...]]]


def _attention(s: GGUFShape, i: int, fused: bool) -> Tensors:
    q, kv = s.heads * s.d, s.kv_heads * s.d
    if fused:
        qkv: Tensors = [(f"blk.{i}.attn_qkv.weight", (q + 2 * kv, s.hidden))]
    else:
        qkv = [(f"blk.{i}.attn_{n}.weight", (rows, s.hidden)) for n, rows in (("q", q), ("k", kv), ("v", kv))]
    return [(f"blk.{i}.attn_norm.weight", (s.hidden,)), *qkv, (f"blk.{i}.attn_output.weight", (s.hidden, q))]


def _mlp(s: GGUFShape, i: int, fused: bool) -> Tensors:
    up: Tensors = (
        [(f"blk.{i}.ffn_up.weight", (2 * s.ff, s.hidden))]  # gate | up
        if fused
        else [(f"blk.{i}.ffn_gate.weight", (s.ff, s.hidden)), (f"blk.{i}.ffn_up.weight", (s.ff, s.hidden))]
    )
    return [(f"blk.{i}.ffn_norm.weight", (s.hidden,)), *up, (f"blk.{i}.ffn_down.weight", (s.hidden, s.ff))]


def _llama_layer(s: GGUFShape, i: int) -> Tensors:
    return [*_attention(s, i, fused=False), *_mlp(s, i, fused=False)]


def _qwen3_layer(s: GGUFShape, i: int) -> Tensors:
    norms = [(f"blk.{i}.attn_q_norm.weight", (s.d,)), (f"blk.{i}.attn_k_norm.weight", (s.d,))]
    return [*_attention(s, i, fused=False), *norms, *_mlp(s, i, fused=False)]


def _experts(s: GGUFShape, i: int) -> Tensors:
    """The router (F32 in llama.cpp's mixes) and the 3-D expert stacks."""
    e, ff = s.experts, s.expert_ff
    return [
        (f"blk.{i}.ffn_norm.weight", (s.hidden,)),
        (f"blk.{i}.ffn_gate_inp.weight", (e, s.hidden)),
        (f"blk.{i}.ffn_gate_exps.weight", (e, ff, s.hidden)),
        (f"blk.{i}.ffn_up_exps.weight", (e, ff, s.hidden)),
        (f"blk.{i}.ffn_down_exps.weight", (e, s.hidden, ff)),
    ]


def _qwen3moe_layer(s: GGUFShape, i: int) -> Tensors:
    """Qwen3's attention (per-head q/k norms) and experts."""
    norms = [(f"blk.{i}.attn_q_norm.weight", (s.d,)), (f"blk.{i}.attn_k_norm.weight", (s.d,))]
    return [*_attention(s, i, fused=False), *norms, *_experts(s, i)]


def _olmoe_layer(s: GGUFShape, i: int) -> Tensors:
    """Llama's attention with q/k norms over the whole projections, and experts."""
    norms = [
        (f"blk.{i}.attn_q_norm.weight", (s.heads * s.d,)),
        (f"blk.{i}.attn_k_norm.weight", (s.kv_heads * s.d,)),
    ]
    return [*_attention(s, i, fused=False), *norms, *_experts(s, i)]


def _phi3_layer(s: GGUFShape, i: int) -> Tensors:
    return [*_attention(s, i, fused=True), *_mlp(s, i, fused=True)]


def _gemma3_layer(s: GGUFShape, i: int) -> Tensors:
    """Llama's tensors plus q/k norms and the sandwich norms around attention and the MLP."""
    norms = [(f"blk.{i}.attn_q_norm.weight", (s.d,)), (f"blk.{i}.attn_k_norm.weight", (s.d,))]
    sandwich = [
        (f"blk.{i}.post_attention_norm.weight", (s.hidden,)),
        (f"blk.{i}.post_ffw_norm.weight", (s.hidden,)),
    ]
    return [*_attention(s, i, fused=False), *norms, *_mlp(s, i, fused=False), *sandwich]


LAYER_TENSORS: dict[str, Callable[[GGUFShape, int], Tensors]] = {
    "llama": _llama_layer,
    "qwen3": _qwen3_layer,
    "qwen3moe": _qwen3moe_layer,
    "olmoe": _olmoe_layer,
    "phi3": _phi3_layer,
    "gemma3": _gemma3_layer,
}


def use_more_bits(layer: int, layers: int) -> bool:
    """llama.cpp's choice of the layers whose attn_v and ffn_down get more bits in the _M mixes."""
    return layer < layers // 8 or layer >= 7 * layers // 8 or (layer - layers // 8) % 3 == 2


# llama.cpp's fallback for a tensor whose rows are not whole 256-weight super-blocks (Gemma 3 1B's 1152
# columns): the legacy type of about the same size.
K_QUANT_FALLBACK = {"Q2_K": "Q4_0", "Q3_K": "Q4_0", "Q4_K": "Q5_0", "Q5_K": "Q5_1", "Q6_K": "Q8_0"}


def q4_k_m_type(name: str, dims: tuple[int, ...], shape: GGUFShape) -> str:
    """The type llama.cpp's Q4_K_M gives a tensor (llama_tensor_get_type, for these architectures)."""
    if len(dims) == 1 or ".ffn_gate_inp." in name:  # norms; the router llama.cpp never quantizes
        return "F32"
    chosen = _q4_k_m_choice(name, shape)
    return chosen if dims[-1] % 256 == 0 else K_QUANT_FALLBACK[chosen]


def iq4_xs_type(name: str, dims: tuple[int, ...], shape: GGUFShape) -> str:
    """The type llama.cpp's IQ4_XS mix gives a tensor, simplified (its attn_v stays IQ4_XS): the output
    head (a tied embedding) Q6_K, every other matrix IQ4_XS, and IQ4_NL for rows that are not whole
    256-weight super-blocks (Gemma 3 1B's 1152 columns)."""
    if len(dims) == 1 or ".ffn_gate_inp." in name:
        return "F32"
    if name == "output.weight" or (shape.tied and name == "token_embd.weight"):
        return "Q6_K" if dims[-1] % 256 == 0 else "Q8_0"
    return "IQ4_XS" if dims[-1] % 256 == 0 else "IQ4_NL"


def _low_bit_choice(name: str, shape: GGUFShape, mix: str) -> str:
    """llama.cpp's Q3_K_M and Q2_K choices (llama_tensor_get_type, for these architectures without 8
    experts): the output Q6_K; attn_v Q5_K in the first two layers then Q4_K (Q3_K_M), or Q4_K where 4
    or more query heads share a KV head, else Q3_K (Q2_K); ffn_down Q5_K in the first 1/16 of the layers
    then Q4_K (Q3_K_M), or Q3_K (Q2_K); attn_output and a fused attn_qkv Q4_K (Q3_K_M), attn_output Q3_K
    (Q2_K); every other matrix the mix's own type."""
    if name == "output.weight" or (shape.tied and name == "token_embd.weight"):
        return "Q6_K"
    layer = int(name.split(".")[1]) if name.startswith("blk.") else 0
    if mix == "Q3_K_M":
        if ".attn_v." in name:
            return "Q5_K" if layer < 2 else "Q4_K"
        if ".ffn_down." in name or ".ffn_down_exps." in name:
            return "Q5_K" if layer < shape.layers // 16 else "Q4_K"
        return "Q4_K" if ".attn_output." in name or ".attn_qkv." in name else "Q3_K"
    if ".attn_v." in name:
        return "Q4_K" if shape.heads // shape.kv_heads >= 4 else "Q3_K"
    return "Q3_K" if ".ffn_down." in name or ".ffn_down_exps." in name or ".attn_output." in name else "Q2_K"


def low_bit_type(mix: str) -> Callable[[str, tuple[int, ...], GGUFShape], str]:
    """The type llama.cpp's Q3_K_M or Q2_K mix gives a tensor; rows that are not whole super-blocks fall
    back as llama.cpp's do (Q2_K, Q3_K: Q4_0)."""

    def choose(name: str, dims: tuple[int, ...], shape: GGUFShape) -> str:
        if len(dims) == 1 or ".ffn_gate_inp." in name:
            return "F32"
        chosen = _low_bit_choice(name, shape, mix)
        return chosen if dims[-1] % 256 == 0 else K_QUANT_FALLBACK[chosen]

    return choose


# The mixes a file can be written in: llama.cpp's names, and the type each gives a tensor.
MIXES = {
    "Q4_K_M": q4_k_m_type,
    "Q3_K_M": low_bit_type("Q3_K_M"),
    "Q2_K": low_bit_type("Q2_K"),
    "IQ4_XS": iq4_xs_type,
}


def _q4_k_m_choice(name: str, shape: GGUFShape) -> str:
    if name == "output.weight" or (shape.tied and name == "token_embd.weight"):
        return "Q6_K"
    if ".attn_qkv." in name:
        return "Q5_K"
    if ".attn_v." in name or ".ffn_down." in name or ".ffn_down_exps." in name:
        return "Q6_K" if use_more_bits(int(name.split(".")[1]), shape.layers) else "Q4_K"
    return "Q4_K"


def tensors(shape: GGUFShape, mix: str = "Q4_K_M") -> list[tuple[str, tuple[int, ...], str]]:
    """Every tensor of the file, in its order: (name, HF-orientation shape, ggml type in `mix`)."""
    names: Tensors = [("token_embd.weight", (shape.vocab, shape.hidden))]
    if not shape.tied:
        names.append(("output.weight", (shape.vocab, shape.hidden)))
    names.append(("output_norm.weight", (shape.hidden,)))
    if shape.longrope_original:
        half = (shape.rotary_dim or shape.d) // 2
        names += [("rope_factors_long.weight", (half,)), ("rope_factors_short.weight", (half,))]
    for i in range(shape.layers):
        names += LAYER_TENSORS[shape.arch](shape, i)
    return [(name, dims, MIXES[mix](name, dims, shape)) for name, dims in names]


# ---------------------------------------------------------------------------------- the tokenizer


@dataclass
class Vocabulary:
    tokens: list[str]
    types: list[int]  # 1 normal, 2 unknown, 3 control, 5 unused, 6 byte (llama.cpp's token types)
    merges: list[str]  # BPE's; none for a SentencePiece vocabulary
    pre: str
    scores: list[float] | None = None  # SentencePiece's

    def id_of(self, token: str) -> int:
        return self.tokens.index(token)


SPM_SPECIALS = ("<pad>", "<eos>", "<bos>", "<unk>")


def spm_vocabulary(shape: GGUFShape) -> Vocabulary:
    """The default model's pieces as a SentencePiece vocabulary (Gemma's layout): the specials, the
    shape's chat tokens, 256 byte-fallback tokens, then each piece with "▁" for a space, scored by its
    rank; unused tokens up to the shape's size."""
    from tokenizers.decoders import ByteLevel

    bpe = default_vocabulary(shape.base_vocab)
    as_text = ByteLevel()

    tokens = [*SPM_SPECIALS, *shape.chat_tokens, *(f"<0x{b:02X}>" for b in range(256))]
    types = [3] * len(SPM_SPECIALS) + [3] * len(shape.chat_tokens) + [6] * 256
    types[SPM_SPECIALS.index("<unk>")] = 2
    seen = set(tokens)
    for token, kind in zip(bpe.tokens, bpe.types, strict=True):
        piece = as_text.decode([token]).replace(" ", "▁")
        if kind != 1 or not piece or "\ufffd" in piece or piece in seen:
            continue  # control tokens, and pieces of a multi-byte character (byte fallback spells them)
        seen.add(piece)
        tokens.append(piece)
        types.append(1)
    scores = [0.0 if kind != 1 else -float(i) for i, kind in enumerate(types)]
    pad = shape.vocab - len(tokens)
    tokens += [f"<unused{i}>" for i in range(pad)]
    types += [1] * pad  # plain text, as vocabulary() says why
    scores += [-1e9] * pad
    return Vocabulary(tokens, types, [], "default", scores)


def vocabulary(shape: GGUFShape) -> Vocabulary:
    """The default model's vocabulary and merges, the shape's chat tokens, unused tokens up to its size."""
    if shape.tokenizer == "spm":
        return spm_vocabulary(shape)
    base = default_vocabulary(shape.base_vocab)
    tokens, types = base.tokens, base.types
    for token in shape.chat_tokens:
        if token not in tokens:
            tokens.append(token)
            types.append(3)
    if len(tokens) > shape.vocab:
        raise ValueError(
            f"the shape's vocabulary ({shape.vocab}) is smaller than the base one ({len(tokens)})"
        )
    pad = shape.vocab - len(tokens)
    # Padding tokens are plain text, not llama.cpp's "unused" type: a random-weight model samples them
    # often, and a server streams an unused token as no text (a client then sees a reply without tokens).
    tokens += [f"<|unused_{i}|>" for i in range(pad)]
    types += [1] * pad
    return Vocabulary(tokens, types, base.merges, base.pre)


def default_vocabulary(first: int | None = None) -> Vocabulary:
    """The default model's byte-level BPE vocabulary (its first `first` tokens and the merges among
    them, still a BPE, where given: toy shapes convert fast)."""
    from gguf import GGUFReader

    from models.options import default_gguf_path  # torch-free: the package's file only

    fields = GGUFReader(default_gguf_path()).fields
    tokens = list(fields["tokenizer.ggml.tokens"].contents())
    types = [int(t) for t in fields["tokenizer.ggml.token_type"].contents()]
    merges = list(fields["tokenizer.ggml.merges"].contents())
    pre = fields["tokenizer.ggml.pre"].contents()
    if first is not None:
        tokens, types = tokens[:first], types[:first]
        kept = set(tokens)
        merges = [m for m in merges if set(m.split(" ")) <= kept and m.replace(" ", "") in kept]
    return Vocabulary(tokens, types, merges, pre)


# ------------------------------------------------------------------------------------- the weights


def random_blocks(ggml_type: str, rows: int, cols: int, rng: np.random.Generator) -> np.ndarray:
    """uint8 [rows, row bytes]: random codes and sub-scales with small super-block scales (weights of
    about 0.02, so activations stay finite through the layers), packed as the type's blocks."""
    from models.gguf.encode import ENCODABLE, encode
    from models.layers.packed_weight import FORMATS

    if ggml_type in ("IQ4_XS", "IQ4_NL"):  # gguf-py does not quantize these: random indices and scales
        from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

        block, size = GGML_QUANT_SIZES[GGMLQuantizationType[ggml_type]]
        raw = rng.integers(0, 256, (rows, cols // block, size), dtype=np.uint8)
        # d (the first 2 bytes): IQ4_XS's sub-scales reach 32 and its codebook 127, IQ4_NL's only the codebook
        top = 1e-5 if ggml_type == "IQ4_XS" else 2e-4
        d = (rng.random((rows, cols // block)) * top + top / 20).astype(np.float16)
        raw[..., 0:2] = d.view(np.uint8).reshape(rows, cols // block, 2)
        return raw.reshape(rows, -1)
    if ggml_type not in ENCODABLE:  # a legacy fallback type: gguf-py quantizes those
        from gguf import GGMLQuantizationType, quants

        values = (rng.standard_normal((rows, cols)) * 0.02).astype(np.float32)
        return quants.quantize(values, GGMLQuantizationType[ggml_type])
    out = []
    for start in range(0, rows, ROWS_PER_CHUNK):
        n = min(ROWS_PER_CHUNK, rows - start)
        out.append(encode(ggml_type, _random_k_quant(FORMATS[ggml_type], n, cols, rng)))
    return np.concatenate(out)


def _random_k_quant(fmt: BlockFormat, n: int, cols: int, rng: np.random.Generator) -> BlockComponents:
    """Random codes and sub-scales of a K-quant for n rows, with small super-block scales (and, for the
    types with minimums, minimums that centre the weights near 0)."""
    import torch

    from models.layers.packed_weight import CODE_RANGE, BlockComponents

    lo, hi = CODE_RANGE[fmt.name]
    codes = torch.from_numpy(rng.integers(lo, hi + 1, (n, cols), dtype=np.int16).astype(np.uint8))
    d = (rng.random((n, cols // 256)) * 2e-4 + 1e-5).astype(np.float16)
    subs = cols // fmt.sub_group
    top = {"Q6_K": 64, "Q3_K": 32, "Q2_K": 16}.get(fmt.name, 64)  # the sub-scales' bound (6, 6, 4 bits)
    if not fmt.has_min:  # Q6_K, Q3_K: signed sub-scales, codes centred by the format's offset
        sc = rng.integers(-top, top, (n, subs), dtype=np.int8)
        return BlockComponents(fmt, codes, torch.from_numpy(d), None, torch.from_numpy(sc))
    sc = rng.integers(top // 4, top, (n, subs), dtype=np.uint8)
    m = rng.integers(0, top, (n, subs), dtype=np.uint8)
    dmin = (d.astype(np.float32) * (hi / 2) * 0.6).astype(np.float16)  # centres the weights near 0
    return BlockComponents(
        fmt, codes, torch.from_numpy(d), torch.from_numpy(dmin), torch.from_numpy(sc), torch.from_numpy(m)
    )


def rope_factors(shape: GGUFShape, long: bool) -> np.ndarray:
    """Synthetic LongRoPE factors: 1 for the short set, a ramp up to 64 for the long one."""
    half = (shape.rotary_dim or shape.d) // 2
    if not long:
        return np.ones(half, dtype=np.float32)
    return np.linspace(1.0, 64.0, half, dtype=np.float32)


def tensor_data(
    name: str, dims: tuple[int, ...], ggml_type: str, shape: GGUFShape, rng: np.random.Generator
) -> np.ndarray:
    if name.startswith("rope_factors_"):
        return rope_factors(shape, long="long" in name)
    if len(dims) == 1:
        return (1.0 + 0.05 * rng.standard_normal(dims[0])).astype(np.float32)
    if ggml_type == "F32":  # the router: logits of about 1, so every expert gets picked
        return (rng.standard_normal(dims) / np.sqrt(dims[-1])).astype(np.float32)
    rows = int(np.prod(dims[:-1]))  # an expert stack's experts one after another
    return random_blocks(ggml_type, rows, dims[-1], rng).reshape(*dims[:-1], -1)


# --------------------------------------------------------------------------------------- the file


def _metadata(w: Any, shape: GGUFShape, vocab: Vocabulary, name: str) -> None:
    from models.gguf.encode import add_arch_metadata, add_decoder_hparams

    w.add_name(name)
    w.add_file_type(MOSTLY_Q4_K_M)
    s = shape
    add_decoder_hparams(
        w, s.layers, s.context, s.hidden, s.ff, s.heads, s.kv_heads, s.rope_theta, s.rms_eps,
        vocab=s.vocab, rotary_dim=s.rotary_dim or s.d, head_dim=s.head_dim,
        experts=s.experts, experts_used=s.experts_used, expert_ff=s.expert_ff,
    )  # fmt: skip
    if shape.longrope_original:
        scale = shape.context / shape.longrope_original
        w.add_rope_scaling_orig_ctx_len(shape.longrope_original)
        w.add_rope_scaling_attn_factors(float(np.sqrt(1 + np.log(scale) / np.log(shape.longrope_original))))
    add_arch_metadata(w, shape.arch, shape.metadata)
    w.add_tokenizer_pre(vocab.pre)
    w.add_token_list(vocab.tokens)
    w.add_token_types(vocab.types)
    if vocab.scores is not None:  # SentencePiece (Gemma): BOS first in every prompt
        w.add_tokenizer_model("llama")
        w.add_token_scores(vocab.scores)
        w.add_bos_token_id(vocab.id_of("<bos>"))
        w.add_unk_token_id(vocab.id_of("<unk>"))
        w.add_pad_token_id(vocab.id_of("<pad>"))
        w.add_add_bos_token(True)
    else:
        w.add_tokenizer_model("gpt2")
        w.add_token_merges(vocab.merges)
        w.add_bos_token_id(vocab.id_of("<|endoftext|>") if "<|endoftext|>" in vocab.tokens else 0)
        w.add_pad_token_id(vocab.id_of("<|endoftext|>") if "<|endoftext|>" in vocab.tokens else 0)
        w.add_add_bos_token(False)
    w.add_eos_token_id(vocab.id_of(shape.eos))
    if shape.eot is not None:
        w.add_eot_token_id(vocab.id_of(shape.eot))
    w.add_chat_template(shape.chat_template)


def write_gguf(shape: GGUFShape, path: Path, name: str = "bench", seed: int = 0, mix: str = "Q4_K_M") -> Path:
    """The file, written to a temporary name and renamed into place (a crash leaves no half file)."""
    import gguf

    vocab = vocabulary(shape)
    plan = tensors(shape, mix)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    os.close(fd)
    try:
        w = gguf.GGUFWriter(tmp, shape.arch)
        _metadata(w, shape, vocab, name)
        for tensor_name, dims, ggml_type in plan:
            if ggml_type == "F32":
                w.add_tensor_info(tensor_name, dims, np.dtype(np.float32), 4 * int(np.prod(dims)))
            else:
                qtype = gguf.GGMLQuantizationType[ggml_type]
                block, size = gguf.GGML_QUANT_SIZES[qtype]
                row_bytes = dims[-1] // block * size
                rows = int(np.prod(dims[:-1]))
                w.add_tensor_info(
                    tensor_name, (*dims[:-1], row_bytes), np.dtype(np.uint8), rows * row_bytes, qtype
                )
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_ti_data_to_file()
        rng = np.random.default_rng(seed)
        for tensor_name, dims, ggml_type in plan:
            w.write_tensor_data(tensor_data(tensor_name, dims, ggml_type, shape, rng))
        w.close()
        os.chmod(tmp, 0o644)  # mkstemp's 0600 would keep the file from another user's server
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return path


def tiny(shape: GGUFShape) -> GGUFShape:
    """The shape's family, GQA ratio, head layout and tokenizer at toy sizes (2 layers, heads of 64,
    every matrix a whole number of 256-weight super-blocks), to check the whole path in seconds:
    tests, and a dry run of the benchmark."""
    heads = 4 * (shape.heads // shape.kv_heads)
    d = 64
    rotary = None if shape.rotary_dim is None else d * shape.rotary_dim // shape.d
    return replace(
        shape,
        # A head_dim the file states is free of hidden / heads; otherwise it is that quotient.
        hidden=256 if shape.head_dim is not None else heads * d,
        ff=512,
        layers=2,
        heads=heads,
        kv_heads=4,
        head_dim=d if shape.head_dim is not None else None,
        rotary_dim=rotary,
        context=min(shape.context, 4096),
        vocab=4096 + len(shape.chat_tokens),
        base_vocab=4096,
        longrope_original=None if shape.longrope_original is None else 1024,
        # 8 experts of 256, as many per token as the shape takes up to 4.
        experts=min(shape.experts, 8),
        experts_used=min(shape.experts_used, 4),
        expert_ff=256 if shape.experts else 0,
    )


def default_path(name: str, is_tiny: bool, mix: str = "Q4_K_M") -> Path:
    from models.options import cache_root

    return cache_root() / "bench-gguf" / f"{name}{'-tiny' if is_tiny else ''}-{mix}.gguf"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m loadtest.gguf_shapes",
        description="Write a random-weight GGUF at a published model's shape in one of llama.cpp's mixes "
        "(Q4_K_M by default); print its path.",
    )
    parser.add_argument("shape", choices=sorted(SHAPES))
    parser.add_argument("--mix", choices=sorted(MIXES), default="Q4_K_M", help="llama.cpp's quantization mix")
    parser.add_argument("--out", type=Path, default=None, help="the file (default: in the orca-serve cache)")
    parser.add_argument("--tiny", action="store_true", help="the shape's layout at toy sizes (a dry run)")
    parser.add_argument("--force", action="store_true", help="write it again even if the file exists")
    a = parser.parse_args(argv)
    shape = tiny(SHAPES[a.shape]) if a.tiny else SHAPES[a.shape]
    path = a.out or default_path(a.shape, a.tiny, a.mix)
    if a.force or not path.is_file():
        print(f"writing {path} ...", file=sys.stderr)
        write_gguf(shape, path, name=a.shape, mix=a.mix)
    print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
