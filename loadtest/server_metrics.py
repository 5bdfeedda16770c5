"""What the server itself counted during a run, from its Prometheus `/metrics` (before minus after).

The client sees latencies; the server's counters say why: how many iterations it ran, how many tokens
went through them (tokens per iteration is the batch it managed to form), and how many requests it
preempted for lack of KV blocks. Names are vLLM's, which orca-serve also exports; a server without
`/metrics` just gives none.
"""

from __future__ import annotations

from collections.abc import Sequence

import httpx
from prometheus_client.parser import text_string_to_metric_families

# Result key -> Prometheus counter name (without its `_total` suffix).
WATCHED: dict[str, str] = {
    "steps": "orca:engine_steps",
    "preemptions": "vllm:num_preemptions",
    "prompt_tokens": "vllm:prompt_tokens",
    "generation_tokens": "vllm:generation_tokens",
    "prefix_cache_queries": "vllm:prefix_cache_queries",
    "prefix_cache_hits": "vllm:prefix_cache_hits",
    "prompt_tokens_computed": "orca:prompt_tokens_computed",
    "spec_proposed_tokens": "orca:spec_proposed_tokens",
    "spec_accepted_tokens": "orca:spec_accepted_tokens",
}


def parse_counters(text: str) -> dict[str, float]:
    """The watched counters in a Prometheus exposition, each summed over its label sets.

    Matched by sample name (`name` or `name_total`, never `name_created`): parsers group a counter's
    samples under different family names depending on the exposition's TYPE lines.
    """
    wanted = {family: key for key, family in WATCHED.items()}
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            name = sample.name.removesuffix("_total")
            key = wanted.get(name)
            if key is not None:
                out[key] = out.get(key, 0.0) + float(sample.value)
    return out


async def scrape(client: httpx.AsyncClient) -> dict[str, float] | None:
    try:
        resp = await client.get("/metrics")
        if resp.status_code != 200:
            return None
        return parse_counters(resp.text)
    except (httpx.HTTPError, ValueError):
        return None


# Figures computed from the counters rather than counted: pooled runs recompute them from the sums.
DERIVED = ("tokens_per_step", "generation_tokens_per_step", "spec_acceptance_rate")


def counter_deltas(before: dict[str, float] | None, after: dict[str, float] | None) -> dict[str, float]:
    """Per counter, after minus before; plus tokens per step when both are known."""
    if not before or not after:
        return {}
    return with_derived({key: after[key] - before.get(key, 0.0) for key in after})


def pooled_deltas(parts: Sequence[dict[str, float]]) -> dict[str, float]:
    """The counter deltas of several runs of one server as one run's (a sliced run's turns)."""
    if not parts or not all(parts):
        return {}
    out: dict[str, float] = {}
    for part in parts:
        for key, value in part.items():
            if key not in DERIVED:
                out[key] = out.get(key, 0.0) + value
    return with_derived(out)


def with_derived(out: dict[str, float]) -> dict[str, float]:
    """`out` (counter deltas) with the figures computed from them added."""
    steps = out.get("steps", 0.0)
    tokens = out.get("prompt_tokens", 0.0) + out.get("generation_tokens", 0.0)
    if steps > 0 and tokens > 0:
        out["tokens_per_step"] = tokens / steps
        out["generation_tokens_per_step"] = out.get("generation_tokens", 0.0) / steps
    proposed = out.get("spec_proposed_tokens", 0.0)
    if proposed > 0:
        out["spec_acceptance_rate"] = out.get("spec_accepted_tokens", 0.0) / proposed
    return out
