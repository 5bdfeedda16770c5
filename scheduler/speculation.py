"""Speculative decoding, the scheduler's half: which decoding requests propose tokens this step, how
many, and (for n-gram prompt lookup) which. Torch-free; the engine verifies what is proposed here
(engine/speculative.py) or, for a draft model, proposes the tokens itself (engine/draft_proposer.py).

The policy is a cost model. A decode step of B requests yields at least B tokens; a proposal adds j
tokens to verify and, if the model accepts each with probability alpha, alpha + alpha^2 + ... +
alpha^j tokens in expectation. Its price is what j more tokens add to the step: `token_cost` of a
one-token step each (a CPU decode step at batch 1 streams the weights once whatever its few rows, so a
verification row costs a fraction of a step; at large batch every row costs real multiply-adds).
Proposal tokens are added, best first (the highest alpha^j of any request), while they raise the
step's expected tokens per unit of cost, so speculation turns itself down as the batch grows and as
acceptance falls, and `max_batch` turns it off past a batch size (decode there is compute-bound:
verifying costs what it saves).

alpha comes from the history of every verification, kept apart by what predicts it (`AcceptanceTable`):
how long the suffix was that n-gram lookup matched (one token is weak evidence, four pin a quote down)
and how the request's previous verification went (a request that is copying goes on copying; one
whose last proposal was rejected at once has probably stopped).
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Literal, Protocol

from engine.contract import SamplingParams

SpeculativeMethod = Literal["auto", "ngram", "draft", "off"]
SPECULATIVE_METHODS: tuple[str, ...] = ("auto", "ngram", "draft", "off")

# Prompt lookup: the longest suffix of the request's tokens, of NGRAM_MAX down to NGRAM_MIN tokens,
# that occurred before proposes what followed its latest occurrence. A one-token match is right often
# enough to try (a copy that was interrupted by an edit resumes with it), at the acceptance its own
# history gives it.
NGRAM_MIN = 1
NGRAM_MAX = 4

# Before any verification, a kind of proposal is assumed accepted this often, with this much weight
# (in verified tokens); history is discounted by DECAY per verification of that kind, so the table
# follows a workload that changes.
PRIOR_ACCEPTANCE = 0.6
PRIOR_WEIGHT = 2.0
DECAY = 0.98

# How a request's previous verification went: every proposal accepted, some, none (or no verification
# yet).
Outcome = Literal["full", "part", "zero", "none"]


class NgramIndex:
    """Where each n-gram (NGRAM_MIN..NGRAM_MAX tokens) of a sequence last occurred, for prompt lookup.

    Append-only, like a request's prompt + accepted outputs. An n-gram is filed under the position
    after it only when the token at that position arrives, so the lookup of the sequence's own suffix
    finds an earlier occurrence with a continuation. O(NGRAM_MAX) per token to extend and per lookup."""

    def __init__(self, min_n: int = NGRAM_MIN, max_n: int = NGRAM_MAX) -> None:
        if not 1 <= min_n <= max_n:
            raise ValueError(f"need 1 <= min_n <= max_n, got {min_n}, {max_n}")
        self.min_n = min_n
        self.max_n = max_n
        self.tokens: list[int] = []
        self._after: dict[tuple[int, ...], int] = {}  # n-gram -> the index after its latest occurrence

    def __len__(self) -> int:
        return len(self.tokens)

    def extend(self, tokens: Sequence[int]) -> None:
        seq = self.tokens
        for t in tokens:
            i = len(seq)
            for n in range(self.min_n, min(self.max_n, i) + 1):
                self._after[tuple(seq[i - n : i])] = i
            seq.append(t)

    def propose(self, k: int) -> tuple[int, list[int]]:
        """The length of the longest suffix that occurred before, and up to k tokens that followed its
        latest earlier occurrence ((0, []) without a match). A continuation that runs into the suffix
        itself repeats with the period it implies (a loop of the text continues as a loop)."""
        seq = self.tokens
        end = len(seq)
        for n in range(min(self.max_n, end), self.min_n - 1, -1):
            start = self._after.get(tuple(seq[end - n :]))
            if start is None:
                continue
            out: list[int] = []
            for m in range(k):
                i = start + m
                out.append(seq[i] if i < end else out[i - end])
            return n, out
        return 0, []


@dataclass
class SpecState:
    """A request's speculative decoding state: how its last verification went, and the kind of its
    proposal in flight (what the AcceptanceTable files the verification under)."""

    last: Outcome = "none"
    pending: tuple[int, Outcome] | None = None


class AcceptanceTable:
    """The chance that the model accepts a proposed token given that it accepted the ones before it,
    by the kind of proposal: (matched n-gram length, 0 for a draft model's; the request's last outcome).
    A discounted count of verified tokens per kind, starting from the prior."""

    def __init__(self) -> None:
        self._counts: dict[tuple[int, Outcome], list[float]] = {}

    def rate(self, kind: tuple[int, Outcome]) -> float:
        accepted, trials = self._counts.get(kind, (0.0, 0.0))
        return (accepted + PRIOR_ACCEPTANCE * PRIOR_WEIGHT) / (trials + PRIOR_WEIGHT)

    def record(self, kind: tuple[int, Outcome], proposed: int, accepted: int) -> None:
        """The first `accepted` of `proposed` tokens were accepted: each a success, the first rejected one
        (if any) a failure; those after it were never tried."""
        counts = self._counts.setdefault(kind, [0.0, 0.0])
        counts[0] = counts[0] * DECAY + accepted
        counts[1] = counts[1] * DECAY + accepted + (1 if accepted < proposed else 0)


@dataclass
class Proposal:
    """What one request proposes this step: the tokens (n-gram), or only how many (the executor's draft
    model proposes them)."""

    count: int
    token_ids: list[int] = field(default_factory=list)


class Proposing(Protocol):
    """What the policy reads and keeps of a request (scheduler.request.Request has it)."""

    prompt_token_ids: Sequence[int]
    output_token_ids: list[int]
    sampling: SamplingParams
    spec: SpecState
    ngram: NgramIndex | None

    @property
    def num_tokens(self) -> int: ...


def ngram_index(req: Proposing) -> NgramIndex:
    """The request's index over its prompt + outputs, built on first use and kept up to date."""
    index = req.ngram
    if index is None:
        index = req.ngram = NgramIndex()
        index.extend(req.prompt_token_ids)
    have = len(index) - len(req.prompt_token_ids)
    if have < len(req.output_token_ids):
        index.extend(req.output_token_ids[have:])
    return index


