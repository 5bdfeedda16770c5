"""Serving metrics as pure functions over request timelines (`RequestRecord`).

Definitions follow vLLM's `benchmark_serving` where the paper is silent:
- TTFT: first token time - send time.
- TPOT: (end-to-end latency - TTFT) / (output tokens - 1); undefined for one-token outputs, which are
  left out of the TPOT distribution and count as meeting a TPOT SLO (they have no decode phase).
- ITL: the gaps between consecutive streamed token chunks, pooled over requests.
- Normalized latency (the ORCA paper's metric): end-to-end latency / generated tokens, in ms/token.
- Goodput: requests per second that completed and met every SLO.
Records hold seconds; summaries report milliseconds.
"""

from __future__ import annotations

import itertools
import math
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

from loadtest.records import RequestRecord

PERCENTILES: tuple[float, ...] = (50.0, 90.0, 99.0)


def ttft(record: RequestRecord) -> float | None:
    if not record.ok or record.first_token_time is None:
        return None
    return record.first_token_time - record.send_time


def e2e_latency(record: RequestRecord) -> float | None:
    if not record.ok or record.end_time is None:
        return None
    return record.end_time - record.send_time


def tpot(record: RequestRecord) -> float | None:
    first, total = ttft(record), e2e_latency(record)
    if first is None or total is None or record.output_tokens < 2:
        return None
    return (total - first) / (record.output_tokens - 1)


def itls(record: RequestRecord) -> list[float]:
    if not record.ok:
        return []
    times = record.token_times
    return [later - earlier for earlier, later in zip(times, times[1:], strict=False)]


def normalized_latency(record: RequestRecord) -> float | None:
    total = e2e_latency(record)
    if total is None or record.output_tokens < 1:
        return None
    return total / record.output_tokens


@dataclass(frozen=True)
class Distribution:
    """Summary statistics of one metric, in the unit of its inputs scaled by `scale`."""

    count: int
    mean: float
    p50: float
    p90: float
    p99: float
    min: float
    max: float

    def to_dict(self) -> dict[str, float | None]:
        # JSON has no NaN (strict parsers such as jq reject it): an empty distribution is null.
        return {k: (None if isinstance(v, float) and math.isnan(v) else v) for k, v in asdict(self).items()}

    @classmethod
    def from_dict(cls, data: dict[str, float | None]) -> Distribution:
        return cls(**{k: (math.nan if v is None else v) for k, v in data.items()})  # type: ignore[arg-type]


def distribution(values: Iterable[float], scale: float = 1.0) -> Distribution:
    """Mean, p50/p90/p99 (numpy's linear interpolation, as vLLM), min and max; NaN when empty."""
    arr = np.asarray([v for v in values], dtype=np.float64) * scale
    if arr.size == 0:
        nan = math.nan
        return Distribution(0, nan, nan, nan, nan, nan, nan)
    p50, p90, p99 = (float(x) for x in np.percentile(arr, PERCENTILES))
    return Distribution(
        count=int(arr.size),
        mean=float(arr.mean()),
        p50=p50,
        p90=p90,
        p99=p99,
        min=float(arr.min()),
        max=float(arr.max()),
    )


# SLO metric name -> per-request value in seconds (None: the request has no such value).
_SLO_METRICS = {
    "ttft": ttft,
    "tpot": tpot,
    "e2el": e2e_latency,
    "nlat": normalized_latency,
}


@dataclass(frozen=True)
class SLO:
    """A service-level objective: `metric` (ttft, tpot, e2el, nlat) at most `threshold_ms`."""

    metric: str
    threshold_ms: float

    def __post_init__(self) -> None:
        if self.metric not in _SLO_METRICS:
            raise ValueError(f"unknown SLO metric {self.metric!r}; choose from {sorted(_SLO_METRICS)}")
        if not self.threshold_ms > 0:
            raise ValueError(f"SLO threshold must be positive, got {self.threshold_ms}")

    @classmethod
    def parse(cls, text: str) -> SLO:
        """`ttft:500` -> SLO("ttft", 500.0); thresholds are milliseconds."""
        name, sep, value = text.partition(":")
        if not sep:
            raise ValueError(f"SLO {text!r} is not METRIC:MILLISECONDS")
        return cls(name.strip().lower(), float(value))

    def met_by(self, record: RequestRecord) -> bool:
        if not record.ok:
            return False
        value = _SLO_METRICS[self.metric](record)
        if value is None:
            # Only TPOT is undefined for a completed request (one output token): no decode phase to miss.
            return self.metric == "tpot"
        return value * 1000.0 <= self.threshold_ms


def meets_slos(record: RequestRecord, slos: Sequence[SLO]) -> bool:
    return record.ok and all(slo.met_by(record) for slo in slos)


