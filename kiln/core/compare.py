"""Numerical comparison: one definition of "close" for kiln's verification and its tests.

Closeness is the largest absolute error relative to the reference's largest magnitude
(``max |a - e| / max |e|``), so entries near zero do not dominate. Checks run in order:
shape, dtype, non-finite entries (NaN positions and infinities must match), then values.
``RTOL_TO_MAX`` is the default bound per dtype; no bound is ever below the dtype's own
rounding step (``torch.finfo(dtype).eps``). Lossy compression is judged by ``sqnr_db``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

# Default bound on max error / max |reference| for a whole computation's output. fp32
# kernels reorder sums and use polynomial transcendentals, so bit equality is not expected;
# half-precision outputs carry several roundings of their ~1e-3 (fp16) / ~8e-3 (bf16) step.
RTOL_TO_MAX: dict[torch.dtype, float] = {
    torch.float64: 1e-10,
    torch.float32: 1e-4,
    torch.float16: 2e-3,
    torch.bfloat16: 2e-2,
}


@dataclass(frozen=True)
class Comparison:
    """The verdict on one tensor pair and the figures behind it."""

    ok: bool
    max_abs: float
    max_rel: float  # max abs error / max |reference|
    detail: str


def tolerance(dtype: torch.dtype, rtol_to_max: float | None = None) -> float:
    """The bound used for ``dtype``: ``rtol_to_max`` (or the dtype's default), never below
    the dtype's rounding step."""
    tol = rtol_to_max if rtol_to_max is not None else RTOL_TO_MAX.get(dtype, 1e-4)
    if dtype.is_floating_point:
        tol = max(tol, torch.finfo(dtype).eps)
    return tol


def compare(actual: Tensor, expected: Tensor, rtol_to_max: float | None = None) -> Comparison:
    """Shape, then dtype, then values; integer, bool and complex tensors must be equal
    unless floating (complex values are compared like floats, by modulus)."""
    inf = float("inf")
    if actual.shape != expected.shape:
        return Comparison(
            False, inf, inf, f"shape {tuple(actual.shape)} != {tuple(expected.shape)}"
        )
    if actual.dtype != expected.dtype:
        return Comparison(False, inf, inf, f"dtype {actual.dtype} != {expected.dtype}")
    a, e = actual.detach().cpu(), expected.detach().cpu()
    if a.numel() == 0:
        return Comparison(True, 0.0, 0.0, "empty")
    if not (e.is_floating_point() or e.is_complex()):
        bad = int((a != e).sum())
        return Comparison(bad == 0, float(bad), float(bad), f"{bad} of {e.numel()} entries differ")
    wide = torch.complex128 if e.is_complex() else torch.float64
    a64, e64 = a.to(wide), e.to(wide)
    finite = torch.isfinite(e64)
    if not torch.equal(torch.isfinite(a64), finite):
        return Comparison(False, inf, inf, "non-finite entries at different positions")
    if not torch.equal(a64[~finite].nan_to_num(0.0), e64[~finite].nan_to_num(0.0)):
        return Comparison(False, inf, inf, "non-finite entries differ (NaN vs inf, or sign)")
    if not bool(finite.any()):
        return Comparison(True, 0.0, 0.0, "all entries non-finite and equal")
    max_abs = float((a64[finite] - e64[finite]).abs().max())
    scale = float(e64[finite].abs().max())
    max_rel = max_abs / scale if scale > 0 else max_abs
    tol = tolerance(e.dtype, rtol_to_max)
    detail = f"max abs error {max_abs:.3g}, {max_rel:.3g} of max |expected| {scale:.3g} (bound {tol:.1e})"
    return Comparison(max_rel <= tol, max_abs, max_rel, detail)


def sqnr_db(reference: Tensor, approx: Tensor) -> float:
    """Signal-to-quantization-noise ratio in dB: 10 log10(|ref|^2 / |ref - approx|^2)."""
    ref = reference.detach().double()
    noise = (ref - approx.detach().double()).pow(2).sum().clamp_min(1e-300)
    return float(10 * torch.log10(ref.pow(2).sum() / noise))
