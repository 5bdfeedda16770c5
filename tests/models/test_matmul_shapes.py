"""Low-precision matmuls on a CPU run on a few row counts (models/layers/linear.py): oneDNN compiles and
caches a kernel per shape, so a server that saw every step size would keep growing (issue #17)."""

from __future__ import annotations

import torch

from models.layers.linear import ColumnParallelLinear, bucketed_rows


def test_bucketed_rows_are_few_and_close() -> None:
    sizes = {bucketed_rows(m) for m in range(1, 8193)}
    assert len(sizes) <= 16 + 8 * 9  # exact to 16, then 8 per power of two
    for m in range(1, 8193):
        rows = bucketed_rows(m)
        assert m <= rows <= m * 1.125 + 1 and bucketed_rows(rows) == rows


def test_padded_bfloat16_matmul_equals_the_plain_one() -> None:
    torch.manual_seed(0)
    layer = ColumnParallelLinear(64, 96, bias=True, dtype=torch.bfloat16)
    with torch.no_grad():
        layer.weight.normal_()
        layer.bias.normal_()
        for m in (1, 17, 100, 333):
            x = torch.randn(m, 64, dtype=torch.bfloat16)
            y = layer.matmul(x, layer.bias)
            assert y.shape == (m, 96) and y.is_contiguous()
            # Row by row: the same row gives the same values whatever the padding around it.
            ref = torch.nn.functional.linear(x, layer.weight, layer.bias)
            torch.testing.assert_close(y, ref, atol=2e-2, rtol=2e-2)
