"""The one reference-compare helper of kiln's tests, over ``kiln.core.compare``."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor

from kiln.core.compare import compare


def assert_close_to_reference(actual: Any, expected: Any, rtol_to_max: float = 1e-5) -> None:
    """Assert ``actual`` matches the reference ``expected``.

    Works on tensors and on nested tuples/lists/dicts of them (and plain python
    scalars). For each tensor pair ``kiln.core.compare.compare`` checks, in order: shape,
    dtype, non-finite entries, then values: max |actual - expected| <= rtol_to_max * max
    |expected| (never below the dtype's rounding step); integer and bool tensors must be
    equal.
    """
    _compare(actual, expected, rtol_to_max, "output")


def _compare(actual: Any, expected: Any, tol: float, path: str) -> None:
    if isinstance(expected, Tensor):
        assert isinstance(actual, Tensor), f"{path}: expected a tensor, got {type(actual)}"
        verdict = compare(actual, expected, tol)
        assert verdict.ok, f"{path}: {verdict.detail}"
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


def assert_equal(actual: Tensor, expected: Tensor) -> None:
    """Assert ``actual`` is bitwise the reference ``expected`` (same shape, dtype and
    values), NaN counting as equal to NaN: for the same operations on the same data."""
    assert actual.shape == expected.shape, f"shape {tuple(actual.shape)} != {tuple(expected.shape)}"
    assert actual.dtype == expected.dtype, f"dtype {actual.dtype} != {expected.dtype}"
    if actual.is_floating_point():
        nan = expected.isnan()
        assert torch.equal(actual.isnan(), nan), "NaN at different positions"
        actual, expected = actual[~nan], expected[~nan]
    bad = int((actual != expected).sum())
    assert bad == 0, f"{bad} of {expected.numel()} entries differ"
