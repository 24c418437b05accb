"""Token generation: prefill once, then decode new tokens, timed; the one loop of kiln.

A ``Decoder`` owns a KV cache and turns tokens into logits — ``EagerDecoder`` runs the
``Transformer`` module; ``kiln.llm.fast_decoder.FastDecoder`` runs the whole decode step in
one C++ call; ``kiln.parallel.pp.PipelineDecoder`` runs one rank's pipeline stage (and
tensor-parallel shard). A ``MultiTokenDecoder`` emits several tokens a call
(``kiln.llm.speculative.SpeculativeDecoder``: a draft guesses, the target checks). The loop
here is the same for all of them, so timings compare like with like and every path returns
one ``Generation``:
  - time to first token = prefill + choosing the first token,
  - per-token latency   = each later step (decode + choosing), their median and mean; a
    call that emits n tokens gives each an n-th of its time.
On a GPU the clock is read after the device has finished the work queued so far (a CUDA
call returns when it is queued, not when it is done).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

import torch
from torch import Tensor

from kiln.models.transformer import Transformer


class Decoder(Protocol):
    """Prefill a prompt, then extend it one token at a time (positions are absolute).

    ``prefill`` returns logits (B, T, V), or only the last position's (B, 1, V): the loop
    reads ``[:, -1]``."""

    def prefill(self, tokens: Tensor) -> Tensor:  # (B, T) -> logits (B, T | 1, V)
        ...

    def step(self, tokens: Tensor, pos: int) -> Tensor:  # (B,) at position pos -> (B, V)
        ...


@runtime_checkable
class MultiTokenDecoder(Protocol):
    """A decoder that chooses its own next tokens and may emit several a call.

    ``advance`` feeds ``token`` (B,) at ``pos`` and returns 1 to ``limit`` next tokens (B, n)
    chosen with ``sampler``, with the logits (B, n, V) of the model whose text it is at those
    positions. ``stats`` describes the calls of the generation since the last ``prefill``."""

    stats: SpeculativeStats

    def prefill(self, tokens: Tensor) -> Tensor:  # (B, T) -> logits (B, T | 1, V)
        ...

    def advance(
        self, token: Tensor, pos: int, limit: int, sampler: Sampler
    ) -> tuple[Tensor, Tensor]:  # (B,) -> tokens (B, n), logits (B, n, V); 1 <= n <= limit
        ...


class EagerDecoder:
    """The ``Transformer`` module run op by op (the reference every fast path matches)."""

    def __init__(self, model: Transformer, batch: int, max_len: int) -> None:
        self.model, self.cache = model, model.new_cache(batch, max_len)

    @torch.inference_mode()
    def prefill(self, tokens: Tensor) -> Tensor:  # (B, T) -> the last position's (B, 1, V)
        return self.model(tokens, 0, self.cache, last_only=True)

    @torch.inference_mode()
    def step(self, tokens: Tensor, pos: int) -> Tensor:
        return self.model(tokens[:, None], pos, self.cache)[:, 0]


@dataclass(frozen=True)
class Sampling:
    """How the next token is chosen. ``temperature == 0`` is greedy (argmax)."""

    temperature: float = 0.0
    top_k: int | None = None
    top_p: float | None = None
    seed: int | None = None

    def __post_init__(self) -> None:
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if self.top_k is not None and self.top_k < 1:
            raise ValueError(f"top_k must be >= 1, got {self.top_k}")
        if self.top_p is not None and not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


class Sampler:
    """``Sampling`` with its random stream, one per generation: a CPU generator seeded by
    ``sampling.seed`` (None: torch's global stream). The same seed and the same logits give
    the same tokens in every process, which is how parallel ranks agree."""

    def __init__(self, sampling: Sampling) -> None:
        self.sampling = sampling
        self.generator: torch.Generator | None = None
        if sampling.seed is not None:
            self.generator = torch.Generator().manual_seed(sampling.seed)

    def choose(self, logits: Tensor) -> Tensor:
        """Next tokens (B,) from logits (B, V)."""
        return choose(logits, self.sampling, self.generator)


def choose(logits: Tensor, sampling: Sampling, generator: torch.Generator | None) -> Tensor:
    """Next tokens (B,) from logits (B, V)."""
    if sampling.greedy:
        return logits.argmax(-1)
    return torch.multinomial(probabilities(logits, sampling), 1, generator=generator)[:, 0]


def probabilities(logits: Tensor, sampling: Sampling) -> Tensor:
    """The distribution (B, V) a sampled token is drawn from: softmax(logits / temperature)
    within the top-k tokens and the top-p mass (``sampling`` must not be greedy)."""
    scores = logits.float() / sampling.temperature
    if sampling.top_k is not None and sampling.top_k < scores.shape[-1]:
        kth = scores.topk(sampling.top_k, dim=-1).values[:, -1:]  # (B, 1)
        scores = scores.masked_fill(scores < kth, -torch.inf)
    if sampling.top_p is not None and sampling.top_p < 1:
        ordered, order = scores.sort(dim=-1, descending=True)
        before = ordered.softmax(-1).cumsum(-1) - ordered.softmax(-1)  # mass of better tokens
        ordered = ordered.masked_fill(before >= sampling.top_p, -torch.inf)  # keeps the best one
        scores = torch.full_like(scores, -torch.inf).scatter(-1, order, ordered)
    return scores.softmax(-1)


@dataclass
class SpeculativeStats:
    """How a multi-token decoder's rounds went: guesses proposed and accepted."""

    rounds: int = 0
    drafted: int = 0
    accepted: int = 0

    @property
    def acceptance(self) -> float:
        """Share of the draft's guesses the target agreed with."""
        return self.accepted / self.drafted if self.drafted else float("nan")

    @property
    def tokens_per_round(self) -> float:
        """Tokens emitted per target call (accepted guesses + the target's own token)."""
        return (self.accepted + self.rounds) / self.rounds if self.rounds else float("nan")


@dataclass
class Generation:
    """New tokens (B, N) and how long they took; with ``keep_logits``, the logits (B, N, V)
    each was chosen from; for a ``MultiTokenDecoder``, how its rounds went."""

    tokens: Tensor
    prompt_len: int
    ttft_s: float
    step_s: list[float] = field(default_factory=list)
    logits: Tensor | None = None
    speculation: SpeculativeStats | None = None

    @property
    def new_tokens(self) -> int:
        return self.tokens.shape[1]

    @property
    def per_token_s(self) -> float:
        """Median decode-step latency (the first token is counted in ``ttft_s``)."""
        return statistics.median(self.step_s) if self.step_s else float("nan")

    @property
    def tokens_per_s(self) -> float:
        """Decode throughput per sequence: steps / their total time."""
        return len(self.step_s) / sum(self.step_s) if self.step_s else float("nan")


def generate(
    decoder: Decoder | MultiTokenDecoder,
    prompt: Tensor,
    max_new_tokens: int,
    sampling: Sampling = Sampling(),
    stop_ids: tuple[int, ...] = (),
    on_token: Callable[[Tensor], None] | None = None,
    keep_logits: bool = False,
) -> Generation:
    """Extend ``prompt`` (B, T) by up to ``max_new_tokens``; stop early once every sequence
    has produced one of ``stop_ids`` (finished sequences then repeat their stop token).
    ``on_token`` gets each new token (B,) as soon as it is known."""
    if prompt.ndim != 2 or prompt.shape[1] == 0:
        raise ValueError(
            f"prompt must be (batch, tokens) with tokens > 0, got {tuple(prompt.shape)}"
        )
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    sampler = Sampler(sampling)
    advance = _advancer(decoder)
    t0 = time.perf_counter()
    logits = decoder.prefill(prompt)[:, -1]  # (B, V)
    token = sampler.choose(logits)  # (B,)
    now = _clock(token)
    ttft = now() - t0
    stops = torch.tensor(stop_ids, dtype=torch.long, device=token.device)
    out, steps = [token], []
    kept = [logits.clone()] if keep_logits else []  # a decoder may reuse its output buffer
    done = torch.isin(token, stops)
    if on_token is not None:
        on_token(token)
    pos = prompt.shape[1]  # `token` sits at pos, not yet fed
    while len(out) < max_new_tokens and not bool(done.all()):
        t = time.perf_counter()
        new, new_logits = advance(token, pos, max_new_tokens - len(out), sampler)
        share = (now() - t) / new.shape[1]
        for i in range(new.shape[1]):
            token = torch.where(done, token, new[:, i])
            done |= torch.isin(token, stops)
            out.append(token)
            if keep_logits:
                kept.append(new_logits[:, i].clone())
            steps.append(share)
            pos += 1
            if on_token is not None:
                on_token(token)
            if bool(done.all()):
                break
    stats = decoder.stats if isinstance(decoder, MultiTokenDecoder) else None
    return Generation(
        torch.stack(out, dim=1), prompt.shape[1], ttft, steps,
        torch.stack(kept, dim=1) if keep_logits else None, stats,
    )  # fmt: skip


Advance = Callable[[Tensor, int, int, Sampler], tuple[Tensor, Tensor]]


def _clock(token: Tensor) -> Callable[[], float]:
    """``time.perf_counter``, on a CUDA device once the device has caught up."""
    if token.device.type != "cuda":
        return time.perf_counter

    def synced() -> float:
        torch.cuda.synchronize(token.device)
        return time.perf_counter()

    return synced


def _advancer(decoder: Decoder | MultiTokenDecoder) -> Advance:
    """``advance(token, pos, limit, sampler)`` -> the next 1 to ``limit`` tokens (B, n) after
    ``token`` at ``pos`` and their logits (B, n, V); chosen once per generation (a Protocol
    isinstance check is not free on the per-token path)."""
    if isinstance(decoder, MultiTokenDecoder):
        multi = decoder

        def advance(token: Tensor, pos: int, limit: int, sampler: Sampler) -> tuple[Tensor, Tensor]:
            new, logits = multi.advance(token, pos, limit, sampler)
            if not 1 <= new.shape[1] <= limit:
                raise RuntimeError(f"{type(multi).__name__} emitted {new.shape[1]} tokens, "
                                   f"not 1 to {limit}")  # fmt: skip
            return new, logits

        return advance
    single = decoder

    def step(token: Tensor, pos: int, limit: int, sampler: Sampler) -> tuple[Tensor, Tensor]:
        logits = single.step(token, pos)  # (B, V)
        return sampler.choose(logits)[:, None], logits[:, None]

    return step
