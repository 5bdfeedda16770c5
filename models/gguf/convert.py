"""GGUF files -> cached HF directories, converted once with transformers' GGUF reader.

For the architectures whose tensors need only renaming (those a family declares in its `GGUFSupport`:
models/registry.py), the directory holds the config, generation config and tokenizer that transformers
derives from the file, plus a manifest mapping every GGUF tensor to its HF name (reader.py); the weights
stay in the GGUF file and are read from it at every load, quantized blocks as they are. Other
architectures are dequantized to float32 safetensors once, as transformers loads them.

transformers' GGUF reader leaves some of what a file states out of the config (Qwen3's head_dim,
Phi-3's partial rotary and LongRoPE factors, the window, Gemma 3's rope scaling and attention scale):
the family's `GGUFSupport.config` reads those from the metadata (metadata.py). Gemma's norms, stored
as w + 1, are read back as w (`GGUFSupport.norm_offset`, kept in the manifest). The generation
config stops on every end-of-turn token the file has (its eos, eot and eom ids and the chat formats'
end-of-turn spellings, as llama.cpp does), not only on `tokenizer.ggml.eos_token_id`. The tokenizer
(vocabulary, merges, BOS only where `tokenizer.ggml.add_bos_token` says so, `tokenizer.chat_template`)
is transformers'. An embedding model's `<arch>.pooling_type` is kept in a small file that
models/pooling.py reads.

A bad file fails before anything is written, with one ModelLoadError: not a GGUF file, truncated or
corrupt, a ggml type nothing here reads, an architecture no family serves.

The result is kept under a key of the file's name, size and mtime (and the cache format). It is
written to a temporary directory and renamed into place, so a crashed conversion is never mistaken
for a finished one.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING

from models.errors import ModelLoadError
from models.options import cache_root

if TYPE_CHECKING:
    from typing import Any

    from models.family import GGUFSupport
    from models.gguf.metadata import GGUFFile

GGUF_MAGIC = b"GGUF"
# 1: every weight dequantized to float32 safetensors; 2: a manifest where possible; 3: configs
# completed from the metadata, every end-of-turn id in the generation config; 4: the pooling type
# (models/pooling.py).
CACHE_FORMAT = 4


def cache_dir_for(gguf: Path) -> Path:
    st = gguf.stat()
    key = hashlib.sha256(f"{st.st_size}:{st.st_mtime_ns}:{CACHE_FORMAT}".encode()).hexdigest()[:12]
    return cache_root() / "models" / f"{gguf.stem}-{key}"


def check_gguf_header(gguf: Path) -> None:
    try:
        with gguf.open("rb") as f:
            magic = f.read(4)
    except OSError as e:
        raise ModelLoadError(f"{gguf}: cannot read ({e.strerror})") from None
    if magic != GGUF_MAGIC:
        raise ModelLoadError(f"{gguf}: not a GGUF file (starts with {magic!r}, expected {GGUF_MAGIC!r})")


def convert_gguf(gguf: Path) -> Path:
    """The HF directory for a GGUF file: from the cache, or converted now and cached."""
    check_gguf_header(gguf)
    target = cache_dir_for(gguf)
    if (target / "config.json").is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=target.parent))
    try:
        _convert_into(gguf, tmp)
        try:
            tmp.rename(target)
        except OSError:
            # Another process finished the same conversion first: keep theirs.
            if not (target / "config.json").is_file():
                raise
    except ModelLoadError:
        raise
    except Exception as e:
        raise ModelLoadError(f"{gguf}: cannot convert GGUF file ({type(e).__name__}: {e})") from None
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return target


def _convert_into(gguf: Path, out: Path) -> None:
    from models.gguf.metadata import GGUFFile
    from models.registry import gguf_support

    meta = GGUFFile(gguf)  # a corrupt file or an unreadable type fails here
    support = gguf_support(meta.architecture)
    config = _read_config(gguf, meta, support)
    if support is not None:
        _write_manifest_dir(gguf, out, meta, config, support)
    else:
        _write_float_dir(gguf, out)
    _write_generation_config(out, config, meta)
    _write_pooling(out, meta)


def _write_pooling(out: Path, meta: GGUFFile) -> None:
    """The file's pooling type, where it has one (embedding models), for models.pooling to read."""
    from models.pooling import POOLING_FILE, gguf_pooling_name

    name = gguf_pooling_name(meta.arch_value("pooling_type"))
    if name is not None:
        (out / POOLING_FILE).write_text(json.dumps({"pooling_type": name}) + "\n")


