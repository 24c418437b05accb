"""Numerical comparison of compiled and eager outputs, with per-dtype tolerances."""

from __future__ import annotations

from dataclasses import dataclass

import torch

# Max error allowed relative to the reference's max magnitude. fp32 kernels reorder
# sums and use polynomial transcendentals, so bit equality is not expected.
RTOL_TO_MAX: dict[torch.dtype, float] = {
    torch.float64: 1e-10,
    torch.float32: 1e-4,
    torch.bfloat16: 2e-2,
    torch.float16: 2e-3,
}


@dataclass(frozen=True)
class Comparison:
    ok: bool
    max_abs: float
    max_rel: float  # max abs error / max |reference|
    detail: str


def compare(
    actual: torch.Tensor, expected: torch.Tensor, rtol_to_max: float | None = None
) -> Comparison:
    """Shape, then dtype, then values (max error relative to the reference's max magnitude)."""
    if actual.shape != expected.shape:
        return Comparison(
            False,
            float("inf"),
            float("inf"),
            f"shape {tuple(actual.shape)} != {tuple(expected.shape)}",
        )
    if actual.dtype != expected.dtype:
        return Comparison(
            False, float("inf"), float("inf"), f"dtype {actual.dtype} != {expected.dtype}"
        )
    if actual.numel() == 0:
        return Comparison(True, 0.0, 0.0, "empty")
    if not actual.is_floating_point():
        bad = int((actual != expected).sum())
        return Comparison(bad == 0, float(bad), float(bad), f"{bad} elements differ")
    a, e = actual.double(), expected.double()
    same_nan = torch.isnan(a) == torch.isnan(e)
    if not bool(same_nan.all()):
        return Comparison(False, float("nan"), float("nan"), "NaN positions differ")
    finite = torch.isfinite(e)
    if not bool((a[~finite] == e[~finite]).all() | torch.isnan(e[~finite]).all()):
        return Comparison(False, float("inf"), float("inf"), "infinities differ")
    diff = (a - e)[finite].abs()
    max_abs = float(diff.max()) if diff.numel() else 0.0
    scale = float(e[finite].abs().max()) if diff.numel() else 0.0
    max_rel = max_abs / scale if scale > 0 else max_abs
    tol = rtol_to_max if rtol_to_max is not None else RTOL_TO_MAX.get(expected.dtype, 1e-4)
    return Comparison(
        max_rel <= tol, max_abs, max_rel, f"max abs {max_abs:.3g}, rel-to-max {max_rel:.3g}"
    )


def compare_all(actual: list[torch.Tensor], expected: list[torch.Tensor]) -> list[Comparison]:
    if len(actual) != len(expected):
        raise ValueError(f"{len(actual)} outputs vs {len(expected)} expected")
    return [compare(a, e) for a, e in zip(actual, expected)]
