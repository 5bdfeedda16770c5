"""Hypothesis strategies the scheduler's property tests share."""

from __future__ import annotations

from hypothesis import strategies as st

from scheduler.config import SchedulerConfig


@st.composite
def scheduler_configs(draw: st.DrawFn, max_extra_budget: int) -> SchedulerConfig:
    """Every batching and KV policy, chunked or not, with a small batch and a token budget just over it
    (so chunking, preemption and the budget's edges are common), speculative decoding on or off (on:
    "auto", the fake runner's draft model where it has one, else n-gram; proposals priced low enough
    that they are common)."""
    max_num_seqs = draw(st.integers(1, 6))
    return SchedulerConfig(
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=max_num_seqs + draw(st.integers(0, max_extra_budget)),
        chunked_prefill=draw(st.booleans()),
        scheduling=draw(st.sampled_from(["iteration", "request"])),
        kv_policy=draw(st.sampled_from(["lazy", "reserve"])),
        speculative=draw(st.sampled_from(["auto", "off"])),
        num_speculative_tokens=draw(st.integers(1, 5)),
        speculative_token_cost=0.02,
    )
