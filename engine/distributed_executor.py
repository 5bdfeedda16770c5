"""Tensor- and pipeline-parallel executor on torch.distributed.

Every rank runs the same engine.model_runner.ModelRunner over its shard. Rank 0, the driver, lives in
the server process: it runs the scheduler, holds tensor shard 0 of the first pipeline stage, and samples
(DistributedExecutor). Ranks 1..N-1 are worker processes (started here with torch multiprocessing, or by
torchrun across machines) that loop in `serve_rank`: receive a step message, run their part, pass the
result on.

One step, for TP=t and PP=p:
  driver: build the batch's inputs, note its rows and start its grammar masks (ExecutorBase._begin_step),
          broadcast the step message to stage 0's other ranks, run stage 0 (ModelRunner.run_step),
          send (message, hidden states) to stage 1 (each TP rank to its counterpart)
  stage s: receive, run its part (ModelRunner.run_step, on its own KV cache), send on; the last stage
          gathers the vocab shards of the logits rows and its TP rank 0 sends them to the driver, then
          the embedding entries' pooled hidden states (engine/pooling.py), if the step has any
  driver: receive them, score prompt tokens, sample and hand out the pooled rows (ExecutorBase.collect).
Every rank runs its part through the same ModelRunner.run_step; this module only moves the message,
the hidden states and the logits between ranks. `submit()` returns after stage 0 so the scheduler can
put up to p batches in flight (ORCA); `collect()` waits for a batch's logits and samples. `step()` is
submit + collect.
"""

from __future__ import annotations

import atexit
import gc
import logging
import multiprocessing.connection
import multiprocessing.process
import os
import signal
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from engine.config import (
    EngineConfig,
    resolve_device,
    resolve_model_path,
)
from engine.contract import ScheduledSequence
from engine.distributed import (
    OP_SHUTDOWN,
    RankGroups,
    Topology,
    WorkerDiedError,
    broadcast_message,
    decode_batch,
    encode_batch,
    init_groups,
    launched_by_torchrun,
    recv_message,
    send_message,
    shutdown_message,
)
from engine.executor import ExecutorBase, PendingStep
from engine.model_runner import ModelRunner
from engine.ports import LOOPBACK, free_tcp_port

logger = logging.getLogger(__name__)

# After a failed collective, how long to wait for a local worker to be seen exiting.
DEATH_GRACE_S = 1.0
# How often start-up checks that the workers are still alive.
STARTUP_POLL_S = 0.2
# How often a driver on CUDA checks a pending receive (and its workers) while it waits.
NCCL_POLL_S = 0.0005
# How long a restart waits to leave the broken process group.
LEAVE_GROUP_TIMEOUT_S = 30.0

T = TypeVar("T")


def rank_device(config: EngineConfig, local_rank: int) -> torch.device:
    """Each rank's device: the CPU, or the local_rank-th GPU of its machine."""
    device = resolve_device(config.device)
    if device.type == "cuda":
        return torch.device("cuda", (device.index or 0) + local_rank)
    return device


