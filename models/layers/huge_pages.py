"""Memory the kernel may back with 2 MiB pages, for the tensors a decode step streams through.

A batch-1 decode step reads every weight once, as fast as memory delivers it. With 4 KiB pages the
hardware prefetchers stop at every page boundary (they never cross one) and each page costs a TLB
walk: on a 2-core AMD EPYC (AVX-512) one quantized matmul over 12 weights of 9-14 MB each, never in
cache, read 24.2 GB/s from 4 KiB pages and 29.8 GB/s from 2 MiB ones (Q4_K; Q6_K 35.7 -> 40.7). Linux
gives an anonymous mapping huge pages at first touch where it is asked to (MADV_HUGEPAGE, honoured
unless /sys/kernel/mm/transparent_hugepage/enabled is "never"); torch's allocator neither asks nor
aligns to 2 MiB, so the packed weights are moved into one such mapping once, after loading.
"""

from __future__ import annotations

import ctypes
import mmap
from collections.abc import Sequence

import torch

HUGE_PAGE = 2 << 20


def huge_page_empty(nbytes: int) -> torch.Tensor:
    """`nbytes` uninitialised bytes (uint8) starting on a 2 MiB boundary of an anonymous mapping advised
    for huge pages (plain pages where the kernel declines). The tensor keeps the mapping."""
    region = mmap.mmap(-1, nbytes + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    whole = torch.frombuffer(region, dtype=torch.uint8)
    start = -whole.data_ptr() % HUGE_PAGE
    # Only the whole huge pages: a partly used one at the end would hold up to 2 MiB for a few bytes.
    advised = nbytes // HUGE_PAGE * HUGE_PAGE
    if advised:
        try:
            region.madvise(mmap.MADV_HUGEPAGE, start, advised)
        except (AttributeError, OSError):  # no THP in this kernel, or not Linux: plain pages
            pass
    return whole[start : start + nbytes]


def huge_page_slots(tensors: Sequence[torch.Tensor], align: int = 64) -> list[torch.Tensor]:
    """Uninitialised tensors shaped as `tensors`, side by side in one huge-page mapping, each starting
    at a multiple of `align` bytes: weights of any size get huge pages (a model's many small ones
    too: SmolLM2-135M's are all below 2 MiB), with at most one partly used page for all of them. The
    caller fills them one by one, dropping each original as it goes, so the move never holds two
    copies of every weight at once (pages are taken only as they are written)."""
    sizes = [t.numel() * t.element_size() for t in tensors]
    offsets, total = [], 0
    for n in sizes:
        offsets.append(total)
        total += -(-n // align) * align
    arena = huge_page_empty(max(total, 1))
    return [
        arena[off : off + n].view(t.dtype).view(t.shape)
        for t, off, n in zip(tensors, offsets, sizes, strict=True)
    ]


def release_freed_memory() -> None:
    """Hand the C heap's free pages back to the system (glibc's malloc_trim): the tensors a move to
    huge pages drops sat in the heap, and without this the process kept their ~25% of the weights'
    size as resident memory (Llama-3.2-1B Q4_K_M: 1710 MB resident after loading instead of 1362)."""
    try:
        ctypes.CDLL(None).malloc_trim(0)
    except (OSError, AttributeError):  # not glibc
        pass
