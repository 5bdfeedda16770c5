"""CUDA graphs for the steps decode graphs cannot take: the forward pass in pieces between attentions.

A decode graph (engine/cuda_graphs.py) captures a whole step, which fixes its attention's shape: one
token per sequence. A step that mixes prompt chunks with decodes (every step of iteration-level
scheduling while requests arrive), or verifies speculative tokens, ran eagerly, and an eager step of a
small model is bound by Python's kernel launches (25 ms for SmolLM2's 30 layers on an H100, where the
graph of a decode step takes 2.4 ms).

Selective batching is what makes the rest capturable: everything but attention works on the step's
flat [num_tokens, hidden] tokens, whoever they belong to, so its kernels depend on the token count
only. vLLM v1's piecewise graphs use the same cut. Per token count `size` (`token_capture_sizes`), the
forward pass is captured as one graph per stretch between two attentions (the embedding and the first
layer up to its queries; a layer's output projection, MLP and the next layer up to its queries; ...;
the last layer's MLP and the final norm), and attention runs eagerly between them with the step's own
metadata, any shape of batch, any backend. A step of T tokens replays the pieces of the smallest size
>= T; its padding tokens run token 0 at position 0 and write the KV cache's scratch block only.

Buffers. A piece reads and writes fixed addresses. The step's input ids, positions and KV slots live in
persistent buffers (copied in before the replay); each attention's queries are copied by the piece
before it into one shared query buffer, and its output is written into one shared output buffer that
the piece after it reads (layers run in turn, so one of each serves every layer and every size); the
last piece writes the final hidden states into a persistent [size, hidden] buffer.

Capture. The model's forward runs once per size with an `AttentionSplitter` on its attention step:
each layer's `Attention.attend` hands its queries to the splitter, which ends the graph being captured,
notes the attention (`AttentionBreak`), and begins the next graph. Sizes are captured largest first,
into one memory pool. Tests on a CPU use a capturer that replays by running the forward pass again
(`calls_forward`), through the same buffers and breaks.
"""

from __future__ import annotations

from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Protocol

import torch

from engine.cuda_graphs import CapturedSizes, CudaCapture, Replayable, bucket_for
from engine.inputs import HostStepInputs, StepInputs
from engine.kv_cache import PagedKVCache
from models.base import CausalLMBase
from models.layers.attention import Attention, AttentionStep
from models.layers.metadata import AttentionMetadata, KVCache

SMALLEST_SIZE = 16  # a step of fewer tokens replays the 16-token pieces (padding costs ~nothing there)


def token_capture_sizes(max_tokens: int) -> tuple[int, ...]:
    """Powers of two from SMALLEST_SIZE below max_tokens, and max_tokens itself: as many sizes as
    doublings, each a step of at most twice the tokens it holds."""
    if max_tokens < 1:
        raise ValueError(f"max_tokens must be >= 1, got {max_tokens}")
    sizes = []
    size = SMALLEST_SIZE
    while size < max_tokens:
        sizes.append(size)
        size *= 2
    sizes.append(max_tokens)
    return tuple(sizes)


class PieceCapturer(Protocol):
    """How pieces are made: CUDA's graphs (CudaPieceCapturer), or a CPU stand-in for tests."""

    # True for a stand-in whose pieces do nothing: a replay runs the forward pass again instead.
    calls_forward: bool

    def begin(self) -> None:
        """Start capturing a piece."""
        ...

    def end(self) -> Replayable:
        """Stop capturing; the piece captured since begin()."""
        ...

    def capture_context(self) -> AbstractContextManager[object]:
        """What the whole capture of one size runs in (CUDA: a side stream)."""
        ...

    def memory_in_use(self) -> int: ...

    def synchronize(self) -> None: ...


class CudaPieceCapturer(CudaCapture):
    """torch.cuda.CUDAGraph per piece, every piece of every size in one memory pool."""

    calls_forward = False

    def __init__(self, device: torch.device) -> None:
        super().__init__(device)
        self.stream = torch.cuda.Stream(device)
        self._graph: torch.cuda.CUDAGraph | None = None

    def capture_context(self) -> AbstractContextManager[object]:
        # Capture needs a stream other than the default one (torch.cuda.graph does the same); the
        # attentions between pieces run there too, so capture() synchronises before it returns.
        self.stream.wait_stream(torch.cuda.current_stream(self.device))
        return torch.cuda.stream(self.stream)

    def begin(self) -> None:
        self._graph = torch.cuda.CUDAGraph()
        self._graph.capture_begin(pool=self.pool)

    def end(self) -> Replayable:
        graph, self._graph = self._graph, None
        assert graph is not None, "end() without begin()"
        graph.capture_end()
        return graph


