"""IterationLoop: the asyncio iteration loop between the server and the engine's executor.

One background task owns the scheduler. Each turn it drains pending aborts (so their KV blocks are free
before the next step), schedules one iteration, hands it to the executor in a single worker thread (the
event loop keeps serving HTTP meanwhile), applies the sampled tokens (their text and every stop rule
with them: scheduler.output_text, scheduler.stop) and pushes deltas to per-request queues. With nothing
to do it sleeps on an asyncio.Event until a request arrives.

There is one loop for every executor: it keeps up to `pipeline_depth` batches in flight (ORCA's rule for
pipeline parallelism, one batch per stage) and the single-process case is depth 1. Each turn makes one
trip to the worker thread, which submits the new batch and, when the pipeline is full (always, at depth
1), collects the oldest one.

At depth 1 with `overlap_schedule` (auto: on a GPU, and on a CPU past one stream) the loop overlaps
instead (_iterate_overlapped): the next step is scheduled and queued on the worker thread while the
current one runs, its decodes carried one token further (scheduler/overlap.py), and the current step's
tokens are applied and sent while the next one runs. Finishes are seen one step late
(docs/architecture.md, "Overlapped scheduling").
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from collections.abc import AsyncIterator, Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from typing import Any

from engine.contract import (
    DeviceCarry,
    Executor,
    FatalRunnerError,
    Pooling,
    SampledToken,
    SamplingParams,
    ScheduledSequence,
    StepResult,
)
from scheduler.config import SchedulerConfig
from scheduler.core import ScheduledStep, Scheduler
from scheduler.output_text import Detokenizer, OutputText, start_output
from scheduler.outputs import FinishReason, RequestDelta, SchedulerStats, StepReport
from scheduler.overlap import kept_rows, last_tokens, resolve, resolve_on_device
from scheduler.request import Request

logger = logging.getLogger(__name__)

StepListener = Callable[[StepReport], None]

# While idle, how often the loop checks that an executor that can restart is still up: a worker can
# die with nothing running, and is restarted before a request needs it.
IDLE_WATCH_S = 1.0


class RestartBudget:
    """At most `max_restarts` restarts within any `window_s` seconds: a worker that dies again and
    again (a broken GPU, a request that crashes it every time) ends in a server that says so (503)."""

    def __init__(self, max_restarts: int, window_s: float) -> None:
        self.max_restarts = max_restarts
        self.window_s = window_s
        self._times: deque[float] = deque()

    def allows(self, now: float) -> bool:
        while self._times and now - self._times[0] > self.window_s:
            self._times.popleft()
        return len(self._times) < self.max_restarts

    def record(self, now: float) -> None:
        self._times.append(now)


def new_step_thread() -> ThreadPoolExecutor:
    """The single worker thread an engine is built in and steps run in (see IterationLoop)."""
    return ThreadPoolExecutor(max_workers=1, thread_name_prefix="orca-step")


class LoopStoppedError(RuntimeError):
    """The loop was shut down or died (or its executor is down); it takes no more requests."""


def _merge(a: RequestDelta, b: RequestDelta) -> RequestDelta:
    """Two consecutive deltas of one request as one (the consumer fell behind the loop): the later
    one's state (finish, counts, embedding) with both deltas' tokens, logprobs and text, and what only
    a first delta carries from whichever has it."""
    logprobs = (
        None if a.logprobs is None and b.logprobs is None else [*(a.logprobs or ()), *(b.logprobs or ())]
    )
    return replace(
        b,
        token_ids=[*a.token_ids, *b.token_ids],
        logprobs=logprobs,
        text=a.text + b.text,
        queue_time_s=a.queue_time_s if a.queue_time_s is not None else b.queue_time_s,
        prompt_logprobs=a.prompt_logprobs if a.prompt_logprobs is not None else b.prompt_logprobs,
    )


@dataclass
class _InFlight:
    """A batch handed to the executor and not yet applied."""

    step: ScheduledStep
    started: float  # perf_counter() at submission (overlapped: when the worker starts it)
    handle: Any = None  # the executor's, from submit()
    sampled: list[StepResult] | None = None  # from collect()
    error: Exception | None = None  # submit() or collect() raised
    # Overlapped scheduling: the step that runs before this one and samples its carried rows' tokens,
    # the rows the worker kept of this one (None: all; scheduler.overlap.resolve), and its run time.
    after: _InFlight | None = None
    kept: list[int] | None = None
    submitted: Sequence[ScheduledSequence] = ()  # the rows as submitted, tokens put in
    duration: float | None = None
    # Overlapped: resolved (on the event loop) once the loop may apply this step's tokens.
    ready: asyncio.Future[None] | None = None


def _resolve_future(future: asyncio.Future[None]) -> None:
    if not future.done():
        future.set_result(None)


class IterationLoop:
    def __init__(
        self,
        executor: Executor,
        config: SchedulerConfig | None = None,
        step_thread: ThreadPoolExecutor | None = None,
        detokenizer: Detokenizer | None = None,
    ) -> None:
        """`detokenizer`: turns each request's tokens into the text its deltas carry, which stop strings
        are matched on (the server's tokenizer). Without one, deltas carry tokens only and a request with
        stop strings is refused.

        `step_thread`: the one-worker pool steps run in (the caller's: the loop shuts down only a pool
        it made itself). Pass the pool the executor was built in: OpenMP (torch's and the native kernels'
        threads) keeps a team of threads per thread that starts parallel regions, and with a second
        team on a machine with few cores libgomp stops spin-waiting, so every parallel region of a step
        pays a sleep and a wake-up (measured on 2 cores: a 22 ms decode step took 30 ms)."""
        self.config = config or SchedulerConfig()
        self._executor = executor
        self._detokenizer = detokenizer
        self._scheduler = Scheduler.for_executor(self.config, executor)
        self.max_model_len: int = self._scheduler.max_model_len  # the model's, capped by the KV cache
        self.hidden_size: int = executor.hidden_size  # the length of an embedding
        self._queues: dict[str, asyncio.Queue[RequestDelta]] = {}
        # Ids of requests to abort, from any thread; deque append/popleft are atomic, and the loop
        # applies them only between steps, never while a step is using the blocks.
        self._aborts: deque[str] = deque()
        self._wake = asyncio.Event()
        self._parked = False  # the loop task sleeps on _wake: nothing to run (is_idle)
        self._listeners: list[StepListener] = []
        self._loop: asyncio.AbstractEventLoop | None = None
        self._task: asyncio.Task[None] | None = None
        self._thread: ThreadPoolExecutor | None = step_thread
        self._owns_thread = step_thread is None
        self._closed = False  # shut down, or the loop died: no new requests
        self._stopping = False
        self._dead = False  # the loop crashed
        self._num_steps = 0
        # The executor went down in a step (FatalRunnerError): no new batches until it is restarted.
        self._down: FatalRunnerError | None = None
        self._restarting = False
        self._restarts = RestartBudget(self.config.max_worker_restarts, self.config.worker_restart_window_s)
        self._num_restarts = 0
        # Steps run on an accelerator: submit() only queues the forward. Overlapped, the loop then
        # schedules ahead at every step, and a step is collected once the next one is queued
        # (_schedules_ahead, _run_queued); so does an executor that samples in submit() (tests).
        self._on_accelerator = executor.device_type != "cpu"
        self._collects_late = self._on_accelerator or bool(getattr(executor, "samples_ahead", False))
        # The worker thread's share of an overlapped step.
        self._worker_step = self._run_queued if self._collects_late else self._run_step
        self._carries: Callable[[Any, Sequence[ScheduledSequence]], bool] | None = getattr(
            executor, "carries", None
        )

    # ---- lifecycle ------------------------------------------------------------------------------

    async def start(self) -> None:
        self._ensure_started()

    def _ensure_started(self) -> None:
        if self._closed:
            raise LoopStoppedError("the loop is not running")
        if self._task is not None:
            return
        self._loop = asyncio.get_running_loop()
        if self._thread is None:
            self._thread = new_step_thread()
        self._task = self._loop.create_task(self._run(), name="orca-scheduler-loop")

    async def shutdown(self) -> None:
        """Abort everything, stop the loop after the steps in flight, join the worker thread."""
        self._closed = True
        self._stopping = True
        self._wake.set()
        if self._task is not None:
            try:
                await self._task
            except BaseException:  # already logged by the loop; shutting down regardless
                logger.debug("scheduler loop ended with an error", exc_info=True)
        if not self._dead:  # after a crash the scheduler's state is not to be trusted; streams are closed
            self._emit_all(self._scheduler.abort_all())
        self._fail_all(FinishReason.ABORT, None)  # any stream still open (none in normal operation)
        if self._thread is not None and self._owns_thread:
            thread, self._thread = self._thread, None
            await asyncio.get_running_loop().run_in_executor(None, thread.shutdown, True)

    @property
    def is_running(self) -> bool:
        return (
            self._task is not None
            and not self._task.done()
            and not self._closed
            and not self._restarting
            and self._executor.dead_reason is None
        )

    @property
    def is_restarting(self) -> bool:
        """The executor's workers are being restarted: requests queue and run once they are back."""
        return self._restarting and not self._closed

    @property
    def is_idle(self) -> bool:
        """The loop is parked with nothing waiting, running or in flight: no step runs until a request
        (or an abort, or shutdown) wakes it."""
        return self._parked

    def _will_restart(self) -> bool:
        return self._restarting or (self._executor.can_restart and self._restarts.allows(time.monotonic()))

    # ---- requests -------------------------------------------------------------------------------

    def generate(
        self, prompt_ids: Sequence[int], params: SamplingParams, request_id: str
    ) -> AsyncIterator[RequestDelta]:
        """Queue a request and return its deltas as an async iterator (call from the event loop).

        This is where a request is validated, once: ValueError at once for a request that cannot run
        (empty prompt, too long, token ids outside the vocabulary, duplicate id, stop strings without a
        detokenizer), LoopStoppedError once the loop is shut down. Steps then trust their batches.
        Closing the iterator before the last delta (aclose(), a cancelled task, a client gone) aborts
        the request.
        """
        prompt = tuple(prompt_ids)
        self._check_token_ids(prompt, params)
        output = start_output(self._detokenizer, prompt, params)
        return self._submit(Request(request_id, prompt, params, output_text=output))

    def embed(
        self, prompt_ids: Sequence[int], pooling: Pooling, request_id: str
    ) -> AsyncIterator[RequestDelta]:
        """Queue an embedding request: prefill-only work in the same iteration loop, batched with the
        generating requests (chunked like any prompt). Its one delta carries the pooled final hidden
        states (`RequestDelta.embedding`, not normalised) with finish reason STOP; it frees its KV
        blocks once its prompt has run. Validated as `generate` is (the input alone must fit the
        context); closing the iterator early aborts it."""
        prompt = tuple(prompt_ids)
        params = SamplingParams()  # read by nothing: an embedding samples no token
        self._check_token_ids(prompt, params)
        return self._submit(
            Request(request_id, prompt, params, output_text=OutputText.without_text(), pooling=pooling)
        )

    def _submit(self, request: Request) -> AsyncIterator[RequestDelta]:
        down = self._executor.dead_reason
        if down is not None and not self._will_restart():
            raise LoopStoppedError(f"the engine is not running: {down}")
        if self._closed:
            raise LoopStoppedError("the loop is not running")
        request_id = request.request_id
        # Safe while a step is in flight: the step holds only running requests, this joins `waiting`.
        self._scheduler.add(request)  # validates lengths and the id
        self._ensure_started()
        queue: asyncio.Queue[RequestDelta] = asyncio.Queue()
        self._queues[request_id] = queue
        self._wake.set()
        return self._stream(request_id, queue)

    def _check_token_ids(self, prompt: Sequence[int], params: SamplingParams) -> None:
        """Reject ids the model does not have: in a step they would index past the embedding."""
        vocab = self._executor.vocab_size
        ids = [*prompt, *(params.logit_bias or ()), *params.stop_token_ids]
        bad = next((t for t in ids if not 0 <= t < vocab), None)
        if bad is not None:
            raise ValueError(f"token id {bad} is out of range for a vocabulary of {vocab}")

    async def _stream(
        self, request_id: str, queue: asyncio.Queue[RequestDelta]
    ) -> AsyncIterator[RequestDelta]:
        done = False
        try:
            while not done:
                delta = await queue.get()
                while not queue.empty():
                    delta = _merge(delta, queue.get_nowait())
                done = delta.finish_reason is not None
                yield delta
        finally:
            if not done:
                self.abort(request_id)

    def abort(self, request_id: str) -> None:
        """End a request; its KV blocks are free before the next step. Any thread; idempotent."""
        self._aborts.append(request_id)
        self._wake_threadsafe()

    def _wake_threadsafe(self) -> None:
        loop = self._loop
        if loop is None:
            return  # not started: the first turn of the loop drains the queue
        try:
            running = asyncio.get_running_loop()
        except RuntimeError:
            running = None
        if running is loop:
            self._wake.set()
        else:
            try:
                loop.call_soon_threadsafe(self._wake.set)
            except RuntimeError:  # the event loop is closed: nothing left to wake
                pass

    # ---- observability --------------------------------------------------------------------------

    def stats(self) -> SchedulerStats:
        return replace(self._scheduler.stats(), num_steps=self._num_steps, num_restarts=self._num_restarts)

    def add_step_listener(self, cb: StepListener) -> None:
        """Call cb(StepReport) after every step, on the event loop thread; keep it cheap."""
        self._listeners.append(cb)

    # ---- the loop -------------------------------------------------------------------------------

    async def _run(self) -> None:
        try:
            await self._iterate()
        except asyncio.CancelledError:
            self._closed = self._dead = True
            self._fail_all(FinishReason.ERROR, "the scheduler loop was cancelled")
            raise
        except Exception as exc:
            if not isinstance(exc, FatalRunnerError):
                logger.exception("the scheduler loop died")
            self._closed = self._dead = True
            self._fail_all(FinishReason.ERROR, f"the scheduler loop died: {type(exc).__name__}: {exc}")

    async def _iterate(self) -> None:
        if self._overlaps() and self._executor.pipeline_depth == 1:
            await self._iterate_overlapped()
            return
        loop = asyncio.get_running_loop()
        assert self._thread is not None
        sched = self._scheduler
        depth = self._executor.pipeline_depth
        in_flight: deque[_InFlight] = deque()
        busy: set[str] = set()  # ids of the requests in in-flight batches
        while in_flight or not self._stopping:
            self._drain_aborts()
            if not in_flight and not self._stopping and self._is_down():
                await self._recover(loop)
                continue
            new: _InFlight | None = None
            if not self._stopping and self._down is None and len(in_flight) < depth and sched.has_work():
                # Spread the requests over the batches in flight: one batch holding all of them would
                # leave the other stages idle (each request waits for its batch before it runs again).
                step = sched.schedule(in_flight=busy, max_seqs=-(-sched.num_unfinished // depth))
                self._emit_all(step.released)
                if step.seqs:
                    new = _InFlight(step, time.perf_counter())
                    in_flight.append(new)
                    busy.update(r.request_id for r in step.requests)
                elif (step.released or step.preempted) and not in_flight:
                    continue
            if not in_flight:
                if sched.has_work() and not self._stopping:
                    raise RuntimeError("the scheduler has work but scheduled nothing")
                self._wake.clear()
                if not self._aborts and not self._stopping:
                    await self._idle()
                continue
            # Collect the oldest batch once the pipeline is full, or when there is nothing new to add.
            oldest = in_flight[0] if new is None or len(in_flight) == depth else None
            await loop.run_in_executor(self._thread, self._turn, new, oldest)
            if new is not None and new.error is not None:
                in_flight.remove(new)
                busy.difference_update(r.request_id for r in new.step.requests)
                self._step_done(new)
            if oldest is not None and oldest in in_flight:
                in_flight.popleft()
                busy.difference_update(r.request_id for r in oldest.step.requests)
                self._step_done(oldest)

    def _overlaps(self) -> bool:
        """Whether the overlapped loop runs: --overlap-schedule on or auto (which then decides step by
        step, _schedules_ahead)."""
        return self.config.overlap_schedule is not False

    def _schedules_ahead(self, pending: ScheduledStep) -> bool:
        """Whether to schedule the next step while `pending` runs. auto: always where steps run on an
        accelerator; on the CPU only past one sequence. A CPU forward pass keeps every core busy, so
        the loop's work beside it takes a core from its OpenMP team: with one stream there is one delta
        to hide and the forward pays more than that (phi-4-mini on 2 cores over HTTP: 1.06-1.11x
        llama-server with overlap, 1.23-1.38x without), while at 8 streams overlap is never behind (the
        default model: 4.15x / 3.54x with it, 2.90x / 3.56x without; docs/benchmarks.md)."""
        chosen = self.config.overlap_schedule
        if chosen is not None:
            return chosen
        return self._on_accelerator or pending.num_seqs > 1

    async def _iterate_overlapped(self) -> None:
        """The loop with overlapped scheduling (one batch at a time on the executor, as at depth 1):
        while step N runs on the worker thread, this schedules step N+1 (its decodes carried one token
        further: Scheduler.schedule(pending=...)) and queues it behind N, then applies N's tokens and
        sends its deltas. So the worker starts N+1 as soon as N is done, and what the loop does between
        steps is hidden behind the forward pass. Finishes are seen one step late: a request that N's
        token ended has run a row in N+1 for nothing, whose token is dropped (Scheduler.update skips
        finished requests). Requests that cannot be carried (scheduler.core.Scheduler._carry) wait for
        N's tokens: when nothing can be carried, N+1 is scheduled after N is applied, as without
        overlap."""
        loop = asyncio.get_running_loop()
        sched = self._scheduler
        pending: _InFlight | None = None  # queued or running on the worker, not applied
        while pending is not None or not self._stopping:
            self._drain_aborts()
            if pending is None and not self._stopping and self._is_down():
                await self._recover(loop)
                continue
            new: _InFlight | None = None
            ahead = pending is None or self._schedules_ahead(pending.step)
            if ahead and not self._stopping and self._down is None and sched.has_work():
                step = sched.schedule(pending=pending.step if pending is not None else None)
                self._emit_all(step.released)
                if step.seqs:
                    new = _InFlight(step, time.perf_counter(), after=pending, ready=loop.create_future())
                elif (step.released or step.preempted) and pending is None:
                    continue
            if pending is None:
                if new is None:
                    if sched.has_work() and not self._stopping and self._down is None:
                        raise RuntimeError("the scheduler has work but scheduled nothing")
                    self._wake.clear()
                    if not self._aborts and not self._stopping:
                        await self._idle()
                    continue
                # Nothing to overlap with: schedule the step after this one while it runs.
                pending = new
                loop.run_in_executor(self._thread, self._worker_step, new)
                continue
            if new is not None:
                loop.run_in_executor(self._thread, self._worker_step, new)  # raises nothing
            elif self._collects_late:
                loop.run_in_executor(self._thread, self._collect_queued, pending)  # nothing behind it
            assert pending.ready is not None
            await pending.ready
            if pending.kept != []:  # else every row was dropped: nothing ran
                self._step_done(pending)
            pending = new

    def _run_step(self, flight: _InFlight) -> None:
        """An overlapped step on a CPU, where submit() is the forward itself: put the step before's
        tokens into the carried rows (scheduler/overlap.py), run the step, collect it and hand its
        tokens to the loop."""
        flight.started = time.perf_counter()
        before, flight.after = flight.after, None  # the chain of steps must not keep every step alive
        try:
            seqs = flight.step.seqs
            if before is not None:
                seqs, flight.kept = resolve(seqs, flight.step.requests, self._tokens_of(before))
            flight.submitted = seqs
            handle = self._executor.submit(seqs) if seqs else None
            flight.sampled = self._executor.collect(handle) if handle is not None else []
        except Exception as exc:
            flight.error = exc
        flight.duration = time.perf_counter() - flight.started
        self._release(flight)

    def _run_queued(self, flight: _InFlight) -> None:
        """An overlapped step where submit() only queues it (an accelerator): submit it, then collect
        the step before and hand that one's tokens to the loop; this one is collected by the step queued
        behind it, or by _collect_queued when the loop queues none.

        Where the executor `carries` them, the carried rows take the step before's tokens on the device
        (engine.contract.DeviceCarry), so this step is queued while that one still runs and the device
        goes from one to the next without waiting for the host: reading the tokens back, putting them in
        and building this step's inputs all happen meanwhile. Otherwise the step before is collected
        first and its tokens put in on the host (scheduler/overlap.py), and this step starts once its
        inputs are built. Either way the step before's tokens reach the loop only once this step is
        queued: the loop's Python (applying them, detokenizing, sending, scheduling the next step)
        runs while the device computes, instead of competing for the GIL with the input building
        while the device idles (measured on an H200 before that: each step 0.23-0.27 ms longer in the
        loop than bare, the time the loop's work took)."""
        flight.started = time.perf_counter()
        before, flight.after = flight.after, None  # the chain of steps must not keep every step alive
        executor = self._executor
        try:
            seqs = flight.step.seqs
            carry = None
            if before is not None and self._can_carry(before, seqs):
                seqs, flight.kept, rows = resolve_on_device(seqs, flight.step.requests)
                carry = DeviceCarry(before.handle, rows) if rows else None
            elif before is not None:
                self._collect(before)
                seqs, flight.kept = resolve(seqs, flight.step.requests, self._tokens_of(before))
            flight.submitted = seqs
            if seqs:
                flight.handle = executor.submit(seqs, carry=carry) if carry else executor.submit(seqs)
        except Exception as exc:
            flight.error = exc
        if before is not None:
            self._collect(before)
            self._release(before)

    def _can_carry(self, before: _InFlight, seqs: Sequence[ScheduledSequence]) -> bool:
        """Whether `seqs`' carried rows can take their tokens from `before` on the device: it is
        submitted, not collected, and the executor `carries` them."""
        if self._carries is None or before.handle is None:
            return False
        return before.sampled is None and before.error is None and self._carries(before.handle, seqs)

    def _collect_queued(self, flight: _InFlight) -> None:
        """On the worker thread: collect a queued step that no step was queued behind (_run_queued)."""
        self._collect(flight)
        self._release(flight)

    def _collect(self, flight: _InFlight) -> None:
        """Wait for a submitted step's tokens (once; a step that failed has none)."""
        if flight.sampled is not None or flight.error is not None:
            return
        try:
            handle = flight.handle
            flight.sampled = self._executor.collect(handle) if handle is not None else []
        except Exception as exc:
            flight.error = exc
        flight.duration = time.perf_counter() - flight.started

    @staticmethod
    def _tokens_of(before: _InFlight) -> dict[str, int]:
        """The step before's last token of each request it sampled for (none if it failed)."""
        if before.error is not None or before.sampled is None:
            return {}
        return last_tokens(before.submitted, before.sampled)

    def _release(self, flight: _InFlight) -> None:
        """From the worker thread: let the loop apply a step's tokens (or its error)."""
        assert self._loop is not None and flight.ready is not None
        self._loop.call_soon_threadsafe(_resolve_future, flight.ready)

    async def _idle(self) -> None:
        """Sleep until there is work; an executor that can restart is checked meanwhile (IDLE_WATCH_S)."""
        self._parked = True
        try:
            if not self._executor.can_restart:
                await self._wake.wait()
                return
            await asyncio.wait_for(self._wake.wait(), IDLE_WATCH_S)
        except asyncio.TimeoutError:
            pass
        finally:
            self._parked = False

    def _is_down(self) -> bool:
        return self._down is not None or self._executor.dead_reason is not None

    async def _recover(self, loop: asyncio.AbstractEventLoop) -> None:
        """The executor is down (a worker died). Its KV cache is lost with it, so the running requests
        fail (an error event, or a 500): recomputing them instead would run again whatever request
        may have crashed the worker and spend the restart budget on it. Waiting requests had nothing
        cached and are served once the executor is back. Raises FatalRunnerError, which ends the loop,
        when the executor cannot restart, the budget is spent, or the restart fails."""
        executor = self._executor
        cause = executor.dead_reason or str(self._down)
        self._down = None
        self._emit_all(
            self._scheduler.kv_cache_lost(f"the engine went down while running this request: {cause}")
        )
        now = time.monotonic()
        if not executor.can_restart:
            raise FatalRunnerError(cause)
        if not self._restarts.allows(now):
            cfg = self.config
            logger.error(
                "the engine is down (%s) after %d restarts within %g s: giving up",
                cause,
                cfg.max_worker_restarts,
                cfg.worker_restart_window_s,
            )
            raise FatalRunnerError(f"{cause} (restarted {cfg.max_worker_restarts} times already)")
        self._restarts.record(now)
        self._restarting = True
        logger.warning(
            "the engine is down (%s): restarting it; %d waiting requests run once it is back",
            cause,
            self._scheduler.stats().waiting,
        )
        try:
            await loop.run_in_executor(self._thread, executor.restart)
        except Exception as exc:
            logger.error("restarting the engine failed: %s", exc)
            raise FatalRunnerError(f"{cause}; restarting failed: {exc}") from exc
        finally:
            self._restarting = False
        self._num_restarts += 1

    def _turn(self, new: _InFlight | None, oldest: _InFlight | None) -> None:
        """The worker thread's share of one turn: submit the new batch, collect the oldest."""
        executor = self._executor
        if new is not None:
            try:
                new.handle = executor.submit(new.step.seqs)
            except Exception as exc:
                new.error = exc
        if oldest is not None and oldest.error is None:
            try:
                oldest.sampled = executor.collect(oldest.handle)
            except Exception as exc:
                oldest.error = exc

    def _step_done(self, done: _InFlight) -> None:
        """Apply a finished batch's tokens (or fail its requests), count it, tell the listeners.
        A FatalRunnerError marks the executor down: no new batch until _recover()."""
        step, exc = done.step, done.error
        if done.kept is not None:  # the worker dropped carried rows of finished requests
            step = kept_rows(step, done.kept)
        updated: list[Request] = []
        if exc is None:
            assert done.sampled is not None
            try:
                updated = self._scheduler.update(step, done.sampled)
            except Exception as update_exc:  # the executor returned something that does not fit
                exc = update_exc
        if exc is not None:
            logger.error(
                "step %d failed; failing its %d requests: %s",
                self._num_steps,
                step.num_seqs,
                ", ".join(r.request_id for r in step.requests),
                exc_info=exc,
            )
            updated = self._scheduler.fail(step.requests, f"{type(exc).__name__}: {exc}")
        self._num_steps += 1
        self._emit_all(updated)
        if self._listeners:
            results = done.sampled if exc is None else None
            duration = done.duration if done.duration is not None else time.perf_counter() - done.started
            self._report(step, updated, results, duration, exc is not None)
        if isinstance(exc, FatalRunnerError) and self._down is None:
            self._down = exc

    def _drain_aborts(self) -> None:
        while self._aborts:
            self._emit_all(self._scheduler.abort(self._aborts.popleft()))

    def _report(
        self,
        step: ScheduledStep,
        updated: list[Request],
        results: Sequence[StepResult] | None,
        duration: float,
        failed: bool,
    ) -> None:
        # Plain lists of ids and ints, built only when someone listens: a few hundred ns per request.
        finished = [r.request_id for r in step.released]
        finished += [r.request_id for r in updated if r.is_finished]
        starts = [seq.start_position for seq in step.seqs]
        stats = self._scheduler.stats()
        proposed = [seq.num_spec_tokens for seq in step.seqs]
        accepted = [0] * len(proposed)
        if results is not None and step.num_spec_tokens:
            accepted = [r.num_accepted if isinstance(r, SampledToken) else 0 for r in results]
        report = StepReport(
            num_seqs=step.num_seqs,
            num_tokens=step.num_tokens,
            num_prompt_tokens=step.num_prompt_tokens,
            num_decode_tokens=step.num_decode_tokens,
            duration_s=duration,
            num_preempted=len(step.preempted),
            num_finished=sum(1 for r in updated if r.is_finished),
            failed=failed,
            step=self._num_steps,
            request_ids=[seq.request_id for seq in step.seqs],
            request_num_tokens=[len(seq.token_ids) for seq in step.seqs],
            request_start_positions=starts,
            # As the scheduler counts decode tokens: one token past the prompt.
            request_is_decode=[
                len(seq.token_ids) == 1 and start >= req.num_prompt_tokens
                for seq, start, req in zip(step.seqs, starts, step.requests, strict=True)
            ],
            preempted_ids=[r.request_id for r in step.preempted],
            finished_ids=finished,
            num_waiting=stats.waiting,
            kv_blocks_used=stats.kv_blocks_used,
            kv_blocks_total=stats.kv_blocks_total,
            num_spec_proposed=step.num_spec_tokens,
            num_spec_accepted=sum(accepted),
            request_num_proposed=proposed,
            request_num_accepted=accepted,
        )
        for cb in self._listeners:
            try:
                cb(report)
            except Exception:  # a metrics bug must not stop serving
                logger.exception("step listener %r failed", cb)

    # ---- deltas ---------------------------------------------------------------------------------

    def _emit_all(self, reqs: list[Request]) -> None:
        for req in reqs:
            self._emit(req)

    def _emit(self, req: Request) -> None:
        """Queue the request's output since its previous delta (and its end, if it ended)."""
        finish = req.finish_reason
        start = req.num_emitted_tokens
        if start == req.num_output_tokens and finish is None:
            return
        queue = (
            self._queues.pop(req.request_id, None) if finish is not None else self._queues.get(req.request_id)
        )
        if queue is None:
            return
        text, logprobs = req.output_text.take()
        # Only the first delta carries the queue time (start == 0: nothing emitted before it).
        queue_time = (
            req.first_scheduled_time - req.arrival_time
            if start == 0 and req.first_scheduled_time is not None
            else None
        )
        queue.put_nowait(
            RequestDelta(
                request_id=req.request_id,
                token_ids=req.output_token_ids[start:],
                logprobs=logprobs if req.sampling.logprobs is not None else None,
                text=text,
                finish_reason=finish,
                stop_string=req.output_text.matched if finish is not None else None,
                error=req.error,
                num_prompt_tokens=req.num_prompt_tokens,
                num_output_tokens=req.num_output_tokens,
                num_cached_tokens=req.num_cached_tokens,
                queue_time_s=queue_time,
                prompt_logprobs=[None, *req.prompt_logprobs]
                if start == 0 and req.sampling.prompt_logprobs is not None
                else None,
                embedding=req.embedding if finish is FinishReason.STOP else None,
            )
        )
        req.num_emitted_tokens = req.num_output_tokens

    def _fail_all(self, reason: FinishReason, message: str | None) -> None:
        """End every open stream (the loop died, or shutdown), so no client waits forever."""
        queues, self._queues = self._queues, {}
        for request_id, queue in queues.items():
            req = self._scheduler.get(request_id)
            queue.put_nowait(
                RequestDelta(
                    request_id=request_id,
                    token_ids=[],
                    logprobs=None if req is None or req.sampling.logprobs is None else [],
                    finish_reason=reason,
                    error=message,
                    num_prompt_tokens=req.num_prompt_tokens if req is not None else 0,
                    num_output_tokens=req.num_emitted_tokens if req is not None else 0,
                )
            )
