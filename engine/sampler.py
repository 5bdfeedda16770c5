"""Token sampling over a batch of logits, vectorised by groups of rows.

Order of processing, per row (each step only for the rows that ask for it):
  0. grammar (structured outputs): tokens the row's grammar does not allow here get -inf
     (engine/token_mask.py computed the mask while the forward ran). Everything below, logprobs
     included, sees the constrained distribution.
  1. min_tokens: while a row has fewer outputs than min_tokens, its EOS and stop tokens get -inf
     (unless its grammar allows nothing else: a finished grammar wins over min_tokens).
  2. logit bias (added).
  3. repetition penalty (HF/CTRL, over prompt + output tokens): a seen token's logit is divided by the
     penalty when positive, multiplied when negative.
  4. presence / frequency penalties (OpenAI, over output tokens): logit -= presence * [count > 0]
     + frequency * count.
  5. greedy rows (temperature 0, or below GREEDY_TEMPERATURE_EPS) take the exact argmax here.
  6. temperature (sampled rows).
  -> logprobs are the log-softmax of this "processed distribution": after 1-6 (greedy rows count as
     temperature 1) and BEFORE the top-k / top-p / min-p truncation, so every returned value is finite
     and top-N lists are comparable across truncation settings.
  7. top-k, then top-p (over the top-k renormalised mass: the smallest set of tokens whose mass is
     >= top_p), then min-p (tokens below min_p * the best token's probability): set to -inf.
  8. draw: argmax(probs / E) with E ~ Exp(1) per token (the exponential race, equivalent to
     sampling from probs). Rows with a seed draw E from their own generator seeded from
     (seed, number of output tokens so far), so the same request gives the same tokens whatever else
     shares the batch or where it sits; unseeded rows share the engine's generator.
     A row that verifies a draft model's proposal d drawn from q (speculative decoding,
     engine/speculative.py) instead keeps d with probability min(1, p(d) / q(d)) and otherwise draws
     from max(0, p - q), renormalised (Leviathan et al.).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from engine.contract import PromptLogprobs, SampledToken, SamplingParams, SamplingRow, ScheduledSequence
from engine.inputs import to_device
from engine.speculative import DraftChoice

if TYPE_CHECKING:
    from engine.token_mask import PendingMask

LOGPROB_FLOOR = -9999.0  # what a -inf logprob is reported as

_MASK64 = (1 << 64) - 1


def _tensor(values: Sequence, device: torch.device, dtype: torch.dtype | None = None) -> torch.Tensor:
    """torch.tensor(values) on `device` without a synchronisation: on CUDA, torch.tensor(list,
    device="cuda") copies from pageable memory and waits for the stream; this goes through pinned
    memory, non-blocking, so the sampler's kernels queue up behind the forward pass."""
    return to_device(torch.tensor(values, dtype=dtype), device)


class HostCopies:
    """Device tensors on their way to the host. On CUDA: non-blocking copies into pinned memory, then an
    event, so that reading them (`tolist`) waits for this step's work only and not for a step queued
    behind it on the same stream (overlapped scheduling on an accelerator), and for one synchronisation
    however many tensors there are (a .tolist() each would wait once each)."""

    def __init__(self, *tensors: torch.Tensor) -> None:
        self._event: torch.cuda.Event | None = None
        if not tensors or tensors[0].device.type == "cpu":
            self._host = list(tensors)
            return
        self._host = [torch.empty(t.shape, dtype=t.dtype, pin_memory=True) for t in tensors]
        for h, t in zip(self._host, tensors, strict=True):
            h.copy_(t, non_blocking=True)
        self._event = torch.cuda.Event()
        self._event.record(torch.cuda.current_stream(tensors[0].device))

    def tolist(self) -> list[list]:
        if self._event is not None:
            self._event.synchronize()
        return [h.tolist() for h in self._host]


@dataclass
class SampledOnDevice:
    """A step's draws before the host has read them (Sampler.start): the tokens stay on the device,
    where the next step's carried rows can read them (engine.contract.DeviceCarry), while their copies
    to the host, and those of the logprobs asked for, are under way."""

    tokens: torch.Tensor  # [S] int64: each sampling row's token, on the logits' device
    copies: HostCopies  # tokens, then (with logprobs) the chosen logprobs, the top values and ids
    # Per row that asked for logprobs: its index among the S rows and how many top logprobs it wants.
    logprob_rows: list[tuple[int, int]] = field(default_factory=list)

    def result(self) -> list[SampledToken]:
        """Wait for this step's copies (not for any step queued after it) and make the tokens."""
        token_list, *logprobs = self.copies.tolist()
        out = [SampledToken(t) for t in token_list]
        if not self.logprob_rows:
            return out
        chosen_lp, top_vals, top_ids = logprobs
        for j, (i, n) in enumerate(self.logprob_rows):
            out[i].logprob = chosen_lp[j]
            out[i].top_logprobs = list(zip(top_ids[j][:n], top_vals[j][:n], strict=True))
        return out