@dataclass
class AttentionBreak:
    """One layer's attention between two pieces: reads its queries from the shared query buffer and
    writes its output into the shared output buffer, for the step that is replaying."""

    layer: Attention
    kv_cache: KVCache
    q: torch.Tensor  # [size, Hq, D], a view of the shared query buffer
    out: torch.Tensor  # [size, Hq * D], a view of the shared output buffer

    def run(self, step: AttentionStep, num_tokens: int) -> None:
        """Attention of the step's `num_tokens` real tokens (the padding rows' output is left as is:
        padding never mixes with real tokens outside attention)."""
        self.out[:num_tokens].copy_(self.layer.run_backend(self.q[:num_tokens], self.kv_cache, step))


class AttentionSplitter:
    """What `Attention.attend` hands a step's queries to while pieces are captured or stood in for:
    copies them into the shared query buffer, then ends the piece (capturing), runs the attention
    eagerly, and begins the next piece. Returns the output buffer the next piece reads."""

    def __init__(
        self, graphs: PiecewiseGraphs, step: AttentionStep, num_tokens: int, capturing: bool
    ) -> None:
        self.graphs = graphs
        self.step = step  # whose metadata the eager attentions run on
        self.num_tokens = num_tokens
        self.capturing = capturing
        self.breaks: list[AttentionBreak] = []
        self.pieces: list[Replayable] = []

    def split(self, layer: Attention, q: torch.Tensor, kv_cache: KVCache) -> torch.Tensor:
        size = q.shape[0]
        brk = AttentionBreak(layer, kv_cache, *self.graphs.break_buffers(size, layer))
        brk.q.copy_(q)  # the last kernel of the piece before the break
        if self.capturing:
            self.pieces.append(self.graphs.capturer.end())
        brk.run(self.step, self.num_tokens)
        if self.capturing:
            self.graphs.capturer.begin()
        self.breaks.append(brk)
        return brk.out


@dataclass
class SizePieces:
    pieces: list[Replayable]  # one more than breaks
    breaks: list[AttentionBreak]


