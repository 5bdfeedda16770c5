"""Tensor and pipeline parallelism on torch.distributed (gloo, CPU, 2 processes, a tiny float32 Llama):
the same greedy tokens as one process, directly, through the pipelined scheduler loop and over HTTP;
a dead worker makes the server unhealthy and fails requests with a clear error.

The pieces without processes (stage splitting, the step message, the pipelined loop on a fake runner)
are tested first, in milliseconds.
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
import shutil
import signal
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch
from builders import (
    GGUF_MIXES,
    build_hf_model,
    cpu_engine_config,
    gguf_structured,
    tiny_gpt2_config,
    tiny_llama_config,
    write_tiny_gguf,
)
from fakes import greedy_through_loop, live_server, metric, server_config
from kernel_marks import needs_native_kernels
from waiting import wait_until

from engine.config import EngineConfig
from engine.contract import SampledToken, SamplingParams, ScheduledSequence
from engine.distributed import Topology, decode_batch, encode_batch
from engine.distributed_executor import DistributedExecutor
from engine.executor import LocalExecutor
from models.layers.parallel import PPContext
from models.loader import load_tokenizer
from models.registry import model_class_for
from models.weight_packing import packable_layers
from scheduler.config import SchedulerConfig
from scheduler.loop import IterationLoop
from server.app import create_app
from server.state import LoadedModel
from server.tokenizer import ServerTokenizer

NUM_KV_BLOCKS = 128


def UNEVEN_CONFIG() -> Any:
    """Heads that do not split evenly over 2 ranks, like the default model's (9 query, 3 KV heads)."""
    return tiny_llama_config(hidden_size=96, num_attention_heads=6, num_key_value_heads=3)


PROMPTS = [
    [3, 1, 4, 1, 5, 9, 2, 6],
    [5, 3, 5],
    [8, 9, 7, 9, 3, 2, 3, 8, 4, 6, 2, 6, 4, 3, 3, 8, 3, 2, 7, 9],  # longer than the token budget: chunked
    [2, 7, 1, 8],
]
MAX_TOKENS = 6
# A small budget, so the long prompt runs in chunks alongside the others' decodes.
SCHED = SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=16)


# ---------------------------------------------------------------------------- no processes needed


def test_layer_ranges_partition_the_layers() -> None:
    for layers in (2, 5, 30):
        for size in (1, 2, 3):
            if layers < size:
                continue
            ranges = [PPContext(r, size).layer_range(layers) for r in range(size)]
            assert [i for r in ranges for i in r] == list(range(layers))
            assert max(map(len, ranges)) - min(map(len, ranges)) <= 1
    with pytest.raises(ValueError, match="cannot be split"):
        PPContext(0, 3).layer_range(2)


@pytest.mark.parametrize("family", ["llama", "llama-untied", "gpt2"])
def test_pipeline_stages_chained_equal_the_whole_model(family: str) -> None:
    """Stage 0 (embedding + first layers) then stage 1 (last layers, norm, head), each loading only its
    own weights from the full checkpoint, give the logits of the unsplit model."""
    from paged_cache import PagedCacheHarness

    config = {
        "llama": lambda: tiny_llama_config(vocab_size=512, num_hidden_layers=3),
        "llama-untied": lambda: tiny_llama_config(vocab_size=512, tie_word_embeddings=False),
        "gpt2": lambda: tiny_gpt2_config(vocab_size=509, n_layer=3),
    }[family]()
    weights = build_hf_model(config).state_dict()
    cls = model_class_for(config)
    whole = cls(config, dtype=torch.float32)
    whole.load_weights(weights.items())
    stages = [cls(config, dtype=torch.float32, pp=PPContext(s, 2)) for s in range(2)]
    for stage in stages:
        stage.load_weights(weights.items())
    assert stages[0].lm_head is None and stages[1].lm_head is not None
    assert stages[0].num_layers + stages[1].num_layers == whole.num_layers

    prompts = [[3, 1, 4, 1, 5], [9, 2]]
    ref, split = PagedCacheHarness(whole, len(prompts)), [PagedCacheHarness(s, len(prompts)) for s in stages]
    batch = ref.step(prompts)
    with torch.no_grad():
        expected = whole.compute_logits(
            whole(batch.input_ids, batch.positions, ref.kv_caches, batch.metadata)
        )
        hidden = stages[0](batch.input_ids, batch.positions, split[0].kv_caches, batch.metadata)
        hidden = stages[1](
            batch.input_ids, batch.positions, split[1].kv_caches, batch.metadata, hidden_states=hidden
        )
        logits = stages[1].compute_logits(hidden)
    torch.testing.assert_close(logits, expected, atol=1e-5, rtol=1e-5)


