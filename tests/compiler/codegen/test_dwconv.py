"""Native depthwise convolutions (the ``dwconv`` template) against eager PyTorch.

Each model holds several depthwise convs side by side (one compiled program per
parametrisation keeps the C++ builds few); every conv must run natively as a ``dwconv``
kernel with its epilogue fused, and the outputs must match eager. The AVX2 code path is
built on an AVX-512 host too (``-mno-avx512f``), like the GGUF kernels' tests.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn

import kiln
from kiln.compiler.fusion.aliases import GraphIndex
from kiln.compiler.fusion.candidates import TemplateRules
from kiln.compiler.ir.graph import Graph, TensorMeta
from kiln.core.compare import compare


def _dw(dims: int, c: int, k: int, stride: int, pad: int | str, dil: int, bias: bool) -> nn.Module:
    conv = nn.Conv1d if dims == 1 else nn.Conv2d
    return conv(c, c, k, stride=stride, padding=pad, dilation=dil, groups=c, bias=bias)


class Branches(nn.Module):
    """Depthwise convs over one input, each with an epilogue, as a tuple of outputs:
    bias + SiLU, + residual (or a clamp), GLU-style gating of a second input, tanh *
    sigmoid gating of two convs, BN + hardswish. ``len(kernels) + 1`` distinct convs."""

    def __init__(self, dims: int, c: int, kernels: list[int], stride: int, pad: str, dil: int):
        super().__init__()

        def p(k: int) -> int | str:  # noqa: E306
            return "same" if pad == "same" else dil * (k - 1) // 2

        self.convs = nn.ModuleList(_dw(dims, c, k, stride, p(k), dil, True) for k in kernels)
        self.gate = _dw(dims, c, kernels[0], stride, p(kernels[0]), dil, False)
        self.bn = nn.BatchNorm1d(c) if dims == 1 else nn.BatchNorm2d(c)
        with torch.no_grad():
            self.bn.running_mean.uniform_(-0.5, 0.5)
            self.bn.running_var.uniform_(0.5, 2.0)
        self.residual = stride == 1

    def forward(self, x: Tensor, g: Tensor) -> tuple[Tensor, ...]:
        outs = []
        for i, conv in enumerate(self.convs):
            y = conv(x)
            if i % 3 == 0:
                y = F.silu(y)
            elif i % 3 == 1:
                y = y + x if self.residual else y.clamp(-0.5, 0.5)
            else:
                y = torch.sigmoid(y) * g  # GLU-style gating of another operand
            outs.append(y)
        a = self.convs[0](x)
        outs.append(torch.tanh(a) * torch.sigmoid(self.gate(x)))  # WaveNet-style gate
        outs.append(F.hardswish(self.bn(self.gate(x))))  # batch norm folded into the conv
        return tuple(outs)


def _check(model: nn.Module, inputs: tuple[Tensor, ...], n_dw: int) -> kiln.CompiledModule:
    model.eval()
    compiled = kiln.compile(model, inputs, cache=False)
    with torch.no_grad():
        expected = model(*inputs)
    got = compiled(*inputs)
    for a, e in zip(got, expected, strict=True):
        verdict = compare(a, e, 1e-5)
        assert verdict.ok, verdict.detail
    table = compiled.report.kernel_table()
    dw = [k for k in compiled.report.kernels if k.template == "dwconv"]
    assert len(dw) == n_dw and all(k.executor == "native" for k in dw), table
    assert not any("conv" in k.primitives for k in compiled.report.kernels if k not in dw), table
    assert all(len(k.primitives) > 1 for k in dw), table  # every epilogue fused
    return compiled


@pytest.mark.parametrize(
    "kernels,stride,pad,dil,width",
    [
        ([3, 5, 7, 15, 31], 1, "same", 1, 100),
        ([3, 5, 7, 15, 31], 1, "sym", 2, 33),
        ([3, 5, 7, 31], 2, "sym", 1, 7),
        ([3, 5, 15], 2, "sym", 2, 100),
    ],
)
def test_dwconv_1d(kernels: list[int], stride: int, pad: str, dil: int, width: int) -> None:
    torch.manual_seed(0)
    model = Branches(1, 12, kernels, stride, pad, dil)
    x = torch.randn(2, 12, width)
    with torch.no_grad():
        g = torch.randn_like(model.convs[0](x))
    _check(model, (x, g), len(kernels) + 1)


@pytest.mark.parametrize(
    "kernels,stride,dil,hw",
    [
        ([3, 5, 7], 1, 1, (9, 33)),
        ([3, 5], 2, 1, (13, 100)),
        ([3, 7], 1, 2, (7, 7)),
        ([3, 5], 2, 2, (20, 17)),
    ],
)
def test_dwconv_2d(kernels: list[int], stride: int, dil: int, hw: tuple[int, int]) -> None:
    torch.manual_seed(0)
    model = Branches(2, 8, kernels, stride, "sym", dil)
    x = torch.randn(1, 8, *hw)
    with torch.no_grad():
        g = torch.randn_like(model.convs[0](x))
    _check(model, (x, g), len(kernels) + 1)


class ConformerConv(nn.Module):
    """The Conformer conv module's core: a time-major input transposed into the conv (a
    strided read), GLU, depthwise conv, batch norm, SiLU, scaled by a per-channel input
    (a broadcast operand in the epilogue)."""

    def __init__(self, c: int, k: int) -> None:
        super().__init__()
        self.dw = nn.Conv1d(c, c, k, padding=k // 2, groups=c)
        self.bn = nn.BatchNorm1d(c)

    def forward(self, x: Tensor, scale: Tensor) -> Tensor:
        y = F.glu(x.transpose(1, 2), dim=1)
        return F.silu(self.bn(self.dw(y))) * scale


def test_dwconv_isas_strided_input_and_broadcast_operand(vector_isa: str) -> None:
    torch.manual_seed(0)
    model = ConformerConv(24, 31)
    compiled = _check(model, (torch.randn(2, 37, 48), torch.randn(2, 24, 1)), 1)
    program = compiled.native_program
    lanes = {"avx512": 16, "avx2": 8}[vector_isa]
    assert program is not None and f"kv::W == {lanes}" in program.source
    assert compiled.report.isa == vector_isa
    torch.manual_seed(1)
    model2 = Branches(2, 4, [3, 5], 2, "sym", 1)
    x = torch.randn(1, 4, 11, 19)
    with torch.no_grad():
        g = torch.randn_like(model2.convs[0](x))
    _check(model2, (x, g), 3)


def test_depthwise_conv_has_both_templates() -> None:
    """A depthwise conv with oneDNN's post-ops may run natively or as oneDNN's call (the
    cost model picks); a dense conv only as oneDNN's."""
    g = Graph()
    x = g.add_input("x", TensorMeta((1, 8, 10, 10), torch.float32))
    out = TensorMeta((1, 8, 10, 10), torch.float32)
    attrs = {"stride": (1, 1), "padding": (1, 1), "dilation": (1, 1)}
    w = g.add_constant("w", torch.randn(8, 1, 3, 3))
    y = g.add_node("conv", (x, w), out, {**attrs, "groups": 8})
    r = g.add_node("relu", (y,), out)
    s = g.add_node("sigmoid", (r,), out)
    wd = g.add_constant("wd", torch.randn(8, 8, 3, 3))
    d = g.add_node("conv", (x, wd), out, {**attrs, "groups": 1})
    g.outputs = [s, d]
    ix = GraphIndex(g)
    rules = TemplateRules(ix)
    assert rules.templates(ix.mask([y])) == ["dwconv", "conv"]
    assert rules.templates(ix.mask([y, r])) == ["dwconv", "conv"]
    assert rules.templates(ix.mask([y, r, s])) == ["dwconv"]  # sigmoid: no oneDNN post-op
    assert rules.templates(ix.mask([d])) == ["conv"]


def test_depthwise_conv_in_a_onednn_chain_stays_there() -> None:
    """On NCHW values (``layouts="nchw"``), next to a conv only oneDNN runs (a dense 3x3
    one), a depthwise conv keeps the channels-last oneDNN chain; next to 1x1 convs
    (native GEMMs) it runs natively."""
    block = nn.Sequential(
        nn.Conv2d(8, 24, 3, padding=1), nn.ReLU6(),
        nn.Conv2d(24, 24, 3, padding=1, groups=24), nn.ReLU6(),
        nn.Conv2d(24, 8, 1),
    ).eval()  # fmt: skip
    x = torch.randn(1, 8, 12, 12)
    compiled = kiln.compile(block, (x,), cache=False, layouts="nchw")
    assert not any(k.template == "dwconv" for k in compiled.report.kernels)
    assert compare(compiled(x), block(x), 1e-5).ok