def score_prompt_tokens(
    logits: torch.Tensor, batch: Sequence[ScheduledSequence], scored: Sequence[tuple[int, int, int]]
) -> list[tuple[int, PromptLogprobs]]:
    """Prompt logprobs: for each (batch index, first row, rows) of `scored`, the raw log-softmax of
    those rows of `logits` [R, vocab] at the prompt tokens that follow their positions, the tokens'
    ranks, and the top-k (the entry's SamplingParams.prompt_logprobs). Raw: no penalty, bias,
    temperature or grammar applies to a prompt, as in vLLM and OpenAI's echo."""
    rows: list[int] = []
    targets: list[int] = []
    for i, first, n in scored:
        seq = batch[i]
        start = seq.start_position + 1
        rows.extend(range(first, first + n))
        targets.extend(seq.prompt_token_ids[start : start + n])
    dev = logits.device
    lp = torch.log_softmax(logits[torch.tensor(rows, device=dev)].float(), dim=-1)  # [N, V]
    target = torch.tensor(targets, device=dev)[:, None]
    chosen = lp.gather(-1, target)  # [N, 1]
    ranks = ((lp > chosen).sum(dim=-1) + 1).tolist()
    chosen_lp = chosen.squeeze(-1).clamp(min=LOGPROB_FLOOR).tolist()
    k_max = max(batch[i].sampling.prompt_logprobs or 0 for i, _, _ in scored)
    top_ids: list[list[int]] = [[] for _ in rows]
    top_vals: list[list[float]] = [[] for _ in rows]
    if k_max:
        top = lp.topk(min(k_max, lp.shape[-1]), dim=-1)
        top_ids, top_vals = top.indices.tolist(), top.values.clamp(min=LOGPROB_FLOOR).tolist()
    out: list[tuple[int, PromptLogprobs]] = []
    at = 0
    for i, _, n in scored:
        k = batch[i].sampling.prompt_logprobs or 0
        span = range(at, at + n)
        out.append(
            (
                i,
                PromptLogprobs(
                    logprobs=chosen_lp[at : at + n],
                    ranks=ranks[at : at + n],
                    top_logprobs=[list(zip(top_ids[j][:k], top_vals[j][:k], strict=True)) for j in span],
                ),
            )
        )
        at += n
    return out


def row_argmax(t: torch.Tensor) -> torch.Tensor:
    """Each row's argmax, [rows] int64 (the first of equal maxima, as torch's). On a CPU through numpy:
    torch's CPU argmax over a vocabulary row costs ~50 us (77 us at 1 row of 49,152, 1.55 ms at 32 rows
    on a 2-core EPYC) against numpy's ~5 us, and a batch-1 decode step is ~6 ms."""
    if t.device.type == "cpu" and t.dtype == torch.float32:
        return torch.from_numpy(t.numpy().argmax(axis=-1))
    return t.argmax(dim=-1)


# Best tokens top-p looks among first: a nucleus almost always lies within them, and a partial sort of
# them costs a fraction of sorting the vocabulary (49,152 tokens: ~4 ms a row on a 2-core CPU).
TOP_P_CANDIDATES = 1024