def test_uneven_heads_shard_by_whole_kv_groups() -> None:
    """SmolLM2-135M's shape (3 KV heads, 3 query heads each) on 2 ranks: rank 0 takes two groups and
    rank 1 one; the o_proj columns follow, and the shards put together are the checkpoint."""
    from models.layers.parallel import TPContext

    config = UNEVEN_CONFIG()
    full = build_hf_model(config).state_dict()
    ranks = []
    for rank in range(2):
        model = model_class_for(config)(config, dtype=torch.float32, tp=TPContext(rank, 2))
        model.load_weights(full.items())
        ranks.append(model)
    attn = [m.model.layers[0].self_attn for m in ranks]
    assert [(a.num_heads, a.num_kv_heads) for a in attn] == [(4, 2), (2, 1)]
    pre = "model.layers.0.self_attn."
    q = torch.cat([a.qkv_proj.weight[: a.num_heads * 16] for a in attn])
    assert torch.equal(q, full[pre + "q_proj.weight"])
    k = torch.cat([a.qkv_proj.weight[a.num_heads * 16 : (a.num_heads + a.num_kv_heads) * 16] for a in attn])
    assert torch.equal(k, full[pre + "k_proj.weight"])
    assert torch.equal(torch.cat([a.o_proj.weight for a in attn], dim=1), full[pre + "o_proj.weight"])


def test_step_message_round_trip() -> None:
    batch = [
        ScheduledSequence("a", [5, 6, 7], 0, [3], True),
        ScheduledSequence("b", [9], 20, [1, 4], True),
        ScheduledSequence("c", [1, 2], 16, [0, 2, 7], False),
    ]
    msg = encode_batch(batch)
    # Compact: header + tokens + 3 ints per sequence + the padded block tables, all int64.
    assert msg.payload.numel() == 6 + 3 * 3 + 3 * 3 and msg.num_logit_rows == 2
    back = decode_batch(msg)
    assert [list(s.token_ids) for s in back] == [[5, 6, 7], [9], [1, 2]]
    assert [s.start_position for s in back] == [0, 20, 16]
    assert [s.sample for s in back] == [True, True, False]
    assert [list(s.block_table) for s in back] == [[3, 0, 0], [1, 4, 0], [0, 2, 7]]

    # An embedding entry's pooling and a scoring entry's count share the flags.
    pooled = [
        ScheduledSequence("e", [4, 4], 0, [5], False, pooling="cls"),
        ScheduledSequence("s", [1, 2, 3], 0, [6], True, num_prompt_scored=2),
        ScheduledSequence("m", [8], 7, [2, 3], False, pooling="mean"),
    ]
    back = decode_batch(encode_batch(pooled))
    assert [s.pooling for s in back] == ["cls", None, "mean"]
    assert [s.num_prompt_scored for s in back] == [0, 2, 0] and [s.sample for s in back] == [
        False,
        True,
        False,
    ]


