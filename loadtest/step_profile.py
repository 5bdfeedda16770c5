"""Where a server's time went under load: its /live feed (per-step durations and batch shapes) and,
optionally, a py-spy sample of its threads (`py-spy record --threads --format raw`).

    python -m loadtest.step_profile live.txt [--py-spy py-spy.txt]

scripts/gpu_check.sh's `profile` phase records both while the load test runs. The feed says how busy the
runner was (the sum of step durations against the wall time the steps spanned) and what each kind of step
cost; py-spy says what the other threads did meanwhile (the asyncio loop's scheduling, detokenizing and
streaming, which the runner's time does not include). A recording with C frames (`py-spy record --native
--idle`, the profile phase's PROFILE_NATIVE=1) also says how much of each thread waited to retake the GIL
and where.
"""

from __future__ import annotations

import argparse
import json
import statistics
from collections import Counter, defaultdict
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

# Steps are grouped by how many tokens they ran: the bucket is the smallest bound not below the count.
TOKEN_BUCKETS = (1, 16, 64, 256, 1024, 4096, 1 << 30)


@dataclass(frozen=True)
class Step:
    step: int
    duration_ms: float
    num_tokens: int
    num_seqs: int
    has_prompt: bool
    time: float  # wall time of the feed message that carried it (the sender's clock, 0.1 s resolution)


def read_feed(path: Path) -> list[Step]:
    """The steps in an SSE capture of /live/events, each once (a new viewer's backlog may repeat)."""
    steps: dict[int, Step] = {}
    for line in path.read_text().splitlines():
        if not line.startswith("data:"):
            continue
        try:
            message = json.loads(line[5:])
        except json.JSONDecodeError:
            continue  # the capture was cut mid-message
        for event in message.get("steps", ()):
            steps[event["step"]] = Step(
                step=event["step"],
                duration_ms=event["duration_ms"],
                num_tokens=sum(event["tokens"]),
                num_seqs=len(event["ids"]),
                has_prompt=not all(event["decode"]),
                time=message["time"],
            )
    return [steps[k] for k in sorted(steps)]


def busy_periods(steps: list[Step], idle_s: float = 0.5) -> list[list[Step]]:
    """The steps split where the feed shows no step for `idle_s` (between load-test rates)."""
    periods: list[list[Step]] = []
    for s in steps:
        if periods and s.time - periods[-1][-1].time <= idle_s:
            periods[-1].append(s)
        else:
            periods.append([s])
    return periods


def summarize_feed(steps: list[Step]) -> list[str]:
    lines = []
    for i, period in enumerate(busy_periods(steps)):
        span = period[-1].time - period[0].time
        busy = sum(s.duration_ms for s in period) / 1000
        lines.append(
            f"period {i}: {len(period)} steps over ~{span:.2f} s (feed clock), runner busy {busy:.2f} s"
            + (f" ({busy / span:.0%})" if span > 0.2 else "")
        )
        groups: dict[tuple[bool, int], list[Step]] = defaultdict(list)
        for s in period:
            bucket = next(b for b in TOKEN_BUCKETS if s.num_tokens <= b)
            groups[(s.has_prompt, bucket)].append(s)
        for (has_prompt, bucket), group in sorted(groups.items()):
            durations = [s.duration_ms for s in group]
            lines.append(
                f"  {'mixed ' if has_prompt else 'decode'} <= {bucket:>5} tokens: {len(group):4} steps, "
                f"median {statistics.median(durations):7.2f} ms, max {max(durations):7.2f} ms, "
                f"sum {sum(durations) / 1000:6.2f} s, mean {statistics.mean(s.num_seqs for s in group):5.1f} seqs"
            )
    return lines


def summarize_py_spy(path: Path, top: int = 25) -> list[str]:
    """Samples per thread, and per thread the functions (file:function) most often on the stack and
    most often at its top."""
    per_thread: Counter[str] = Counter()
    inclusive: dict[str, Counter[str]] = defaultdict(Counter)
    leaf: dict[str, Counter[str]] = defaultdict(Counter)
    for thread, frames, count in _samples(path):
        per_thread[thread] += count
        names = [_frame_name(f) for f in frames]
        for name in set(names):
            inclusive[thread][name] += count
        if names:
            leaf[thread][names[-1]] += count
    lines = []
    for thread, samples in per_thread.most_common():
        lines.append(f"{thread}: {samples} samples")
        lines.append("  on the stack:")
        lines += [f"    {n / samples:6.1%}  {name}" for name, n in inclusive[thread].most_common(top)]
        lines.append("  at the top:")
        lines += [f"    {n / samples:6.1%}  {name}" for name, n in leaf[thread].most_common(top)]
    return lines


