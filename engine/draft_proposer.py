"""The draft model of speculative decoding: a smaller model with the target's tokenizer that proposes
the tokens a step verifies (`--draft-model`; the scheduler's cost model decides who proposes how many).

It runs before the target's forward pass, in the same step (vLLM's draft model runs after the
verification and hands its proposals to the next step's scheduler; this keeps the scheduler unaware of
who proposes). It has a ModelRunner and a KV cache of its own, with the target's block count and block
size: the scheduler's block tables address both caches alike, so a proposal's slots are the ones the
target verifies it in, and nothing new needs allocating.

Per entry that asks for k proposals (ScheduledSequence.num_spec_tokens, no spec_token_ids):
  round 0: the tokens the draft has not seen yet, up to and including the entry's own token, as one
           chunk; its logits at the last position give proposal 1;
  round j: proposal j at its position, one token; its logits give proposal j + 1 (up to k).
All entries of a round run in one forward. The draft keeps, per request, how many positions of its
cache hold what it would compute now (`_seen`): a step starting before that (proposals rejected, a
preemption) rolls it back; one starting after it (every proposal accepted, whose last one the draft
never ran) is caught up in round 0. It never runs on steps that propose nothing, so under load it costs
nothing; a request that starts proposing catches its whole context up once. Prefix-cache blocks may
hold no draft K/V (whoever computed them may not have proposed): a request's first proposal therefore
starts from position 0. A wrong draft cache could only lower acceptance: the target verifies every
proposal.

Draws: greedy requests propose the draft's argmax (a point mass, as n-gram proposals); sampled ones
draw from the draft's distribution with the request's temperature and top-k/top-p/min-p, and that
distribution goes with the proposal so the verification can apply Leviathan et al.'s test.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from engine.config import EngineConfig, resolve_model_path
from engine.contract import SamplingParams, ScheduledSequence
from engine.model_runner import ModelRunner
from engine.roofline import weight_bytes_per_step
from engine.sampler import Sampler, row_argmax, row_seed

logger = logging.getLogger(__name__)

# A request the draft has not seen for this many rounds is forgotten (it finished or was aborted: the
# executor is never told).
FORGET_AFTER_ROUNDS = 4096
# Seeds of the draft's own draws differ from the verification's (the same seed and output index).
_DRAFT_SEED_SALT = 0x5EED_D4AF


@dataclass
class _Seen:
    positions: int  # positions 0..positions-1 of the draft cache hold this request's K/V
    # The request's list of outputs, by identity: one object per request for its whole life (ids may be
    # reused, prompts shared), so a record never passes for another request's.
    outputs: Sequence[int]
    round: int  # when it was last proposed for


class DraftProposer:
    def __init__(self, config: EngineConfig, target: ModelRunner) -> None:
        """Load config.draft_model beside `target` (same device and dtype setting, its block count and
        block size). Raises ValueError for a draft that cannot propose for this target."""
        assert config.draft_model is not None
        path = resolve_model_path(config.draft_model, config.load_format)
        draft_config = replace(
            config,
            model=config.draft_model,
            draft_model=None,
            num_kv_blocks=target.num_kv_blocks,
            kv_cache_memory=None,
            max_model_len=None,
        )
        self.runner = ModelRunner(draft_config, Path(path), target.device)
        if self.runner.vocab_size != target.vocab_size:
            raise ValueError(
                f"the draft model's vocabulary ({self.runner.vocab_size} tokens) is not the target's "
                f"({target.vocab_size}): a draft model needs the same tokenizer"
            )
        if self.runner.max_model_len < target.max_model_len:
            raise ValueError(
                f"the draft model takes {self.runner.max_model_len} positions, fewer than the target's "
                f"{target.max_model_len} (lower --max-model-len)"
            )
        # A decode step is bound by reading the weights: a draft forward costs about their ratio.
        self.cost = weight_bytes_per_step(self.runner.model) / max(1, weight_bytes_per_step(target.model))
        self.sampler = Sampler(
            target.vocab_size, target.eos_token_ids, target.device, config.seed ^ _DRAFT_SEED_SALT
        )
        self._seen: dict[str, _Seen] = {}
        self._round = 0
        logger.info(
            "draft model %s: a forward costs about %.2f of the target's", config.draft_model, self.cost
        )

    def propose(
        self, batch: Sequence[ScheduledSequence]
    ) -> tuple[list[ScheduledSequence], dict[int, torch.Tensor]]:
        """The batch with proposals for every entry that asks for them, and for those that sample, the
        draft distributions ([k, vocab]) their proposals were drawn from, by batch index."""
        self._round += 1
        for seq in batch:  # a step that starts before what the draft holds rolls it back
            seen = self._seen.get(seq.request_id)
            if seen is not None and seen.outputs is not seq.output_token_ids:
                del self._seen[seq.request_id]
            elif seen is not None and seq.start_position < seen.positions:
                seen.positions = seq.start_position
        asking = [i for i, s in enumerate(batch) if s.num_spec_tokens and not s.spec_token_ids]
        proposals: dict[int, list[int]] = {i: [] for i in asking}
        probs: dict[int, list[torch.Tensor]] = {i: [] for i in asking if not batch[i].sampling.greedy}
        with torch.inference_mode():
            for j in range(max(batch[i].num_spec_tokens for i in asking)):
                now = [i for i in asking if batch[i].num_spec_tokens > j]
                chunks = [self._chunk(batch[i], proposals[i]) for i in now]
                logits = self.runner.logits(chunks)  # [len(now), vocab]: each chunk's last position
                for row, i in enumerate(now):
                    token, q = self._draw(logits[row], batch[i], len(proposals[i]))
                    proposals[i].append(token)
                    if q is not None:
                        probs[i].append(q)
        out = list(batch)
        for i in asking:
            seq = batch[i]
            out[i] = replace(seq, spec_token_ids=proposals[i])
            # Proposals 1..k-1 were run; the last one was not (a later step catches it up if accepted).
            end = seq.start_position + seq.num_tokens + seq.num_spec_tokens - 1
            self._seen[seq.request_id] = _Seen(end, seq.output_token_ids, self._round)
        if self._round % 256 == 0:
            self._forget()
        return out, {i: torch.stack(qs) for i, qs in probs.items()}

    def _chunk(self, seq: ScheduledSequence, proposed: list[int]) -> ScheduledSequence:
        """What the draft runs for an entry in this round: its unseen tokens through the entry's own
        (round 0), or its newest proposal."""
        own_end = seq.start_position + seq.num_tokens
        if proposed:
            start, tokens = own_end + len(proposed) - 1, [proposed[-1]]
        else:
            seen = self._seen.get(seq.request_id)
            start = seen.positions if seen is not None else 0
            context = [*seq.prompt_token_ids, *seq.output_token_ids]
            tokens = context[start:own_end]
        return ScheduledSequence(
            request_id=seq.request_id,
            token_ids=tokens,
            start_position=start,
            block_table=seq.block_table,
            sample=True,
        )

    def _draw(self, logits: torch.Tensor, seq: ScheduledSequence, j: int) -> tuple[int, torch.Tensor | None]:
        """Proposal j + 1 from the draft's logits [V]: its argmax for a greedy request, else a draw from
        its distribution (returned with it) under the request's temperature and truncation."""
        params = seq.sampling
        if params.greedy:
            return int(row_argmax(logits[None])[0]), None
        scaled = self.sampler.truncate((logits / params.temperature)[None], [params])
        q = scaled.softmax(dim=-1)[0]
        gen = self._generator(params, len(seq.output_token_ids) + j)
        noise = torch.empty_like(q).exponential_(generator=gen)
        return int((q / noise).argmax()), q

    def _generator(self, params: SamplingParams, index: int) -> torch.Generator:
        if params.seed is None:
            return self.sampler.generator
        gen = torch.Generator(device=self.sampler.device)
        gen.manual_seed(row_seed(params.seed ^ _DRAFT_SEED_SALT, index))
        return gen

    def _forget(self) -> None:
        cutoff = self._round - FORGET_AFTER_ROUNDS
        for rid in [r for r, s in self._seen.items() if s.round < cutoff]:
            del self._seen[rid]
