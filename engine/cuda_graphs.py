"""CUDA graphs for decode steps.

A decode step of a small model is bound by launches, not by the GPU: every layer is a dozen small kernels
issued one by one from Python, so at batch 1 the GPU mostly waits for the CPU. A captured CUDA graph
replays the whole forward pass (and the LM head) as one launch.

What is captured. One graph per batch size in `capture_sizes(max_num_seqs)` (1, 2, 4, 8, ... and
max_num_seqs itself), for steps where every sequence runs exactly one token (decodes, and one-token
prompt chunks). Any other step (a prompt chunk of more tokens, more sequences than the largest size)
runs eagerly, as it would without graphs. A step of B sequences replays the smallest graph of size
b >= B: rows B..b-1 are padding.

How a graph sees a new step. A graph replays fixed kernels on fixed addresses, so its inputs live in
persistent device buffers (`GraphInputBuffers`, allocated once at the largest size) and each step copies
its values there before the replay: two non-blocking copies from pinned host memory (the ids,
positions, slots and lengths in one array, `DecodeWords`; the block tables). The host values the kernels were specialised on are
frozen at capture: a decode-only step (max_query_len 1) of b sequences whose histories may be as long
as max_model_len, which fixes the triton backend's launch configuration (its split count is the
long-history one; models/layers/triton_attention.py launch_config explains why that is correct for
any history). Block tables are captured at full width (every block max_model_len needs); entries past
a row's length are stale and never read (the kernel masks keys by seq_lens).

Padding rows. They run token 0 at position 0 with a history of one token, written to and read from the
KV cache's scratch block (engine/kv_cache.py), which no sequence owns: padding never touches a real
sequence's blocks and attends to a finite value. Block 0 is a real block and is never used for this.
Their logits are computed and ignored.

Memory. Graphs are captured from the largest size down into one shared memory pool, so the smaller
graphs reuse the largest one's intermediate memory; each graph writes its logits into one persistent
[max size, vocab] float32 buffer, whose first B rows are the step's logits.

Which runs capture graphs: engine.executor decides (one process, CUDA, a backend that can be captured:
the triton backend, whose launches read host-side sizes only and never synchronise; a family whose steps
decide on the host what runs, a mixture of experts, opts out; `--enforce-eager` turns them off). Which
steps replay one: engine.model_runner.ModelRunner.run_step, the one step path.
Before each capture the size is run once eagerly on a side stream: that compiles the Triton variants
and lets cuBLAS pick its kernels outside the capture.
"""

from __future__ import annotations

import bisect
import logging
import time
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import numpy as np
import torch
from torch import nn

from engine.inputs import HostStepInputs, to_device
from engine.kv_cache import PagedKVCache
from models.layers.metadata import AttentionMetadata


def capture_sizes(max_num_seqs: int) -> tuple[int, ...]:
    """The batch sizes to capture: powers of two below max_num_seqs, and max_num_seqs itself.

    Powers of two keep the count (and the start-up time) logarithmic; padding a batch up to the next one
    costs little while a decode step is bound by reading the weights, which is where graphs matter."""
    if max_num_seqs < 1:
        raise ValueError(f"max_num_seqs must be >= 1, got {max_num_seqs}")
    sizes = []
    size = 1
    while size < max_num_seqs:
        sizes.append(size)
        size *= 2
    sizes.append(max_num_seqs)
    return tuple(sizes)


def bucket_for(sizes: tuple[int, ...], num_seqs: int) -> int | None:
    """The smallest captured size that holds num_seqs sequences (sizes ascending), or None."""
    i = bisect.bisect_left(sizes, num_seqs)
    return sizes[i] if i < len(sizes) else None


@dataclass(frozen=True)
class DecodeWords:
    """A decode step of b rows in one int32 array of 8b + 1 words, the layout the graph of size b reads:
    [input_ids | positions | slot_mapping] as int64 (2b words each), then [seq_lens (b) |
    seq_start_loc (b + 1)]. The same views over a pinned host tensor and over the graphs' device buffer,
    so a step travels in one copy."""

    input_ids: torch.Tensor  # [b] int64
    positions: torch.Tensor  # [b] int64
    slot_mapping: torch.Tensor  # [b] int64
    seq_lens: torch.Tensor  # [b] int32
    seq_start_loc: torch.Tensor  # [b + 1] int32

    @staticmethod
    def words(size: int) -> int:
        return 8 * size + 1

    @classmethod
    def over(cls, words: torch.Tensor, size: int) -> DecodeWords:
        b = size
        int64 = words[: 6 * b].view(torch.int64)
        return cls(
            int64[:b], int64[b : 2 * b], int64[2 * b :], words[6 * b : 7 * b], words[7 * b : 8 * b + 1]
        )


