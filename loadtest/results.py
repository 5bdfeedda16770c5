"""The results file: the benchmark's configuration, one summary per (configuration, rate), every record."""

from __future__ import annotations

import json
import math
import os
import platform
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from loadtest.metrics import Summary
from loadtest.records import RequestRecord

FORMAT_VERSION = 1


def rate_to_json(rate: float) -> float | str:
    return "inf" if math.isinf(rate) else rate  # JSON has no infinity


def rate_from_json(value: float | str) -> float:
    return float(value)


def format_rate(rate: float) -> str:
    return "inf" if math.isinf(rate) else f"{rate:g}"


# The instruction-set extensions that decide a CPU server's kernels: every figure is read beside them.
ISA_FLAGS = (
    "avx2", "fma", "avx512f", "avx512bw", "avx512vl", "avx512_vnni", "avx_vnni", "avx512_bf16",
    "avx512_fp16", "amx_tile", "amx_int8", "amx_bf16",
)  # fmt: skip


def isa_flags() -> list[str]:
    """Which of ISA_FLAGS this machine's CPU has (from /proc/cpuinfo; empty where there is none)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                have = set(line.split(":", 1)[1].split())
                return [f for f in ISA_FLAGS if f in have]
    except OSError:
        pass
    return []


def isa_text() -> str:
    """isa_flags() as a report's words."""
    return " ".join(isa_flags()) or "unknown"


def machine_info() -> dict[str, Any]:
    cpu = platform.processor()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return {
        "platform": platform.platform(),
        "cpu": cpu,
        "cpu_count": os.cpu_count(),
        "isa": isa_flags(),
        "python": sys.version.split()[0],
    }


@dataclass
class RunResult:
    """One configuration at one request rate."""

    label: str
    rate: float
    summary: Summary
    records: list[RequestRecord]
    extras: dict[str, Any] = field(default_factory=dict)  # server command, model, prompt format

    def to_dict(self) -> dict[str, Any]:
        return {
            "label": self.label,
            "rate": rate_to_json(self.rate),
            "extras": self.extras,
            "summary": self.summary.to_dict(),
            "requests": [r.to_dict() for r in self.records],
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> RunResult:
        return cls(
            label=data["label"],
            rate=rate_from_json(data["rate"]),
            summary=Summary.from_dict(data["summary"]),
            records=[RequestRecord.from_dict(r) for r in data["requests"]],
            extras=data.get("extras", {}),
        )


@dataclass
class BenchmarkResults:
    config: dict[str, Any]
    runs: list[RunResult] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return {
            "format_version": FORMAT_VERSION,
            "config": self.config,
            "runs": [run.to_dict() for run in self.runs],
        }

    def save(self, path: Path) -> None:
        """Written atomically, so a sweep that dies midway leaves its finished runs readable."""
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(path.name + ".tmp")
        # Compact: a sweep holds thousands of timelines (`jq .` pretty-prints it when needed).
        tmp.write_text(json.dumps(self.to_dict(), separators=(",", ":"), allow_nan=False))
        tmp.replace(path)

    @classmethod
    def load(cls, path: Path) -> BenchmarkResults:
        data = json.loads(path.read_text())
        return cls(config=data.get("config", {}), runs=[RunResult.from_dict(r) for r in data["runs"]])
