"""CUDA graphs for decode steps (engine/cuda_graphs.py).

On a CPU everything but the capture runs: the sizes, the padding, the persistent buffers, the metadata
a graph is captured with, and whole executors whose "graphs" are the captured function called again
(ReplayByCalling), so a replay reads its buffers and the host values frozen at capture exactly as a
CUDA graph would. Tokens must equal an eager executor's over a script that crosses every size, mixes
prompts into decode steps, outgrows the largest graph and has rows that do not sample; and the padding
rows must write the scratch block only. The `cuda` tests do the same with real graphs, and check that a
step synchronises once.
"""

from __future__ import annotations

import logging
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from fake_graphs import PiecesByCalling, ReplayByCalling

from engine.config import EngineConfig
from engine.contract import SampledToken, SamplingParams, ScheduledSequence
from engine.cuda_graphs import (
    DecodeWords,
    GraphInputBuffers,
    bucket_for,
    capture_sizes,
    pad_decode_step,
)
from engine.executor import LocalExecutor, cuda_graphs_off_reason, piecewise_graphs_off_reason
from engine.inputs import build_host_inputs
from engine.piecewise_graphs import PiecewiseGraphs, token_capture_sizes
from models.layers.attention import triton_available

GREEDY = SamplingParams(temperature=0.0, ignore_eos=True)
BLOCK_SIZE = 4
BLOCKS_PER_REQUEST = 8  # 32 tokens: every request of SCRIPT fits
MAX_NUM_SEQS = 4


# --------------------------------------------------------------------------- sizes and padding


def test_capture_sizes_are_powers_of_two_and_the_maximum():
    assert capture_sizes(1) == (1,)
    assert capture_sizes(2) == (1, 2)
    assert capture_sizes(64) == (1, 2, 4, 8, 16, 32, 64)
    assert capture_sizes(48) == (1, 2, 4, 8, 16, 32, 48)
    assert capture_sizes(256)[-1] == 256
    with pytest.raises(ValueError):
        capture_sizes(0)


def test_bucket_is_the_smallest_size_that_holds_the_batch():
    sizes = capture_sizes(48)
    assert [bucket_for(sizes, n) for n in (1, 2, 3, 4, 5, 17, 32, 33, 48)] == [1, 2, 4, 4, 8, 32, 32, 48, 48]
    assert bucket_for(sizes, 49) is None


def decode(rid: str, token: int, position: int, table: list[int], sample: bool = True) -> ScheduledSequence:
    return ScheduledSequence(rid, [token], position, table, sample, GREEDY)


def test_padding_rows_run_token_0_in_the_scratch_block():
    host = build_host_inputs(
        [decode("a", 11, 5, [3, 7]), decode("b", 12, 0, [2]), decode("c", 13, 8, [4, 5, 6])], BLOCK_SIZE
    )
    step = pad_decode_step(host, size=4, scratch_block=9)
    words = DecodeWords.over(step.words, 4)
    assert words.input_ids.tolist() == [11, 12, 13, 0]
    assert words.positions.tolist() == [5, 0, 8, 0]
    # a: position 5 is block 7 offset 1; padding: the scratch block's first slot.
    assert words.slot_mapping.tolist() == [7 * 4 + 1, 2 * 4, 6 * 4, 9 * 4]
    assert words.seq_lens.tolist() == [6, 1, 9, 1]
    assert words.seq_start_loc.tolist() == [0, 6, 7, 16, 17]
    assert step.block_tables.tolist() == [[3, 7, 0], [2, 0, 0], [4, 5, 6], [9, 0, 0]]


def test_only_one_token_steps_that_fit_are_padded():
    prompt = build_host_inputs([ScheduledSequence("p", [1, 2, 3], 0, [0], True, GREEDY)], BLOCK_SIZE)
    with pytest.raises(ValueError, match="does not fit"):
        pad_decode_step(prompt, size=4, scratch_block=9)
    two = build_host_inputs([decode("a", 1, 0, [0]), decode("b", 1, 0, [1])], BLOCK_SIZE)
    with pytest.raises(ValueError, match="does not fit"):
        pad_decode_step(two, size=1, scratch_block=9)


