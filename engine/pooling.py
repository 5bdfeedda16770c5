"""Embedding requests' share of a step: their final hidden states pooled, one row per entry.

The model's output on the last stage is the final norm's (`[T, hidden]`, before the LM head): what
transformers' `output_hidden_states[-1]` holds and what sentence-transformers and vLLM pool. Each
embedding entry gives one float32 row, its chunk's share (engine.contract.PooledState says how the
scheduler combines the chunks).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from engine.inputs import PoolSpan


def pool_hidden(hidden: torch.Tensor, pools: Sequence[PoolSpan]) -> torch.Tensor:
    """[P, hidden] float32 from `hidden` [T, hidden]: per span, the sum of its tokens' states ("mean"),
    its last token's ("last") or its first token's ("cls"). Summed in float32, whatever the dtype."""
    rows = []
    for span in pools:
        chunk = hidden[span.first : span.first + span.num_tokens]
        if span.pooling == "mean":
            rows.append(chunk.float().sum(dim=0))
        else:
            rows.append(chunk[-1 if span.pooling == "last" else 0].float())
    return torch.stack(rows)