def top_k_top_p(logits: torch.Tensor, top_k: list[int], top_p: list[float]) -> torch.Tensor:
    """Rows of [S, V] logits cut to their top-k, then to the smallest set of the best tokens whose
    renormalised mass reaches top-p (the best is always kept); the rest become -inf. A row's result
    depends on that row alone. Each row is first tried on its TOP_P_CANDIDATES best tokens (at least its
    top-k): when their mass reaches p (or top-k holds), every kept token is among them and the kept set
    is the full sort's (up to float rounding of the renormalisation at the cut); the rest (a flat
    distribution) are sorted whole. 4-5x faster on 49,152-token rows on a CPU; a GPU sorts every row."""
    dev = logits.device
    vocab = logits.shape[-1]
    if dev.type != "cpu":
        # A GPU sorts every row in microseconds, and the candidates' fallback would need the host to
        # read which rows it covers (a synchronisation the overlapped step must not have).
        return top_k_top_p_by_sort(
            logits, _tensor(top_k, dev)[:, None], _tensor(top_p, dev, logits.dtype)[:, None]
        )
    m = min(vocab, max([TOP_P_CANDIDATES, *(k for k in top_k if k < vocab)]))
    vals, order = logits.topk(m, dim=-1)  # [S, m], best first
    ranks = torch.arange(m, device=dev)[None, :]
    k = _tensor(top_k, dev)[:, None]
    has_k = k < vocab  # [S, 1]: the row's whole top-k is among the candidates
    vals = vals.masked_fill(ranks >= k, float("-inf"))
    # Probabilities over the top-k tokens, or over the whole vocabulary without a top-k.
    norm = torch.where(has_k, vals.logsumexp(dim=-1, keepdim=True), logits.logsumexp(dim=-1, keepdim=True))
    probs = (vals - norm).exp()
    mass_before = probs.cumsum(dim=-1) - probs  # mass of the better-ranked tokens
    p = _tensor(top_p, dev, probs.dtype)[:, None]
    covered = (has_k | (mass_before[:, -1:] + probs[:, -1:] >= p)).squeeze(-1)  # [S]
    # Keep a token while the better ones have not reached p yet; the best is always kept.
    vals = vals.masked_fill((mass_before >= p) & (ranks > 0), float("-inf"))
    out = torch.full_like(logits, float("-inf")).scatter_(-1, order, vals)
    if not bool(covered.all()):
        rest = (~covered).nonzero().squeeze(-1)
        out[rest] = top_k_top_p_by_sort(logits[rest], k[rest], p[rest])
    return out


