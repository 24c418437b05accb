"""Verification of compiled outputs against eager, through ``kiln.core.compare``."""

from __future__ import annotations

import torch

from kiln.core.compare import Comparison, compare


def compare_all(actual: list[torch.Tensor], expected: list[torch.Tensor]) -> list[Comparison]:
    """``compare`` per output pair, each at its dtype's default bound."""
    if len(actual) != len(expected):
        raise ValueError(f"{len(actual)} outputs vs {len(expected)} expected")
    return [compare(a, e) for a, e in zip(actual, expected, strict=True)]