def test_communication_volume_of_the_default_model_shape() -> None:
    """The per-sequence figures docs/parallelism.md quotes for SmolLM2-135M (30 layers, hidden 576,
    vocabulary 49152, float32) in a decode step."""
    from engine.parallel_bench import comm_volume

    shape = dict(num_layers=30, hidden=576, vocab=49152, act_bytes=4, tokens=1, seqs=1, blocks=5)
    tp2, pp2 = comm_volume(2, 1, **shape), comm_volume(1, 2, **shape)
    assert tp2.tensor_parallel == 61 * 2 * 576 * 4 + 49152 * 4 and tp2.pipeline == 0
    assert pp2.pipeline == 576 * 4 + 49152 * 4 and pp2.tensor_parallel == 0
    assert tp2.control == pp2.control == 8 * (8 + 1 + 3 + 5)  # one message, to one other rank


def test_topology_is_stage_major() -> None:
    topo = Topology(tp_size=2, pp_size=3)
    assert topo.world_size == 6
    assert [topo.stage_of(r) for r in range(6)] == [0, 0, 1, 1, 2, 2]
    assert topo.stage_ranks(1) == [2, 3] and topo.rank_of(2, 1) == 5


# ------------------------------------------------------------------------- two gloo processes


def engine_config(model_dir: Path, tp: int = 1, pp: int = 1) -> EngineConfig:
    return cpu_engine_config(
        model_dir,
        num_kv_blocks=NUM_KV_BLOCKS,
        tensor_parallel_size=tp,
        pipeline_parallel_size=pp,
        distributed_timeout_s=60.0,
    )


@pytest.fixture(scope="module")
def uneven_llama_dir(tmp_path_factory: pytest.TempPathFactory, smollm2_tokenizer_dir: Path) -> Path:
    """A tiny random Llama (with the SmolLM2 tokenizer) whose heads split unevenly over 2 ranks. Its
    weights have a GGUF model's structure, so every rank packs its shards for the native kernels
    (where they build) and the parallel tests cover sharded packed weights too."""
    out = tmp_path_factory.mktemp("uneven-llama")
    gguf_structured(build_hf_model(UNEVEN_CONFIG())).save_pretrained(out, safe_serialization=True)
    for f in smollm2_tokenizer_dir.iterdir():
        shutil.copy(f, out / f.name)
    return out


@pytest.fixture(scope="module")
def reference_tokens(uneven_llama_dir: Path) -> list[list[int]]:
    runner = LocalExecutor(engine_config(uneven_llama_dir))
    return asyncio.run(greedy_through_loop(runner, PROMPTS, MAX_TOKENS, SCHED))


@pytest.fixture(scope="module")
def reference_texts(uneven_llama_dir: Path) -> list[str]:
    return asyncio.run(
        completions_over_http(LocalExecutor(engine_config(uneven_llama_dir)), uneven_llama_dir)
    )


# Class scope: one runner per config at a time (a process joins one default process group at most).
@pytest.fixture(scope="class", params=[(2, 1), (1, 2)], ids=["tp2", "pp2"])
def parallel_runner(request: pytest.FixtureRequest, uneven_llama_dir: Path) -> Iterator[DistributedExecutor]:
    tp, pp = request.param
    runner = DistributedExecutor(engine_config(uneven_llama_dir, tp, pp))
    try:
        yield runner
    finally:
        runner.close()


class InFlightProbe:
    """Wraps a runner's submit/collect to record how many batches were in flight at once."""

    def __init__(self, runner: DistributedExecutor) -> None:
        self._runner = runner
        self.outstanding = 0
        self.max_outstanding = 0

    def __getattr__(self, name: str) -> Any:
        return getattr(self._runner, name)

    def submit(self, batch: Sequence[ScheduledSequence]) -> Any:
        handle = self._runner.submit(batch)
        self.outstanding += 1
        self.max_outstanding = max(self.max_outstanding, self.outstanding)
        return handle

    def collect(self, handle: Any) -> list[SampledToken | None]:
        self.outstanding -= 1
        return self._runner.collect(handle)

    def step(self, batch: Sequence[ScheduledSequence]) -> list[SampledToken | None]:
        return self.collect(self.submit(batch))