def top_k_top_p_by_sort(logits: torch.Tensor, k: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    """top_k_top_p by a full sort of each row ([R, V] logits, k and p [R, 1])."""
    vocab = logits.shape[-1]
    sorted_logits, order = logits.sort(dim=-1, descending=True)  # [R, V] each
    ranks = torch.arange(vocab, device=logits.device)[None, :]
    sorted_logits = sorted_logits.masked_fill(ranks >= k, float("-inf"))
    probs = sorted_logits.softmax(dim=-1)
    mass_before = probs.cumsum(dim=-1) - probs
    sorted_logits = sorted_logits.masked_fill((mass_before >= p) & (ranks > 0), float("-inf"))
    return torch.empty_like(logits).scatter_(-1, order, sorted_logits)


def row_seed(seed: int, num_output_tokens: int) -> int:
    """A 64-bit generator seed from (request seed, step), mixed with splitmix64 so nearby pairs differ."""
    x = (seed * 0x9E3779B97F4A7C15 + num_output_tokens + 1) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


class Sampler:
    def __init__(
        self,
        vocab_size: int,
        eos_token_ids: frozenset[int] = frozenset(),
        device: torch.device | str = "cpu",
        seed: int = 0,
    ) -> None:
        self.vocab_size = vocab_size
        self.eos_token_ids = frozenset(t for t in eos_token_ids if 0 <= t < vocab_size)
        self.device = torch.device(device)
        self.generator = torch.Generator(device=self.device)
        self.generator.manual_seed(seed)

    def __call__(
        self,
        logits: torch.Tensor,
        rows: Sequence[SamplingRow],
        mask: PendingMask | None = None,
        drafts: Sequence[DraftChoice | None] | None = None,
    ) -> list[SampledToken]:
        """Pick one token per row (`start`, then its result)."""
        return self.start(logits, rows, mask, drafts).result()

    def start(
        self,
        logits: torch.Tensor,
        rows: Sequence[SamplingRow],
        mask: PendingMask | None = None,
        drafts: Sequence[DraftChoice | None] | None = None,
    ) -> SampledOnDevice:
        """Pick one token per row on the logits' device; the host reads the draws from the result. On
        CUDA nothing here waits for the device unless a row needs the host meanwhile (a grammar mask
        being filled, a draft's rejection step). `logits` is [B, vocab] float32 and is modified in
        place. `mask`: the grammar masks of the constrained rows (TokenMasker.start on the same rows),
        None without any. `drafts[i]`: the proposal row i verifies and the draft distribution it came
        from; only a sampled row with a distribution draws differently (module docstring, step 8)."""
        if mask is not None:
            mask.apply(logits)
        params = [r.sampling for r in rows]
        num_out = [len(r.output_token_ids) for r in rows]
        plain = all(
            p.greedy
            and p.logprobs is None
            and not p.logit_bias
            and not p.needs_penalties
            and p.min_tokens <= n
            for p, n in zip(params, num_out, strict=True)
        )
        if plain:
            # The common serving case: greedy, nothing to process, one kernel and one sync.
            tokens = row_argmax(logits)
            return SampledOnDevice(tokens, HostCopies(tokens))

        self._ban_stop_tokens(logits, params, num_out)
        self._apply_logit_bias(logits, params)
        self._apply_repetition_penalty(logits, rows)
        self._apply_presence_frequency(logits, rows)

        greedy_rows = [i for i, p in enumerate(params) if p.greedy]
        sampled_rows = [i for i, p in enumerate(params) if not p.greedy]
        tokens = torch.empty(len(rows), dtype=torch.int64, device=logits.device)  # [B]
        if greedy_rows:
            g = _tensor(greedy_rows, logits.device)
            tokens[g] = row_argmax(logits[g])
        s: torch.Tensor | None = None
        if sampled_rows:
            s = _tensor(sampled_rows, logits.device)
            temps = _tensor([params[i].temperature for i in sampled_rows], logits.device)
            logits[s] = logits[s] / temps[:, None]
        # Extreme but valid settings (repetition_penalty=1e-300, a tiny temperature after a big bias)
        # can push a logit to +inf, whose softmax is NaN for every token: cap at the largest float.
        torch.nan_to_num_(logits, nan=float("-inf"), posinf=torch.finfo(logits.dtype).max)

        logprob_rows = [i for i, p in enumerate(params) if p.logprobs is not None]
        logprobs: torch.Tensor | None = None
        if logprob_rows:
            lp_idx = _tensor(logprob_rows, logits.device)
            logprobs = torch.log_softmax(logits[lp_idx], dim=-1)  # [L, V]: before truncation

        if sampled_rows:
            assert s is not None
            sub = logits[s]  # [S, V]
            sub = self.truncate(sub, [params[i] for i in sampled_rows])
            against = [drafts[i] if drafts is not None else None for i in sampled_rows]
            tokens[s] = self._draw(
                sub, [params[i] for i in sampled_rows], [num_out[i] for i in sampled_rows], against
            )

        if logprobs is None:
            return SampledOnDevice(tokens, HostCopies(tokens))
        return self._with_logprobs(tokens, logprobs, lp_idx, logprob_rows, params)

    # --- processing -----------------------------------------------------------------------------

    def _ban_stop_tokens(
        self, logits: torch.Tensor, params: list[SamplingParams], num_out: list[int]
    ) -> None:
        rows: list[int] = []
        cols: list[int] = []
        for i, (p, n) in enumerate(zip(params, num_out, strict=True)):
            if n < p.min_tokens:
                banned = set(p.stop_token_ids)
                if not p.ignore_eos:
                    banned |= self.eos_token_ids
                banned = {t for t in banned if 0 <= t < self.vocab_size}
                if p.grammar is not None and not self._allows_besides(logits[i], banned):
                    continue  # the grammar is complete: only EOS is left, so min_tokens gives way
                rows.extend([i] * len(banned))
                cols.extend(banned)
        if rows:
            logits[_tensor(rows, logits.device), _tensor(cols, logits.device)] = float("-inf")

    @staticmethod
    def _allows_besides(row: torch.Tensor, tokens: set[int]) -> bool:
        """Whether a (masked) row of logits allows some token outside `tokens`."""
        allowed = int(torch.isfinite(row).sum())
        if tokens:
            allowed -= int(torch.isfinite(row[torch.tensor(sorted(tokens), device=row.device)]).sum())
        return allowed > 0

    def _apply_logit_bias(self, logits: torch.Tensor, params: list[SamplingParams]) -> None:
        rows: list[int] = []
        cols: list[int] = []
        vals: list[float] = []
        for i, p in enumerate(params):
            if p.logit_bias:
                rows.extend([i] * len(p.logit_bias))
                cols.extend(p.logit_bias.keys())
                vals.extend(p.logit_bias.values())
        if rows:
            dev = logits.device
            logits.index_put_(
                (_tensor(rows, dev), _tensor(cols, dev)),
                _tensor(vals, dev, logits.dtype),
                accumulate=True,
            )

    def _apply_repetition_penalty(self, logits: torch.Tensor, rows: Sequence[SamplingRow]) -> None:
        idx = [i for i, r in enumerate(rows) if r.sampling.repetition_penalty != 1.0]
        if not idx:
            return
        dev = logits.device
        seen = self._token_mask(
            [list(rows[i].prompt_token_ids) + list(rows[i].output_token_ids) for i in idx], dev
        )  # [R, V] bool
        penalty = _tensor([rows[i].sampling.repetition_penalty for i in idx], dev)[:, None]
        r = _tensor(idx, dev)
        sub = logits[r]  # [R, V]
        penalised = torch.where(sub > 0, sub / penalty, sub * penalty)
        logits[r] = torch.where(seen, penalised, sub)

    def _apply_presence_frequency(self, logits: torch.Tensor, rows: Sequence[SamplingRow]) -> None:
        idx = [
            i
            for i, r in enumerate(rows)
            if r.sampling.presence_penalty != 0.0 or r.sampling.frequency_penalty != 0.0
        ]
        if not idx:
            return
        dev = logits.device
        counts = self._token_counts([rows[i].output_token_ids for i in idx], dev)  # [R, V]
        presence = _tensor([rows[i].sampling.presence_penalty for i in idx], dev)[:, None]
        frequency = _tensor([rows[i].sampling.frequency_penalty for i in idx], dev)[:, None]
        r = _tensor(idx, dev)
        logits[r] = logits[r] - presence * (counts > 0) - frequency * counts

    def _token_counts(self, token_lists: Sequence[Sequence[int]], device: torch.device) -> torch.Tensor:
        """[R, V] float32: how often each token occurs in each row's list."""
        counts = torch.zeros(len(token_lists), self.vocab_size, device=device)
        row_idx = [i for i, toks in enumerate(token_lists) for _ in range(len(toks))]
        if row_idx:
            flat = [t for toks in token_lists for t in toks]
            counts.index_put_(
                (_tensor(row_idx, device), _tensor(flat, device)),
                torch.ones(len(flat), device=device),
                accumulate=True,
            )
        return counts

    def _token_mask(self, token_lists: Sequence[Sequence[int]], device: torch.device) -> torch.Tensor:
        """[R, V] bool: which tokens occur in each row's list."""
        mask = torch.zeros(len(token_lists), self.vocab_size, dtype=torch.bool, device=device)
        row_idx = [i for i, toks in enumerate(token_lists) for _ in range(len(toks))]
        if row_idx:
            flat = [t for toks in token_lists for t in toks]
            mask[_tensor(row_idx, device), _tensor(flat, device)] = True
        return mask

    # --- truncation and drawing -----------------------------------------------------------------

    def truncate(self, logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
        """top-k, top-p, min-p over temperature-scaled logits [S, V]; dropped tokens become -inf."""
        dev = logits.device
        vocab = logits.shape[-1]
        top_k = [p.top_k if 0 < p.top_k < vocab else vocab for p in params]
        top_p = [p.top_p for p in params]
        if any(p < 1.0 for p in top_p):
            logits = top_k_top_p(logits, top_k, top_p)
        elif any(k < vocab for k in top_k):
            # top-k only: the k-th best value is the threshold (ties at the threshold are kept).
            kmax = max(top_k)
            best = logits.topk(kmax, dim=-1).values  # [S, kmax]
            k = _tensor(top_k, dev)[:, None].clamp(max=kmax)
            kth = best.gather(-1, k - 1)  # [S, 1]
            logits = logits.masked_fill(logits < kth, float("-inf"))
        min_p = [p.min_p for p in params]
        if any(m > 0.0 for m in min_p):
            # prob < min_p * max_prob  <=>  logit < max_logit + log(min_p)
            mp = _tensor(min_p, dev, logits.dtype)[:, None]
            threshold = logits.max(dim=-1, keepdim=True).values + torch.log(mp)  # -inf where min_p == 0
            logits = logits.masked_fill(logits < threshold, float("-inf"))
        return logits

    def _draw(
        self,
        logits: torch.Tensor,
        params: list[SamplingParams],
        num_out: list[int],
        drafts: Sequence[DraftChoice | None] = (),
    ) -> torch.Tensor:
        """One token per row of [S, V] logits by the exponential race; returns [S] int64. On a CPU, rows
        cut by top-k / top-p race over their kept tokens only (a -inf token cannot win): drawing Exp(1)
        noise costs ~27 ns a token there, 1.3 ms a row over 49,152 tokens, against ~10-1,000 kept.
        Rows that verify a draft model's proposal are drawn by `_draw_against_draft`."""
        against = {i: d for i, d in enumerate(drafts) if d is not None and d[1] is not None}
        if against:
            tokens = torch.empty(len(params), dtype=torch.int64, device=logits.device)
            rest = [i for i in range(len(params)) if i not in against]
            if rest:
                r = _tensor(rest, logits.device)
                tokens[r] = self._draw(logits[r], [params[i] for i in rest], [num_out[i] for i in rest])
            for i, (token, q) in against.items():
                assert q is not None
                gen = self._row_generator(params[i], num_out[i])
                tokens[i] = self._draw_against_draft(logits[i], token, q, gen)
            return tokens
        vocab = logits.shape[-1]
        if logits.device.type == "cpu":
            kept = torch.isfinite(logits)  # [S, V]
            counts = kept.sum(dim=-1).tolist()
            if all(0 < c < vocab for c in counts):
                tokens = []
                for i, p in enumerate(params):
                    idx = kept[i].nonzero().squeeze(-1)
                    probs = logits[i, idx].softmax(dim=-1)
                    noise = torch.empty_like(probs).exponential_(generator=self._row_generator(p, num_out[i]))
                    tokens.append(int(idx[(probs / noise).argmax()]))
                return torch.tensor(tokens, dtype=torch.int64)
        probs = logits.softmax(dim=-1)  # [S, V]
        noise = torch.empty_like(probs)  # [S, V] ~ Exp(1)
        unseeded = [i for i, p in enumerate(params) if p.seed is None]
        if unseeded:
            u = _tensor(unseeded, probs.device)
            noise[u] = torch.empty(len(unseeded), probs.shape[-1], device=probs.device).exponential_(
                generator=self.generator
            )
        for i, p in enumerate(params):
            if p.seed is not None:
                noise[i].exponential_(generator=self._row_generator(p, num_out[i]))
        return row_argmax(probs / noise)

    @staticmethod
    def _draw_against_draft(logits: torch.Tensor, token: int, q: torch.Tensor, gen: torch.Generator) -> int:
        """Leviathan et al.'s rejection step for one row: keep the draft's `token` with probability
        min(1, p(token) / q(token)), else draw from max(0, p - q) renormalised, where p = softmax of
        the row's (truncated) logits [V] and q [V] the draft's distribution `token` was drawn from."""
        p = logits.softmax(dim=-1)
        q = q.to(p.device, p.dtype)
        u = float(torch.rand(1, generator=gen, device=gen.device))
        p_tok, q_tok = float(p[token]), float(q[token])
        if q_tok > 0 and u * q_tok < p_tok:
            return token
        residual = (p - q).clamp_(min=0.0)
        if not float(residual.sum()) > 0:  # p == q (to rounding): the rejection never happens exactly
            residual = p
        noise = torch.empty_like(residual).exponential_(generator=gen)
        return int((residual / noise).argmax())

    def _row_generator(self, p: SamplingParams, num_out: int) -> torch.Generator:
        """A seeded row's own generator for this step (see the module docstring); else the engine's."""
        if p.seed is None:
            return self.generator
        gen = torch.Generator(device=self.device)
        gen.manual_seed(row_seed(p.seed, num_out))
        return gen

    def _with_logprobs(
        self,
        tokens: torch.Tensor,  # [B] int64
        logprobs: torch.Tensor,  # [L, V]
        lp_idx: torch.Tensor,  # [L]: the rows that asked for logprobs
        logprob_rows: list[int],
        params: list[SamplingParams],
    ) -> SampledOnDevice:
        # A banned token (min_tokens' stop tokens) has logprob -inf, which JSON cannot carry: report
        # it as vLLM does, as a finite floor.
        logprobs = logprobs.clamp(min=LOGPROB_FLOOR)
        chosen = logprobs.gather(-1, tokens[lp_idx][:, None]).squeeze(-1)  # [L]
        n_max = max(params[i].logprobs or 0 for i in logprob_rows)
        top = logprobs.topk(min(max(n_max, 1), logprobs.shape[-1]), dim=-1)  # [L, n]
        # Tokens, chosen logprobs and top lists come to the host together: one synchronisation.
        copies = HostCopies(tokens, chosen, top.values, top.indices)
        wanted = [(i, params[i].logprobs or 0) for i in logprob_rows]
        return SampledOnDevice(tokens, copies, wanted)