def run_duration(records: Sequence[RequestRecord]) -> float:
    """From the run's start (time 0, the first arrival) to the last response's end."""
    ends = [r.end_time for r in records if r.end_time is not None]
    ends += [r.send_time for r in records]  # failed requests still occupied the run
    return max(ends, default=0.0)


def goodput(records: Sequence[RequestRecord], slos: Sequence[SLO], duration: float) -> float:
    if duration <= 0:
        return 0.0
    return sum(1 for r in records if meets_slos(r, slos)) / duration


def error_counts(records: Iterable[RequestRecord]) -> dict[str, int]:
    return dict(sorted(Counter(r.error_kind for r in records if r.error_kind is not None).items()))


@dataclass
class Summary:
    """One run (one configuration at one request rate). Latencies in ms, throughputs per second."""

    num_requests: int
    completed: int
    duration_s: float
    request_throughput: float  # completed requests / duration
    output_token_throughput: float
    total_token_throughput: float  # prompt + output tokens of completed requests / duration
    ttft_ms: Distribution
    tpot_ms: Distribution
    itl_ms: Distribution
    e2el_ms: Distribution
    normalized_latency_ms: Distribution  # ms per generated token; its p50 is the paper's y axis
    goodput: float | None  # requests/s meeting every SLO; None without SLOs
    slos: list[str]
    errors: dict[str, int]
    short_outputs: int  # completed with fewer tokens than asked: the server ignored min_tokens/ignore_eos
    prompt_len_mismatches: int  # the server counted other prompt lengths than asked (another tokenizer)
    extras: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        for name in _DISTRIBUTIONS:
            data[name] = getattr(self, name).to_dict()
        return data

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Summary:
        fields = dict(data)
        for name in _DISTRIBUTIONS:
            fields[name] = Distribution.from_dict(data[name])
        return cls(**fields)


_DISTRIBUTIONS = ("ttft_ms", "tpot_ms", "itl_ms", "e2el_ms", "normalized_latency_ms")


def _defined(values: Iterable[float | None]) -> list[float]:
    return [v for v in values if v is not None]


def summarize(
    records: Sequence[RequestRecord], slos: Sequence[SLO] = (), duration: float | None = None
) -> Summary:
    if duration is None:
        duration = run_duration(records)
    done = [r for r in records if r.ok]
    out_tokens = sum(r.output_tokens for r in done)
    in_tokens = sum(
        r.prompt_tokens_reported if r.prompt_tokens_reported is not None else r.prompt_len for r in done
    )
    per_s = (lambda x: x / duration) if duration > 0 else (lambda x: 0.0)
    return Summary(
        num_requests=len(records),
        completed=len(done),
        duration_s=duration,
        request_throughput=per_s(len(done)),
        output_token_throughput=per_s(out_tokens),
        total_token_throughput=per_s(in_tokens + out_tokens),
        ttft_ms=distribution(_defined(map(ttft, done)), 1000.0),
        tpot_ms=distribution(_defined(map(tpot, done)), 1000.0),
        itl_ms=distribution((gap for r in done for gap in itls(r)), 1000.0),
        e2el_ms=distribution(_defined(map(e2e_latency, done)), 1000.0),
        normalized_latency_ms=distribution(_defined(map(normalized_latency, done)), 1000.0),
        goodput=goodput(records, slos, duration) if slos else None,
        slos=[f"{s.metric}:{s.threshold_ms:g}" for s in slos],
        errors=error_counts(records),
        short_outputs=sum(1 for r in done if r.output_tokens < r.max_tokens),
        prompt_len_mismatches=sum(
            1
            for r in done
            if r.prompt_tokens_reported is not None and r.prompt_tokens_reported != r.prompt_len
        ),
    )


@dataclass(frozen=True)
class Capacity:
    """The load a configuration sustains under a latency bound (see `capacity_at_latency`)."""

    load: float  # offered rate or achieved throughput (req/s), whichever the points were given in
    crossed: bool  # False: even the highest measured load stayed under the bound, so this is a lower bound


def capacity_at_latency(points: Sequence[tuple[float, float]], latency: float) -> Capacity | None:
    """The load (req/s) up to which median normalized latency stays <= `latency`, from a rate sweep.

    `points` are (load, median normalized latency) pairs, the load being the offered request rate or
    the achieved request throughput. Walking up the loads, the curve is followed to its first point
    over the bound and interpolated linearly to the crossing, which is how one reads "throughput at
    the same latency" off the paper's figures. A noisy point under the bound beyond the crossing does
    not count: the configuration did not sustain the loads in between. None if even the lightest
    load is over the bound.
    """
    pts = sorted((x, lat) for x, lat in points if math.isfinite(x) and not math.isnan(lat))
    if not pts or pts[0][1] > latency:
        return None
    for (x0, l0), (x1, l1) in itertools.pairwise(pts):
        if l1 > latency:
            return Capacity(x0 + (x1 - x0) * (latency - l0) / (l1 - l0), crossed=True)
    return Capacity(pts[-1][0], crossed=False)
