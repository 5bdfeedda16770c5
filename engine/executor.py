"""Executors: what the scheduler's loop drives (engine.contract.Executor). Each holds the driver's
ModelRunner (rank 0), the grammar masker and the sampler; they differ only in who else runs the step.

    LocalExecutor        one process: the runner is the whole model
    DistributedExecutor  tensor x pipeline parallel ranks (engine/distributed_executor.py)

`engine.executor_factory.create_executor(config)` picks one. A step is `collect(submit(batch))` in both:
`submit` calls `ExecutorBase._begin_step` (the draft model's proposals where entries ask for them,
verifications spread over rows, the inputs prepared, which rows sample and score, the grammar masks
started) and runs (or, with pipeline stages, starts) the step through `ModelRunner.run_step`;
`collect` waits for the logits rows (and the embedding entries' pooled rows), scores prompt tokens,
samples and reads back what each verification accepted, here on the driver. On a GPU the local
executor samples in `submit` instead where it can (`samples_ahead`), so that the next step may be
queued with its carried rows' tokens read on the device (`carries`, engine.contract.DeviceCarry).
"""

from __future__ import annotations

import logging
from abc import ABC, abstractmethod
from bisect import bisect_left
from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import cached_property
from itertools import accumulate
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from engine.config import EngineConfig, resolve_device, resolve_model_path
from engine.contract import (
    DeviceCarry,
    FatalRunnerError,
    PooledState,
    PromptLogprobs,
    ScheduledSequence,
    StepResult,
    carriable_on_device,
)
from engine.inputs import CarriedTokens, HostStepInputs, PoolSpan, to_device
from engine.model_runner import ModelRunner
from engine.sampler import HostCopies, SampledOnDevice, Sampler, score_prompt_tokens
from engine.speculative import StepRows, accept, spread
from engine.token_mask import PendingMask, TokenMasker

if TYPE_CHECKING:
    from engine.draft_proposer import DraftProposer

logger = logging.getLogger(__name__)


@dataclass
class PendingStep:
    """A batch between submit() and collect()."""

    batch: Sequence[ScheduledSequence]
    # The rows the model runs (verifications spread out: engine/speculative.py); None for an empty batch.
    rows: StepRows | None = None
    sample_rows: list[int] = field(default_factory=list)  # indices into rows.rows of the rows that sample
    logits: torch.Tensor | None = None  # [R, vocab] float32 (still arriving while `recv` is pending)
    # Prompt logprobs (engine.inputs.HostStepInputs): which logits rows score prompts, which sample.
    scored: list[tuple[int, int, int]] = field(default_factory=list)
    sample_logit_rows: list[int] | None = None
    # Embedding entries (engine/pooling.py): their spans, and their pooled rows [P, hidden] float32.
    pools: list[PoolSpan] = field(default_factory=list)
    pooled: torch.Tensor | None = None
    pooled_copy: HostCopies | None = None  # on its way to the host (samples_ahead)
    recvs: list[Any] = field(default_factory=list)  # dist.Work of the irecvs of logits and pooled rows
    sends: list[Any] = field(default_factory=list)  # dist.Work of the isends to stage 1
    keep: list[torch.Tensor] = field(default_factory=list)  # tensors the isends read from
    mask: PendingMask | None = None  # grammar masks of the constrained rows, computed meanwhile
    # Sampled in submit() (LocalExecutor.samples_ahead): the draws, still on the device.
    ahead: SampledOnDevice | None = None

    @cached_property
    def sample_index(self) -> dict[str, int]:
        """Each sampling row's index among the draws, by request id (what a carried row of the next
        step reads)."""
        assert self.rows is not None
        return {self.rows.rows[r].request_id: j for j, r in enumerate(self.sample_rows)}


