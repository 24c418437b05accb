"""Low-rank factorisation: rank selection, activation awareness."""

from __future__ import annotations

import torch

from kiln.compress.lowrank import breakeven_rank, factorize, rank_for_error
from tests.compress.toy import correlated_inputs


def test_rank_for_error_is_the_smallest_rank() -> None:
    s = torch.tensor([10.0, 5.0, 2.0, 1.0, 0.5])
    total = float(s.pow(2).sum())
    for max_error in (0.01, 0.1, 0.2, 0.5):
        r = rank_for_error(s, max_error)
        err = lambda r: (float(s[r:].pow(2).sum()) / total) ** 0.5  # noqa: E731
        assert err(r) <= max_error and (r == 0 or err(r - 1) > max_error)


def test_factorize_meets_its_error_budget() -> None:
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(64, 16, generator=gen) @ torch.randn(16, 96, generator=gen)
    w += 0.05 * torch.randn(64, 96, generator=gen)
    u, v = factorize(w, max_error=0.1)
    assert u.shape[1] <= 16
    assert float((u @ v - w).norm() / w.norm()) <= 0.1 + 1e-5


def test_activation_aware_has_lower_output_error() -> None:
    gen = torch.Generator().manual_seed(1)
    w = torch.randn(64, 64, generator=gen)
    x = correlated_inputs(4096, k=64, seed=2) * torch.linspace(0.05, 3.0, 64)  # uneven inputs
    h = x.T @ x / x.shape[0]
    plain = factorize(w, rank=16)
    aware = factorize(w, rank=16, h=h)
    err = lambda uv: float(((uv[0] @ uv[1] - w) @ x.T).norm())  # noqa: E731
    assert err(aware) < 0.9 * err(plain)


def test_breakeven_rank() -> None:
    assert breakeven_rank(576, 576) == 287  # 287 * 1152 < 576^2 <= 288 * 1152
