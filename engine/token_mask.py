"""Token masks for the rows of a step that carry a grammar, computed while the forward pass runs.

`TokenMasker.start(rows)` is called before the forward: for a batch without a grammar it returns None
and does nothing else (an unconstrained batch pays one attribute check per row). Otherwise a worker
thread advances each constrained row's matcher to its outputs, has llguidance fill a bitmask (its Rust
code releases the GIL) and unpacks it into a boolean "banned" matrix. The sampler calls
`PendingMask.apply(logits)` first thing: it waits for that thread (normally long done: the forward takes
tens of milliseconds, a mask tenths) and sets the banned logits to -inf.

Only the driver (rank 0) samples, so only it holds matchers and masks, whatever the parallelism.
"""

from __future__ import annotations

import os
import time
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from engine.contract import SamplingRow

if TYPE_CHECKING:
    from engine.grammar import GrammarMatcher


@dataclass
class MaskStats:
    """Cumulative figures (benchmarks and metrics read them)."""

    steps: int = 0
    rows: int = 0
    fill_s: float = 0.0  # advancing matchers + filling and unpacking masks (in the worker thread)
    wait_s: float = 0.0  # what the sampler waited for the worker: the part the forward did not hide
    apply_s: float = 0.0  # setting banned logits to -inf (on the sampler's path)


class PendingMask:
    """The masks of one step's constrained rows, being computed."""

    def __init__(self, rows: list[int], future: Future[torch.Tensor], stats: MaskStats) -> None:
        self.rows = rows  # indices into the sampler's rows
        self._future = future
        self._stats = stats

    def apply(self, logits: torch.Tensor) -> None:
        """Ban (-inf) what each constrained row's grammar does not allow here. logits: [S, V], in place."""
        t0 = time.perf_counter()
        banned = self._future.result()  # [C, V'] bool, V' >= V
        t1 = time.perf_counter()
        vocab = logits.shape[-1]
        if logits.device.type == "cpu":
            # numpy's boolean assignment is one pass; torch's masked_fill_ costs more on CPU threads.
            values = logits.numpy()
            banned_np = banned.numpy()
            for j, i in enumerate(self.rows):
                values[i][banned_np[j, :vocab]] = -np.inf
        else:
            idx = torch.tensor(self.rows, device=logits.device)
            mask = banned[:, :vocab].to(logits.device, non_blocking=True)
            logits[idx] = logits[idx].masked_fill(mask, float("-inf"))
        self._stats.wait_s += t1 - t0
        self._stats.apply_s += time.perf_counter() - t1


class TokenMasker:
    """Starts and hands out each step's masks. One per runner; its thread runs one step's masks at a
    time, in submission order (pipeline parallelism keeps several batches in flight, never one request
    in two of them)."""

    def __init__(self, num_threads: int | None = None) -> None:
        cores = os.cpu_count() or 1
        # The forward pass uses the cores too: half of them is plenty for masks of a few hundred us.
        self._num_threads = num_threads or max(1, min(8, cores // 2))
        self._pool: ThreadPoolExecutor | None = None
        self._executor: Any = None  # llguidance.LLExecutor, made with the first constrained batch
        self.stats = MaskStats()

    def start(self, rows: Sequence[SamplingRow]) -> PendingMask | None:
        constrained = [i for i, r in enumerate(rows) if r.sampling.grammar is not None]
        if not constrained:
            return None
        if self._pool is None:
            import llguidance as llg

            self._executor = llg.LLExecutor(self._num_threads)
            self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="orca-grammar")
        # A verification's later rows get their masks with its row 0, along the proposals (their
        # outputs end with proposals, which must not be committed to the matcher).
        work = [
            (rows[i].sampling.grammar, rows[i].output_token_ids, list(rows[i].spec_token_ids), j)
            for j, i in enumerate(constrained)
            if rows[i].spec_index == 0
        ]
        future = self._pool.submit(self._compute, work, len(constrained))
        return PendingMask(constrained, future, self.stats)

    def _compute(
        self, work: list[tuple[GrammarMatcher | None, Sequence[int], list[int], int]], num_rows: int
    ) -> torch.Tensor:
        import llguidance.numpy as llg_np

        t0 = time.perf_counter()
        plain: list[tuple[Any, int]] = []
        along: list[tuple[Any, int, list[int]]] = []
        vocab = 0
        for grammar, outputs, proposals, row in work:
            assert grammar is not None
            grammar.advance(outputs)
            vocab = grammar.vocab_size
            if proposals:
                along.append((grammar.matcher, row, proposals))
            else:
                plain.append((grammar.matcher, row))
        bitmask = llg_np.allocate_token_bitmask(num_rows, vocab)  # [C, ceil(V/32)] int32
        if along:
            bitmask[:] = 0  # allocated all-allowed; zero marks the rows llguidance leaves unwritten
            llg_np.fill_next_token_bitmask_par_with_draft_tokens(self._executor, along, bitmask)
            # llguidance stops at the first proposal the grammar refuses (or that a matcher that has
            # ended cannot take): the rows after it are left unwritten, still zero, which no mask it
            # writes is (it allows EOS at least). They repeat the last written row: after a refused
            # proposal their draws are never used (it is rejected at that row), and a matcher that has
            # ended allows only EOS from then on, as it does without speculation.
            for _, row, proposals in along:
                for r in range(row + 1, row + len(proposals) + 1):
                    if not bitmask[r].any():
                        bitmask[r] = bitmask[r - 1]
        if plain:
            llg_np.fill_next_token_bitmask_par(self._executor, plain, bitmask)
        allowed = np.unpackbits(bitmask.view(np.uint8), axis=1, count=vocab, bitorder="little")  # [C, V]
        banned = torch.from_numpy(np.logical_not(allowed))
        self.stats.steps += 1
        self.stats.rows += num_rows
        self.stats.fill_s += time.perf_counter() - t0
        return banned

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None