class ExecutorBase(ABC):
    """The driver's side of every executor: sizes read off its runner, a step's rows and grammar masks
    (_begin_step), and scoring and sampling in collect()."""

    def __init__(
        self, config: EngineConfig, model_path: Path, runner: ModelRunner, pipeline_depth: int
    ) -> None:
        self.config = config
        self.model_path = model_path
        self.runner = runner  # rank 0's share of the model (the whole model in one process)
        self.device = runner.device
        self.dtype = runner.dtype
        self.num_kv_blocks: int = runner.num_kv_blocks
        self.block_size: int = runner.block_size
        self.kv_cache_dtype: str = runner.kv_cache.spec.format.name
        self.max_model_len: int = runner.max_model_len
        self.vocab_size: int = runner.vocab_size
        self.hidden_size: int = runner.hidden_size
        self.eos_token_ids: frozenset[int] = runner.eos_token_ids
        self.pipeline_depth: int = pipeline_depth
        self.sampler = Sampler(self.vocab_size, self.eos_token_ids, self.device, config.seed)
        # Grammar masks (structured outputs): only the driver samples, so only it holds matchers.
        self.masker = TokenMasker()
        # Speculative decoding with a draft model (engine/draft_proposer.py): None without one.
        self.proposer: DraftProposer | None = None

    @property
    def device_type(self) -> str:
        return self.device.type

    @property
    def draft_model_cost(self) -> float | None:
        return self.proposer.cost if self.proposer is not None else None

    @property
    def kv_window(self) -> int | None:
        # A draft model catches up on the positions it has not seen, reading keys the target's window
        # has left behind: with one, every block stays.
        return self.runner.kv_window if self.proposer is None else None

    @property
    def dead_reason(self) -> str | None:
        return None

    @property
    def can_restart(self) -> bool:
        return False  # one process: a failed step fails only its requests, nothing goes down

    def restart(self) -> None:
        raise FatalRunnerError(f"{type(self).__name__} cannot restart")

    @abstractmethod
    def submit(self, batch: Sequence[ScheduledSequence]) -> PendingStep: ...

    def _wait(self, pending: PendingStep) -> None:
        """Until the pending step's logits are here (a distributed executor waits on its transfers)."""
        return None  # one process: submit() computed them

    def collect(self, pending: PendingStep) -> list[StepResult]:
        self._wait(pending)
        out: list[StepResult] = [None] * len(pending.batch)
        rows = pending.rows
        if pending.pooled is not None and rows is not None:
            # Copied in submit() where the next step may be queued before this one is collected: a
            # .tolist() here would wait for that one too.
            pooled = pending.pooled_copy.tolist()[0] if pending.pooled_copy else pending.pooled.tolist()
            for span, values in zip(pending.pools, pooled, strict=True):
                out[rows.entry_of_row[span.entry]] = PooledState(values, span.num_tokens)
        if pending.logits is None or rows is None:
            return out
        logits = pending.logits
        if pending.ahead is not None:
            sampled = pending.ahead.result()
        else:
            with torch.inference_mode():
                if pending.scored:  # before sampling, which changes its rows in place
                    for r, scored in score_prompt_tokens(logits, rows.rows, pending.scored):
                        out[rows.entry_of_row[r]] = scored
                    logits = logits[pending.sample_logit_rows]
                if not pending.sample_rows:
                    return out
                sampled = self.sampler(
                    logits, rows.sampling, pending.mask, rows.drafts if rows.has_drafts else None
                )
        for i, tok in enumerate(accept(rows, sampled)):
            if tok is None:
                continue
            prompt = out[i]
            if isinstance(prompt, PromptLogprobs):  # the last prompt chunk both scores and samples
                tok.prompt_logprobs = prompt
            out[i] = tok
        return out

    def _begin_step(self, batch: Sequence[ScheduledSequence]) -> tuple[PendingStep, HostStepInputs]:
        """A batch's PendingStep and host inputs, the same for every executor: the draft model's
        proposals for the entries that ask for them, verifications spread over one-token rows
        (engine/speculative.py), the inputs of those rows, which logits rows sample and which score
        prompt tokens (what collect() reads), and the grammar masks of the sampling rows started. Call
        it before the forward pass: the masks are computed while it runs (None, and no work, for a
        batch without a grammar). The masker is given exactly the rows collect() hands the sampler, in
        the same order, since a mask's row indices are positions among them."""
        draft_probs = None
        if self.proposer is not None and any(s.num_spec_tokens and not s.spec_token_ids for s in batch):
            batch, draft_probs = self.proposer.propose(batch)
        rows = spread(batch, draft_probs)
        host = self.runner.prepare_host(rows.rows)
        pending = PendingStep(
            batch,
            rows,
            sample_rows=host.sample_rows,
            scored=host.scored,
            sample_logit_rows=host.sample_logit_rows,
            pools=host.pools,
        )
        pending.mask = self.masker.start(rows.sampling)
        return pending, host

    def step(self, batch: Sequence[ScheduledSequence]) -> list[StepResult]:
        """One whole step: the batch's tokens, None for entries that do not sample."""
        return self.collect(self.submit(batch))

    def close(self) -> None:
        """Release what the executor holds beyond this process (worker processes)."""
        return None


def cuda_graphs_off_reason(config: EngineConfig, runner: ModelRunner) -> str | None:
    """Why a LocalExecutor cannot replay CUDA graphs for decode steps (None: it can)."""
    backend = runner.model.attn_backend
    if runner.device.type != "cuda":
        return f"the device is {runner.device}"
    if config.enforce_eager:
        return "--enforce-eager"
    if config.max_num_seqs is None:
        return "the largest batch is unknown (EngineConfig.max_num_seqs: the scheduler's --max-num-seqs)"
    if backend is None or not backend.capturable:
        name = backend.name if backend is not None else "none"
        return f"the {name!r} attention backend cannot be captured (the triton backend can)"
    blocker = runner.model.capture_blocker(runner.device)
    if blocker is not None:
        return f"the {runner.model.family.name} model's steps choose on the host what runs: {blocker}"
    return None


# The most tokens piecewise graphs are captured for (vLLM caps its capture sizes likewise): a larger
# step is compute-bound enough to run eagerly, and the pieces' memory (their activations at that many
# tokens, after the KV cache has taken its share of the device) stays small.
PIECEWISE_MAX_TOKENS = 2048