def test_buffers_take_a_step_and_graphs_see_views_of_them():
    buffers = GraphInputBuffers(max_size=8, max_blocks_per_seq=5, device=torch.device("cpu"))
    host = build_host_inputs([decode("a", 11, 5, [3, 7]), decode("b", 12, 0, [2])], BLOCK_SIZE)
    buffers.load(pad_decode_step(host, size=2, scratch_block=9))
    ids, positions = buffers.inputs(2)
    assert ids.tolist() == [11, 12] and positions.tolist() == [5, 0]
    md = buffers.metadata(2, max_model_len=20, block_size=BLOCK_SIZE)
    assert md.slot_mapping.tolist() == [29, 8]
    assert md.seq_lens.tolist() == [6, 1]
    assert md.seq_start_loc.tolist() == [0, 6, 7]
    assert md.query_start_loc.tolist() == [0, 1, 2]
    assert md.block_tables.shape == (2, 5)  # full width, whatever this step needed
    assert md.block_tables[:, :2].tolist() == [[3, 7], [2, 0]]
    # Captured for the longest history: the host sizes a graph's kernels are specialised on.
    assert md.max_query_len == 1 and md.max_seq_len == 20 and md.seq_lens_cpu == [20, 20]
    # The graph of size 2 reads the same memory every time: views, not copies.
    assert ids.data_ptr() == buffers.words.data_ptr()
    assert md.seq_lens.data_ptr() == buffers.words.data_ptr() + 6 * 2 * 4
    too_wide = build_host_inputs([decode("w", 1, 23, list(range(6)))], BLOCK_SIZE)
    with pytest.raises(ValueError, match="exceed"):
        buffers.load(pad_decode_step(too_wide, size=1, scratch_block=9))


# ------------------------------------------------------------------ executors on a script of steps


@dataclass
class Request:
    prompt: list[int]
    chunks: list[int]  # prompt chunk sizes, in order
    index: int  # which blocks it owns
    output: list[int] = field(default_factory=list)
    chunks_done: int = 0

    @property
    def table(self) -> list[int]:
        return list(range(self.index * BLOCKS_PER_REQUEST, (self.index + 1) * BLOCKS_PER_REQUEST))

    @property
    def prompt_done(self) -> int:
        return sum(self.chunks[: self.chunks_done])


PROMPTS: dict[str, tuple[list[int], list[int]]] = {
    "a": (list(range(100, 110)), [10]),
    "b": (list(range(200, 207)), [7]),
    "c": (list(range(300, 312)), [12]),
    "d": (list(range(400, 405)), [5]),
    "e": (list(range(500, 503)), [3]),
    "f": ([600], [1]),  # a one-token prompt: its prefill is a one-token step
    "g": ([700, 701], [1, 1]),  # two one-token chunks, the first samples nothing
}
# (admitted before the step, retired before the step); the comments say what the step is with
# MAX_NUM_SEQS = 4 (graphs of 1, 2 and 4).
SCRIPT: list[tuple[list[str], list[str]]] = [
    (["a", "b"], []),  # prompts only: eager
    ([], []),  # 2 decodes: graph 2
    (["c"], []),  # 2 decodes + a prompt: eager
    ([], []),  # 3 decodes: graph 4 (one padding row)
    (["d", "e"], []),  # 3 decodes + 2 prompts: eager
    ([], []),  # 5 decodes: more than the largest graph, eager
    ([], ["a"]),  # 4 decodes: graph 4
    ([], ["b", "c", "d"]),  # 1 decode: graph 1
    (["f", "g"], []),  # 1 decode, f's one-token prompt, g's first chunk (samples nothing): graph 4
    ([], []),  # 2 decodes and g's last chunk: graph 4
    ([], ["e"]),  # 2 decodes: graph 2
    ([], ["f"]),  # 1 decode: graph 1
]
SCRIPT_REPLAYS = {1: 2, 2: 2, 4: 4}  # graph size: steps that replay it


