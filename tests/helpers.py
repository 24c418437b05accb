"""Shared test helpers."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

# Low-precision dtypes cannot meet a float32 tolerance: their rounding step
# alone is ~1e-3 (float16) / ~8e-3 (bfloat16) of the magnitude.
_DTYPE_FLOOR = {torch.float16: 1e-3, torch.bfloat16: 8e-3}


def assert_close_to_reference(actual: Any, expected: Any, rtol_to_max: float = 1e-5) -> None:
    """Assert ``actual`` matches the reference ``expected``.

    Works on tensors and on nested tuples/lists/dicts of them (and plain
    python scalars). For each tensor pair it checks, in order: shape, dtype,
    then values. Floating values pass when max |actual - expected| <=
    rtol_to_max * max |expected| (error relative to the reference's largest
    magnitude, so tiny entries don't dominate); non-finite entries must match
    exactly; integer and bool tensors must be equal.
    """
    _compare(actual, expected, rtol_to_max, "output")


def _compare(actual: Any, expected: Any, tol: float, path: str) -> None:
    if isinstance(expected, torch.Tensor):
        assert isinstance(actual, torch.Tensor), f"{path}: expected a tensor, got {type(actual)}"
        _compare_tensors(actual, expected, tol, path)
    elif isinstance(expected, Mapping):
        assert isinstance(actual, Mapping), f"{path}: expected a mapping, got {type(actual)}"
        assert list(actual.keys()) == list(expected.keys()), (
            f"{path}: keys {list(actual.keys())} != {list(expected.keys())}"
        )
        for k in expected:
            _compare(actual[k], expected[k], tol, f"{path}[{k!r}]")
    elif isinstance(expected, (tuple, list)):
        assert isinstance(actual, (tuple, list)), f"{path}: expected a sequence, got {type(actual)}"
        assert type(actual) is type(expected), f"{path}: {type(actual)} != {type(expected)}"
        assert len(actual) == len(expected), f"{path}: length {len(actual)} != {len(expected)}"
        for i, (a, e) in enumerate(zip(actual, expected, strict=True)):
            _compare(a, e, tol, f"{path}[{i}]")
    else:
        assert actual == expected, f"{path}: {actual!r} != {expected!r}"


def _compare_tensors(actual: torch.Tensor, expected: torch.Tensor, tol: float, path: str) -> None:
    assert actual.shape == expected.shape, f"{path}: shape {actual.shape} != {expected.shape}"
    assert actual.dtype == expected.dtype, f"{path}: dtype {actual.dtype} != {expected.dtype}"
    a, e = actual.detach().cpu(), expected.detach().cpu()
    if a.numel() == 0:
        return
    if not (e.is_floating_point() or e.is_complex()):
        mismatch = (a != e).sum().item()
        assert mismatch == 0, f"{path}: {mismatch} of {e.numel()} entries differ"
        return
    a64, e64 = (
        a.to(torch.complex128 if e.is_complex() else torch.float64),
        e.to(torch.complex128 if e.is_complex() else torch.float64),
    )
    finite = torch.isfinite(e64)
    same_nonfinite = torch.equal(torch.isfinite(a64), finite) and torch.equal(
        a64[~finite].real.nan_to_num(0.0), e64[~finite].real.nan_to_num(0.0)
    )
    assert same_nonfinite, f"{path}: non-finite entries differ"
    if not finite.any():
        return
    scale = e64[finite].abs().max().item()
    err = (a64[finite] - e64[finite]).abs().max().item()
    limit = max(tol, _DTYPE_FLOOR.get(e.dtype, 0.0)) * max(scale, torch.finfo(torch.float32).tiny)
    assert err <= limit, (
        f"{path}: max abs error {err:.3e} > {limit:.3e} "
        f"(= {max(tol, _DTYPE_FLOOR.get(e.dtype, 0.0)):.1e} x max |expected| {scale:.3e})"
    )
