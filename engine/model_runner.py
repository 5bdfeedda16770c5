"""ModelRunner: one rank's share of the model and everything it needs to run a step.

Every process runs this same class (nano-vllm's design): the single-process engine is tensor rank 0 of
1 and pipeline stage 0 of 1. A runner loads its shard of its stage's layers, owns their KV cache, turns
a batch into flat inputs and attention metadata (`prepare_host`), and runs a step: `run_step` is the
one place a step runs, on every rank of every executor. It runs this stage's layers and returns a
StepOutput: the hidden states for the next stage, or (on the last stage) the logits rows. Who sends
what to whom, grammar masks and sampling belong to the executors (engine/executor.py,
engine/distributed_executor.py). On CUDA a one-process runner may also hold CUDA graphs of its decode
steps (engine/cuda_graphs.py) and of every other step in pieces between attentions
(engine/piecewise_graphs.py): the executor captures them, and `run_step` replays one where it can.
"""

from __future__ import annotations

import json
import logging
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from engine.config import EngineConfig, resolve_dtype, resolve_max_model_len
from engine.contract import ScheduledSequence
from engine.cuda_graphs import CaptureStats, DecodeGraphs, GraphCapturer
from engine.inputs import HostStepInputs, InputLimits, build_host_inputs, check_batch
from engine.kv_cache import PagedKVCache, plan_kv_cache
from engine.piecewise_graphs import PieceCapturer, PiecewiseGraphs
from engine.pooling import pool_hidden
from models.layers.attention import Attention
from models.layers.attention_backends import WarmUpLayer

if TYPE_CHECKING:
    from engine.distributed import RankGroups

logger = logging.getLogger(__name__)

# Set to 1 to verify every batch before it runs (engine.inputs.check_batch): for debugging a scheduler.
DEBUG_CHECKS_ENV = "ORCA_DEBUG_CHECKS"


@dataclass
class StepOutput:
    """What one rank's part of a step gives (ModelRunner.run_step): `hidden` on a stage that is not the
    last; on the last stage, `logits` when the step has logits rows and `pooled` when it has embedding
    entries (either, both or neither)."""

    hidden: torch.Tensor | None = None  # [T, hidden]: what the next pipeline stage runs on
    # [R, vocab] float32, rows in engine.inputs.StepInputs.logits_indices order: each entry's scored
    # prompt tokens, then its last token if it samples. On every tensor rank of the last stage (they
    # all take part in gathering the vocab shards); a CUDA-graph step's is a view of the graphs' output
    # buffer, valid until the next step.
    logits: torch.Tensor | None = None
    # [P, hidden] float32: each embedding entry's share of its pooling (engine/pooling.py), in batch
    # order; on every tensor rank of the last stage.
    pooled: torch.Tensor | None = None


def read_eos_token_ids(model_path: Path, hf_config: Any) -> frozenset[int]:
    """EOS ids from generation_config.json and config.json together (either may list several)."""
    ids: set[int] = set()

    def add(value: Any) -> None:
        if isinstance(value, int):
            ids.add(value)
        elif isinstance(value, (list, tuple)):
            ids.update(v for v in value if isinstance(v, int))

    add(getattr(hf_config, "eos_token_id", None))
    gen_file = Path(model_path) / "generation_config.json"
    if gen_file.is_file():
        with open(gen_file) as f:
            add(json.load(f).get("eos_token_id"))
    return frozenset(ids)


