"""loadtest.step_profile reads what the /live feed sends and what py-spy writes."""

from __future__ import annotations

from pathlib import Path

from loadtest.step_profile import main, read_feed, summarize_feed, summarize_py_spy, summarize_waits
from scheduler.outputs import StepReport
from server.live_feed import encode_message


def _report(step: int, tokens: list[int], decode: list[bool], ms: float) -> StepReport:
    return StepReport(
        num_seqs=len(tokens),
        num_tokens=sum(tokens),
        num_prompt_tokens=sum(t for t, d in zip(tokens, decode, strict=True) if not d),
        num_decode_tokens=sum(decode),
        duration_s=ms / 1000,
        step=step,
        request_ids=[f"r{i}" for i in range(len(tokens))],
        request_num_tokens=tokens,
        request_start_positions=[0] * len(tokens),
        request_is_decode=decode,
    )


def _capture(tmp_path: Path, messages: list[list[StepReport]]) -> Path:
    """An SSE capture as `curl -N /live/events` writes it: a message per line after `data: `."""
    lines = []
    for reports in messages:
        lines += [f"data: {encode_message(reports, max_steps=64, max_entries=1024)}", ""]
    lines.append('data: {"steps": [{"step": 9')  # cut off mid-message by the capture's end
    path = tmp_path / "live.txt"
    path.write_text("\n".join(lines))
    return path


def test_reads_each_step_once_with_its_shape(tmp_path: Path) -> None:
    prefill = _report(1, [100, 28], [False, False], 12.0)
    mixed = _report(2, [1, 1, 50], [True, True, False], 8.0)
    decode = _report(3, [1, 1, 1], [True, True, True], 2.0)
    # A viewer's backlog repeats steps it already had: each counts once.
    path = _capture(tmp_path, [[prefill, mixed], [mixed, decode]])
    steps = read_feed(path)
    assert [(s.step, s.num_tokens, s.num_seqs, s.has_prompt) for s in steps] == [
        (1, 128, 2, True),
        (2, 52, 3, True),
        (3, 3, 3, False),
    ]
    assert [s.duration_ms for s in steps] == [12.0, 8.0, 2.0]
    summary = "\n".join(summarize_feed(steps))
    assert "3 steps" in summary
    assert "runner busy 0.02 s" in summary
    assert "decode <=    16 tokens:    1 steps, median    2.00 ms" in summary
    assert "mixed  <=    64 tokens:    1 steps, median    8.00 ms" in summary
    assert "mixed  <=   256 tokens:    1 steps, median   12.00 ms" in summary


def _py_spy(tmp_path: Path, *lines: str) -> Path:
    """A `py-spy record --format raw` file of these lines (each: thread;frames... samples)."""
    raw = tmp_path / "py-spy.txt"
    raw.write_text("".join(f"{line}\n" for line in lines))
    return raw


def test_py_spy_samples_per_thread_and_function(tmp_path: Path) -> None:
    raw = _py_spy(
        tmp_path,
        "thread (1): MainThread;run (asyncio/runners.py:118);send (h11_impl.py:40) 30",
        "thread (1): MainThread;run (asyncio/runners.py:118);send (h11_impl.py:52) 10",
        "thread (2): orca-step_0;_run_step (scheduler/loop.py:430);__call__ (engine/sampler.py:222) 60",
    )
    lines = summarize_py_spy(raw, top=5)
    assert lines[0] == "thread (2): orca-step_0: 60 samples"
    assert "    100.0%  engine/sampler.py:__call__" in lines
    main_thread = lines.index("thread (1): MainThread: 40 samples")
    # Two lines of one function add up; the leaf is the function, not the line.
    assert "    100.0%  h11_impl.py:send" in lines[main_thread:]


def test_cli_prints_both(tmp_path: Path, capsys) -> None:
    path = _capture(tmp_path, [[_report(1, [1], [True], 1.5)]])
    raw = _py_spy(tmp_path, "thread (7): MainThread;serve (server/cli.py:10) 4")
    main([str(path), "--py-spy", str(raw)])
    out = capsys.readouterr().out
    assert "period 0: 1 steps" in out
    assert "thread (7): MainThread: 4 samples" in out


def test_native_recording_says_how_long_each_thread_waited_for_the_gil(tmp_path: Path) -> None:
    raw = _py_spy(
        tmp_path,
        # a torch call released the GIL and waits to take it back, at two lines
        "thread (2): orca-step_0;load (engine/cuda_graphs.py:161);THPVariable_copy_ (libtorch_python.so);"
        "pybind11::gil_scoped_release::~gil_scoped_release (libtorch_python.so);0x1 (libc.so.6) 6",
        "thread (2): orca-step_0;pad (engine/cuda_graphs.py:110);"
        "pybind11::gil_scoped_acquire::gil_scoped_acquire (libtorch_python.so) 2",
        # no work yet: the executor's queue
        "thread (2): orca-step_0;_worker (concurrent/futures/thread.py:89);PyThread_acquire_lock_timed (python3.12) 4",
        # on a CPU in Python, and in a CUDA call
        "thread (2): orca-step_0;run (engine/model_runner.py:300) 5",
        "thread (2): orca-step_0;replay (torch/cuda/graphs.py:139);0x2 (libcuda.so) 3",
        "thread (1): MainThread;run (asyncio/runners.py:118);0x3 (libc.so.6) 10",
    )
    lines = summarize_waits(raw, top=5)
    assert lines[0] == "waits (C frames):"
    assert (
        "thread (2): orca-step_0: 8 of 20 samples waiting to retake the GIL (40%), 4 waiting on a lock or queue (20%)"
        in lines
    )
    assert "         6  engine/cuda_graphs.py:161 load" in lines
    assert (
        "thread (1): MainThread: 0 of 10 samples waiting to retake the GIL (0%), 0 waiting on a lock or queue (0%)"
        in lines
    )


def test_a_recording_without_c_frames_has_no_waits_section(tmp_path: Path) -> None:
    assert summarize_waits(_py_spy(tmp_path, "thread (1): MainThread;run (asyncio/runners.py:118) 3")) == []
