"""IterationLoop: the asyncio iteration loop between the server and the model runner.

One background task owns the scheduler. Each turn it drains pending aborts and finishes (so their KV
blocks are free before the next step), schedules one iteration, runs `runner.step` in a single worker
thread (the event loop keeps serving HTTP meanwhile), applies the sampled tokens and pushes deltas to
per-request queues. With nothing to do it sleeps on an asyncio.Event until a request arrives.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from collections.abc import AsyncIterator, Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Literal

from engine.contract import ModelRunner, SamplingParams
from scheduler.config import SchedulerConfig
from scheduler.core import ScheduledStep, Scheduler
from scheduler.outputs import FinishReason, RequestDelta, SchedulerStats, StepReport
from scheduler.request import Request

logger = logging.getLogger(__name__)

StepListener = Callable[[StepReport], None]
_Control = tuple[str, Literal["abort", "finish"]]


class LoopStoppedError(RuntimeError):
    """The engine was shut down or its loop died; it takes no more requests."""


def _merge(a: RequestDelta, b: RequestDelta) -> RequestDelta:
    """Two consecutive deltas of one request as one (the consumer fell behind the loop)."""
    logprobs = (
        None if a.logprobs is None and b.logprobs is None else [*(a.logprobs or ()), *(b.logprobs or ())]
    )
    return RequestDelta(
        request_id=a.request_id,
        token_ids=[*a.token_ids, *b.token_ids],
        logprobs=logprobs,
        finish_reason=b.finish_reason,
        error=b.error,
        num_prompt_tokens=b.num_prompt_tokens,
        num_output_tokens=b.num_output_tokens,
        queue_time_s=a.queue_time_s if a.queue_time_s is not None else b.queue_time_s,
    )


class IterationLoop:
    def __init__(self, runner: ModelRunner, config: SchedulerConfig | None = None) -> None:
        self.config = config or SchedulerConfig()
        self._runner = runner
        # A request longer than the whole KV cache could never run (reserve) or would preempt itself
        # forever (lazy), so the cache's capacity caps the length like the model's limit does.
        limits = [runner.max_model_len, runner.num_kv_blocks * runner.block_size]
        if self.config.max_model_len is not None:
            limits.append(self.config.max_model_len)
        self.max_model_len: int = min(limits)
        self._scheduler = Scheduler(
            self.config,
            num_kv_blocks=runner.num_kv_blocks,
            block_size=runner.block_size,
            max_model_len=self.max_model_len,
            eos_token_ids=runner.eos_token_ids,
        )
        self._queues: dict[str, asyncio.Queue[RequestDelta]] = {}
        # Aborts and finishes from any thread; deque append/popleft are atomic, and the loop applies
        # them only between steps, never while a step is using the blocks.
        self._control: deque[_Control] = deque()
        self._wake = asyncio.Event()
        self._listeners: list[StepListener] = []
        self._loop: asyncio.AbstractEventLoop | None = None
        self._task: asyncio.Task[None] | None = None
        self._executor: ThreadPoolExecutor | None = None
        self._closed = False  # shut down, or the loop died: no new requests
        self._stopping = False
        self._dead = False  # the loop crashed
        self._num_steps = 0

    # ---- lifecycle ------------------------------------------------------------------------------

    async def start(self) -> None:
        self._ensure_started()

    def _ensure_started(self) -> None:
        if self._closed:
            raise LoopStoppedError("the engine is not running")
        if self._task is not None:
            return
        self._loop = asyncio.get_running_loop()
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="orca-step")
        self._task = self._loop.create_task(self._run(), name="orca-scheduler-loop")

    async def shutdown(self) -> None:
        """Abort everything, stop the loop after its current step, join the worker thread."""
        self._closed = True
        self._stopping = True
        self._wake.set()
        if self._task is not None:
            try:
                await self._task
            except BaseException:  # already logged by the loop; shutting down regardless
                logger.debug("scheduler loop ended with an error", exc_info=True)
        if not self._dead:  # after a crash the scheduler's state is not to be trusted; streams are closed
            for request_id in list(self._scheduler.requests):
                self._emit_all(self._scheduler.abort(request_id))
        self._fail_all(FinishReason.ABORT, None)  # any stream still open (none in normal operation)
        if self._executor is not None:
            executor, self._executor = self._executor, None
            await asyncio.get_running_loop().run_in_executor(None, executor.shutdown, True)

    @property
    def is_running(self) -> bool:
        return (
            self._task is not None
            and not self._task.done()
            and not self._closed
            and self._runner_down() is None
        )

    def _runner_down(self) -> str | None:
        """Why the runner can take no more steps (a multi-process runner whose worker died), if it
        says so; a plain runner has no `dead_reason` and is never down."""
        reason = getattr(self._runner, "dead_reason", None)
        return reason if isinstance(reason, str) else None

    # ---- requests -------------------------------------------------------------------------------

    def generate(
        self, prompt_ids: Sequence[int], params: SamplingParams, request_id: str
    ) -> AsyncIterator[RequestDelta]:
        """Queue a request and return its deltas as an async iterator (call from the event loop).

        Raises ValueError at once for a request that cannot run (empty prompt, too long, duplicate
        id) and LoopStoppedError once the engine is shut down. Closing the iterator before the last
        delta (aclose(), a cancelled task, a client gone) aborts the request.
        """
        down = self._runner_down()
        if down is not None:
            raise LoopStoppedError(f"the engine is not running: {down}")
        if self._closed:
            raise LoopStoppedError("the engine is not running")
        prompt = tuple(prompt_ids)
        self._scheduler.validate(request_id, len(prompt), params.max_tokens)
        self._check_token_ids(prompt, params)
        self._ensure_started()
        # Safe while a step is in flight: the step holds only running requests, this joins `waiting`.
        self._scheduler.add(Request(request_id, prompt, params))
        queue: asyncio.Queue[RequestDelta] = asyncio.Queue()
        self._queues[request_id] = queue
        self._wake.set()
        return self._stream(request_id, queue)

    def _check_token_ids(self, prompt: Sequence[int], params: SamplingParams) -> None:
        """Reject ids the model does not have here: in a step they would fail every request batched
        with this one. (The runner's vocab_size is optional in the protocol; skipped without it.)"""
        vocab = getattr(self._runner, "vocab_size", None)
        if not isinstance(vocab, int):
            return
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
        self._control.append((request_id, "abort"))
        self._wake_threadsafe()

    def finish(self, request_id: str) -> None:
        """End a request as a normal stop (the server saw a stop string). Any thread; idempotent."""
        self._control.append((request_id, "finish"))
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
        s = self._scheduler
        return SchedulerStats(
            running=len(s.running),
            waiting=len(s.waiting),
            kv_blocks_used=s.allocator.num_used,
            kv_blocks_total=s.allocator.num_blocks,
            num_preemptions=s.num_preemptions,
            num_steps=self._num_steps,
        )

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
            logger.exception("the scheduler loop died")
            self._closed = self._dead = True
            self._fail_all(FinishReason.ERROR, f"the scheduler loop died: {type(exc).__name__}: {exc}")

    async def _iterate(self) -> None:
        depth = getattr(self._runner, "pipeline_depth", 1)
        if isinstance(depth, int) and depth > 1:
            await self._iterate_pipelined(depth)
            return
        loop = asyncio.get_running_loop()
        assert self._executor is not None
        sched = self._scheduler
        while not self._stopping:
            self._drain_control()
            if not sched.has_work():
                self._wake.clear()
                if not self._control and not self._stopping:
                    await self._wake.wait()
                continue
            step = sched.schedule()
            self._emit_all(step.released)
            if not step.seqs:
                if step.released or step.preempted:
                    continue
                raise RuntimeError("the scheduler has work but scheduled nothing")
            t0 = time.perf_counter()
            failed = False
            try:
                sampled = await loop.run_in_executor(self._executor, self._runner.step, step.seqs)
                updated = sched.update(step, sampled)
            except Exception as exc:
                logger.exception(
                    "step %d failed; failing its %d requests: %s",
                    self._num_steps,
                    step.num_seqs,
                    ", ".join(r.request_id for r in step.requests),
                )
                updated = sched.fail(step.requests, f"{type(exc).__name__}: {exc}")
                failed = True
                if getattr(exc, "fatal", False):
                    # The runner cannot recover (a worker process died): stop, failing every request.
                    self._emit_all(updated)
                    raise
            duration = time.perf_counter() - t0
            self._num_steps += 1
            self._emit_all(updated)
            if self._listeners:
                self._report(step, updated, duration, failed)

    async def _iterate_pipelined(self, depth: int) -> None:
        """ORCA's pipelined loop: keep up to `depth` batches in flight (one per pipeline stage) and wait
        only when that many are outstanding. The runner has submit(seqs) -> handle (returns once the
        first stage has its share) and collect(handle) -> sampled tokens, called in submission order.
        A request is in at most one in-flight batch: the scheduler skips those in flight."""
        loop = asyncio.get_running_loop()
        assert self._executor is not None
        runner: Any = self._runner
        sched = self._scheduler
        in_flight: deque[tuple[ScheduledStep, Any, float]] = deque()
        busy: set[str] = set()
        while in_flight or not self._stopping:
            self._drain_control()
            if not self._stopping and len(in_flight) < depth and sched.has_work():
                # Spread the requests over the batches in flight: one batch holding all of them would
                # leave the other stages idle (each request waits for its batch before it runs again).
                per_batch = -(-(len(sched.running) + len(sched.waiting)) // depth)
                step = sched.schedule(in_flight=busy, max_seqs=per_batch)
                self._emit_all(step.released)
                if step.seqs:
                    t0 = time.perf_counter()
                    try:
                        handle = await loop.run_in_executor(self._executor, runner.submit, step.seqs)
                    except Exception as exc:
                        self._step_failed(step, exc, t0)
                        continue
                    in_flight.append((step, handle, t0))
                    busy.update(r.request_id for r in step.requests)
                    continue
                if (step.released or step.preempted) and not in_flight:
                    continue
            if in_flight:
                step, handle, t0 = in_flight.popleft()
                try:
                    sampled = await loop.run_in_executor(self._executor, runner.collect, handle)
                    updated = sched.update(step, sampled)
                except Exception as exc:
                    self._step_failed(step, exc, t0)
                    continue
                finally:
                    busy.difference_update(r.request_id for r in step.requests)
                self._num_steps += 1
                self._emit_all(updated)
                if self._listeners:
                    self._report(step, updated, time.perf_counter() - t0, False)
                continue
            if not sched.has_work():
                self._wake.clear()
                if not self._control and not self._stopping:
                    await self._wake.wait()
                continue
            raise RuntimeError("the scheduler has work but scheduled nothing")

    def _step_failed(self, step: ScheduledStep, exc: Exception, t0: float) -> None:
        """Fail a step's requests; re-raise (ending the loop) if the runner cannot recover."""
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
        if getattr(exc, "fatal", False):
            raise exc
        if self._listeners:
            self._report(step, updated, time.perf_counter() - t0, True)

    def _drain_control(self) -> None:
        sched = self._scheduler
        while self._control:
            request_id, kind = self._control.popleft()
            released = sched.abort(request_id) if kind == "abort" else sched.finish(request_id)
            self._emit_all(released)

    def _report(self, step: ScheduledStep, updated: list[Request], duration: float, failed: bool) -> None:
        report = StepReport(
            num_seqs=step.num_seqs,
            num_tokens=step.num_tokens,
            num_prompt_tokens=step.num_prompt_tokens,
            num_decode_tokens=step.num_decode_tokens,
            duration_s=duration,
            num_preempted=len(step.preempted),
            num_finished=sum(1 for r in updated if r.is_finished),
            failed=failed,
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
        logprobs = req.output_logprobs[start:] if req.sampling.logprobs is not None else None
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
                logprobs=logprobs,
                finish_reason=finish,
                error=req.error,
                num_prompt_tokens=req.num_prompt_tokens,
                num_output_tokens=req.num_output_tokens,
                queue_time_s=queue_time,
            )
        )
        req.num_emitted_tokens = req.num_output_tokens

    def _fail_all(self, reason: FinishReason, message: str | None) -> None:
        """End every open stream (the loop died, or shutdown), so no client waits forever."""
        queues, self._queues = self._queues, {}
        for request_id, queue in queues.items():
            req = self._scheduler.requests.get(request_id)
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
