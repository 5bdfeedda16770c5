"""Speculative decoding, the engine's half: a batch's verifications as rows of one forward pass, and the
accepted tokens read back from what the sampler drew at each row.

**Rows.** An entry that verifies k proposals (ScheduledSequence.spec_token_ids: its one uncomputed
token t0, then d1..dk at the next positions) runs as k + 1 one-token rows over its block table: row j
is token j at position start + j, attending to the history up to and including itself. Every layer
writes the whole step's K/V before any row attends, so row j sees rows 0..j-1 exactly as a causal
prompt chunk's query j would: the same forward, but a shape every decode path takes (the native
decode layers on a CPU, CUDA-graph decode steps, and the tensor/pipeline workers, which receive plain
rows). A row's logits are the target's distribution after t0, d1..dj.

**Verification.** The sampler draws one token at every row from the target's processed distribution
there (grammar mask, penalties and min_tokens as after the proposals before it; seeded rows from the
generator of that output index, as without speculation). Row j's draw is checked against d(j+1):
 - a greedy row draws the argmax: the proposals are accepted while they are the argmax;
 - a sampled row with a point-mass proposal (n-gram; a greedy draft) draws x ~ p: P(x = d) = p(d),
   Leviathan et al.'s acceptance probability min(1, p(d) / 1), and a rejected row's x is distributed
   as p without d, renormalised: their residual max(0, p - q) for q the point mass at d;
 - a sampled row with a draft model's distribution q accepts d with probability min(1, p(d) / q(d))
   and otherwise draws from max(0, p - q), renormalised (the sampler's `_draw_against_draft`); that
   draw is never d, so "the row drew d" still means "accepted".
So the tokens are the accepted proposals, then the first row's draw that is not its proposal (or the
last row's, the bonus, when all were accepted): exactly the target's distribution, token by token.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import torch

from engine.contract import SampledToken, SamplingParams, SamplingRow, ScheduledSequence

# A draft token and the draft model's distribution it was drawn from ([vocab]); None: a point mass.
DraftChoice = tuple[int, torch.Tensor | None]


@dataclass
class VerifyRow:
    """Row j of an entry's verification, as the sampler and the grammar masker read it (SamplingRow):
    the request after its outputs and its first j proposals. Row 0 carries the proposals so the masker
    computes a mask at every row along them (without committing them); the later rows' masks come with
    it (their spec_index says so)."""

    entry: ScheduledSequence
    spec_index: int
    output_token_ids: Sequence[int]

    @property
    def sampling(self) -> SamplingParams:
        return self.entry.sampling

    @property
    def prompt_token_ids(self) -> Sequence[int]:
        return self.entry.prompt_token_ids

    @property
    def spec_token_ids(self) -> Sequence[int]:
        return self.entry.spec_token_ids if self.spec_index == 0 else ()


@dataclass
class StepRows:
    """A batch as the runner runs it: verifying entries spread over one-token rows (module docstring)."""

    rows: list[ScheduledSequence]  # what the model runs (prepare_host), in batch order
    entry_of_row: list[int]  # rows[r] belongs to batch entry entry_of_row[r]
    # Per sampling row (the rows with sample=True, in order): what the sampler and the masker read, and
    # the proposal its draw is checked against (None: a plain row, or a verification's last).
    sampling: list[SamplingRow] = field(default_factory=list)
    drafts: list[DraftChoice | None] = field(default_factory=list)
    # Per batch entry: its first sampling row and how many it has (0 for an entry that samples nothing).
    groups: list[tuple[int, int]] = field(default_factory=list)

    @property
    def has_drafts(self) -> bool:
        return any(d is not None for d in self.drafts)


def spread(
    batch: Sequence[ScheduledSequence], draft_probs: Mapping[int, torch.Tensor] | None = None
) -> StepRows:
    """The batch's rows. `draft_probs[i]`: [k, vocab], the draft model's distributions entry i's
    proposals were drawn from (only for entries that sample with temperature; others are point masses)."""
    out = StepRows([], [])
    for i, seq in enumerate(batch):
        k = len(seq.spec_token_ids)
        first = len(out.sampling)
        if not k:
            out.rows.append(seq)
            out.entry_of_row.append(i)
            if seq.sample:
                out.sampling.append(seq)
                out.drafts.append(None)
            out.groups.append((first, int(seq.sample)))
            continue
        if len(seq.token_ids) != 1 or not seq.sample:
            raise ValueError(
                f"{seq.request_id!r}: proposals follow one decode token of an entry that samples"
            )
        tokens = [*seq.token_ids, *seq.spec_token_ids]
        probs = draft_probs.get(i) if draft_probs else None
        for j, token in enumerate(tokens):
            out.rows.append(
                ScheduledSequence(
                    request_id=seq.request_id if j == 0 else f"{seq.request_id}+{j}",
                    token_ids=(token,),
                    start_position=seq.start_position + j,
                    block_table=seq.block_table,
                    sample=True,
                    sampling=seq.sampling,
                    prompt_token_ids=seq.prompt_token_ids,
                    output_token_ids=seq.output_token_ids,
                )
            )
            out.entry_of_row.append(i)
            outputs = seq.output_token_ids if j == 0 else [*seq.output_token_ids, *seq.spec_token_ids[:j]]
            out.sampling.append(VerifyRow(seq, j, outputs))
            out.drafts.append((tokens[j + 1], probs[j] if probs is not None else None) if j < k else None)
        out.groups.append((first, k + 1))
    return out


def accept(rows: StepRows, sampled: Sequence[SampledToken]) -> list[SampledToken | None]:
    """Per batch entry, its result from the sampled rows: a plain entry's token; a verification's
    accepted proposals and the token after them (module docstring); None for an entry that samples
    nothing."""
    out: list[SampledToken | None] = []
    for first, n in rows.groups:
        if n == 0:
            out.append(None)
            continue
        if n == 1 and rows.drafts[first] is None:
            out.append(sampled[first])
            continue
        accepted = 0
        while accepted < n - 1:
            draft = rows.drafts[first + accepted]
            assert draft is not None
            if sampled[first + accepted].token_id != draft[0]:
                break
            accepted += 1
        head = sampled[first]
        head.following = list(sampled[first + 1 : first + accepted + 1])
        head.num_verified = n - 1
        out.append(head)
    return out