def max_proposal(req: Proposing, limit: int, max_model_len: int) -> int:
    """Tokens a request may propose: a step yields up to proposals + 1 tokens, and none may pass
    max_tokens or the maximum length (their positions must exist)."""
    room = req.sampling.max_tokens - len(req.output_token_ids) - 1
    return max(0, min(limit, room, max_model_len - req.num_tokens))


class SpeculationPolicy:
    """Decides each step's proposals and learns from their verifications (see the module docstring)."""

    def __init__(
        self,
        method: Literal["ngram", "draft"],
        max_tokens: int,
        max_batch: int,
        token_cost: float,
        draft_cost: float = 0.0,
    ) -> None:
        if max_tokens < 1 or max_batch < 1 or not token_cost > 0 or draft_cost < 0:
            raise ValueError(
                "speculation needs max_tokens >= 1, max_batch >= 1, token_cost > 0, draft_cost >= 0"
            )
        self.method = method
        self.max_tokens = max_tokens
        self.max_batch = max_batch
        # A draft model's forward for each proposed token costs on top of its verification.
        self.token_cost = token_cost + (draft_cost if method == "draft" else 0.0)
        self.acceptance = AcceptanceTable()

    def plan(
        self, decodes: Sequence[Proposing], spare: int, max_model_len: int, batch: int | None = None
    ) -> dict[int, Proposal]:
        """Proposals for this step's decoding requests (by index into `decodes`), `spare` tokens at most.
        `batch`: the step's decode rows, `decodes` and any others that cannot propose (rows carried from
        the step in flight under overlapped scheduling); the cost of verifying grows with all of them."""
        b = len(decodes) if batch is None else batch
        if not decodes or b > self.max_batch:
            return {}
        candidates: dict[int, list[int] | int] = {}  # index -> n-gram tokens, or a count for drafts
        rates: dict[int, float] = {}
        for i, req in enumerate(decodes):
            k = max_proposal(req, self.max_tokens, max_model_len)
            if k == 0:
                continue
            if self.method == "ngram":
                n, tokens = ngram_index(req).propose(k)
                if not tokens:
                    continue
                candidates[i] = tokens
            else:
                n, candidates[i] = 0, k
            req.spec.pending = (n, req.spec.last)
            rates[i] = self.acceptance.rate(req.spec.pending)
        chosen = self._allocate(b, candidates, rates, spare)
        out: dict[int, Proposal] = {}
        for i, k in chosen.items():
            c = candidates[i]
            out[i] = Proposal(k, c[:k]) if isinstance(c, list) else Proposal(k)
        return out

    def worth_waiting(self, req: Proposing, batch: int) -> bool:
        """Whether a decoding request whose next token is not known yet should wait for it so that it
        can propose (overlapped scheduling carries it to the next step without proposals otherwise):
        whether the first token of a proposal would pay in a step of `batch` decodes, at the
        acceptance of the kind of proposal it would likely make. For n-gram lookup that is one token
        longer than the match its known tokens make (the pending token likely continues it). Without
        such a match, the pending token alone may match (the weakest kind): a request that has
        verified before waits if that kind pays; one that never has (its tokens have not repeated so
        far) is carried."""
        if batch > self.max_batch or max_proposal(req, self.max_tokens, 1 << 62) == 0:
            return False
        if self.method == "ngram":
            n, _ = ngram_index(req).propose(1)
            if not n and req.spec.last == "none":
                return False
            kind: tuple[int, Outcome] = (min(n + 1, NGRAM_MAX), req.spec.last)
        else:
            kind = (0, req.spec.last)
        # The first proposal token pays when alpha * C > c * G, with G = batch and C = 1 + c (batch - 1).
        cost = self.token_cost
        return self.acceptance.rate(kind) * (1.0 + cost * (batch - 1)) > cost * batch

    def record(self, req: Proposing, proposed: int, accepted: int) -> None:
        """A verification of the request's proposal: the model accepted `accepted` of `proposed` tokens."""
        kind = req.spec.pending
        if kind is not None:
            self.acceptance.record(kind, proposed, accepted)
        req.spec.pending = None
        req.spec.last = "full" if accepted == proposed else "part" if accepted else "zero"

    def _allocate(
        self, batch: int, candidates: dict[int, list[int] | int], rates: dict[int, float], budget: int
    ) -> dict[int, int]:
        """Proposal lengths, best token first, while each raises expected tokens per unit of cost."""
        cost = self.token_cost
        gain_total = float(batch)  # every request yields at least its own token
        cost_total = 1.0 + cost * (batch - 1)
        # Max-heap of each request's next token: its expected gain alpha^(j+1).
        heap = [(-rates[i], i) for i in candidates]
        heapq.heapify(heap)
        chosen: dict[int, int] = {}
        while heap and budget > 0:
            neg_gain, i = heapq.heappop(heap)
            gain = -neg_gain
            # (G + g) / (C + c) > G / C: later tokens gain less and G / C only grows, so stop here.
            if gain * cost_total <= cost * gain_total:
                break
            k = chosen.get(i, 0) + 1
            chosen[i] = k
            gain_total += gain
            cost_total += cost
            budget -= 1
            c = candidates[i]
            if k < (len(c) if isinstance(c, list) else c):
                heapq.heappush(heap, (-(gain * rates[i]), i))
        return chosen