def run_script(executor: LocalExecutor) -> dict[str, list[int]]:
    """Every request's greedy tokens over SCRIPT (decodes first, then prompt chunks, as the scheduler
    orders a step)."""
    running: dict[str, Request] = {}
    finished: dict[str, Request] = {}
    for admit, retire in SCRIPT:
        for rid in retire:
            finished[rid] = running.pop(rid)
        for rid in admit:
            prompt, chunks = PROMPTS[rid]
            running[rid] = Request(prompt, chunks, index=list(PROMPTS).index(rid))
        batch = []
        for rid, r in running.items():
            if r.chunks_done == len(r.chunks):
                position = len(r.prompt) + len(r.output) - 1
                batch.append(ScheduledSequence(rid, [r.output[-1]], position, r.table, True, GREEDY))
        for rid, r in running.items():
            if r.chunks_done < len(r.chunks):
                start, n = r.prompt_done, r.chunks[r.chunks_done]
                last = r.chunks_done == len(r.chunks) - 1
                batch.append(
                    ScheduledSequence(rid, r.prompt[start : start + n], start, r.table, last, GREEDY)
                )
        sampled = executor.step(batch)
        for entry, tok in zip(batch, sampled, strict=True):
            r = running[entry.request_id]
            if r.chunks_done < len(r.chunks):
                r.chunks_done += 1
            assert (tok is not None) == entry.sample
            if tok is not None:
                r.output.append(tok.token_id)
    finished.update(running)
    return {rid: r.output for rid, r in sorted(finished.items())}


def executor(
    model_dir: Path, device: str, backend: str, enforce_eager: bool, max_num_batched_tokens: int | None = None
) -> LocalExecutor:
    """max_num_batched_tokens None: decode graphs only (no piecewise ones), what most tests here check."""
    return LocalExecutor(
        EngineConfig(
            model=str(model_dir),
            dtype="float32",
            device=device,
            block_size=BLOCK_SIZE,
            num_kv_blocks=len(PROMPTS) * BLOCKS_PER_REQUEST,
            attention_backend=backend,
            max_num_seqs=MAX_NUM_SEQS,
            max_num_batched_tokens=max_num_batched_tokens,
            enforce_eager=enforce_eager,
        )
    )


def cpu_backends() -> list[str]:
    # triton in its interpreter is the backend graphs capture on a GPU; cpu-decode checks the same
    # buffers through the torch and native paths, and fast.
    return ["cpu-decode", *(["triton"] if triton_available("cpu") else [])]


