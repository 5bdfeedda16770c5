"""Marks and probes for tests of the native CPU kernels (models/kernels/). Without AVX2/FMA or a C compiler the
kernels are not built, the code falls back to torch ops, and these tests are skipped; a test over
`EVERY_VARIANT` runs each ISA variant this CPU supports and skips the others, saying which flag is
missing."""

from __future__ import annotations

import pytest

from models.kernels import cpu as cpu_kernels
from models.kernels.isa import VARIANTS, cpu_flags

needs_native_kernels = pytest.mark.skipif(
    not cpu_kernels.available(), reason="native CPU kernels not built here (no AVX2/FMA or no C compiler)"
)


def _variant_param(v) -> object:
    missing = sorted(set(v.cpu_flags) - cpu_flags())
    skip = pytest.mark.skipif(
        bool(missing), reason=f"this CPU lacks {', '.join(missing)} for the {v.name} kernels"
    )
    return pytest.param(v.name, id=v.name, marks=[skip])


EVERY_VARIANT = [_variant_param(v) for v in VARIANTS]


def kernels_for(name: str) -> cpu_kernels.Kernels:
    """The kernels of one variant, or a skip when this machine cannot build or run them."""
    try:
        return cpu_kernels.for_variant(name)
    except RuntimeError as e:
        pytest.skip(str(e))


def native_calls(monkeypatch) -> list[bool]:
    """Whether each decode-layers forward from now on ran its layers in the native call (True) or the
    modules (models/layers/native_decode.py)."""
    from models.layers.native_decode import NativeDecodeLayers

    calls: list[bool] = []
    forward = NativeDecodeLayers.forward

    def spy(self, *args):
        out = forward(self, *args)
        calls.append(out is not None)
        return out

    monkeypatch.setattr(NativeDecodeLayers, "forward", spy)
    return calls