@dataclass
class PaddedDecodeStep:
    """A decode step's inputs padded to a captured size b, on the host: its words (`DecodeWords`
    layout) and its block tables [b, width], views of one host tensor."""

    size: int
    words: torch.Tensor  # [8b + 1] int32
    block_tables: torch.Tensor  # [b, width] int32


def pad_decode_step(
    host: HostStepInputs, size: int, scratch_block: int, pin: bool = False
) -> PaddedDecodeStep:
    """`host` (B one-token sequences) padded to `size` rows: each padding row runs token 0 at position 0
    with a one-token history in `scratch_block`, written at its first slot. One host tensor holds it,
    pinned when `pin` (CUDA: the copies into the graph's buffers do not wait).

    It is filled through numpy, and the torch calls are as few as it takes (an allocation, a view; the
    buffers' load adds two copies): under load the event loop's thread (requests, detokenizing, SSE)
    holds the GIL, and every torch call releases it and waits to take it back; a native profile of a
    GPU server put half of a decode step's time in those waits (docs/benchmarks.md, "Where an
    iteration-level server's step goes"). numpy's assignments keep the GIL and cost ~1 us each."""
    n, b = host.num_seqs, size
    if b < n or not host.is_decode_only:
        raise ValueError(f"a decode step of {n} sequences does not fit a graph of size {size}")
    width = host.block_tables.shape[1]
    head = DecodeWords.words(b)
    staging = torch.empty(head + b * width, dtype=torch.int32, pin_memory=pin)
    words = staging.numpy()
    int64 = words[: 6 * b].view(np.int64)  # [input_ids | positions | slot_mapping], b each
    int64[:n] = host.input_ids.numpy()
    int64[b : b + n] = host.positions.numpy()
    int64[2 * b : 2 * b + n] = host.slot_mapping.numpy()
    int64[n:b] = 0
    int64[b + n : 2 * b] = 0
    int64[2 * b + n :] = scratch_block * host.block_size
    int32 = words[6 * b : head]  # [seq_lens (b) | seq_start_loc (b + 1)]
    int32[:n] = host.seq_lens.numpy()
    int32[n:b] = 1
    int32[b] = 0
    np.cumsum(int32[:b], dtype=np.int32, out=int32[b + 1 :])
    tables = words[head:].reshape(b, width)
    tables[:n] = host.block_tables.numpy()
    tables[n:] = 0
    tables[n:, 0] = scratch_block
    return PaddedDecodeStep(size, staging[:head], staging[head:].view(b, width))


