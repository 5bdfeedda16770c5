"""Workloads (what each request asks for) and arrival processes (when requests are sent).

Request i of a workload is drawn from its own generator seeded with (seed, i), so it is the same
prompt and output length in every configuration, at every rate, whatever the number of requests:
configurations are compared on identical traffic.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import numpy as np

from loadtest.prompts import PromptBuilder


@dataclass(frozen=True)
class RequestSpec:
    index: int
    prompt: list[int] | str  # token ids (exact length) or text
    prompt_len: int
    output_len: int  # sent as max_tokens and min_tokens, with ignore_eos
    # A whole conversation for the chat endpoint (multi-turn workloads); `prompt` is then unused.
    messages: tuple[dict[str, str], ...] | None = None


class LengthSampler(Protocol):
    def sample(self, rng: np.random.Generator) -> tuple[int, int]:
        """(prompt tokens, output tokens) of one request."""
        ...


@dataclass(frozen=True)
class UniformLengths:
    """The ORCA paper's trace: input uniform in [32, 512], output uniform in [1, 128] (bounds inclusive)."""

    input_min: int = 32
    input_max: int = 512
    output_min: int = 1
    output_max: int = 128

    def __post_init__(self) -> None:
        if not 1 <= self.input_min <= self.input_max:
            raise ValueError(f"input length bounds [{self.input_min}, {self.input_max}] are invalid")
        if not 1 <= self.output_min <= self.output_max:
            raise ValueError(f"output length bounds [{self.output_min}, {self.output_max}] are invalid")

    def sample(self, rng: np.random.Generator) -> tuple[int, int]:
        return (
            int(rng.integers(self.input_min, self.input_max, endpoint=True)),
            int(rng.integers(self.output_min, self.output_max, endpoint=True)),
        )


def ratio_bounds(length: int, range_ratio: float) -> tuple[int, int]:
    """vLLM's `--random-range-ratio`: uniform in [length * (1 - r), length * (1 + r)], at least 1."""
    if length < 1 or not 0.0 <= range_ratio < 1.0:
        raise ValueError(f"need length >= 1 and 0 <= range ratio < 1, got {length}, {range_ratio}")
    # The epsilon keeps float noise (200 * 1.1 = 220.00000000000003) from widening the range by one.
    lo = math.floor(length * (1 - range_ratio) + 1e-9)
    hi = math.ceil(length * (1 + range_ratio) - 1e-9)
    return max(1, lo), max(1, hi)


def random_lengths(input_len: int, output_len: int, range_ratio: float) -> UniformLengths:
    lo_in, hi_in = ratio_bounds(input_len, range_ratio)
    lo_out, hi_out = ratio_bounds(output_len, range_ratio)
    return UniformLengths(lo_in, hi_in, lo_out, hi_out)


@dataclass(frozen=True)
class FileEntry:
    prompt: str
    output_len: int | None


def load_jsonl(path: Path) -> list[FileEntry]:
    """One JSON object per line: {"prompt": str, "output_len"?: int} ("max_tokens" is read too)."""
    entries: list[FileEntry] = []
    for lineno, line in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
            prompt = obj["prompt"]
        except (json.JSONDecodeError, KeyError, TypeError) as exc:
            raise ValueError(f"{path}:{lineno}: expected an object with a 'prompt' ({exc})") from exc
        if not isinstance(prompt, str) or not prompt:
            raise ValueError(f"{path}:{lineno}: 'prompt' must be a non-empty string")
        out = obj.get("output_len", obj.get("max_tokens"))
        entries.append(FileEntry(prompt, int(out) if out is not None else None))
    if not entries:
        raise ValueError(f"{path}: no prompts")
    return entries


class Workload:
    """Builds request i on demand. Either `lengths` (synthetic prompts) or `entries` (a prompt file)."""

    def __init__(
        self,
        name: str,
        builder: PromptBuilder,
        seed: int,
        as_text: bool,
        lengths: LengthSampler | None = None,
        entries: Sequence[FileEntry] | None = None,
        default_output_len: int = 128,
    ) -> None:
        if (lengths is None) == (entries is None):
            raise ValueError("a workload has either length distributions or file entries")
        self.name = name
        self.builder = builder
        self.seed = seed
        self.as_text = as_text
        self.lengths = lengths
        self.entries = list(entries) if entries is not None else None
        self.default_output_len = default_output_len

    def spec(self, index: int, round_: int = 0) -> RequestSpec:
        """Request `index` of a run. Synthetic prompts keep their lengths from run to run but take new
        tokens in each `round_` (a sweep's later rates): a server with a prefix cache would otherwise
        serve every rate after the first from its cache. A file's prompts are the file's."""
        rng = np.random.default_rng([self.seed, index])
        if self.entries is not None:
            entry = self.entries[index % len(self.entries)]  # a file shorter than the run is cycled
            out_len = entry.output_len or self.default_output_len
            if self.as_text:
                return RequestSpec(index, entry.prompt, self.builder.count(entry.prompt), out_len)
            ids = self.builder.tokenizer.encode(entry.prompt, add_special_tokens=True)
            return RequestSpec(index, ids, len(ids), out_len)
        assert self.lengths is not None
        in_len, out_len = self.lengths.sample(rng)
        if round_:
            rng = np.random.default_rng([self.seed, index, round_])
        if self.as_text:
            return RequestSpec(index, self.builder.text_prompt(in_len, rng), in_len, out_len)
        return RequestSpec(index, self.builder.token_prompt(in_len, rng), in_len, out_len)

    def with_text_prompts(self) -> Workload:
        return Workload(
            self.name,
            self.builder,
            self.seed,
            True,
            self.lengths,
            self.entries,
            self.default_output_len,
        )


def arrival_times(
    rate: float,
    rng: np.random.Generator,
    num_requests: int | None = None,
    duration: float | None = None,
    burstiness: float = 1.0,
) -> list[float]:
    """Send times (s, first at 0) of a Poisson (burstiness 1) or gamma process at `rate` requests/s.

    Gaps are gamma(shape=burstiness, scale=1/(rate*burstiness)): mean 1/rate whatever the burstiness,
    coefficient of variation 1/sqrt(burstiness) (below 1 burstier than Poisson, above 1 smoother), as
    in vLLM. An infinite rate sends everything at once. Stops after `num_requests` arrivals or at the
    last arrival before `duration` seconds, whichever comes first.
    """
    if num_requests is None and duration is None:
        raise ValueError("bound the arrivals with num_requests or duration")
    if not rate > 0 or not burstiness > 0:
        raise ValueError(f"rate and burstiness must be positive, got {rate}, {burstiness}")
    if math.isinf(rate):
        if num_requests is None:
            raise ValueError("an infinite rate needs num_requests (or a concurrency limit)")
        return [0.0] * num_requests
    times: list[float] = []
    now = 0.0
    while num_requests is None or len(times) < num_requests:
        if duration is not None and now >= duration:
            break
        times.append(now)
        now += float(rng.gamma(shape=burstiness, scale=1.0 / (rate * burstiness)))
    return times