async def completions_over_http(runner: Any, model_dir: Path) -> list[str]:
    tokenizer = ServerTokenizer(load_tokenizer(model_dir))
    config = server_config(model=str(model_dir), served_model_name="tiny", log_stats_interval_s=0)
    app = create_app(config, lambda: LoadedModel(runner, tokenizer, runner.vocab_size))
    async with live_server(app) as url, httpx.AsyncClient(base_url=url, timeout=60) as http:
        bodies = [
            {"model": "tiny", "prompt": p, "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True}
            for p in ("The capital of France is", "Once upon a time", "1, 2, 3,")
        ]
        answers = await asyncio.gather(*(http.post("/v1/completions", json=b) for b in bodies))
        assert all(r.status_code == 200 for r in answers), [r.text for r in answers]
        return [r.json()["choices"][0]["text"] for r in answers]


async def embeddings_through_loop(executor: Any) -> dict[str, list[float]]:
    """The long prompt's embedding with each pooling, next to greedy generations of the others."""
    engine = IterationLoop(executor, SCHED)
    await engine.start()
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)

    async def embed(pooling: Any) -> list[float]:
        [delta] = [d async for d in engine.embed(PROMPTS[2], pooling, f"e-{pooling}")]
        assert delta.embedding is not None, delta.error
        return delta.embedding

    async def generate(i: int) -> None:
        assert [d async for d in engine.generate(PROMPTS[i], params, f"g{i}")][-1].error is None

    try:
        poolings = ("last", "mean", "cls")
        results = await asyncio.gather(*(embed(p) for p in poolings), generate(0), generate(3))
        return dict(zip(poolings, results[:3], strict=True))
    finally:
        await engine.shutdown()


