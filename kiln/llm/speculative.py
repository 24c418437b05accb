"""Speculative decoding: a cheap draft guesses, the model checks k guesses at once.

A decode step is bound by reading the weights (SmolLM2-135M fp32: 540 MB per token), and
reading them for a few rows costs little more than for 1 (``decode_gemv.h`` streams each
weight once for all rows: 9 rows took 1.5x one row's time). So a small, fast *draft* model proposes k
tokens one step at a time, and the *target* scores the current token and all k guesses in
one ``FastDecoder.extend`` call (k + 1 positions, causal). The target's greedy choice at each
position is kept while it agrees with the draft; at the first disagreement the target's own
token is taken instead, and the round ends. Every token emitted is the target's argmax given
the tokens before it, so the text is the target's greedy text: the draft changes the speed,
never the output (up to the target's own fp32 summation order across 1 vs k + 1 rows).
``SpeculativeDecoder`` is a ``MultiTokenDecoder``: the one loop runs it and returns a
``Generation`` whose ``speculation`` counts rounds, guesses and acceptances::

    gen = generate(SpeculativeDecoder(target, draft, k=4), prompt, 64, sampling)

Sampled decoding (temperature > 0, with top-k / top-p) uses speculative sampling
(``accept_or_resample``, Leviathan et al. 2023; Chen et al. 2023): the draft samples its
guesses from its distribution q; guess x at a position is kept with probability
min(1, p(x) / q(x)) under the target's distribution p there, and the first one refused is
replaced by a sample of the normalised excess max(0, p - q). Each emitted token is then
distributed exactly as the target alone would sample it; only the random stream differs,
so a seed gives other text than plain sampling with the same seed.

The default draft is the target's own weights quantized to INT8 per output channel, head
included, run by the fast step: a quarter of an fp32 model's bytes per token. On SmolLM2 it
agreed with the fp32 model on 89-100% of its guesses; an INT4 draft (symmetric, groups of
64) agreed on only 31-43% and made decoding slower, not faster.

Caches: both decoders write keys and values for positions they process; a rejected guess
leaves stale slots beyond the accepted prefix, which the next round overwrites before any
position attends to them (attention reads slots up to its own position only).
"""

from __future__ import annotations

import copy

import torch
from torch import Tensor

from kiln.compress.configs import Int4WeightOnly, Int8WeightOnly
from kiln.compress.verbs import quantize_
from kiln.llm.fast_decoder import FastDecoder, quantize_head_
from kiln.llm.generate import Decoder, Sampler, SpeculativeStats, probabilities
from kiln.models.transformer import Transformer

DEFAULT_DRAFT = Int8WeightOnly()


def quantized_draft(
    model: Transformer, config: Int8WeightOnly | Int4WeightOnly = DEFAULT_DRAFT
) -> Transformer:
    """A copy of ``model`` with its blocks quantized by ``config`` and an INT8 head (untied
    from the embedding table, which stays as it is): a draft for ``model``.

    The copy is made from ``model``'s own weights (no second checkpoint to load); ``model``
    is left untouched."""
    draft = copy.deepcopy(model)
    quantize_(draft, config, filter_fn=lambda mod, name: name.startswith("layers."))
    quantize_head_(draft, Int8WeightOnly())
    return draft


def accept_or_resample(
    p: Tensor, q: Tensor, guesses: list[int], generator: torch.Generator | None
) -> tuple[list[int], int]:
    """One round of speculative sampling: p (k + 1, V) the target's distributions at the k + 1
    positions, q (k, V) the draft's, ``guesses`` (k) drawn from q. Returns the emitted tokens
    (the kept guesses, then one token drawn by the target's rule) and how many were kept."""
    u = torch.rand(len(guesses), generator=generator)
    for i, g in enumerate(guesses):
        if u[i] * q[i, g] < p[i, g]:  # kept with probability min(1, p / q); q[i, g] > 0
            continue
        excess = (p[i] - q[i]).clamp(min=0)
        total = excess.sum()
        dist = excess / total if total > 0 else p[i]  # total 0: p == q up to rounding
        return [*guesses[:i], int(torch.multinomial(dist, 1, generator=generator))], i
    k = len(guesses)
    return [*guesses, int(torch.multinomial(p[k], 1, generator=generator))], k