def piecewise_graphs_off_reason(config: EngineConfig) -> str | None:
    """Why an executor that captures decode graphs captures no piecewise ones (None: it does)."""
    if config.cuda_graphs != "all":
        return f"--cuda-graphs {config.cuda_graphs}"
    if config.max_num_batched_tokens is None:
        return "the largest step is unknown (EngineConfig.max_num_batched_tokens: the scheduler's flag)"
    return None


class LocalExecutor(ExecutorBase):
    """The whole model in this process (tensor and pipeline parallel size 1). On CUDA, decode steps
    replay CUDA graphs captured at start-up (engine/cuda_graphs.py), and the other steps piecewise ones
    (engine/piecewise_graphs.py; not with --cuda-graphs decode), unless --enforce-eager."""

    def __init__(self, config: EngineConfig) -> None:
        if config.tensor_parallel_size * config.pipeline_parallel_size > 1:
            raise ValueError("LocalExecutor runs one process; tensor/pipeline parallel sizes must be 1")
        model_path = resolve_model_path(config.model, config.load_format)
        runner = ModelRunner(config, model_path, resolve_device(config.device))
        super().__init__(config, model_path, runner, pipeline_depth=1)
        if config.draft_model is not None:
            from engine.draft_proposer import DraftProposer

            self.proposer = DraftProposer(config, runner)
        # Whether submit() samples the steps it can right after their forward rather than in collect(),
        # so that the next step's carried rows can take their tokens on the device (carries()): where
        # submit() only queues the work, on a GPU. On a CPU submit() is the forward itself and sampling
        # stays in collect(); tests turn this on there to run the same path.
        self.samples_ahead = self.device.type != "cpu"
        off = cuda_graphs_off_reason(config, runner)
        if off is None:
            assert config.max_num_seqs is not None
            runner.capture_decode_graphs(config.max_num_seqs)
            pieces_off = piecewise_graphs_off_reason(config)
            if pieces_off is None:
                assert config.max_num_batched_tokens is not None
                runner.capture_piecewise_graphs(min(config.max_num_batched_tokens, PIECEWISE_MAX_TOKENS))
            else:
                logger.info("piecewise CUDA graphs off: %s; steps with prompt tokens run eagerly", pieces_off)
        elif runner.device.type == "cuda":
            logger.info("CUDA graphs off: %s; every step runs eagerly", off)

    def submit(self, batch: Sequence[ScheduledSequence], carry: DeviceCarry | None = None) -> PendingStep:
        """Start a step (on a GPU: queue it). With `carry` (see `carries`), the carried rows' tokens
        are read on the device from the step before, which need not have been collected."""
        if not batch:
            return PendingStep(batch)
        pending, host = self._begin_step(batch)
        if carry is not None:
            host.carried = self._carried_tokens(carry, pending, host)
        out = self.runner.run_step(host)
        pending.logits = out.logits  # [R, vocab]; None without logits rows
        pending.pooled = out.pooled  # [P, hidden]; None without embedding entries
        if self.samples_ahead:
            self._sample_ahead(pending)
            if pending.pooled is not None:
                pending.pooled_copy = HostCopies(pending.pooled)
        return pending

    def _sample_ahead(self, pending: PendingStep) -> None:
        """Sample a submitted step now (samples_ahead) unless its sampling needs the host or a prompt's
        scores first: a grammar mask still being filled, prompt logprobs, proposals to verify."""
        rows = pending.rows
        if (
            pending.logits is None
            or rows is None
            or not pending.sample_rows
            or pending.mask is not None
            or pending.scored
            or rows.has_drafts
        ):
            return
        with torch.inference_mode():
            pending.ahead = self.sampler.start(pending.logits, rows.sampling)

    def carries(self, handle: PendingStep, batch: Sequence[ScheduledSequence]) -> bool:
        """Whether `batch`'s carried rows can take their tokens from `handle`'s step on the device
        (submit(batch, DeviceCarry(handle, rows))): that step sampled in submit(), and
        carriable_on_device."""
        return handle.ahead is not None and carriable_on_device(batch, handle.sample_index)

    def _carried_tokens(
        self, carry: DeviceCarry, pending: PendingStep, host: HostStepInputs
    ) -> CarriedTokens:
        """The carried rows' tokens, gathered on the device from the step before's draws, and where they
        go in this step's flat tokens (over CARRIED_PLACEHOLDER)."""
        before: PendingStep = carry.handle
        assert before.ahead is not None and pending.rows is not None
        batch, entry_of_row = pending.batch, pending.rows.entry_of_row
        starts = [0, *accumulate(host.query_lens)]
        # A carried row is its entry's first (only) row; rows are in batch order (spread).
        flat = [starts[bisect_left(entry_of_row, i)] for i in carry.rows]
        src = [before.sample_index[batch[i].request_id] for i in carry.rows]
        tokens = before.ahead.tokens.index_select(
            0, to_device(torch.tensor(src, dtype=torch.int64), self.device)
        )
        return CarriedTokens(flat, tokens)
