"""kiln.llm.upcast.fp32_linears: 16-bit linear layers multiply in fp32 inside the block,
and only there."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from kiln.compress import Int8WeightOnly, quantize_
from kiln.llm import upcast
from kiln.llm.upcast import fp32_linears, native_half_matmul
from tests.support.compare import assert_close_to_reference


@pytest.fixture
def no_half_instructions(monkeypatch: pytest.MonkeyPatch) -> None:
    """A CPU without 16-bit dot products (as the AVX2 hosts): every 16-bit layer upcasts."""
    monkeypatch.setattr(upcast, "cpu_flags", lambda: ("avx2", "fma"))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_linears_multiply_in_fp32_inside_the_block(
    dtype: torch.dtype, no_half_instructions: None
) -> None:
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


def test_restored_after_an_error_and_compressed_layers_untouched(
    no_half_instructions: None,
) -> None:
    model = nn.Sequential(nn.Linear(64, 64), nn.Linear(64, 64)).bfloat16()
    quantize_(model, Int8WeightOnly(), filter_fn=lambda m, name: name == "1")
    with pytest.raises(RuntimeError, match="boom"), fp32_linears(model) as n:
        assert n == 1  # the Int8Linear is not an nn.Linear
        raise RuntimeError("boom")
    assert "forward" not in model[0].__dict__
    x = torch.randn(3, 64).bfloat16()
    assert torch.equal(model[0](x), F.linear(x, model[0].weight, model[0].bias))


def test_native_16bit_matmuls_are_kept(monkeypatch: pytest.MonkeyPatch) -> None:
    """With AVX-512 BF16 (Zen 4 / 5) bf16 layers keep torch's own matmul; fp16 ones, which
    that CPU has no instructions for, still upcast."""
    monkeypatch.setattr(upcast, "cpu_flags", lambda: ("avx2", "avx512_bf16", "avx512f"))
    assert native_half_matmul(torch.bfloat16) and not native_half_matmul(torch.float16)
    model = nn.Sequential(nn.Linear(32, 32).bfloat16(), nn.Linear(32, 32).half())
    with fp32_linears(model) as n:
        assert n == 1
        assert "forward" not in model[0].__dict__ and "forward" in model[1].__dict__