class TestParallelEqualsOneProcess:
    """TP=2 and PP=2, each against the same one-process reference."""

    async def test_parallel_greedy_equals_one_process(
        self, parallel_runner: DistributedExecutor, reference_tokens: list[list[int]]
    ) -> None:
        probe = InFlightProbe(parallel_runner)
        got = await greedy_through_loop(probe, PROMPTS, MAX_TOKENS, SCHED)
        assert got == reference_tokens
        # ORCA: with P stages the loop keeps P batches in flight; without a pipeline, one.
        assert probe.max_outstanding == parallel_runner.topology.pp_size

    def test_runner_step_and_two_submits_in_flight(
        self, parallel_runner: DistributedExecutor, reference_tokens: list[list[int]]
    ) -> None:
        """A prompt chunk that samples nothing, then two requests in two separate batches, both
        submitted before either is collected."""
        params = SamplingParams(temperature=0.0)
        a, b = PROMPTS[0], PROMPTS[3]
        assert parallel_runner.step([ScheduledSequence("a", a[:5], 0, [0], False, params, a, [])]) == [None]
        first_a = ScheduledSequence("a", a[5:], 5, [0], True, params, a, [])
        first_b = ScheduledSequence("b", b, 0, [1], True, params, b, [])
        pa, pb = parallel_runner.submit([first_a]), parallel_runner.submit([first_b])
        tok_a, tok_b = parallel_runner.collect(pa)[0], parallel_runner.collect(pb)[0]
        assert tok_a is not None and tok_b is not None
        assert [tok_a.token_id, tok_b.token_id] == [reference_tokens[0][0], reference_tokens[3][0]]
        nxt = parallel_runner.step(
            [ScheduledSequence("a", [tok_a.token_id], len(a), [0], True, params, a, [])]
        )
        assert nxt[0] is not None and nxt[0].token_id == reference_tokens[0][1]

    @needs_native_kernels
    def test_rank_zero_runs_packed_shards(self, parallel_runner: DistributedExecutor) -> None:
        """The uneven shards (rank 0's o_proj input is 64 of 96 columns) still pack exactly."""
        layers = packable_layers(parallel_runner.runner.model)
        assert layers and all(m.packed is not None for m in layers)

    async def test_shared_prefixes_equal_one_process_without_caching(
        self, parallel_runner: DistributedExecutor, uneven_llama_dir: Path
    ) -> None:
        """Every rank follows the scheduler's block tables: prompts that share cached blocks (a common
        stem, repeated prompts, then all of them again) give one uncached process's tokens."""
        stem = [11 + (i * 37) % 500 for i in range(35)]
        prompts = [stem + PROMPTS[i % 4] for i in range(4)] + [stem + PROMPTS[1]] * 2
        no_cache = dataclasses.replace(SCHED, enable_prefix_caching=False)
        want = await greedy_through_loop(
            LocalExecutor(engine_config(uneven_llama_dir)), prompts, MAX_TOKENS, no_cache
        )
        engine = IterationLoop(parallel_runner, SCHED)
        await engine.start()
        params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)

        async def one(rid: str, prompt: Sequence[int]) -> list[int]:
            return [t async for d in engine.generate(prompt, params, rid) for t in d.token_ids]

        try:
            for round_ in range(2):
                got = await asyncio.gather(*(one(f"{round_}-{i}", p) for i, p in enumerate(prompts)))
                assert list(got) == want
        finally:
            await engine.shutdown()
        assert engine.stats().prefix_cache.hits >= 5 * 32 + 6 * 32

    async def test_speculative_decoding_equals_one_process_without_it(
        self, parallel_runner: DistributedExecutor, uneven_llama_dir: Path
    ) -> None:
        """n-gram proposals are verified in rows the workers run like any others (a pipeline keeps its
        batches in flight meanwhile): the tokens of one process that does not speculate."""
        prompts = [p * 3 for p in PROMPTS]  # something to quote
        plain = dataclasses.replace(SCHED, speculative="off")
        want = await greedy_through_loop(LocalExecutor(engine_config(uneven_llama_dir)), prompts, 24, plain)
        engine = IterationLoop(parallel_runner, dataclasses.replace(SCHED, speculative="ngram"))
        assert await greedy_through_loop(parallel_runner, prompts, 24, engine=engine) == want
        assert engine.stats().speculation.accepted_tokens > 0

    async def test_embeddings_equal_one_process(
        self, parallel_runner: DistributedExecutor, uneven_llama_dir: Path
    ) -> None:
        """Embedding entries' pooled hidden states reach the driver (from the last stage, pipelined;
        from rank 0's own layers, tensor parallel), chunked and batched with generations: one
        process's vectors."""
        want = await embeddings_through_loop(LocalExecutor(engine_config(uneven_llama_dir)))
        got = await embeddings_through_loop(parallel_runner)
        for pooling in want:
            torch.testing.assert_close(
                torch.tensor(got[pooling]), torch.tensor(want[pooling]), atol=1e-4, rtol=1e-4
            )

    async def test_parallel_server_matches_one_process(
        self, parallel_runner: DistributedExecutor, uneven_llama_dir: Path, reference_texts: list[str]
    ) -> None:
        assert await completions_over_http(parallel_runner, uneven_llama_dir) == reference_texts


