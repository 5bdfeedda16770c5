"""A model's pooling as its files declare it (models/pooling.py): a GGUF's `<arch>.pooling_type`, kept
through the conversion; a sentence-transformers Pooling module (Qwen3-Embedding's last token); else
the last token's. A pooling no embedding can be made with says why."""

from __future__ import annotations

from pathlib import Path

import pytest
from builders import sentence_transformers_dir, write_tiny_gguf

from models.gguf.convert import convert_gguf
from models.pooling import DECODER_DEFAULT, model_pooling


@pytest.mark.parametrize(
    ("value", "method", "problem"),
    [
        (3, "last", None),
        (1, "mean", None),
        (2, "cls", None),
        (0, None, "one vector per token"),
        (4, None, "reranker"),
        (None, "last", None),
    ],
    ids=["last", "mean", "cls", "none", "rank", "absent"],
)
def test_a_gguf_pooling_type_survives_the_conversion(
    tmp_path: Path, monkeypatch, value: int | None, method: str | None, problem: str | None
) -> None:
    monkeypatch.setenv("ORCA_CACHE_DIR", str(tmp_path / "cache"))
    path = tmp_path / "embedder.gguf"
    write_tiny_gguf(path, pooling_type=value)
    pooling = model_pooling(convert_gguf(path))
    assert pooling.method == method
    if value is None:
        assert pooling == DECODER_DEFAULT
    else:
        assert "GGUF" in pooling.source
    assert (problem is None) == (pooling.problem is None)
    if problem is not None:
        assert problem in str(pooling.problem)


@pytest.mark.parametrize(
    ("modes", "method"),
    [
        ({"lasttoken": True, "mean_tokens": False}, "last"),
        ({"mean_tokens": True}, "mean"),
        ({"cls_token": True}, "cls"),
    ],
)
def test_a_sentence_transformers_pooling_module(tmp_path: Path, modes: dict, method: str) -> None:
    pooling = model_pooling(sentence_transformers_dir(tmp_path / "st", **modes))
    assert pooling.method == method and "1_Pooling/config.json" in pooling.source


def test_poolings_that_make_no_embedding_here(tmp_path: Path) -> None:
    max_pool = model_pooling(sentence_transformers_dir(tmp_path / "max", max_tokens=True))
    assert max_pool.method is None and "pooling_mode_max_tokens" in str(max_pool.problem)
    both = model_pooling(sentence_transformers_dir(tmp_path / "both", mean_tokens=True, cls_token=True))
    assert both.method is None and "pooling_mode_mean_tokens + pooling_mode_cls_token" in str(both.problem)
    unset = model_pooling(sentence_transformers_dir(tmp_path / "unset"))
    assert unset.method is None and "no pooling mode" in str(unset.problem)


def test_a_plain_decoder_pools_its_last_token(tmp_path: Path) -> None:
    assert model_pooling(tmp_path) == DECODER_DEFAULT and DECODER_DEFAULT.method == "last"
