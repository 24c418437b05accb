"""Every benchmark-suite model compiles with kiln's C++ backend and computes what eager
does, on inputs other than the ones it was compiled with. (The benchmark runner records
a failed compile as an error and goes on; this is where a broken model fails a test.)"""

from __future__ import annotations

import warnings

import pytest
import torch

import kiln
from kiln.bench.suite import MODELS
from kiln.core.native import isa
from tests.support.compare import assert_close_to_reference


def _fresh_like(inputs: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
    """New inputs of the same shapes and dtypes: floats redrawn, integer indices shuffled
    (they must stay in range, as the model's own are)."""
    gen = torch.Generator().manual_seed(1234)
    out = []
    for x in inputs:
        if x.is_floating_point():
            out.append(torch.randn(x.shape, generator=gen, dtype=x.dtype))
        else:
            flat = x.reshape(-1)
            out.append(flat[torch.randperm(flat.numel(), generator=gen)].reshape(x.shape))
    return tuple(out)


def _check(name: str, vector_isa: str | None = None) -> None:
    model, inputs = MODELS[name].build()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch.export's notes on nn.LSTM's flat weights
        compiled = kiln.compile(model, inputs)
    report = compiled.report
    assert report.executor == "native"
    assert report.isa == (vector_isa or isa())
    assert report.verification.startswith("ok")
    assert sum(k.executor == "native" for k in report.kernels) >= 1
    fresh = _fresh_like(inputs)
    with torch.inference_mode():
        expected = model(*fresh)
        actual = compiled(*fresh)
    assert_close_to_reference(actual, expected, rtol_to_max=1e-4)


@pytest.mark.parametrize("name", sorted(MODELS))
def test_suite_model_compiles_and_matches_eager(name: str) -> None:
    _check(name)


# One model per family through the other vector ISA as well (on an AVX-512 host, the AVX2
# programs an AVX2-only machine would build).
FAMILIES = ["tcnn_mlp", "dlrm", "bert_small", "lstm", "conformer", "wavenet", "mobilenet_v2"]


@pytest.mark.parametrize("name", FAMILIES)
def test_suite_model_on_each_vector_isa(name: str, vector_isa: str) -> None:
    if vector_isa == isa():
        pytest.skip("the host's own ISA: covered by the test above")
    _check(name, vector_isa)