async def test_dead_worker_without_restarts_makes_server_unhealthy(uneven_llama_dir: Path) -> None:
    """Restarts off (--max-worker-restarts 0): a worker killed in the middle of a generation fails
    that request with an error naming the worker (no hang), /health turns 503, and later requests
    are refused at once."""
    runner = DistributedExecutor(engine_config(uneven_llama_dir, pp=2))
    tokenizer = ServerTokenizer(load_tokenizer(uneven_llama_dir))
    config = server_config(
        model=str(uneven_llama_dir), served_model_name="tiny", log_stats_interval_s=0, max_worker_restarts=0
    )
    app = create_app(config, lambda: LoadedModel(runner, tokenizer, runner.vocab_size))
    short = {"model": "tiny", "prompt": "Hello", "max_tokens": 4, "temperature": 0}
    long = {**short, "max_tokens": 400, "ignore_eos": True}
    try:
        async with live_server(app) as url, httpx.AsyncClient(base_url=url, timeout=60) as http:
            assert (await http.get("/health")).status_code == 200
            assert (await http.post("/v1/completions", json=short)).status_code == 200

            engine = app.state.server.loop
            steps_before = engine.stats().num_steps
            in_flight = asyncio.create_task(http.post("/v1/completions", json=long))
            await wait_until(lambda: engine.stats().num_steps >= steps_before + 3)
            os.kill(runner.worker_pids[0], signal.SIGKILL)
            cut = await in_flight
            assert cut.status_code >= 500 and "orca-rank1" in cut.json()["error"]["message"]

            await wait_until(lambda: runner.dead_reason is not None)
            assert (await http.get("/health")).status_code == 503
            refused = await http.post("/v1/completions", json=short)
            assert refused.status_code == 503 and "exited" in refused.json()["error"]["message"]
    finally:
        runner.close()


def test_a_failed_start_leaves_the_group_and_the_next_engine_starts(
    uneven_llama_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Rank 0 fails to load after the rendezvous: the engine raises that error, its worker is gone,
    and this process belongs to no group, so the next parallel engine (a retry, the server's
    restart) starts; before, every later engine in the process was refused."""
    import engine.distributed_executor as executor_module

    spawned: list[DistributedExecutor] = []
    real_spawn = DistributedExecutor._spawn_workers

    def spawn_and_remember(self: DistributedExecutor, *args: Any) -> None:
        spawned.append(self)
        real_spawn(self, *args)

    def cannot_load(*args: Any, **kwargs: Any) -> None:
        raise RuntimeError("rank 0 could not load its shard")

    monkeypatch.setattr(DistributedExecutor, "_spawn_workers", spawn_and_remember)
    monkeypatch.setattr(executor_module, "ModelRunner", cannot_load)
    with pytest.raises(RuntimeError, match="could not load its shard"):
        DistributedExecutor(engine_config(uneven_llama_dir, pp=2))
    assert not torch.distributed.is_initialized()
    assert [p.is_alive() for p in spawned[0]._procs] == [False]

    monkeypatch.undo()
    runner = DistributedExecutor(engine_config(uneven_llama_dir, pp=2))
    runner.close()


@needs_native_kernels
@pytest.mark.parametrize("arch", ["qwen3", "phi3"])
async def test_new_families_from_gguf_tp2_equal_one_process(
    arch: str, tmp_path: Path, fresh_model_cache: Path
) -> None:
    """Qwen3 (q/k norms on each rank's heads) and Phi-3 (fused qkv and gate/up cut into q/k/v and
    gate/up first, then by rank) GGUF files under TP=2: every rank packs its shards of the decoder
    layers' blocks (8 heads of 64: o_proj's 256 input columns per rank are whole super-blocks), and
    greedy tokens equal one process's."""
    from models.loader import resolve_model

    gguf = tmp_path / f"{arch}.gguf"
    shape = dict(hidden=256, head_dim=64) if arch == "qwen3" else dict(hidden=512)
    write_tiny_gguf(
        gguf,
        arch=arch,
        ff=512,
        heads=8,
        kv_heads=2,
        layers=2,
        types=GGUF_MIXES["Q4_K_M"],
        tied=False,
        **shape,
    )
    path = resolve_model(str(gguf))
    reference = await greedy_through_loop(LocalExecutor(engine_config(path)), PROMPTS, MAX_TOKENS, SCHED)
    runner = DistributedExecutor(engine_config(path, tp=2))
    try:
        # (The 261-token vocabulary pads to 2 x 131 rows: the embedding and head shards stay float.)
        decoder = [m for layer in runner.runner.model.decoder_layers() for m in packable_layers(layer)]
        assert len(decoder) == 8 and all(m.packed is not None for m in decoder)
        assert await greedy_through_loop(runner, PROMPTS, MAX_TOKENS, SCHED) == reference
    finally:
        runner.close()