class GraphInputBuffers:
    """The persistent device tensors every graph reads its inputs from, sized for the largest graph.

    The graph of size b reads fixed views of them: the first 8b + 1 words of `words` in the
    `DecodeWords` layout of size b, the first b rows of `block_tables` (full width: every block
    max_model_len needs), and a fixed query_start_loc."""

    def __init__(self, max_size: int, max_blocks_per_seq: int, device: torch.device) -> None:
        self.max_size = max_size
        self.max_blocks_per_seq = max_blocks_per_seq
        self.words = torch.zeros(DecodeWords.words(max_size), dtype=torch.int32, device=device)
        self.block_tables = torch.zeros(max_size, max_blocks_per_seq, dtype=torch.int32, device=device)
        # cu_seqlens_q of a decode step: one query per sequence, the same for every step (written once).
        self.query_start_loc = torch.arange(max_size + 1, dtype=torch.int32, device=device)

    def load(self, step: PaddedDecodeStep) -> None:
        """Copy a padded step into the views of its size: two copies, non-blocking from pinned memory on
        CUDA (no wait for the previous step, whose replay reads the same buffers earlier in the same
        stream; torch keeps the pinned block from reuse until they have run)."""
        b, width = step.size, step.block_tables.shape[1]
        if width > self.max_blocks_per_seq:
            raise ValueError(f"block tables of {width} blocks exceed the graphs' {self.max_blocks_per_seq}")
        non_blocking = self.words.device.type == "cuda"
        self.words[: DecodeWords.words(b)].copy_(step.words, non_blocking=non_blocking)
        self.block_tables[:b, :width].copy_(step.block_tables, non_blocking=non_blocking)

    def inputs(self, size: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(input_ids, positions) of the graph of `size`."""
        views = DecodeWords.over(self.words, size)
        return views.input_ids, views.positions

    def metadata(self, size: int, max_model_len: int, block_size: int) -> AttentionMetadata:
        """The attention metadata the graph of `size` is captured with: views of the buffers, and host
        sizes for the longest history any replay may have (see the module docstring)."""
        b = size
        views = DecodeWords.over(self.words, b)
        return AttentionMetadata(
            slot_mapping=views.slot_mapping,
            query_start_loc=self.query_start_loc[: b + 1],
            seq_start_loc=views.seq_start_loc,
            seq_lens=views.seq_lens,
            block_tables=self.block_tables[:b],
            query_lens_cpu=[1] * b,
            seq_lens_cpu=[max_model_len] * b,
            max_query_len=1,
            max_seq_len=max_model_len,
            block_size=block_size,
        )


class Replayable(Protocol):
    def replay(self) -> None: ...


class GraphCapturer(Protocol):
    """How graphs are made: CUDA's (CudaGraphCapturer), or the tests' stand-in that replays by calling
    the function again, which runs everything else here on a CPU."""

    def capture(self, fn: Callable[[], None]) -> Replayable:
        """Warm up `fn` once, then capture it; the result's replay() runs what fn ran."""
        ...

    def memory_in_use(self) -> int:
        """Device bytes in use (for the start-up log)."""
        ...

    def synchronize(self) -> None: ...


class CudaCapture:
    """What a capturer on CUDA shares: its device, a memory pool for its graphs, and the device's
    memory in use and synchronisation."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.pool = torch.cuda.graph_pool_handle()

    def memory_in_use(self) -> int:
        free, total = torch.cuda.mem_get_info(self.device)
        return total - free

    def synchronize(self) -> None:
        torch.cuda.synchronize(self.device)


class CudaGraphCapturer(CudaCapture):
    """torch.cuda.CUDAGraph, every graph in one shared memory pool (capture the largest first)."""

    def capture(self, fn: Callable[[], None]) -> torch.cuda.CUDAGraph:
        # One eager run on a side stream first, as torch's docs ask: Triton compiles the variant and
        # cuBLAS picks its kernels now, not during the capture.
        current = torch.cuda.current_stream(self.device)
        side = torch.cuda.Stream(self.device)
        side.wait_stream(current)
        with torch.cuda.stream(side):
            fn()
        current.wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            fn()
        return graph


@dataclass(frozen=True)
class CaptureStats:
    sizes: tuple[int, ...]
    seconds: float
    memory_bytes: int  # device memory the graphs and their buffers took


class CaptureDevice(Protocol):
    """What timing a capture needs of a capturer (GraphCapturer and PieceCapturer both have it)."""

    def memory_in_use(self) -> int: ...

    def synchronize(self) -> None: ...


class CapturedSizes(ABC):
    """What decode graphs and piecewise graphs share: the model and KV cache they run, their sizes
    (ascending), the device and capturer, and a capture that takes every size largest first (one
    memory pool serves them all) and measures what it cost."""

    def __init__(
        self,
        model: nn.Module,
        kv_cache: PagedKVCache,
        sizes: tuple[int, ...],
        device: torch.device,
        capturer: CaptureDevice,
    ) -> None:
        self.model = model
        self.kv_cache = kv_cache
        self.sizes = sizes
        self.device = device
        self.capturer = capturer
        self.stats: CaptureStats | None = None  # what capture() cost

    def capture(self) -> CaptureStats:
        """Capture every size, largest first; log and return what it cost."""
        capturer = self.capturer
        capturer.synchronize()
        start_memory, start = capturer.memory_in_use(), time.perf_counter()
        with torch.inference_mode():
            for size in reversed(self.sizes):
                self._capture_size(size)
        capturer.synchronize()
        stats = CaptureStats(self.sizes, time.perf_counter() - start, capturer.memory_in_use() - start_memory)
        self.stats = stats
        logging.getLogger(type(self).__module__).info(  # under the subclass's module, as its tests read
            "CUDA graphs: captured %s in %.2f s, %.0f MiB of device memory",
            self._captured(),
            stats.seconds,
            stats.memory_bytes / 2**20,
        )
        return stats

    @abstractmethod
    def _capture_size(self, size: int) -> None:
        """Capture the graphs of one size."""

    @abstractmethod
    def _captured(self) -> str:
        """What a capture made, for the log."""


class DecodeGraphs(CapturedSizes):
    """One captured forward pass (model and LM head) per batch size, and the buffers they read."""

    capturer: GraphCapturer

    def __init__(
        self,
        model: nn.Module,
        kv_cache: PagedKVCache,
        max_num_seqs: int,
        max_model_len: int,
        device: torch.device,
        capturer: GraphCapturer | None = None,
    ) -> None:
        capturer = capturer if capturer is not None else CudaGraphCapturer(device)
        super().__init__(model, kv_cache, capture_sizes(max_num_seqs), device, capturer)
        self.max_model_len = max_model_len
        self.block_size = kv_cache.block_size
        self.buffers: GraphInputBuffers | None = None
        self.logits: torch.Tensor | None = None  # [max size, vocab] float32, every graph's output
        self.graphs: dict[int, Replayable] = {}

    def _capture_size(self, size: int) -> None:
        if self.buffers is None:  # sized by the first (largest) capture, inside its measured memory
            max_size = self.sizes[-1]
            self.buffers = GraphInputBuffers(max_size, -(-self.max_model_len // self.block_size), self.device)
            self.logits = torch.empty(
                max_size, self.model.vocab_size, dtype=torch.float32, device=self.device
            )
        # Warm-up and capture run on padding rows only: valid inputs that touch no sequence.
        self.buffers.load(self._pad(_empty_decode(self.block_size), size))
        self.graphs[size] = self.capturer.capture(self._forward_fn(size))

    def _captured(self) -> str:
        return f"{len(self.sizes)} decode graphs (batch sizes {', '.join(map(str, self.sizes))})"

    def _forward_fn(self, size: int) -> Callable[[], None]:
        assert self.buffers is not None and self.logits is not None
        input_ids, positions = self.buffers.inputs(size)
        metadata = self.buffers.metadata(size, self.max_model_len, self.block_size)
        logits_out = self.logits[:size]
        model, kv_layers = self.model, self.kv_cache.layers

        def forward() -> None:
            hidden = model(input_ids, positions, kv_layers, metadata)  # [size, hidden]
            logits_out.copy_(model.compute_logits(hidden))

        return forward

    def _pad(self, host: HostStepInputs, size: int) -> PaddedDecodeStep:
        return pad_decode_step(host, size, self.kv_cache.scratch_block, pin=self.device.type == "cuda")

    def size_for(self, host: HostStepInputs) -> int | None:
        """The graph a step can replay, or None when it must run eagerly."""
        assert self.buffers is not None
        if not host.is_decode_only or host.block_tables.shape[1] > self.buffers.max_blocks_per_seq:
            return None  # prompt tokens, or a history past max_model_len (a caller that skipped checks)
        return bucket_for(self.sizes, host.num_seqs)

    def run(self, host: HostStepInputs, size: int) -> torch.Tensor:
        """Replay the graph of `size` on `host`'s step: [S, vocab] float32 logits of the rows that
        sample, a view of the shared output buffer valid until the next replay."""
        assert self.buffers is not None and self.logits is not None
        self.buffers.load(self._pad(host, size))
        if host.carried is not None:
            host.carried.write(self.buffers.inputs(size)[0])
        self.graphs[size].replay()
        logits = self.logits[: host.num_seqs]
        if len(host.sample_rows) == host.num_seqs:
            return logits
        rows = to_device(torch.tensor(host.sample_rows, dtype=torch.int64), self.device)
        return logits.index_select(0, rows)


def _empty_decode(block_size: int) -> HostStepInputs:
    """A decode step of no sequences: padded, it is all padding rows (what warm-up and capture run)."""
    return HostStepInputs(
        input_ids=torch.zeros(0, dtype=torch.int64),
        positions=torch.zeros(0, dtype=torch.int64),
        slot_mapping=torch.zeros(0, dtype=torch.int64),
        seq_lens=torch.zeros(0, dtype=torch.int32),
        block_tables=torch.zeros(0, 1, dtype=torch.int32),
        query_lens=[],
        seq_lens_list=[],
        sample_rows=[],
        last_token_index=[],
        block_size=block_size,
    )
