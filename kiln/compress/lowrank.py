"""Low-rank factorisation by truncated SVD, with the rank chosen from an error budget.

Plain: W = U S V^T, keep the top r singular triplets; the relative Frobenius error is
sqrt(sum_{i>r} s_i^2 / sum_i s_i^2).

Activation-aware: what matters is the error on the layer's outputs, || (W - W') X ||.
With H = X X^T / n = L L^T (Cholesky), that is || (W - W') L ||_F, so take the SVD of
W L instead and map the right factor back through L^-1. The error is then relative to
|| W L ||, the outputs' own size.
"""

from __future__ import annotations

import torch
from torch import Tensor

from kiln.compress.obs import Moment, as_moment


def rank_for_error(singular_values: Tensor, max_error: float) -> int:
    """Smallest r whose truncation error sqrt(sum_{i>r} s_i^2 / sum s_i^2) <= max_error."""
    energy = singular_values.double().pow(2)
    tail = energy.flip(0).cumsum(0).flip(0)  # tail[r] = sum_{i >= r} s_i^2
    rel = (tail / energy.sum()).sqrt()
    ok = torch.nonzero(rel <= max_error)
    return int(ok[0]) if len(ok) else len(singular_values)


def breakeven_rank(n: int, k: int) -> int:
    """Largest rank whose factors (N + K) r are smaller than the dense N K weight."""
    return (n * k - 1) // (n + k)


def factorize(
    w: Tensor,
    *,
    rank: int | None = None,
    max_error: float | None = None,
    h: Moment | None = None,
) -> tuple[Tensor, Tensor]:
    """(N, K) -> U (N, r), V (r, K) with W ~ U V. ``h`` (K, K) makes it activation-aware."""
    w = w.detach().double()
    if h is not None:
        chol = as_moment(h).cholesky  # (K, K) lower, H ~ L L^T
        u, s, vh = torch.linalg.svd(w @ chol, full_matrices=False)
    else:
        u, s, vh = torch.linalg.svd(w, full_matrices=False)
    r = rank if rank is not None else rank_for_error(s, float(max_error or 0.0))
    r = max(1, min(r, len(s)))
    left = u[:, :r] * s[:r]  # (N, r)
    right = vh[:r]  # (r, K)
    if h is not None:  # right L^-1: solve X L = right for X
        right = torch.linalg.solve_triangular(chol, right, upper=False, left=False)
    return left.float(), right.float()
