"""Hypothesis strategies the scheduler's property tests share."""

from __future__ import annotations

from hypothesis import strategies as st

from scheduler.config import SchedulerConfig


@st.composite
def scheduler_configs(draw: st.DrawFn, max_extra_budget: int) -> SchedulerConfig:
    """Every batching and KV policy, chunked or not, with a small batch and a token budget just over it
    (so chunking, preemption and the budget's edges are common)."""
    max_num_seqs = draw(st.integers(1, 6))
    return SchedulerConfig(
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=max_num_seqs + draw(st.integers(0, max_extra_budget)),
        chunked_prefill=draw(st.booleans()),
        scheduling=draw(st.sampled_from(["iteration", "request"])),
        kv_policy=draw(st.sampled_from(["lazy", "reserve"])),
    )
