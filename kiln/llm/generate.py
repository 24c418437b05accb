"""Token generation: prefill once, then one decode step per new token, timed.

A ``Decoder`` owns a KV cache and turns tokens into logits — ``EagerDecoder`` runs the
``Transformer`` module; ``kiln.llm.fast_decoder.FastDecoder`` runs the whole decode step in
one C++ call; the parallel runtimes wrap their ranks behind the same two methods. The loop
here is the same for all of them, so timings compare like with like:
  - time to first token = prefill + choosing the first token,
  - per-token latency   = each later step (decode + choosing), their median and mean.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

import torch
from torch import Tensor

from kiln.models.kv_cache import KVCache
from kiln.models.transformer import Transformer


class Decoder(Protocol):
    """Prefill a prompt, then extend it one token at a time (positions are absolute)."""

    def prefill(self, tokens: Tensor) -> Tensor:  # (B, T) -> logits (B, T, V)
        ...

    def step(self, tokens: Tensor, pos: int) -> Tensor:  # (B,) at position pos -> (B, V)
        ...


class EagerDecoder:
    """The ``Transformer`` module run op by op (the reference every fast path matches)."""

    def __init__(self, model: Transformer, batch: int, max_len: int) -> None:
        self.model, self.cache = model, model.new_cache(batch, max_len)

    @property
    def kv_cache(self) -> KVCache:
        return self.cache

    @torch.inference_mode()
    def prefill(self, tokens: Tensor) -> Tensor:
        return self.model(tokens, 0, self.cache)

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
class Generation:
    """New tokens (B, N) and how long they took."""

    tokens: Tensor
    prompt_len: int
    ttft_s: float
    step_s: list[float] = field(default_factory=list)

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
    decoder: Decoder,
    prompt: Tensor,
    max_new_tokens: int,
    sampling: Sampling = Sampling(),
    stop_ids: tuple[int, ...] = (),
    on_token: Callable[[Tensor], None] | None = None,
) -> Generation:
    """Extend ``prompt`` (B, T) by up to ``max_new_tokens``; stop early once every sequence
    has produced one of ``stop_ids`` (finished sequences then repeat their stop token)."""
    if prompt.ndim != 2 or prompt.shape[1] == 0:
        raise ValueError(
            f"prompt must be (batch, tokens) with tokens > 0, got {tuple(prompt.shape)}"
        )
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    generator = None
    if sampling.seed is not None:
        generator = torch.Generator().manual_seed(sampling.seed)
    stops = torch.tensor(stop_ids, dtype=torch.long)
    t0 = time.perf_counter()
    token = choose(decoder.prefill(prompt)[:, -1], sampling, generator)  # (B,)
    ttft = time.perf_counter() - t0
    out, steps = [token], []
    done = torch.isin(token, stops)
    if on_token is not None:
        on_token(token)
    pos = prompt.shape[1]
    while len(out) < max_new_tokens and not bool(done.all()):
        t = time.perf_counter()
        nxt = choose(decoder.step(token, pos), sampling, generator)
        steps.append(time.perf_counter() - t)
        token = torch.where(done, token, nxt)
        done |= torch.isin(token, stops)
        out.append(token)
        pos += 1
        if on_token is not None:
            on_token(token)
    return Generation(torch.stack(out, dim=1), prompt.shape[1], ttft, steps)
