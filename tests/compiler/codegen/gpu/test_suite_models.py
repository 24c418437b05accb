"""Whole suite models through the Triton backend (the interpreter without a GPU): each
compiles, verifies against eager at compile time, and matches a second eager run on
fresh inputs; the kernels the model family needs run as generated code."""

from __future__ import annotations

import pytest
import torch

import kiln
from kiln.bench.suite import MODELS
from kiln.core.compare import compare

# model -> templates that must run natively for it
CASES = {
    "tcnn_mlp": {"chain"},
    "nerf_mlp": {"gemm"},
    "conformer": {"reduction", "pointwise"},
    "dlrm": {"gemm"},
    "vit_tiny": {"attention", "reduction", "gemm"},
}


@pytest.mark.parametrize("name", list(CASES))
def test_suite_model_matches_eager(name: str, device: torch.device) -> None:
    model, inputs = MODELS[name].build("cpu")
    model = model.to(device)
    inputs = tuple(x.to(device) for x in inputs)
    compiled = kiln.compile(model, inputs, backend="triton", cache=False)
    assert compiled.report.verification.startswith("ok"), compiled.report.summary()
    native = {k.template for k in compiled.report.kernels if k.executor == "native"}
    assert CASES[name] <= native, compiled.report.kernel_table()
    fresh = tuple(torch.randn_like(x) if x.is_floating_point() else x for x in inputs)
    with torch.no_grad():
        expected = model(*fresh)
    r = compare(compiled(*fresh), expected)
    assert r.ok, r.detail