def _read_config(gguf: Path, meta: GGUFFile, support: GGUFSupport | None) -> Any:
    """transformers' config of the file, completed by the family, naming the HF architecture; a
    ModelLoadError if no family here serves it."""
    from transformers import AutoConfig
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    from models.registry import SUPPORTED_ARCHITECTURES, SUPPORTED_GGUF_ARCHITECTURES, family_for

    supported = (
        f"supported: {', '.join(SUPPORTED_GGUF_ARCHITECTURES)} (read in place), or any that transformers "
        f"reads as one of {', '.join(SUPPORTED_ARCHITECTURES)}"
    )
    try:
        if support is not None and support.metadata_config is not None:
            config = AutoConfig.for_model(**support.metadata_config(meta))
        else:
            config = AutoConfig.from_pretrained(gguf.parent, gguf_file=gguf.name)
    except ValueError as e:  # "GGUF model with architecture ... is not supported yet"
        raise ModelLoadError(
            f"{gguf}: unsupported GGUF architecture {meta.architecture!r} ({e}); {supported}"
        ) from None
    if support is not None and support.config is not None:
        config = type(config).from_dict({**config.to_dict(), **support.config(meta, config)})
    model_type = support.model_type(meta) if support is not None and support.model_type else None
    if model_type is not None and model_type != config.model_type:
        entries = {
            k: v for k, v in config.to_dict().items() if k not in ("model_type", "transformers_version")
        }
        config = AutoConfig.for_model(model_type, **entries)
    architecture = MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(config.model_type)
    config.architectures = [architecture] if architecture else []
    try:
        family_for(config)
    except ModelLoadError:
        raise ModelLoadError(
            f"{gguf}: unsupported GGUF architecture {meta.architecture!r} "
            f"(transformers reads it as {architecture or config.model_type}); {supported}"
        ) from None
    return config


def _write_generation_config(out: Path, config: Any, meta: GGUFFile) -> None:
    """Generation stops on every end-of-turn id of the file (the engine reads them:
    engine/model_runner.py read_eos_token_ids), not only on its eos id."""
    from transformers import GenerationConfig

    generation = GenerationConfig.from_model_config(config)
    ids = meta.end_of_turn_ids()
    if ids:
        generation.eos_token_id = ids if len(ids) > 1 else ids[0]
    generation.save_pretrained(out)


def _write_manifest_dir(gguf: Path, out: Path, meta: GGUFFile, config: Any, support: GGUFSupport) -> None:
    """Config, tokenizer and the tensor manifest: no weights are read."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedTokenizerFast
    from transformers.modeling_gguf_pytorch_utils import (
        TENSOR_PROCESSORS,
        TensorProcessor,
        get_gguf_hf_weights_map,
    )

    from models.gguf.reader import write_manifest
    from models.registry import family_for

    with torch.device("meta"):  # only the parameter names are needed
        hf = AutoModelForCausalLM.from_config(config)
    processor = TENSOR_PROCESSORS.get(meta.architecture, TensorProcessor)(config=config.to_dict())
    # Named as the file's architecture names its tensors (a Mixtral file's are llama's).
    mapping = get_gguf_hf_weights_map(hf, processor, model_type=meta.architecture)
    mapping.update(_block_tensor_names(meta, support, family_for(config).weights.layers))
    # transformers' LlamaTensorProcessor un-permutes q (over the heads) and k (over the KV heads).
    permute: dict[str, int] = {}
    if support.permute_qk:
        heads = config.num_attention_heads
        kv_heads = getattr(config, "num_key_value_heads", None) or heads
        for name in mapping:
            if ".attn_q." in name:
                permute[name] = heads
            elif ".attn_k." in name:
                permute[name] = kv_heads
    # Gemma's norms are stored as w + 1; transformers' tensor processor subtracts the 1 from each.
    offsets = {n: support.norm_offset for n in mapping if support.norm_offset and "norm.weight" in n}
    config.save_pretrained(out)
    # Where transformers does not read the architecture, its tokenizer class for the file is unknown
    # too: the file's tokenizer metadata alone (vocabulary, merges, specials, chat template) makes one.
    tokenizer_class = AutoTokenizer if support.metadata_config is None else PreTrainedTokenizerFast
    tokenizer_class.from_pretrained(gguf.parent, gguf_file=gguf.name).save_pretrained(out)
    write_manifest(gguf, out, mapping, permute, meta.architecture, meta.reader, offsets)


def _block_tensor_names(meta: GGUFFile, support: GGUFSupport, layers: str) -> dict[str, str]:
    """GGUF name -> HF name of the block tensors the family names itself (GGUFSupport.block_tensors).
    A file whose metadata counts experts but holds none of the expert stacks named there stores
    them in a layout not read here (one tensor per expert, llama.cpp's before 2024; a fused gate/up
    stack): a ModelLoadError naming it."""
    names = dict(support.block_tensors)
    out = {}
    for name in meta.tensors:
        block, _, rest = name.partition(".")[2].partition(".")
        if name.startswith("blk.") and block.isdigit() and rest in names:
            out[name] = f"{layers}{block}.{names[rest]}"
    if names and meta.arch_value("expert_count") and not out:
        found = sorted(n for n in meta.tensors if n.startswith("blk.0.ffn"))
        raise ModelLoadError(
            f"{meta.path}: unsupported expert tensor layout: {meta.arch_value('expert_count')} experts "
            f"but none of the stacks {', '.join(f'blk.N.{n}' for n in names)} (block 0 has "
            f"{', '.join(found) or 'no ffn tensors'}); convert it again with a current llama.cpp"
        )
    return out


def _write_float_dir(gguf: Path, out: Path) -> None:
    import torch
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    # transformers marks a GGUF-loaded model as quantized and refuses save_pretrained, although the
    # weights are already dequantized to float32; write config and weights ourselves instead.
    config = model.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    config.architectures = [type(model).__name__]
    config.save_pretrained(out)
    state = model.state_dict()
    if getattr(config, "tie_word_embeddings", False):
        state.pop("lm_head.weight", None)  # the same storage as the embedding; safetensors refuses aliases
    save_file(
        {k: v.contiguous() for k, v in state.items()}, out / "model.safetensors", metadata={"format": "pt"}
    )
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    tokenizer.save_pretrained(out)  # the generation config is written after (_write_generation_config)
