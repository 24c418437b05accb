"""Perplexity of a causal language model on a token stream, by sliding windows.

The protocol is the standard one (Hugging Face's "perplexity of fixed-length models"):
windows of ``context`` tokens start every ``stride`` tokens; each window scores only the
tokens that the previous window did not score, with between ``context - stride`` and
``context - 1`` tokens of history (the first window scores all its tokens but the first,
which has nothing to be predicted from). With ``stride < context`` every token after the
first is scored exactly once; with ``stride == context`` (no overlap) a window's first token
has no history in it and is not scored either.
The last window starts on the stride grid like the others and may therefore be shorter.

    ppl = exp(mean over scored tokens of -log p(token | its window's earlier tokens))

Windows of equal length are batched for speed; the scores do not depend on the batching.

``window_losses`` keeps each window's summed negative log-likelihood and scored-token count,
so that two models scored on the same tokens can be compared window by window (a paired
difference whose spread across windows says how far the overall figure can be trusted);
``perplexity`` is their total.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from itertools import groupby
from typing import Any

import torch
import torch.nn.functional as F

ProgressFn = Callable[[int, int], None]


@dataclass(frozen=True)
class PerplexityResult:
    """ppl = exp(nll_mean); nll_mean in nats per token over ``n_scored`` tokens."""

    ppl: float
    nll_mean: float
    n_scored: int

    def __post_init__(self) -> None:
        if self.n_scored < 1 or not math.isfinite(self.nll_mean):
            raise ValueError(f"invalid perplexity result {self}")


@dataclass(frozen=True)
class Window:
    """Tokens ``[begin, end)`` go in; targets ``[score_from, end)`` are scored."""

    begin: int
    end: int
    score_from: int

    @property
    def length(self) -> int:
        return self.end - self.begin


def sliding_windows(n_tokens: int, context: int, stride: int) -> list[Window]:
    """The windows of the protocol for a stream of ``n_tokens`` tokens."""
    if n_tokens < 2:
        raise ValueError(f"need at least 2 tokens to score one, got {n_tokens}")
    if not 1 <= stride <= context or context < 2:
        raise ValueError(f"need 1 <= stride <= context and context >= 2, got {stride}, {context}")
    windows, begin, scored_to = [], 0, 0
    while True:
        end = min(begin + context, n_tokens)
        windows.append(Window(begin, end, max(scored_to, begin + 1)))
        if end == n_tokens:
            return windows
        scored_to, begin = end, begin + stride


def _logits(output: Any) -> torch.Tensor:
    """Logits from a model's output: a tensor, or an object with ``.logits`` (Hugging Face)."""
    logits = output if isinstance(output, torch.Tensor) else getattr(output, "logits", None)
    if not isinstance(logits, torch.Tensor) or logits.dim() != 3:
        raise TypeError(f"model must return (B, T, V) logits or an object with .logits: {output!r}")
    return logits


def _device_of(model: Callable[..., Any]) -> torch.device:
    """Where the model's parameters live (the CPU for plain callables without any)."""
    if isinstance(model, torch.nn.Module):
        for p in model.parameters():
            return p.device
    return torch.device("cpu")


@dataclass(frozen=True)
class WindowLosses:
    """Per-window scores of one model on one token stream, in window order.

    ``nll[w]`` is the summed negative log-likelihood (nats, float64) of the ``counts[w]``
    tokens window ``w`` scores; every window scores at least one token.
    """

    nll: torch.Tensor  # (W,) float64
    counts: torch.Tensor  # (W,) int64

    def __post_init__(self) -> None:
        if self.nll.shape != self.counts.shape or self.nll.dim() != 1 or self.nll.numel() < 1:
            raise ValueError(f"need two (W,) tensors, got {self.nll.shape}, {self.counts.shape}")

    @property
    def mean_nll(self) -> torch.Tensor:
        """Each window's mean negative log-likelihood per scored token -> (W,) float64."""
        return self.nll / self.counts.to(torch.float64)

    def total(self) -> PerplexityResult:
        """The whole stream's perplexity: every scored token counted once."""
        nll_sum, n_scored = 0.0, 0
        for nll, count in zip(self.nll.tolist(), self.counts.tolist()):  # in window order
            nll_sum += nll
            n_scored += count
        nll_mean = nll_sum / n_scored
        return PerplexityResult(ppl=math.exp(nll_mean), nll_mean=nll_mean, n_scored=n_scored)


def window_losses(
    model: Callable[..., Any],
    tokens: torch.Tensor,
    context: int = 512,
    stride: int = 256,
    batch_size: int = 4,
    progress: ProgressFn | None = None,
) -> WindowLosses:
    """Each sliding window's summed NLL and scored-token count for ``model`` on ``tokens``.

    Arguments as for ``perplexity``. The windows are ``sliding_windows(len(tokens), context,
    stride)``, so two models scored with the same arguments score the same tokens in each
    window.
    """
    if tokens.dim() != 1:
        raise ValueError(f"tokens must be 1-D, got shape {tuple(tokens.shape)}")
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    windows = sliding_windows(tokens.numel(), context, stride)
    device = _device_of(model)
    ids = tokens.to(device=device, dtype=torch.int64)  # (N,)
    nlls: list[float] = []
    counts: list[int] = []
    done = 0
    with torch.inference_mode():
        for _, same_length in groupby(windows, key=lambda w: w.length):  # keeps window order
            group = list(same_length)
            for i in range(0, len(group), batch_size):
                batch = group[i : i + batch_size]
                inputs = torch.stack([ids[w.begin : w.end] for w in batch])  # (B, T)
                logits = _logits(model(inputs))  # (B, T, V)
                for row, w in enumerate(batch):
                    first = w.score_from - w.begin  # first scored position within the window
                    pred = logits[row, first - 1 : -1]  # (S, V): position t predicts t + 1
                    if pred.dtype not in (torch.float32, torch.float64):
                        pred = pred.float()
                    target = inputs[row, first:]  # (S,)
                    nll = F.cross_entropy(pred, target, reduction="sum")
                    nlls.append(float(nll.double()))
                    counts.append(target.numel())
                done += len(batch)
                if progress is not None:
                    progress(done, len(windows))
    return WindowLosses(
        torch.tensor(nlls, dtype=torch.float64), torch.tensor(counts, dtype=torch.int64)
    )


def perplexity(
    model: Callable[..., Any],
    tokens: torch.Tensor,
    context: int = 512,
    stride: int = 256,
    batch_size: int = 4,
    progress: ProgressFn | None = None,
) -> PerplexityResult:
    """Sliding-window perplexity of ``model`` on ``tokens`` (a 1-D int64 stream).

    ``model(input_ids)`` takes (B, T) int64 ids and returns (B, T, V) logits, or an object
    with ``.logits``. ``progress(done, total)`` is called after each batch with the number of
    windows done. Log-probabilities are computed in float32 (float64 for float64 logits)
    and the negative log-likelihoods summed in float64.
    """
    return window_losses(model, tokens, context, stride, batch_size, progress).total()