class ModelRunner:
    """Its tensor shard of its pipeline stage's layers, their KV cache, and the step's forward pass."""

    def __init__(
        self,
        config: EngineConfig,
        model_path: Path,
        device: torch.device,
        groups: RankGroups | None = None,  # None: one process holds the whole model
        agree: Callable[[Callable[[], int]], int] | None = None,
    ) -> None:
        """`agree` runs the ranks' agreement on the KV block count (a collective that waits for every
        rank); the distributed executor passes one that watches its workers while it waits. The rest
        runs in the calling thread, which should be the one steps run in (scheduler.loop.IterationLoop
        says why)."""
        from models.loader import load_model, max_model_len

        self.device = device
        self.dtype = resolve_dtype(config.dtype, device, model_path)
        self.groups = groups
        parallel: dict[str, Any] = {}
        if groups is not None:
            parallel = dict(
                tp_rank=groups.tp_rank,
                tp_size=groups.topology.tp_size,
                tp_group=groups.tp,
                pp_rank=groups.stage,
                pp_size=groups.topology.pp_size,
            )
        self.model = load_model(
            model_path,
            self.dtype,
            device,
            attention_backend=config.attention_backend,
            weight_packing=config.weight_packing,
            load_format=config.load_format,
            **parallel,
        )
        if device.type == "cpu":
            from models.weight_packing import describe_cpu_setup

            # What --dtype auto chose and what it costs: ISA variant, precision, kernels, weight bytes.
            logger.info(
                "model dtype %s; %s", str(self.dtype).removeprefix("torch."), describe_cpu_setup(self.model)
            )
        hf_config = self.model.config
        self.max_model_len: int = resolve_max_model_len(config.max_model_len, max_model_len(hf_config))
        self.vocab_size: int = self.model.vocab_size
        self.hidden_size: int = self.model.hidden_size
        self.eos_token_ids: frozenset[int] = read_eos_token_ids(model_path, hf_config)
        self.kv_window: int | None = self.model.family.shared_window(hf_config)  # Executor.kv_window
        # This stage's layers and this tensor rank's KV heads.
        spec, num_blocks = plan_kv_cache(self.model, config, self.dtype, device)
        if groups is not None:
            from engine.distributed import agree_on_min

            # Block ids mean the same on every rank, so all ranks use the smallest count any can hold.
            cpu_group, mine = groups.cpu, num_blocks
            num_blocks = (agree or (lambda run: run()))(lambda: agree_on_min(mine, cpu_group))
        self.kv_cache = PagedKVCache(spec, num_blocks, device)
        logger.info("%s", self.kv_cache.describe())
        self.num_kv_blocks: int = num_blocks
        self.block_size: int = config.block_size
        # One process, or the last pipeline stage: this runner computes the logits.
        self.is_last_stage: bool = groups is None or groups.is_last_stage
        self._limits: InputLimits | None = None
        if os.environ.get(DEBUG_CHECKS_ENV) == "1":
            self._limits = InputLimits(num_blocks, config.block_size, self.max_model_len, self.vocab_size)
            logger.warning("%s=1: every batch is checked before it runs (slower)", DEBUG_CHECKS_ENV)
        self.decode_graphs: DecodeGraphs | None = None  # set by capture_decode_graphs
        self.piecewise_graphs: PiecewiseGraphs | None = None  # set by capture_piecewise_graphs
        # Whether steps replay the captured graphs (engine.bench turns it off to compare).
        self.use_cuda_graphs = False
        if device.type == "cuda":
            self._warm_up_attention()

    def _warm_up_attention(self) -> None:
        """Have the attention backend compile every kernel variant a step of this model can need now,
        not in the first serving step that needs it (models/layers/triton_attention.py,
        compile_every_config)."""
        backend = self.model.attn_backend
        attentions = [m for m in self.model.modules() if isinstance(m, Attention)]
        if backend is None or len(attentions) != len(self.kv_cache.layers):
            return  # layers that share a cache, or none: nothing to pair them with
        layers = [
            WarmUpLayer(a.num_heads, a.sliding_window, k, v)
            for a, (k, v) in zip(attentions, self.kv_cache.layers, strict=True)
        ]
        start = time.perf_counter()
        ran = backend.warm_up(layers, self.dtype, self.kv_cache.scratch_block)
        if ran:
            torch.cuda.synchronize(self.device)
            logger.info(
                "attention: compiled %d %s kernel variants in %.2f s",
                ran,
                backend.name,
                time.perf_counter() - start,
            )

    def prepare_host(self, batch: Sequence[ScheduledSequence]) -> HostStepInputs:
        """The step's flat inputs on the host (a graph step copies them into its own buffers)."""
        if self._limits is not None:
            check_batch(batch, self._limits)
        return build_host_inputs(batch, self.block_size)

    def capture_decode_graphs(self, max_num_seqs: int, capturer: GraphCapturer | None = None) -> CaptureStats:
        """Capture a CUDA graph of the whole forward pass and LM head for decode steps of each size up
        to max_num_seqs (engine/cuda_graphs.py), and replay them from now on; `capturer` stands in for
        CUDA in tests. A graph runs the whole model: one process only."""
        if self.groups is not None:
            raise ValueError("CUDA graphs capture the whole model: tensor/pipeline parallel runs are eager")
        graphs = DecodeGraphs(
            self.model, self.kv_cache, max_num_seqs, self.max_model_len, self.device, capturer
        )
        stats = graphs.capture()
        self.decode_graphs = graphs
        self.use_cuda_graphs = True
        return stats

    def capture_piecewise_graphs(
        self, max_tokens: int, capturer: PieceCapturer | None = None
    ) -> CaptureStats:
        """Capture the forward pass in pieces between attentions for steps of up to max_tokens tokens
        (engine/piecewise_graphs.py): the steps a decode graph does not take (prompt chunks, speculative
        verification) replay them from now on. One process only, as for decode graphs."""
        if self.groups is not None:
            raise ValueError("CUDA graphs capture the whole model: tensor/pipeline parallel runs are eager")
        graphs = PiecewiseGraphs(self.model, self.kv_cache, max_tokens, self.device, self.dtype, capturer)
        stats = graphs.capture()
        self.piecewise_graphs = graphs
        self.use_cuda_graphs = True
        return stats

    def run_step(self, host: HostStepInputs, hidden_in: torch.Tensor | None = None) -> StepOutput:
        """Run this rank's part of a step: its stage's layers over the step's tokens (`hidden_in`, the
        previous stage's [T, hidden], on every stage but the first) and, on the last stage, the LM head
        at the logits rows, and the embedding entries' pooled final hidden states. Writes the step's K/V to
        this rank's cache. A decode step that a captured graph covers replays it; any other step runs
        eagerly."""
        with torch.inference_mode():
            if self.use_cuda_graphs:
                logits = self._replay_graph(host)
                if logits is not None:
                    return StepOutput(logits=logits if host.num_logit_rows else None)
            inputs = host.to(self.device)
            pieces = self.piecewise_graphs if self.use_cuda_graphs else None
            size = pieces.size_for(host) if pieces is not None else None
            if pieces is not None and size is not None:
                hidden = pieces.run(inputs, size)  # [T, hidden]
            else:
                hidden = self.model(
                    inputs.input_ids,
                    inputs.positions,
                    self.kv_cache.layers,
                    inputs.attn_metadata,
                    hidden_states=hidden_in,
                )  # [T, hidden]
            if not self.is_last_stage:
                return StepOutput(hidden=hidden)
            out = StepOutput(pooled=pool_hidden(hidden, inputs.pools) if inputs.pools else None)
            if inputs.num_logit_rows:
                # Tensor parallel: every rank of the last stage takes part in the all-gather of the vocab.
                out.logits = self.model.compute_logits(hidden[inputs.logits_indices])
            return out

    def _replay_graph(self, host: HostStepInputs) -> torch.Tensor | None:
        """[S, vocab] float32 logits of the sampling entries from a captured graph, or None when the step
        must run eagerly: it has prompt tokens, more sequences than the largest graph, an embedding
        entry (a graph returns no hidden states), or wants logits rows a graph does not compute. A graph computes one row per sampling sequence, at its last
        token; a step with as many rows as sampling sequences wants exactly those (a scored prompt
        token, or every token for a parity check, is a row more)."""
        graphs = self.decode_graphs
        if graphs is None or host.pools or host.num_logit_rows != len(host.sample_rows):
            return None
        size = graphs.size_for(host)
        if size is None:
            return None
        return graphs.run(host, size)

    def logits(self, batch: Sequence[ScheduledSequence], all_tokens: bool = False) -> torch.Tensor:
        """Run a step on one process without sampling (the KV cache is written as by a step): [R, vocab]
        at the step's logits rows (each sample=True entry's last token, and any scored prompt tokens),
        or [T, vocab] at every token (for parity checks). The same path as a served step (run_step)."""
        if self.groups is not None:  # the other ranks would not take part
            raise ValueError("logits() runs the whole model: one process only")
        host = self.prepare_host(batch)
        if all_tokens:
            # Every token is a logits row; no row scores a prompt (scored indexes the rows it replaces).
            every = list(range(host.input_ids.shape[0]))
            host = replace(host, last_token_index=every, scored=[], sample_logit_rows=None)
        out = self.run_step(host)
        if out.logits is None:  # no entry samples or scores
            return torch.empty(0, self.vocab_size, dtype=torch.float32, device=self.device)
        return out.logits