# pp2's restart runs in the slow target: the restart path is the same for both, and tp2 keeps it in `make test`.
@pytest.mark.parametrize(
    ("tp", "pp"), [(2, 1), pytest.param(1, 2, marks=pytest.mark.slow)], ids=["tp2", "pp2"]
)
async def test_a_killed_worker_is_restarted_and_the_server_serves_again(
    tp: int, pp: int, uneven_llama_dir: Path, reference_texts: list[str]
) -> None:
    """kill -9 a worker under load: the requests in flight fail (500 or an error event), one queued
    behind them is served after the restart, /health is 200 again, /metrics counts the restart, and
    the restarted group gives the same greedy text as one process."""
    runner = DistributedExecutor(engine_config(uneven_llama_dir, tp, pp))
    tokenizer = ServerTokenizer(load_tokenizer(uneven_llama_dir))
    config = server_config(
        model=str(uneven_llama_dir), served_model_name="tiny", log_stats_interval_s=0, max_num_seqs=2
    )
    app = create_app(config, lambda: LoadedModel(runner, tokenizer, runner.vocab_size))
    long = {"model": "tiny", "prompt": "Hello", "max_tokens": 400, "temperature": 0, "ignore_eos": True}
    try:
        async with live_server(app) as url, httpx.AsyncClient(base_url=url, timeout=120) as http:
            engine = app.state.server.loop
            old_pids = runner.worker_pids
            running = [asyncio.create_task(http.post("/v1/completions", json=long)) for _ in range(2)]
            await wait_until(lambda: engine.stats().running == 2 and engine.stats().num_steps >= 3)
            streamed = asyncio.create_task(http.post("/v1/completions", json={**long, "stream": True}))
            short = {**long, "max_tokens": 4}
            queued = asyncio.create_task(http.post("/v1/completions", json=short))
            await wait_until(lambda: engine.stats().waiting == 2)
            os.kill(old_pids[0], signal.SIGKILL)
            for r in await asyncio.gather(*running):
                assert r.status_code == 500 and "exited" in r.json()["error"]["message"], r.text
            # The queued ones ran after the restart (the stream was admitted after it too, or failed
            # in flight with an error event: either is a clean answer).
            assert (await queued).status_code == 200
            assert (await streamed).status_code == 200
            await wait_until(lambda: engine.is_running)
            assert (await http.get("/health")).status_code == 200
            assert runner.worker_pids != old_pids
            assert "orca:worker_restarts_total" in (metrics := (await http.get("/metrics")).text)
            assert metric(metrics, "orca:worker_restarts_total") == 1
            assert engine.stats().kv_blocks_used == 0
        assert await completions_over_http(runner, uneven_llama_dir) == reference_texts
    finally:
        runner.close()


async def assert_split_equals_one_process(
    model_dir: Path, tp: int, pp: int, prompts: list[list[int]]
) -> None:
    """12 greedy tokens per prompt through the scheduler loop: the model split over tp x pp processes
    says what one process says."""
    want = await greedy_through_loop(LocalExecutor(engine_config(model_dir)), prompts, 12, SCHED)
    runner = DistributedExecutor(engine_config(model_dir, tp, pp))
    try:
        assert await greedy_through_loop(runner, prompts, 12, SCHED) == want
    finally:
        runner.close()


@pytest.mark.parametrize(("tp", "pp"), [(2, 1), (1, 2)], ids=["tp2", "pp2"])
async def test_sliding_window_model_equals_one_process(tp: int, pp: int, tiny_gemma3_dir: Path) -> None:
    """Gemma 3 split over 2 ranks: sharded heads with their q/k norms, the sandwich norms after the
    all-reduce, each rank's local layers keeping their window (8 tokens); or its stages, each with its
    layers' windows and rotary tables. Prompts and generations past the window, one prompt chunked."""
    prompts = [[*p, *p, *p] for p in PROMPTS]  # 9 to 60 tokens
    await assert_split_equals_one_process(tiny_gemma3_dir, tp, pp, prompts)


