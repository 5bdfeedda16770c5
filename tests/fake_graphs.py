"""A stand-in for CUDA graphs on a CPU (engine.cuda_graphs.GraphCapturer): capture runs the function
once, as the warm-up does, and keeps it; replay calls it again. A replay then reads the persistent
buffers and the host values frozen at capture, as a CUDA graph does, so everything about decode graphs
except the capture itself runs without a GPU."""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass, field


@dataclass
class ReplayByCalling:
    captured: int = 0  # graphs captured so far (each graph's id is its capture index)
    replays: dict[int, int] = field(default_factory=dict)  # capture index -> replays

    def capture(self, fn: Callable[[], None]) -> _CalledGraph:
        fn()
        graph = _CalledGraph(self, self.captured, fn)
        self.captured += 1
        return graph

    def memory_in_use(self) -> int:
        return 0

    def synchronize(self) -> None:
        return None


@dataclass
class _CalledGraph:
    capturer: ReplayByCalling
    index: int
    fn: Callable[[], None]

    def replay(self) -> None:
        self.capturer.replays[self.index] = self.capturer.replays.get(self.index, 0) + 1
        self.fn()


@dataclass
class PiecesByCalling:
    """The stand-in for piecewise graphs (engine.piecewise_graphs.PieceCapturer): its pieces do
    nothing, and a replay runs the forward pass again through the same persistent buffers and attention
    breaks (`calls_forward`), so everything but CUDA's capture runs on a CPU."""

    calls_forward = True
    begun: int = 0  # pieces begun (capture and its warm-up included)

    def capture_context(self) -> contextlib.nullcontext[None]:
        return contextlib.nullcontext()

    def begin(self) -> None:
        self.begun += 1

    def end(self) -> _NoPiece:
        return _NoPiece()

    def memory_in_use(self) -> int:
        return 0

    def synchronize(self) -> None:
        return None


class _NoPiece:
    def replay(self) -> None:
        raise AssertionError("a stand-in's pieces are not replayed: the forward pass runs again")
