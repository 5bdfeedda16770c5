"""The tokenizer prompts are measured with: a local HF directory, the default model's, or the server's.

Prompt lengths are only exact when counted with the tokenizer the server uses, so the choice is, in
order: `--tokenizer PATH` (or `--tokenizer server`); the served model id (or the path the server says
it loaded it from) when it names a local HF directory; the project's default model through `models.loader.resolve_model("default")`; the server's
`POST /tokenize` (vLLM's shape: {"tokens": [...]}) and `POST /detokenize` endpoints.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Protocol

import httpx

log = logging.getLogger(__name__)

SERVER = "server"  # the --tokenizer value that forces the server's /tokenize endpoint


class PromptTokenizer(Protocol):
    description: str

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]: ...

    def decode(self, ids: Sequence[int]) -> str: ...


class HFTokenizer:
    """A tokenizer from an HF directory (tokenizer.json through `tokenizers`, else transformers)."""

    def __init__(self, path: Path) -> None:
        self.description = str(path)
        self._fast: Any = None
        self._hf: Any = None
        if path.is_dir() and (path / "tokenizer.json").exists():
            # `tokenizers` alone loads in milliseconds; transformers takes seconds to import.
            from tokenizers import Tokenizer

            self._fast = Tokenizer.from_file(str(path / "tokenizer.json"))
        else:
            from transformers import AutoTokenizer

            if path.suffix == ".gguf":
                self._hf = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
            else:
                self._hf = AutoTokenizer.from_pretrained(path)

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        if self._fast is not None:
            return list(self._fast.encode(text, add_special_tokens=add_special_tokens).ids)
        return list(self._hf.encode(text, add_special_tokens=add_special_tokens))

    def decode(self, ids: Sequence[int]) -> str:
        if self._fast is not None:
            return self._fast.decode(list(ids), skip_special_tokens=False)
        return self._hf.decode(list(ids), skip_special_tokens=False)


class EndpointTokenizer:
    """The server's own tokenizer over HTTP (synchronous: used while building prompts, before a run)."""

    def __init__(self, base_url: str, model: str, headers: dict[str, str] | None = None) -> None:
        self.description = f"{base_url}/tokenize"
        self._model = model
        self._client = httpx.Client(base_url=base_url, headers=headers or {}, timeout=60.0)

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        body = {"model": self._model, "prompt": text, "add_special_tokens": add_special_tokens}
        resp = self._client.post("/tokenize", json=body)
        resp.raise_for_status()
        return [int(t) for t in resp.json()["tokens"]]

    def decode(self, ids: Sequence[int]) -> str:
        resp = self._client.post("/detokenize", json={"model": self._model, "tokens": list(ids)})
        resp.raise_for_status()
        return str(resp.json()["prompt"])

    def close(self) -> None:
        self._client.close()


def _path_of(resolved: object) -> Path | None:
    """The model path out of whatever `resolve_model` returns (a path, or an object holding one)."""
    if isinstance(resolved, str | Path):
        return Path(resolved)
    for attr in ("hf_dir", "tokenizer_dir", "model_dir", "local_dir", "path"):
        value = getattr(resolved, attr, None)
        if isinstance(value, str | Path):
            return Path(value)
    return None


def default_model_tokenizer_path() -> Path | None:
    try:
        from models.loader import resolve_model
    except ImportError:
        return None
    try:
        path = _path_of(resolve_model("default"))
    except Exception as exc:  # the default model may be missing; the server fallback still works
        log.info("resolve_model('default') failed: %s", exc)
        return None
    return path if path is not None and path.exists() else None


def _has_tokenizer(path: Path) -> bool:
    return path.is_dir() and any((path / f).exists() for f in ("tokenizer.json", "tokenizer_config.json"))


def resolve_tokenizer(
    choice: str | None,
    base_url: str,
    model: str,
    headers: dict[str, str] | None = None,
    hint: str | None = None,
) -> PromptTokenizer:
    """`hint`: where the server says it loaded the model from (the `root` of its /v1/models card)."""
    if choice == SERVER:
        return EndpointTokenizer(base_url, model, headers)
    if choice:
        path = Path(choice).expanduser()
        if not path.exists():
            raise FileNotFoundError(f"--tokenizer {choice}: no such file or directory")
        return HFTokenizer(path)
    for name in (model, hint):
        served = Path(name).expanduser() if name else None
        if served is not None and _has_tokenizer(served):
            return HFTokenizer(served)
    default = default_model_tokenizer_path()
    if default is not None:
        return HFTokenizer(default)
    return EndpointTokenizer(base_url, model, headers)
