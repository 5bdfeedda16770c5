"""The timeline of one benchmark request: what the client saw and when. Metrics are computed from these."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any


class ErrorKind:
    """How a request failed; HTTP failures are `http_<status>` (see `http_error`)."""

    TIMEOUT = "timeout"  # no complete answer within the request timeout
    CONNECTION = "connection"  # could not connect, or the connection broke mid-stream
    STREAM = "stream"  # the server answered 200 but the stream was malformed or carried an error

    @staticmethod
    def http_error(status: int) -> str:
        return f"http_{status}"


@dataclass
class RequestRecord:
    """One request's timeline. Times are seconds since the start of its run (one rate of one config)."""

    index: int  # position in the workload: the same index is the same prompt in every run
    prompt_len: int  # prompt tokens the workload asked for
    max_tokens: int  # output tokens asked for (with ignore_eos and min_tokens, the exact output length)
    scheduled_time: float  # when the arrival process wanted it sent (closed loop: when a slot freed)
    send_time: float = 0.0  # when it was sent (later than scheduled when a concurrency limit held it)
    first_token_time: float | None = None
    token_times: list[float] = field(default_factory=list)  # arrival of each streamed token chunk
    end_time: float | None = None
    output_tokens: int = 0  # the server's usage count if it sent one, else the number of token chunks
    prompt_tokens_reported: int | None = None  # the server's usage.prompt_tokens, to check prompt lengths
    cached_tokens_reported: int | None = None  # usage.prompt_tokens_details.cached_tokens (prefix cache)
    error: str | None = None
    error_kind: str | None = None

    @property
    def ok(self) -> bool:
        return self.error_kind is None and self.end_time is not None and self.first_token_time is not None

    def to_dict(self) -> dict[str, Any]:
        # Microseconds are plenty for latencies and keep results files a third of the size.
        data = asdict(self)
        for key in ("scheduled_time", "send_time", "first_token_time", "end_time"):
            if data[key] is not None:
                data[key] = round(data[key], 6)
        data["token_times"] = [round(t, 6) for t in self.token_times]
        return data

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> RequestRecord:
        return cls(**data)
