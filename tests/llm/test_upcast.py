"""kiln.llm.upcast.fp32_linears: 16-bit linear layers multiply in fp32 inside the block,
and only there."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from kiln.compress import Int8WeightOnly, quantize_
from kiln.llm.upcast import fp32_linears
from tests.support.compare import assert_close_to_reference


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_linears_multiply_in_fp32_inside_the_block(dtype: torch.dtype) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 48), nn.Linear(48, 40), nn.Linear(40, 8)).to(dtype)
    model[2].float()  # an fp32 layer: untouched
    x = torch.randn(21, 64).to(dtype)
    native = model[0](x)
    with fp32_linears(model) as n:
        assert n == 2
        got = model[0](x)
    w, b = model[0].weight.double(), model[0].bias.double()
    expected = (x.double() @ w.T + b).to(dtype)  # one rounding, of a (near-)exact product
    assert_close_to_reference(got.float(), expected.float(), rtol_to_max=1e-2)
    assert_close_to_reference(got.float(), native.float(), rtol_to_max=1e-2)
    assert got.dtype == dtype
    assert all("forward" not in m.__dict__ for m in model)  # each layer's own forward again


def test_restored_after_an_error_and_compressed_layers_untouched() -> None:
    model = nn.Sequential(nn.Linear(64, 64), nn.Linear(64, 64)).bfloat16()
    quantize_(model, Int8WeightOnly(), filter_fn=lambda m, name: name == "1")
    with pytest.raises(RuntimeError, match="boom"), fp32_linears(model) as n:
        assert n == 1  # the Int8Linear is not an nn.Linear
        raise RuntimeError("boom")
    assert "forward" not in model[0].__dict__
    x = torch.randn(3, 64).bfloat16()
    assert torch.equal(model[0](x), F.linear(x, model[0].weight, model[0].bias))