class SpeculativeDecoder:
    """Decoding of ``target`` (batch 1) with ``draft`` guessing ``k`` tokens a round: a
    ``MultiTokenDecoder`` for ``kiln.llm.generate.generate``, which it extends by up to
    k + 1 tokens a call. ``prefill`` fills both caches (the time to first token covers
    both); ``stats`` counts the rounds since it.

    ``draft`` is any batch-1 ``Decoder`` (prefill / step) over the same vocabulary with a
    cache of at least the target's length; ``target.max_chunk`` must be >= k + 1.
    """

    def __init__(self, target: FastDecoder, draft: Decoder, k: int = 3) -> None:
        if k < 1:
            raise ValueError(f"k (guesses per round) must be >= 1, got {k}")
        if target.batch != 1:
            raise ValueError(
                f"speculative decoding runs one sequence; target has batch {target.batch}"
            )
        if target.max_chunk < k + 1:
            raise ValueError(
                f"the target verifies k + 1 = {k + 1} positions a call; its max_chunk is "
                f"{target.max_chunk}"
            )
        self.target, self.draft, self.k = target, draft, k
        self.stats = SpeculativeStats()
        # The previous round's last guess (at pos - 1), accepted but not yet in the draft's
        # cache: the next round feeds it first.
        self._pending: Tensor | None = None

    @torch.no_grad()
    def prefill(self, tokens: Tensor) -> Tensor:
        """Both caches take ``tokens`` (1, T); returns the target's logits (1, T, V)."""
        if tokens.ndim != 2 or tokens.shape[0] != 1 or tokens.shape[1] == 0:
            raise ValueError(f"prompt must be (1, tokens), got {tuple(tokens.shape)}")
        self.stats, self._pending = SpeculativeStats(), None
        logits = self.target.prefill(tokens)
        self.draft.prefill(tokens)  # counted in the time to first token: decoding needs it
        return logits

    @torch.no_grad()
    def advance(
        self, token: Tensor, pos: int, limit: int, sampler: Sampler
    ) -> tuple[Tensor, Tensor]:
        """One round after ``token`` (1,) at ``pos``: up to min(k + 1, ``limit``) tokens
        (1, n), greedy or sampled as ``sampler`` says, and the target's logits (1, n, V)."""
        if pos + limit > self.target.max_len:
            raise ValueError(
                f"{pos} tokens + {limit} more exceed the target's cache of "
                f"{self.target.max_len} positions"
            )
        k = min(self.k, limit - 1)
        guesses, q = self._guess(token, pos, k, sampler)
        new, logits = self._verify(token, guesses, q, pos, sampler)
        return torch.tensor([new]), logits[None, : len(new)]

    def _guess(
        self, token: Tensor, pos: int, k: int, sampler: Sampler
    ) -> tuple[list[int], Tensor | None]:
        """k draft tokens after ``token`` at ``pos``, and (sampling) the draft's distributions
        q (k, V) they were drawn from. A pending guess (at pos - 1) goes in first: a
        FastDecoder draft takes it and ``token`` in one call (one weight pass, not two)."""
        pending = self._pending
        if k == 0:  # the last token: the target alone
            return [], None
        guesses: list[int] = []
        qs: list[Tensor] = []
        for i in range(k):
            if i == 0 and pending is not None and isinstance(self.draft, FastDecoder):
                both = torch.stack([pending, token], 1)  # (1, 2) at pos - 1, pos
                logits = self.draft.extend(both, pos - 1)[:, -1]  # (1, V)
            else:
                if i == 0 and pending is not None:
                    self.draft.step(pending, pos - 1)
                logits = self.draft.step(token, pos + i)  # (1, V)
            if sampler.sampling.greedy:
                token = logits.argmax(-1)  # (1,)
            else:
                qs.append(probabilities(logits, sampler.sampling)[0])
                token = torch.multinomial(qs[-1], 1, generator=sampler.generator)
            guesses.append(int(token))
        return guesses, torch.stack(qs) if qs else None

    def _verify(
        self, token: Tensor, guesses: list[int], q: Tensor | None, pos: int, sampler: Sampler
    ) -> tuple[list[int], Tensor]:
        """The target scores [token, *guesses] at pos..: returns the emitted tokens (the
        kept guesses, then one of the target's own) and the target's logits (k + 1, V)."""
        chunk = torch.tensor([[int(token), *guesses]])  # (1, k + 1)
        logits = self.target.extend(chunk, pos)[0]  # (k + 1, V)
        if sampler.sampling.greedy:
            best = logits.argmax(-1).tolist()  # (k + 1,)
            n = 0
            while n < len(guesses) and guesses[n] == best[n]:
                n += 1
            new = [*guesses[:n], best[n]]
        else:
            p = probabilities(logits, sampler.sampling)  # (k + 1, V)
            q = q if q is not None else p[:0]  # no guesses (the last token): p alone
            new, n = accept_or_resample(p, q, guesses, sampler.generator)
        self.stats.rounds += 1
        self.stats.drafted += len(guesses)
        self.stats.accepted += n
        kept_all = guesses and n == len(guesses)
        self._pending = torch.tensor([guesses[-1]]) if kept_all else None
        return new, logits