@pytest.mark.parametrize(("tp", "pp"), [(2, 1), (1, 2)], ids=["tp2", "pp2"])
async def test_mixture_of_experts_equals_one_process(tp: int, pp: int, tiny_qwen3_moe_dir: Path) -> None:
    """Qwen3-MoE over 2 processes: a slice of every expert per rank, routed alike on both (one
    all-reduce of all experts' partial sums per layer); or its stages, sparse and dense layers
    apart. The server's greedy tokens, prompts chunked and batched, are one process's."""
    await assert_split_equals_one_process(tiny_qwen3_moe_dir, tp, pp, PROMPTS)


@pytest.mark.slow
async def test_tp2_pp2_four_processes(uneven_llama_dir: Path, reference_tokens: list[list[int]]) -> None:
    runner = DistributedExecutor(engine_config(uneven_llama_dir, tp=2, pp=2))
    try:
        assert await greedy_through_loop(runner, PROMPTS, MAX_TOKENS, SCHED) == reference_tokens
    finally:
        runner.close()


TORCHRUN_SCRIPT = """
import json, os, sys
from engine.contract import SamplingParams, ScheduledSequence
from engine.config import EngineConfig
from engine.distributed_executor import DistributedExecutor, run_torchrun_worker

config = EngineConfig(
    model=sys.argv[1], dtype="float32", device="cpu", kv_cache_dtype="float32",  # as the reference
    num_kv_blocks=16, pipeline_parallel_size=2,
)
if int(os.environ["RANK"]) != 0:
    run_torchrun_worker(config)
    sys.exit(0)
runner = DistributedExecutor(config)
prompt, out = json.loads(sys.argv[2]), []
for _ in range(int(sys.argv[3])):
    start = len(prompt) + len(out) - (1 if out else len(prompt))
    tokens = out[-1:] if out else prompt
    seq = ScheduledSequence("r", tokens, start, [0, 1], True, SamplingParams(temperature=0.0), prompt, out)
    out.append(runner.step([seq])[0].token_id)
runner.close()
print("TOKENS", json.dumps(out))
"""


@pytest.mark.slow
def test_torchrun_launch_matches_one_process(
    tmp_path: Path, uneven_llama_dir: Path, reference_tokens: list[list[int]]
) -> None:
    """Ranks started by torchrun (as across machines): rank 0 drives, rank 1 runs the worker loop."""
    import json
    import subprocess
    import sys

    from engine.ports import free_tcp_port

    script = tmp_path / "run.py"
    script.write_text(TORCHRUN_SCRIPT)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc-per-node", "2"]
    cmd += ["--master-addr", "127.0.0.1", "--master-port", str(free_tcp_port())]
    cmd += [str(script), str(uneven_llama_dir), json.dumps(PROMPTS[0]), str(MAX_TOKENS)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=Path(__file__).parents[2])
    assert done.returncode == 0, done.stderr[-3000:]
    line = next(x for x in done.stdout.splitlines() if x.startswith("TOKENS"))
    assert json.loads(line.split(" ", 1)[1]) == reference_tokens[0]


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs")
@pytest.mark.parametrize(("tp", "pp"), [(2, 1), (1, 2)], ids=["tp2", "pp2"])
async def test_cuda_nccl_matches_one_process(tp: int, pp: int, uneven_llama_dir: Path) -> None:
    """The same check on GPUs: NCCL for the data path, gloo for the step messages."""
    single = dataclasses.replace(engine_config(uneven_llama_dir), device="cuda")
    expected = await greedy_through_loop(LocalExecutor(single), PROMPTS, MAX_TOKENS)
    runner = DistributedExecutor(
        dataclasses.replace(single, tensor_parallel_size=tp, pipeline_parallel_size=pp)
    )
    try:
        assert await greedy_through_loop(runner, PROMPTS, MAX_TOKENS, SCHED) == expected
    finally:
        runner.close()
