"""Lowerings that the decomposition step usually hides (linear, matmul, mv,
scaled addmm), exercised on the un-decomposed export, plus edge cases of the
conversion (outputs that are inputs or parameters, factories)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn

import kiln
from kiln.compiler.capture import capture, fallback_report
from kiln.compiler.capture.export import to_graph
from kiln.compiler.capture.passes import optimize
from kiln.compiler.ir.graph import Graph, ValueKind
from kiln.compiler.ir.semantics import run_graph
from tests.support.compare import assert_close_to_reference


def raw_graph(model: nn.Module, inputs: tuple[Tensor, ...]) -> Graph:
    """Lower the export *without* run_decompositions (CIA ops kept)."""
    with torch.no_grad():
        ep = torch.export.export(model.eval(), inputs)
        graph, _ = to_graph(ep)
        return optimize(graph)


class Products(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(5, 4))
        self.b = nn.Parameter(torch.randn(5))

    def forward(self, x: Tensor, y: Tensor, z: Tensor, v: Tensor) -> tuple[Tensor, ...]:
        a = F.linear(x, self.w, self.b)  # (2, 3, 5)
        b = torch.matmul(y, z)  # (2, 1, 3, 4) @ (3, 4, 2): broadcast batch -> (2, 3, 3, 2)
        c = torch.matmul(x, self.w.t())  # (2, 3, 5)
        d = torch.mv(self.w, v)  # (5,)
        e = torch.addmm(self.b, x[0], self.w.t(), beta=0.5, alpha=2.0)  # (3, 5)
        return a, b, c, d, e


def test_products_lower_to_mm_and_bmm() -> None:
    torch.manual_seed(0)
    model = Products()
    inputs = (torch.randn(2, 3, 4), torch.randn(2, 1, 3, 4), torch.randn(3, 4, 2), torch.randn(4))
    g = raw_graph(model, inputs)
    assert not fallback_report(g)
    ops = [n.op for n in g.nodes]
    assert ops.count("bmm") == 1
    assert ops.count("mm") == 3  # linear and x @ w.t() share one mm after CSE
    for n in g.nodes:
        if n.op == "mm" and n.inputs[1] in g.constants:
            assert g.values[n.inputs[1]].kind == ValueKind.PARAM
            assert g.constants[n.inputs[1]].is_contiguous()
    with torch.no_grad():
        expected = model(*inputs)
    assert_close_to_reference(tuple(run_graph(g, list(inputs))), expected)


class Passthrough(nn.Module):
    """Outputs that are an input, a parameter, a repeated value and a factory."""

    def __init__(self) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.randn(3))

    def forward(self, x: Tensor) -> tuple[Tensor, ...]:
        y = x * self.scale
        return x, self.scale, y, y, torch.zeros(2, 3) + torch.full((3,), 2.5)


def test_passthrough_outputs_and_factories() -> None:
    model = Passthrough()
    x = torch.randn(2, 3)
    result = capture(model, (x,))
    g = result.graph
    assert g.outputs[0] == "x"
    assert g.values[g.outputs[1]].kind == ValueKind.PARAM
    assert g.outputs[2] == g.outputs[3]
    assert g.outputs[4] in g.constants  # the factory arithmetic folds away
    with torch.no_grad():
        expected = model(x)
    assert_close_to_reference(result.unflatten(run_graph(g, [x])), expected)


class Stats(nn.Module):
    def forward(self, x: Tensor) -> tuple[Tensor, ...]:  # (4, 6)
        return (
            x.var(0),
            x.var(-1, keepdim=True, correction=0),
            x.std(1),
            torch.logsumexp(x, dim=1),
            x.sum(),
            x.amin(0),
            x.max(),
            (x > 0).any(-1),
            torch.linalg.vector_norm(x, dim=-1),
        )


def test_statistics_are_primitive() -> None:
    x = torch.randn(4, 6) * 3 + 1
    result = capture(Stats(), (x,))
    assert not result.fallbacks
    assert_close_to_reference(result.unflatten(run_graph(result.graph, [x])), Stats()(x))


def test_gelu_tanh_and_exact_match_torch_over_a_wide_range() -> None:
    class Gelus(nn.Module):
        def forward(self, x: Tensor) -> tuple[Tensor, Tensor]:
            return F.gelu(x), F.gelu(x, approximate="tanh")

    x = torch.linspace(-8, 8, 1001)
    result = capture(Gelus(), (x,))
    assert_close_to_reference(result.unflatten(run_graph(result.graph, [x])), Gelus()(x))


class Pads(nn.Module):
    def forward(self, x: Tensor, m: Tensor) -> tuple[Tensor, ...]:  # x (2, 3, 5, 7) float, m bool
        return (
            F.pad(x, (4, 0)),  # a causal conv's left pad
            F.pad(x, (1, 2, 3, 0), value=-1.5),  # two dims, a fill value
            F.pad(x, (-2, 1, 0, -1)),  # crops and pads together
            F.pad(m, (1, 1), value=True),  # a bool tensor
        )


def test_constant_pad_lowers_to_slices_and_cats_natively() -> None:
    torch.manual_seed(0)
    inputs = (torch.randn(2, 3, 5, 7), torch.rand(2, 3) > 0.5)
    result = capture(Pads(), inputs)
    assert not fallback_report(result.graph)
    assert "cat" in [n.op for n in result.graph.nodes]
    with torch.no_grad():
        expected = Pads()(*inputs)
    got = result.unflatten(run_graph(result.graph, list(inputs)))
    for g, e in zip(got, expected, strict=True):
        assert torch.equal(g, e)  # pure data movement: exact
    compiled = kiln.compile(Pads(), inputs)
    assert all(k.executor == "native" for k in compiled.report.kernels)
    for g, e in zip(compiled(*inputs), expected, strict=True):
        assert torch.equal(g, e)


@pytest.mark.parametrize(
    "module,shape",
    [
        (nn.ConvTranspose2d(48, 20, 2, stride=2), (2, 48, 6, 7)),  # a U-Net's upsampling
        (nn.ConvTranspose1d(40, 12, 3, stride=3, bias=False), (1, 40, 9)),
    ],
)
def test_non_overlapping_transposed_conv_is_a_native_gemm(
    module: nn.Module, shape: tuple[int, ...]
) -> None:
    torch.manual_seed(0)
    module.eval()
    x = torch.randn(shape)
    compiled = kiln.compile(module, (x,))
    assert not compiled.report.fallbacks
    assert any(k.template == "gemm" for k in compiled.report.kernels)
    with torch.no_grad():
        assert_close_to_reference(compiled(x), module(x), rtol_to_max=1e-5)


def test_overlapping_transposed_conv_falls_back_with_the_reason() -> None:
    module = nn.ConvTranspose2d(8, 4, 3, stride=2, padding=1).eval()
    x = torch.randn(1, 8, 5, 5)
    compiled = kiln.compile(module, (x,))
    assert [f.reason for f in compiled.report.fallbacks] == [
        "transposed convolution with overlapping tiles, padding or groups"
    ]
    with torch.no_grad():
        assert_close_to_reference(compiled(x), module(x), rtol_to_max=1e-5)


class Upsamples(nn.Module):
    """Nearest upsampling by whole factors (2x, and 3 x 2 given as an output size), and a
    bilinear one kiln leaves to PyTorch."""

    def forward(self, x: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        return (
            F.interpolate(x, scale_factor=2.0, mode="nearest"),
            F.interpolate(x, size=(3 * x.shape[2], 2 * x.shape[3]), mode="nearest"),
            F.interpolate(x, scale_factor=2.0, mode="bilinear"),
        )


def test_nearest_upsampling_is_two_native_index_selects() -> None:
    x = torch.randn(2, 5, 6, 7)
    result = capture(Upsamples(), (x,))
    ops = [n.op for n in result.graph.nodes]
    assert ops.count("index_select") == 4 and ops.count("opaque") == 1  # bilinear: torch
    with torch.no_grad():
        expected = Upsamples()(x)
    got = result.unflatten(run_graph(result.graph, [x]))
    for g, e in zip(got[:2], expected[:2], strict=True):
        assert torch.equal(g, e)  # pure data movement: exact
    compiled = kiln.compile(Upsamples(), (x,))
    assert [f.op for f in compiled.report.fallbacks] == ["aten.upsample_bilinear2d.vec"]
    for g, e in zip(compiled(x), expected, strict=True):
        assert_close_to_reference(g, e, rtol_to_max=1e-6)