# C frames (py-spy --native) in which a thread waits to take the GIL back: libtorch_python's guards
# around every torch call that released it, and CPython's own.
GIL_WAIT_FRAMES = ("gil_scoped_acquire", "gil_scoped_release", "take_gil", "PyEval_RestoreThread")
GIL_WAIT_FRAMES += ("PyEval_AcquireThread", "PyGILState_Ensure")
# ... and in which it waits for a lock (an executor's queue: no work yet).
LOCK_WAIT_FRAMES = ("PyThread_acquire_lock", "PyMutex_Lock")


def summarize_waits(path: Path, top: int = 10) -> list[str]:
    """From a recording with C frames and idle samples (`py-spy record --native --idle`): per thread,
    the samples spent waiting to retake the GIL and waiting on a lock, and the Python lines where the
    GIL waits happened. Empty when the recording has no C frames."""
    total: Counter[str] = Counter()
    gil: Counter[str] = Counter()
    lock: Counter[str] = Counter()
    where: dict[str, Counter[str]] = defaultdict(Counter)
    native = False
    for thread, frames, count in _samples(path):
        total[thread] += count
        python = [i for i, f in enumerate(frames) if _is_python(f)]
        tail = frames[python[-1] + 1 :] if python else frames
        native = native or bool(tail)
        if any(w in f for f in tail for w in GIL_WAIT_FRAMES):
            gil[thread] += count
            if python:
                function, _, at = frames[python[-1]].partition(" (")
                where[thread][f"{_short_path(at.rstrip(')'))} {function}"] += count
        elif any(w in f for f in tail for w in LOCK_WAIT_FRAMES):
            lock[thread] += count
    if not native:
        return []
    lines = ["waits (C frames):"]
    for thread, samples in total.most_common():
        lines.append(
            f"{thread}: {gil[thread]} of {samples} samples waiting to retake the GIL "
            f"({gil[thread] / samples:.0%}), {lock[thread]} waiting on a lock or queue "
            f"({lock[thread] / samples:.0%})"
        )
        lines += [f"    {n:6d}  {at}" for at, n in where[thread].most_common(top)]
    return lines


def _samples(path: Path) -> Iterator[tuple[str, list[str], int]]:
    """(thread, frames from the outermost, samples) of each line of a `py-spy --format raw` file."""
    for line in path.read_text().splitlines():
        stack, _, count_text = line.rpartition(" ")
        if stack and count_text.isdigit():
            thread, *frames = stack.split(";")
            yield thread, frames, int(count_text)


def _is_python(frame: str) -> bool:
    _, _, where = frame.partition(" (")
    return ".py:" in where or where.startswith(("<string>", "<frozen"))


def _frame_name(frame: str) -> str:
    """`function (path/to/file.py:123)` -> `file.py:function`, so lines of one function add up."""
    function, _, where = frame.partition(" (")
    return f"{_short_path(where.rstrip(')').rsplit(':', 1)[0])}:{function}"


def _short_path(path: str) -> str:
    """The last folder and the file (`engine/cuda_graphs.py`, `engine/cuda_graphs.py:161`)."""
    return "/".join(Path(path).parts[-2:])


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("feed", type=Path, help="an SSE capture of /live/events")
    parser.add_argument("--py-spy", type=Path, help="py-spy record --threads --format raw output")
    parser.add_argument("--top", type=int, default=25, help="functions listed per thread")
    args = parser.parse_args(argv)
    print("\n".join(summarize_feed(read_feed(args.feed))))
    if args.py_spy and args.py_spy.exists():
        print("\n".join(summarize_py_spy(args.py_spy, args.top) + summarize_waits(args.py_spy)))


if __name__ == "__main__":
    main()