@pytest.mark.parametrize("backend", cpu_backends())
def test_graph_steps_give_the_eager_tokens_and_touch_only_the_scratch_block(
    tiny_llama_dir: Path, backend: str, caplog: pytest.LogCaptureFixture
):
    eager = executor(tiny_llama_dir, "cpu", backend, enforce_eager=True)
    graphed = executor(tiny_llama_dir, "cpu", backend, enforce_eager=True)
    fake = ReplayByCalling()
    with caplog.at_level(logging.INFO, logger="engine.cuda_graphs"):
        stats = graphed.runner.capture_decode_graphs(MAX_NUM_SEQS, capturer=fake)
    assert graphed.runner.use_cuda_graphs  # capturing turns replays on
    assert stats.sizes == (1, 2, 4)
    assert "captured 3 decode graphs (batch sizes 1, 2, 4)" in caplog.text
    sizes_by_capture = list(reversed(stats.sizes))  # largest first, into one pool

    expected = run_script(eager)
    assert run_script(graphed) == expected
    replays = {sizes_by_capture[i]: n for i, n in fake.replays.items()}
    assert replays == SCRIPT_REPLAYS, "the script's graph steps (see SCRIPT) did not all replay"

    # The same K/V in every real block; the padding rows wrote the scratch block only.
    ours, theirs = graphed.runner.kv_cache, eager.runner.kv_cache
    real = slice(0, graphed.num_kv_blocks)
    torch.testing.assert_close(ours.k_cache[:, real], theirs.k_cache[:, real], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(ours.v_cache[:, real], theirs.v_cache[:, real], atol=1e-5, rtol=1e-5)
    assert ours.k_cache[:, ours.scratch_block].abs().sum() > 0
    assert theirs.k_cache[:, theirs.scratch_block].abs().sum() == 0


def test_graphs_are_off_unless_cuda_a_capturable_backend_and_a_batch_bound(tiny_llama_dir: Path):
    cpu = executor(tiny_llama_dir, "cpu", "cpu-decode", enforce_eager=False)
    assert not cpu.runner.use_cuda_graphs and cpu.runner.decode_graphs is None
    assert cuda_graphs_off_reason(cpu.config, cpu.runner) == "the device is cpu"

    def on_cuda(capturable: bool, blocker: str | None = None) -> SimpleNamespace:  # what the policy reads
        backend = SimpleNamespace(name="triton" if capturable else "sdpa", capturable=capturable)
        model = SimpleNamespace(
            attn_backend=backend, family=cpu.runner.model.family, capture_blocker=lambda device: blocker
        )
        return SimpleNamespace(device=torch.device("cuda"), model=model)

    config = cpu.config
    assert cuda_graphs_off_reason(config, on_cuda(True)) is None
    # A layer that picks on the host what runs (a mixture of experts without its fused kernels).
    assert "experts" in (cuda_graphs_off_reason(config, on_cuda(True, "its experts ...")) or "")
    assert "'sdpa' attention backend" in (cuda_graphs_off_reason(config, on_cuda(False)) or "")
    assert cuda_graphs_off_reason(replace(config, enforce_eager=True), on_cuda(True)) == "--enforce-eager"
    assert "max_num_seqs" in (cuda_graphs_off_reason(replace(config, max_num_seqs=None), on_cuda(True)) or "")


def test_run_step_replays_a_graph_only_where_the_graph_computes_the_rows_asked_for(tiny_llama_dir: Path):
    """ModelRunner.run_step owns the replay decision: a decode step of sampling rows replays (its
    logits are a view of the graphs' buffer, equal to the eager step's); a step that also scores a
    prompt token, asks for every token's logits (ModelRunner.logits) or pools an embedding runs
    eagerly."""
    ex = executor(tiny_llama_dir, "cpu", "cpu-decode", enforce_eager=True)
    fake = ReplayByCalling()
    runner = ex.runner
    runner.capture_decode_graphs(MAX_NUM_SEQS, capturer=fake)
    assert runner.decode_graphs is not None and runner.decode_graphs.logits is not None
    graph_out = runner.decode_graphs.logits
    tables = [list(range(i * BLOCKS_PER_REQUEST, (i + 1) * BLOCKS_PER_REQUEST)) for i in range(3)]
    prompts = [list(range(100 + 20 * i, 109 + 20 * i + i)) for i in range(3)]
    first = ex.step([ScheduledSequence(str(i), p, 0, tables[i], True, GREEDY) for i, p in enumerate(prompts)])
    assert not fake.replays  # prompts run eagerly

    def decode(i: int, scored: int = 0) -> ScheduledSequence:
        token = first[i]
        assert isinstance(token, SampledToken)
        return ScheduledSequence(
            str(i), [token.token_id], len(prompts[i]), tables[i], True, GREEDY, num_prompt_scored=scored
        )

    def replays() -> int:
        return sum(fake.replays.values())

    batch = [decode(i) for i in range(3)]
    host = runner.prepare_host(batch)
    graph = runner.run_step(host).logits
    assert replays() == 1 and graph is not None
    assert graph.untyped_storage().data_ptr() == graph_out.untyped_storage().data_ptr()
    graph = graph.clone()
    runner.use_cuda_graphs = False  # the same step again, eagerly (it writes the same K/V)
    eager = runner.run_step(host).logits
    runner.use_cuda_graphs = True
    assert eager is not None and eager.untyped_storage().data_ptr() != graph_out.untyped_storage().data_ptr()
    torch.testing.assert_close(graph, eager, atol=1e-5, rtol=1e-5)

    scoring = runner.run_step(runner.prepare_host([decode(0, scored=1), decode(1)])).logits
    assert replays() == 1 and scoring is not None and scoring.shape[0] == 3  # 1 scored row + 2 samples
    every = runner.logits([decode(0), replace(decode(1), sample=False)], all_tokens=True)
    assert replays() == 1 and every.shape[0] == 2
    # A one-token embedding entry beside a decode: eager too (a graph gives logits, no hidden states).
    embedding = ScheduledSequence("e", [5], 0, list(range(24, 32)), False, pooling="last")
    both = runner.run_step(runner.prepare_host([decode(0), embedding]))
    assert replays() == 1 and both.logits is not None and both.logits.shape[0] == 1
    assert both.pooled is not None and both.pooled.shape == (1, runner.hidden_size)


# ------------------------------------------------------------------------------- piecewise graphs


def test_token_capture_sizes_double_from_16_to_the_step_budget():
    assert token_capture_sizes(1) == (1,)
    assert token_capture_sizes(16) == (16,)
    assert token_capture_sizes(100) == (16, 32, 64, 100)
    assert token_capture_sizes(2048) == (16, 32, 64, 128, 256, 512, 1024, 2048)


# SCRIPT's steps that no decode graph takes, by their token count: 17 (a's and b's prompts), 14 (2
# decodes and c's prompt), 11 (3 decodes, d's and e's prompts) and 5 (5 decodes, past the largest
# decode graph).
SCRIPT_EAGER_STEP_TOKENS = [17, 14, 11, 5]


def count_piecewise_steps(pieces: PiecewiseGraphs) -> list[int]:
    """From now on, the token count of every step that replays `pieces` (appended as they run)."""
    replayed: list[int] = []
    run = pieces.run

    def counted(inputs, size):  # noqa: ANN001, ANN202
        replayed.append(int(inputs.input_ids.shape[0]))
        return run(inputs, size)

    pieces.run = counted  # type: ignore[method-assign]
    return replayed


@pytest.mark.parametrize("backend", cpu_backends())
@pytest.mark.parametrize("max_tokens", [16, 32])
def test_piecewise_steps_give_the_eager_tokens_and_touch_only_the_scratch_block(
    tiny_llama_dir: Path, backend: str, max_tokens: int, caplog: pytest.LogCaptureFixture
):
    """The steps with prompt tokens run in pieces between attentions (a stand-in replays by running the
    forward pass again, through the same buffers and breaks), padded to 16 or 32 tokens; one of more
    tokens than the largest size runs eagerly. Tokens and K/V are the eager executor's."""
    eager = executor(tiny_llama_dir, "cpu", backend, enforce_eager=True)
    graphed = executor(tiny_llama_dir, "cpu", backend, enforce_eager=True)
    runner = graphed.runner
    runner.capture_decode_graphs(MAX_NUM_SEQS, capturer=ReplayByCalling())
    fake = PiecesByCalling()
    with caplog.at_level(logging.INFO, logger="engine.piecewise_graphs"):
        stats = runner.capture_piecewise_graphs(max_tokens, capturer=fake)
    layers = runner.model.num_layers
    assert stats.sizes == token_capture_sizes(max_tokens)
    pieces = runner.piecewise_graphs
    assert pieces is not None
    for size in stats.sizes:  # a piece before each attention, and one after the last
        assert len(pieces.by_size[size].breaks) == layers
        assert len(pieces.by_size[size].pieces) == layers + 1
    assert fake.begun == len(stats.sizes) * (layers + 1)
    assert (
        f"captured {len(stats.sizes) * (layers + 1)} pieces of {len(stats.sizes)} token counts" in caplog.text
    )

    replayed = count_piecewise_steps(pieces)
    expected = run_script(eager)
    assert run_script(graphed) == expected
    assert replayed == [t for t in SCRIPT_EAGER_STEP_TOKENS if t <= max_tokens]

    # The K/V of real blocks: a padded step's matmuls have more rows, which may move a float32 result by
    # a rounding, and so a 16-bit cache entry by one step (1.2e-4 at 0.2 in float16).
    ours, theirs = runner.kv_cache, eager.runner.kv_cache
    real = slice(0, graphed.num_kv_blocks)
    torch.testing.assert_close(ours.k_cache[:, real], theirs.k_cache[:, real], atol=5e-4, rtol=2e-3)
    torch.testing.assert_close(ours.v_cache[:, real], theirs.v_cache[:, real], atol=5e-4, rtol=2e-3)


def test_piecewise_graphs_follow_the_flag_and_the_step_budget(tiny_llama_dir: Path):
    config = executor(tiny_llama_dir, "cpu", "cpu-decode", enforce_eager=True).config
    assert piecewise_graphs_off_reason(replace(config, max_num_batched_tokens=64)) is None
    assert "max_num_batched_tokens" in (piecewise_graphs_off_reason(config) or "")
    off = piecewise_graphs_off_reason(replace(config, max_num_batched_tokens=64, cuda_graphs="decode"))
    assert off == "--cuda-graphs decode"
    with pytest.raises(ValueError, match="cuda_graphs"):
        replace(config, cuda_graphs="sometimes")


# ------------------------------------------------------------------------------------------ CUDA

cuda = pytest.mark.skipif(
    not (torch.cuda.is_available() and triton_available("cuda")), reason="needs a CUDA GPU and triton"
)


@pytest.mark.cuda
@cuda
def test_cuda_graph_tokens_equal_eager_tokens(tiny_llama_dir: Path, caplog: pytest.LogCaptureFixture):
    eager = executor(tiny_llama_dir, "cuda", "triton", enforce_eager=True)
    assert not eager.runner.use_cuda_graphs
    with caplog.at_level(logging.INFO, logger="engine.cuda_graphs"):
        graphed = executor(tiny_llama_dir, "cuda", "triton", enforce_eager=False)
    assert graphed.runner.use_cuda_graphs
    line = next(r.getMessage() for r in caplog.records if "captured" in r.getMessage())
    print(line)  # the start-up cost, for the GPU check's log
    assert "captured 3 decode graphs (batch sizes 1, 2, 4)" in line and " MiB" in line
    assert run_script(graphed) == run_script(eager)
    real = slice(0, graphed.num_kv_blocks)
    torch.testing.assert_close(
        graphed.runner.kv_cache.k_cache[:, real], eager.runner.kv_cache.k_cache[:, real], atol=1e-4, rtol=1e-4
    )


def bfloat16_executor(model_dir: Path, max_num_batched_tokens: int | None = None) -> LocalExecutor:
    """Serving's dtype on CUDA, with graphs (piecewise ones too where max_num_batched_tokens is given)."""
    return LocalExecutor(
        EngineConfig(
            model=str(model_dir),
            dtype="bfloat16",
            device="cuda",
            block_size=BLOCK_SIZE,
            num_kv_blocks=4 * BLOCKS_PER_REQUEST,
            attention_backend="triton",
            max_num_seqs=MAX_NUM_SEQS,
            max_num_batched_tokens=max_num_batched_tokens,
        )
    )


@pytest.mark.cuda
@cuda
def test_piecewise_graph_tokens_equal_eager_tokens(tiny_llama_dir: Path, caplog: pytest.LogCaptureFixture):
    """Real piecewise graphs: SCRIPT's steps with prompt tokens replay the pieces of 16 or 32 tokens,
    their attentions eager between them; the tokens and K/V are the eager executor's."""
    eager = executor(tiny_llama_dir, "cuda", "triton", enforce_eager=True)
    with caplog.at_level(logging.INFO, logger="engine.piecewise_graphs"):
        graphed = executor(tiny_llama_dir, "cuda", "triton", enforce_eager=False, max_num_batched_tokens=32)
    pieces = graphed.runner.piecewise_graphs
    assert pieces is not None and pieces.sizes == (16, 32)
    line = next(r.getMessage() for r in caplog.records if "pieces" in r.getMessage())
    print(line)  # the start-up cost, for the GPU check's log
    replayed = count_piecewise_steps(pieces)
    assert run_script(graphed) == run_script(eager)
    assert replayed == SCRIPT_EAGER_STEP_TOKENS
    real = slice(0, graphed.num_kv_blocks)
    for ours, theirs in (
        (graphed.runner.kv_cache.k_cache, eager.runner.kv_cache.k_cache),
        (graphed.runner.kv_cache.v_cache, eager.runner.kv_cache.v_cache),
    ):
        torch.testing.assert_close(ours[:, real], theirs[:, real], atol=5e-4, rtol=2e-3)


@pytest.mark.cuda
@cuda
def test_piecewise_graph_logits_match_eager_in_bfloat16_and_a_mixed_step_does_not_synchronise(
    tiny_llama_dir: Path,
):
    """Serving's dtype: a step of prompts and decodes replayed in pieces against the same step run
    eagerly; building and queueing it never waits for the GPU."""
    ex = bfloat16_executor(tiny_llama_dir, max_num_batched_tokens=64)
    runner = ex.runner
    assert runner.piecewise_graphs is not None
    tables = [list(range(i * BLOCKS_PER_REQUEST, (i + 1) * BLOCKS_PER_REQUEST)) for i in range(4)]
    prompts = [list(range(100 + 20 * i, 109 + 20 * i + i)) for i in range(4)]
    first = ex.step(
        [ScheduledSequence(str(i), p, 0, tables[i], True, GREEDY) for i, p in enumerate(prompts[:2])]
    )
    batch = [
        *(
            ScheduledSequence(str(i), [first[i].token_id], len(prompts[i]), tables[i], True, GREEDY)
            for i in range(2)
        ),
        *(ScheduledSequence(str(i), prompts[i], 0, tables[i], True, GREEDY) for i in (2, 3)),
    ]
    host = runner.prepare_host(batch)
    pieces = runner.run_step(host).logits
    assert pieces is not None
    pieces = pieces.clone()
    runner.use_cuda_graphs = False  # the same step again, eagerly (it writes the same K/V)
    eager = runner.run_step(host).logits
    runner.use_cuda_graphs = True
    torch.testing.assert_close(pieces, eager, atol=0.1, rtol=0.05)
    submitted, collected = step_syncs(ex, batch)
    assert submitted == 0, "building inputs or the piecewise forward synchronised"
    assert collected <= 1


@pytest.mark.cuda
@cuda
def test_a_mixture_of_experts_is_captured_and_replays_its_eager_tokens(tiny_qwen3_moe_dir: Path):
    """Its experts run in the fused Triton kernels, which read nothing back to the host: the decode
    steps are captured, and their tokens are the eager ones."""
    eager = executor(tiny_qwen3_moe_dir, "cuda", "triton", enforce_eager=True)
    graphed = executor(tiny_qwen3_moe_dir, "cuda", "triton", enforce_eager=False)
    assert graphed.runner.use_cuda_graphs
    assert run_script(graphed) == run_script(eager)


@pytest.mark.cuda
@cuda
def test_cuda_graph_logits_match_eager_in_bfloat16(tiny_llama_dir: Path):
    """Serving's dtype: a replayed graph's logits against the eager forward's on the same step, at the
    bucket boundaries (1, a padded 3, a full 4)."""
    ex = bfloat16_executor(tiny_llama_dir)
    assert ex.runner.use_cuda_graphs
    tables = [list(range(i * BLOCKS_PER_REQUEST, (i + 1) * BLOCKS_PER_REQUEST)) for i in range(4)]
    prompts = [list(range(100 + 20 * i, 109 + 20 * i + i)) for i in range(4)]
    first = ex.step([ScheduledSequence(str(i), p, 0, tables[i], True, GREEDY) for i, p in enumerate(prompts)])
    runner = ex.runner
    assert runner.decode_graphs is not None and runner.decode_graphs.logits is not None
    graph_out = runner.decode_graphs.logits
    for n in (1, 3, 4):
        batch = [
            ScheduledSequence(str(i), [first[i].token_id], len(prompts[i]), tables[i], True, GREEDY)
            for i in range(n)
        ]
        host = runner.prepare_host(batch)
        graph = runner.run_step(host).logits
        assert graph is not None
        # A replay: its logits are a view of the graphs' output buffer (an eager step's are not).
        assert graph.untyped_storage().data_ptr() == graph_out.untyped_storage().data_ptr()
        graph = graph.clone()
        runner.use_cuda_graphs = False  # the same step again, eagerly (it writes the same K/V)
        eager = runner.run_step(host).logits
        runner.use_cuda_graphs = True
        torch.testing.assert_close(graph, eager, atol=0.1, rtol=0.05)


def count_syncs(fn: Callable[[], object]) -> int:
    """How many times fn synchronised the host with the GPU (torch's sync debug mode warns each time)."""
    torch.cuda.synchronize()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            fn()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    # Only the per-operation warnings: the first switch to "warn" also warns that the mode is a prototype.
    return sum("called a synchronizing CUDA operation" in str(w.message) for w in caught)


def step_syncs(ex: LocalExecutor, batch: list[ScheduledSequence]) -> tuple[int, int]:
    """Synchronisations in submit (inputs and forward) and in collect (sampling) of one step."""
    handle: list = []
    submitted = count_syncs(lambda: handle.append(ex.submit(batch)))
    return submitted, count_syncs(lambda: ex.collect(handle[0]))


@pytest.mark.cuda
@cuda
@pytest.mark.parametrize("enforce_eager", [False, True])
def test_a_decode_step_synchronises_once(tiny_llama_dir: Path, enforce_eager: bool):
    """Inputs and forward queue up without waiting; sampling waits once, for the token ids (greedy), or
    once for ids, logprobs and a seeded draw together."""
    ex = executor(tiny_llama_dir, "cuda", "triton", enforce_eager=enforce_eager)
    tables = [list(range(i * BLOCKS_PER_REQUEST, (i + 1) * BLOCKS_PER_REQUEST)) for i in range(3)]
    prompts = [list(range(100 + 10 * i, 105 + 10 * i)) for i in range(3)]
    first = ex.step([ScheduledSequence(str(i), p, 0, tables[i], True, GREEDY) for i, p in enumerate(prompts)])
    sampled = SamplingParams(temperature=0.8, top_p=0.9, top_k=50, seed=7, logprobs=2, ignore_eos=True)
    for params in (GREEDY, sampled):
        batch = [
            ScheduledSequence(str(i), [first[i].token_id], 5, tables[i], True, params, prompts[i], [1])
            for i in range(3)
        ]
        submitted, collected = step_syncs(ex, batch)
        assert submitted == 0, "building inputs or the forward pass synchronised"
        assert collected <= 1, f"sampling synchronised {collected} times ({params})"