class PiecewiseGraphs(CapturedSizes):
    """The pieces of each token count, their persistent buffers, and the replay of a step."""

    model: CausalLMBase
    capturer: PieceCapturer

    def __init__(
        self,
        model: CausalLMBase,
        kv_cache: PagedKVCache,
        max_tokens: int,
        device: torch.device,
        dtype: torch.dtype,
        capturer: PieceCapturer | None = None,
    ) -> None:
        capturer = capturer if capturer is not None else CudaPieceCapturer(device)
        super().__init__(model, kv_cache, token_capture_sizes(max_tokens), device, capturer)
        max_size = self.sizes[-1]
        attentions = [m for m in model.modules() if isinstance(m, Attention)]
        width = max(a.num_heads * a.head_dim for a in attentions)
        # ids | positions | slots, as the decode graphs lay them out
        self.int64 = torch.zeros(3 * max_size, dtype=torch.int64, device=device)
        self.queries = torch.zeros(max_size * width, dtype=dtype, device=device)
        self.outputs = torch.zeros(max_size * width, dtype=dtype, device=device)
        self.hidden = torch.zeros(max_size, model.hidden_size, dtype=dtype, device=device)
        self.by_size: dict[int, SizePieces] = {}
        self._metadata: dict[int, AttentionMetadata] = {}  # each size's capture metadata

    def break_buffers(self, size: int, layer: Attention) -> tuple[torch.Tensor, torch.Tensor]:
        heads, dim = layer.num_heads, layer.head_dim
        q = self.queries[: size * heads * dim].view(size, heads, dim)
        return q, self.outputs[: size * heads * dim].view(size, heads * dim)

    def size_for(self, host: HostStepInputs) -> int | None:
        return bucket_for(self.sizes, int(host.input_ids.shape[0]))

    # ---- capture ----------------------------------------------------------------------------------

    def _capture_size(self, size: int) -> None:
        capturer = self.capturer
        self._load_tokens(size)  # all padding
        metadata = self._metadata[size] = self._capture_metadata(size)
        step = self.model.begin_step(self.int64[:size], metadata)
        # One eager run first: Triton compiles, cuBLAS picks its kernels, outside the capture.
        self._forward(size, AttentionSplitter(self, step, size, capturing=False))
        with capturer.capture_context():
            splitter = AttentionSplitter(self, step, size, capturing=True)
            capturer.begin()
            self._forward(size, splitter)
            splitter.pieces.append(capturer.end())
        self.by_size[size] = SizePieces(splitter.pieces, splitter.breaks)

    def _captured(self) -> str:
        pieces = len(self.by_size[self.sizes[0]].pieces)
        sizes = ", ".join(map(str, self.sizes))
        return f"{pieces * len(self.sizes)} pieces of {len(self.sizes)} token counts ({sizes})"

    def _forward(self, size: int, splitter: AttentionSplitter) -> None:
        ids, positions = self.int64[:size], self.int64[size : 2 * size]
        # The pieces' own metadata: only its slot mapping is read inside them (the KV cache write).
        # Built before capture: a capture cannot copy host values to the device.
        metadata = self._metadata[size]
        self.model.attention_splitter = splitter
        try:
            hidden = self.model(ids, positions, self.kv_cache.layers, metadata)
        finally:
            self.model.attention_splitter = None
        self.hidden[:size].copy_(hidden)

    def _load_tokens(self, size: int, inputs: StepInputs | None = None) -> int:
        """Put a step's ids, positions and KV slots (None: none) into the buffers of `size`, the rest
        padding tokens (token 0 at position 0, writing the scratch block's slot); returns its token
        count. Device-to-device: the step's inputs are on the device already."""
        n = 0
        if inputs is not None:
            n = int(inputs.input_ids.shape[0])
            self.int64[:n].copy_(inputs.input_ids)
            self.int64[size : size + n].copy_(inputs.positions)
            self.int64[2 * size : 2 * size + n].copy_(inputs.attn_metadata.slot_mapping)
        if n < size:
            self.int64[n:size].zero_()
            self.int64[size + n : 2 * size].zero_()
            self.int64[2 * size + n : 3 * size].fill_(self.kv_cache.scratch_block * self.kv_cache.block_size)
        return n

    def _capture_metadata(self, size: int) -> AttentionMetadata:
        """One sequence of `size` prompt tokens whose every block is the scratch block: valid for the
        capture's eager attentions (which compile the prompt variant of the kernel), touching no real
        sequence."""
        block_size = self.kv_cache.block_size
        blocks = -(-size // block_size)
        device = self.device
        return AttentionMetadata(
            slot_mapping=self.int64[2 * size : 3 * size],
            query_start_loc=torch.tensor([0, size], dtype=torch.int32, device=device),
            seq_start_loc=torch.tensor([0, size], dtype=torch.int32, device=device),
            seq_lens=torch.tensor([size], dtype=torch.int32, device=device),
            block_tables=torch.full(
                (1, blocks), self.kv_cache.scratch_block, dtype=torch.int32, device=device
            ),
            query_lens_cpu=[size],
            seq_lens_cpu=[size],
            max_query_len=size,
            max_seq_len=size,
            block_size=block_size,
        )

    # ---- replay -----------------------------------------------------------------------------------

    def run(self, inputs: StepInputs, size: int) -> torch.Tensor:
        """Replay the pieces of `size` for the step of `inputs` (on the device), its attentions on the
        step's own metadata: [T, hidden], a view of the persistent output valid until the next replay."""
        num_tokens = self._load_tokens(size, inputs)
        step = self.model.begin_step(inputs.input_ids, inputs.attn_metadata)
        if self.capturer.calls_forward:
            self._forward(size, AttentionSplitter(self, step, num_tokens, capturing=False))
        else:
            pieces = self.by_size[size]
            for piece, brk in zip(pieces.pieces, pieces.breaks, strict=False):
                piece.replay()
                brk.run(step, num_tokens)
            pieces.pieces[-1].replay()
        return self.hidden[:num_tokens]
