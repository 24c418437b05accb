"""1x1 convolutions as native GEMMs (``pointconv.py``) against eager PyTorch, and the
Conformer convolution module and a MobileNetV2 block with every conv native."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn

import kiln
from kiln.bench.suite._base import randomize_norm_stats
from kiln.bench.suite.mobilenet import InvertedResidual
from kiln.bench.suite.speech import ConvModule
from kiln.core.compare import compare


class Pointwise(nn.Module):
    """1x1 conv (+ bias) -> ReLU6 -> + residual, and a bias-free 1x1 conv alone."""

    def __init__(self, dims: int, c_in: int, c_out: int) -> None:
        super().__init__()
        conv = nn.Conv1d if dims == 1 else nn.Conv2d
        self.a = conv(c_in, c_out, 1)
        self.b = conv(c_in, c_out, 1, bias=False)

    def forward(self, x: Tensor, r: Tensor) -> tuple[Tensor, Tensor]:
        return F.relu6(self.a(x)) + r, self.b(x)


def _check(model: nn.Module, inputs: tuple[Tensor, ...], templates: dict[str, int]) -> str:
    model.eval()
    compiled = kiln.compile(model, inputs, cache=False)
    with torch.no_grad():
        expected = model(*inputs)
    got = compiled(*inputs)
    for a, e in zip(
        got if isinstance(got, tuple) else (got,),
        expected if isinstance(expected, tuple) else (expected,),
        strict=True,
    ):
        verdict = compare(a, e, 1e-5)
        assert verdict.ok, verdict.detail
    kernels = compiled.report.kernels
    table = compiled.report.kernel_table()
    convs = [k for k in kernels if "conv" in k.primitives]
    assert all(k.executor == "native" for k in convs), table
    for template, n in templates.items():
        assert sum(k.template == template for k in convs) == n, table
    program = compiled.native_program
    assert program is not None
    return program.source


@pytest.mark.parametrize(
    "dims,batch,c_in,c_out,spatial",
    [(1, 1, 16, 40, (37,)), (1, 2, 33, 8, (7,)), (2, 1, 8, 40, (5, 7)), (2, 2, 24, 72, (13, 11))],
)
def test_pointwise_conv_as_gemm(
    dims: int, batch: int, c_in: int, c_out: int, spatial: tuple[int, ...]
) -> None:
    torch.manual_seed(0)
    x = torch.randn(batch, c_in, *spatial)
    _check(Pointwise(dims, c_in, c_out), (x, torch.randn(batch, c_out, *spatial)), {"gemm": 2})


def test_conformer_conv_module_all_native(vector_isa: str) -> None:
    """LN -> 1x1 conv -> GLU -> depthwise conv (31) -> BN -> SiLU -> 1x1 conv -> residual,
    the input time-major (the 1x1 conv reads it transposed)."""
    torch.manual_seed(0)
    module = ConvModule(48, 31)
    randomize_norm_stats(module)
    source = _check(module, (torch.randn(2, 29, 48),), {"gemm": 2, "dwconv": 1})
    assert f"kv::W == {16 if vector_isa == 'avx512' else 8}" in source


def test_inverted_residual_all_native() -> None:
    """MobileNetV2 block: 1x1 expand (ReLU6), 3x3 depthwise (ReLU6), 1x1 project with the
    residual add fused into its GEMM."""
    torch.manual_seed(0)
    block = InvertedResidual(16, 16, 1, 6)
    randomize_norm_stats(block)
    _check(block, (torch.randn(1, 16, 15, 15),), {"gemm": 2, "dwconv": 1})
