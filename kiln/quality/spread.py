"""How far a measured accuracy loss can be trusted: a mean paired difference and its margin.

A compressed model and the original are scored on the same units of text (perplexity
windows, sentences); ``d[i]`` is the compressed model's loss minus the original's on unit
``i``. The reported increase is the weighted mean of ``d`` (weights: tokens per window, so
that it equals log(ppl / ppl_original); equal weights for sentences), and its margin is
``z`` standard errors of that mean, estimated from the spread of ``d`` across units:

    mean   = sum_i w_i d_i                      (weights normalised to sum to 1)
    se     = sqrt(n / (n - 1) * sum_i w_i^2 (d_i - mean)^2)
    margin = z * se

With equal weights se is the textbook s / sqrt(n) (s: the sample standard deviation of d).
Units of one text are treated as independent samples, which neighbouring windows of a novel
only approximately are; the margin is a guard against a lucky stretch of text, not a
guarantee about other text (that is what confirming on a disjoint text is for).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

# One-sided 95 % normal quantile: a plan whose true increase is at the budget passes the
# "increase + margin <= budget" test on about 5 % of search texts like the one measured.
Z_ONE_SIDED_95 = 1.6449


@dataclass(frozen=True)
class PairedDifference:
    """A mean paired loss difference and ``z`` standard errors of it (same units)."""

    mean: float
    margin: float
    n: int  # units of text (windows, sentences) the difference was measured on


def paired_difference(
    diffs: torch.Tensor, weights: torch.Tensor | None = None, z: float = Z_ONE_SIDED_95
) -> PairedDifference:
    """Weighted mean of ``diffs`` (n,) and ``z`` times its standard error (module docstring).

    ``weights`` (n,) are non-negative (default: equal); one unit gives a margin of 0, there
    being no spread to estimate from.
    """
    if diffs.dim() != 1 or diffs.numel() < 1:
        raise ValueError(f"diffs must be a non-empty 1-D tensor, got shape {tuple(diffs.shape)}")
    if z < 0:
        raise ValueError(f"z must be >= 0, got {z}")
    d = diffs.to(torch.float64)  # (n,)
    w = torch.ones_like(d) if weights is None else weights.to(torch.float64)  # (n,)
    if w.shape != d.shape or bool((w < 0).any()) or float(w.sum()) <= 0:
        raise ValueError(f"weights must be (n,) = {tuple(d.shape)}, non-negative, not all 0")
    if not bool(torch.isfinite(d).all()):
        raise ValueError("diffs must be finite")
    w = w / w.sum()
    mean = float((w * d).sum())
    n = d.numel()
    if n == 1:
        return PairedDifference(mean, 0.0, 1)
    se = math.sqrt(n / (n - 1) * float((w.square() * (d - mean).square()).sum()))
    return PairedDifference(mean, z * se, n)
