"""Flags: size parsing and how command-line flags reach the server's config."""

from __future__ import annotations

import pytest

from server.cli import parse_args
from server.config import parse_size


@pytest.mark.parametrize(
    ("text", "value"),
    [
        ("4096", 4096),
        ("2GiB", 2 * 2**30),
        ("512MiB", 512 * 2**20),
        ("1GB", 10**9),
        ("1.5 KiB", 1536),
        ("3g", 3 * 10**9),
    ],
)
def test_parse_size(text, value):
    assert parse_size(text) == value


@pytest.mark.parametrize("text", ["", "lots", "2XB", "-1GiB", "0"])
def test_parse_size_rejects(text):
    with pytest.raises(ValueError):
        parse_size(text)


def test_cli_flags():
    c = parse_args(
        "--model m.gguf --served-model-name x --port 9000 --kv-cache-memory 2GiB --scheduling request "
        "--kv-policy reserve --no-chunked-prefill --api-key k --max-num-seqs 8 --max-num-batched-tokens 256".split()
    )
    assert (c.model, c.model_name, c.port, c.kv_cache_memory) == ("m.gguf", "x", 9000, 2 * 2**30)
    assert (c.scheduling, c.kv_policy, c.chunked_prefill, c.api_key) == ("request", "reserve", False, "k")
    assert (c.max_num_seqs, c.max_num_batched_tokens) == (8, 256)
    d = parse_args([])
    assert (d.model, d.model_name, d.host, d.port, d.chunked_prefill) == (
        "default",
        "default",
        "127.0.0.1",
        8000,
        True,
    )
    with pytest.raises(SystemExit):
        parse_args(["--kv-cache-memory", "lots"])
    with pytest.raises(SystemExit):
        parse_args(["--kv-cache-memory", "1GiB", "--num-kv-blocks", "10"])