def share_cpu_threads(local_world_size: int) -> None:
    """Ranks on one CPU split its cores; torch's default (all cores each) oversubscribes them."""
    cores = os.cpu_count() or 1
    torch.set_num_threads(max(1, cores // local_world_size))


def recv_hidden(
    runner: ModelRunner, num_tokens: int, src: int, group: dist.ProcessGroup | None
) -> torch.Tensor:
    hidden = torch.empty(
        num_tokens, runner.hidden_size, dtype=runner.dtype, device=runner.device
    )  # [T, hidden]
    dist.recv(hidden, src, group=group)
    return hidden


def serve_rank(runner: ModelRunner, g: RankGroups) -> None:
    """A worker rank's loop: run steps until the shutdown message."""
    with torch.inference_mode():
        while True:
            if g.is_first_stage:
                assert g.stage0_control is not None  # workers of stage 0 exist only with TP > 1
                msg = broadcast_message(None, 0, g.stage0_control)
            else:
                msg = recv_message(g.prev_rank, g.control)
            if msg.op == OP_SHUTDOWN:
                if not g.is_last_stage:
                    send_message(msg, g.next_rank, g.control)
                return
            hidden_in = None if g.is_first_stage else recv_hidden(runner, msg.num_tokens, g.prev_rank, g.data)
            out = runner.run_step(runner.prepare_host(decode_batch(msg)), hidden_in)
            if out.hidden is not None:  # not the last stage
                send_message(msg, g.next_rank, g.control)
                dist.send(out.hidden, g.next_rank, group=g.data)
            elif g.rank == g.last_stage_head:  # every TP rank computed them; one sends, in this order
                if out.logits is not None:
                    dist.send(out.logits, 0, group=g.data)
                if out.pooled is not None:
                    dist.send(out.pooled, 0, group=g.data)


# ---- worker processes ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class WorkerSpec:
    """What a spawned worker needs (picklable)."""

    rank: int
    topology: Topology
    init_method: str
    engine: EngineConfig
    model_path: str
    local_world_size: int


def worker_main(spec: WorkerSpec) -> None:
    """Entry point of a worker process started by the driver."""
    # Ctrl-C reaches the whole foreground process group; the driver decides when workers stop (it
    # drains in-flight requests first), so they ignore it.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s rank{spec.rank} %(levelname)s %(message)s")
    device = rank_device(spec.engine, spec.rank)
    if device.type == "cpu":
        share_cpu_threads(spec.local_world_size)
    groups = init_groups(
        spec.rank, spec.topology, spec.init_method, device, spec.engine.distributed_timeout_s
    )
    try:
        serve_rank(ModelRunner(spec.engine, Path(spec.model_path), device, groups), groups)
    finally:
        dist.destroy_process_group()


def run_torchrun_worker(config: EngineConfig) -> None:
    """Entry point of ranks 1..N-1 under torchrun (`python -m server` on every rank; see docs)."""
    rank = int(os.environ["RANK"])
    topology = Topology(config.tensor_parallel_size, config.pipeline_parallel_size)
    if int(os.environ["WORLD_SIZE"]) != topology.world_size:
        raise ValueError(
            f"torchrun started {os.environ['WORLD_SIZE']} processes, but tensor x pipeline parallel "
            f"size is {topology.world_size}"
        )
    local_rank = int(os.environ.get("LOCAL_RANK", rank))
    device = rank_device(config, local_rank)
    if device.type == "cpu":
        share_cpu_threads(int(os.environ.get("LOCAL_WORLD_SIZE", 1)))
    model_path = resolve_model_path(config.model, config.load_format)
    groups = init_groups(rank, topology, "env://", device, config.distributed_timeout_s)
    try:
        serve_rank(ModelRunner(config, model_path, device, groups), groups)
    finally:
        dist.destroy_process_group()


# ---- the driver ---------------------------------------------------------------------------------------


def _destroy_group_within(timeout_s: float) -> bool:
    """destroy_process_group, bounded: a collective backend may wait on a dead peer. True when this
    process belongs to no group afterwards."""

    def destroy() -> None:
        try:
            dist.destroy_process_group()
        except Exception:  # a broken group may fail to tear down; what matters is that it is gone
            logger.debug("destroy_process_group failed", exc_info=True)

    leaving = threading.Thread(target=destroy, name="orca-leave-group", daemon=True)
    leaving.start()
    leaving.join(timeout_s)
    return not leaving.is_alive() and not dist.is_initialized()


class DistributedExecutor(ExecutorBase):
    """engine.contract.Executor over tensor_parallel_size x pipeline_parallel_size ranks."""

    def __init__(self, config: EngineConfig) -> None:
        if dist.is_initialized():
            raise ValueError(
                "this process already belongs to a process group: one parallel engine per process"
            )
        if config.draft_model is not None:
            raise ValueError("--draft-model runs in one process only (n-gram speculation works in parallel)")
        self.topology = Topology(config.tensor_parallel_size, config.pipeline_parallel_size)
        model_path = resolve_model_path(
            config.model, config.load_format
        )  # converts a GGUF once, before any worker starts
        self._procs: list[multiprocessing.process.BaseProcess] = []
        self._dead_reason: str | None = None
        self._closed = False
        # Ranks started by torchrun (across machines) are not ours to restart.
        self._torchrun = launched_by_torchrun()
        if self._torchrun:
            world = self.topology.world_size
            if int(os.environ["RANK"]) != 0:
                raise ValueError(
                    "DistributedExecutor is rank 0; other torchrun ranks run run_torchrun_worker"
                )
            if int(os.environ["WORLD_SIZE"]) != world:
                raise ValueError(
                    f"torchrun started {os.environ['WORLD_SIZE']} processes, but tensor x pipeline "
                    f"parallel size is {world}"
                )
        runner = self._start(config, model_path)
        atexit.register(self.close)
        # ORCA: as many batches in flight as there are stages.
        super().__init__(config, model_path, runner, pipeline_depth=self.topology.pp_size)

    def _start(self, config: EngineConfig, model_path: Path) -> ModelRunner:
        """Spawn the workers (unless torchrun started them), join the rendezvous, load rank 0's shard."""
        world = self.topology.world_size
        if self._torchrun:
            init_method = "env://"
            local_world = int(os.environ.get("LOCAL_WORLD_SIZE", 1))
            device = rank_device(config, int(os.environ.get("LOCAL_RANK", 0)))
        else:
            # A fresh port each time: a restarted group must not meet the old rendezvous.
            init_method = f"tcp://{LOOPBACK}:{free_tcp_port()}"
            local_world = world
            device = rank_device(config, 0)
            self._spawn_workers(config, model_path, init_method, world)
        if device.type == "cpu":
            share_cpu_threads(local_world)
        try:
            self._groups = self._watching_workers(
                lambda: init_groups(0, self.topology, init_method, device, config.distributed_timeout_s)
            )
            # Built here, in the caller's thread (the one steps run in: one OpenMP thread team), with only
            # the wait for the other ranks watched from a helper thread.
            return ModelRunner(config, model_path, device, self._groups, agree=self._watching_workers)
        except BaseException:
            self._kill_workers()
            # Leave the half-made group too: this process could start no other parallel engine (the
            # server's restart, a second attempt) while it belongs to one.
            if dist.is_initialized():
                _destroy_group_within(LEAVE_GROUP_TIMEOUT_S)
            raise

    def _spawn_workers(self, config: EngineConfig, model_path: Path, init_method: str, world: int) -> None:
        ctx = mp.get_context("spawn")
        for rank in range(1, world):
            spec = WorkerSpec(rank, self.topology, init_method, config, str(model_path), world)
            # daemon: a driver that exits normally takes its workers with it.
            proc = ctx.Process(target=worker_main, args=(spec,), name=f"orca-rank{rank}", daemon=True)
            proc.start()
            self._procs.append(proc)

    def _watching_workers(self, start: Callable[[], T]) -> T:
        """Run a start-up phase that waits on every rank (rendezvous, loading) in a helper thread, and
        fail at once, naming the worker, if a worker process exits meanwhile (a worker that cannot
        load its shard would otherwise leave the driver waiting for the whole timeout)."""
        result: list[T] = []
        error: list[BaseException] = []
        done = threading.Event()

        def run() -> None:
            try:
                result.append(start())
            except BaseException as exc:  # handed to the caller's thread
                error.append(exc)
            finally:
                done.set()

        threading.Thread(target=run, name="orca-parallel-start", daemon=True).start()
        while not done.wait(STARTUP_POLL_S):
            exited = self._exited_worker()
            if exited is not None:
                raise WorkerDiedError(f"start-up failed: {exited} (see its log above)")
        if error:
            raise error[0]
        return result[0]

    # ---- health ---------------------------------------------------------------------------------

    @property
    def worker_pids(self) -> list[int]:
        return [p.pid for p in self._procs if p.pid is not None]

    @property
    def dead_reason(self) -> str | None:
        """Why this engine can run no more steps (None while it can). Cheap: the scheduler loop and the
        server's health check read it; a worker that exited is noticed here even while idle."""
        if self._dead_reason is None:
            self._dead_reason = self._exited_worker()
        return self._dead_reason

    def _exited_worker(self) -> str | None:
        for proc in self._procs:
            if not proc.is_alive():
                return f"worker {proc.name} (pid {proc.pid}) exited with code {proc.exitcode}"
        return None

    def _check_alive(self) -> None:
        reason = self.dead_reason
        if reason is not None:
            raise WorkerDiedError(f"the parallel engine is down: {reason}")

    def _fail(self, exc: BaseException) -> WorkerDiedError:
        """A collective failed mid-step: the group is broken for good."""
        # The failure is usually a peer's socket closing as it dies; give the process a moment to be
        # reaped so the error names the worker rather than the socket.
        if self._procs:
            gone = multiprocessing.connection.wait([p.sentinel for p in self._procs], DEATH_GRACE_S)
            for proc in self._procs:
                if proc.sentinel in gone:
                    # The sentinel closes a moment before the exit status can be collected.
                    proc.join(DEATH_GRACE_S)
        if self.dead_reason is None:
            self._dead_reason = f"a distributed operation failed ({type(exc).__name__}: {exc})"
        return WorkerDiedError(f"the parallel engine is down: {self.dead_reason}")

    # ---- steps ----------------------------------------------------------------------------------

    def submit(self, batch: Sequence[ScheduledSequence]) -> PendingStep:
        """Start a step: tell every rank, run stage 0. Returns once stage 0's part is sent on. Any
        failure raises WorkerDiedError: the ranks are no longer in step with each other."""
        if self._closed:
            raise WorkerDiedError("the parallel engine is shut down")
        self._check_alive()
        if not batch:
            return PendingStep(batch)
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)  # per thread: the step thread is not the one that started
        g, runner = self._groups, self.runner
        pending, host = self._begin_step(batch)
        assert pending.rows is not None
        msg = encode_batch(pending.rows.rows)  # the workers run the same rows
        try:
            with torch.inference_mode():
                if g.stage0_control is not None:
                    broadcast_message(msg, 0, g.stage0_control)
                out = runner.run_step(host)
                if out.hidden is None:  # no pipeline: this rank also holds (a shard of) the LM head
                    pending.logits, pending.pooled = out.logits, out.pooled
                    return pending
                pending.keep = [msg.header, msg.payload, out.hidden]
                pending.sends = [dist.isend(msg.header, g.next_rank, group=g.control)]
                if msg.payload.numel():
                    pending.sends.append(dist.isend(msg.payload, g.next_rank, group=g.control))
                pending.sends.append(dist.isend(out.hidden, g.next_rank, group=g.data))
                if host.num_logit_rows:
                    pending.logits = torch.empty(
                        host.num_logit_rows, self.vocab_size, dtype=torch.float32, device=self.device
                    )
                    pending.recvs.append(dist.irecv(pending.logits, g.last_stage_head, group=g.data))
                if host.pools:  # the embedding entries' pooled rows, after the logits
                    pending.pooled = torch.empty(
                        len(host.pools), self.hidden_size, dtype=torch.float32, device=self.device
                    )
                    pending.recvs.append(dist.irecv(pending.pooled, g.last_stage_head, group=g.data))
        except Exception as exc:
            raise self._fail(exc) from exc
        return pending

    def _wait(self, pending: PendingStep) -> None:
        """Until the step's sends are out and its logits and pooled rows have come back from the last
        stage."""
        try:
            for work in pending.sends:
                self._wait_work(work)
            for work in pending.recvs:
                self._wait_work(work)
        except WorkerDiedError:
            raise
        except Exception as exc:
            raise self._fail(exc) from exc
        pending.keep.clear()

    def _wait_work(self, work: Any) -> None:
        """Wait for a point-to-point operation. gloo fails at once when a peer's socket closes, but
        NCCL waits for a dead peer until its watchdog timeout, so on CUDA the driver polls the
        operation and its local workers' liveness instead of blocking."""
        if self.device.type == "cuda" and self._procs:
            while not work.is_completed():
                self._check_alive()
                time.sleep(NCCL_POLL_S)
        work.wait()

    # ---- restart --------------------------------------------------------------------------------

    @property
    def can_restart(self) -> bool:
        return not self._torchrun and not self._closed

    def restart(self) -> None:
        """Replace the whole group after a rank died: kill what is left of it, leave the broken process
        group, then start as at first (new workers, a new rendezvous on a new port, rank 0's shard
        loaded again: its layers hold the old tensor-parallel group). The KV cache starts empty."""
        if not self.can_restart:
            raise WorkerDiedError(
                "the parallel engine is shut down"
                if self._closed
                else "ranks started by torchrun cannot be restarted by the server; restart the job"
            )
        cause = self.dead_reason or "restart requested"
        self._dead_reason = f"restarting the workers after: {cause}"
        logger.warning("restarting the parallel engine's workers (%s)", cause)
        t0 = time.monotonic()
        self._kill_workers()
        self._procs = []
        # Drop rank 0's shard and KV cache before loading new ones: never two copies in memory.
        del self.runner
        gc.collect()
        self._leave_group()
        try:
            runner = self._start(self.config, self.model_path)
        except BaseException as exc:
            self._dead_reason = f"restarting the workers failed: {type(exc).__name__}: {exc}"
            raise WorkerDiedError(self._dead_reason) from exc
        if runner.num_kv_blocks != self.num_kv_blocks:  # the scheduler's block ids are fixed
            self.runner = runner
            self._dead_reason = (
                f"the restarted engine has {runner.num_kv_blocks} KV blocks, not {self.num_kv_blocks}"
            )
            raise WorkerDiedError(self._dead_reason)
        self.runner = runner
        self._dead_reason = None
        logger.warning("the parallel engine's workers are back after %.1f s", time.monotonic() - t0)

    def _leave_group(self) -> None:
        """destroy_process_group on a group a rank left broken (a default group that cannot be left
        means no new one can start)."""
        if not _destroy_group_within(LEAVE_GROUP_TIMEOUT_S):
            self._dead_reason = "the broken process group could not be left"
            raise WorkerDiedError(self._dead_reason)

    # ---- shutdown -------------------------------------------------------------------------------

    def close(self, timeout_s: float = 10.0) -> None:
        """Stop the workers (a shutdown message when the group is healthy, else kill) and leave the group."""
        if self._closed:
            return
        self._closed = True
        atexit.unregister(self.close)
        g = self._groups
        if self._dead_reason is None and all(p.is_alive() for p in self._procs):
            try:
                msg = shutdown_message()
                if g.stage0_control is not None:
                    broadcast_message(msg, 0, g.stage0_control)
                if not g.is_last_stage:
                    send_message(msg, g.next_rank, g.control)
                for proc in self._procs:
                    proc.join(timeout_s)
            except Exception:  # a broken group: the workers are killed below
                logger.warning("workers did not take the shutdown message; killing them", exc_info=True)
        self._kill_workers()
        try:
            dist.destroy_process_group()
        except Exception:  # a group left broken by a dead worker may fail to tear down; nothing to do
            logger.debug("destroy_process_group failed", exc_info=True)

    def _kill_workers(self) -> None:
        for proc in self._procs:
            if proc.is_alive():
                proc.kill()
            proc.join(5.0)
