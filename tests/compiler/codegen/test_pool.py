"""The ``pool2d`` kernels (``codegen/cpu/pool.py``) against eager PyTorch, on fresh
inputs: max and average pools with overlapping, padded and tiling windows over odd
sizes, on NCHW values and on channels-last ones (in a conv region), in both vector ISAs.
Inputs are all negative where padding is in play, so a max that let the padding in (as
zeros) would show. Several pools share one program, so the C++ builds stay few."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn

import kiln
from kiln.bench.suite._base import randomize_norm_stats
from kiln.compiler.api import CompileOptions, compile_graph
from kiln.compiler.ir.graph import Graph, TensorMeta
from tests.support.compare import assert_close_to_reference

# (mode, kernel, stride, padding)
POOLS = [
    ("max", (3, 3), (2, 2), (1, 1)),
    ("avg", (3, 3), (2, 2), (1, 1)),
    ("max", (2, 2), (2, 2), (0, 0)),
    ("avg", (2, 2), (2, 2), (0, 0)),
    ("max", (3, 3), (1, 1), (1, 1)),
    ("avg", (3, 3), (1, 1), (1, 1)),
    ("max", (3, 2), (1, 2), (1, 0)),
    ("avg", (5, 5), (3, 2), (2, 1)),
]


def _pool_graph(shape: tuple[int, int, int, int], channels_last: bool) -> Graph:
    """Every pool of ``POOLS`` over one input (N, C, H, W), or (N, H, W, C)."""
    g = Graph()
    x = g.add_input("x", TensorMeta(shape, torch.float32))
    n, c, h, w = (shape[0], shape[3], shape[1], shape[2]) if channels_last else shape
    for mode, (kh, kw), (sh, sw), (ph, pw) in POOLS:
        oh, ow = (h + 2 * ph - kh) // sh + 1, (w + 2 * pw - kw) // sw + 1
        out = (n, oh, ow, c) if channels_last else (n, c, oh, ow)
        attrs = {"mode": mode, "kernel": (kh, kw), "stride": (sh, sw), "padding": (ph, pw)}
        attrs["channels_last"] = channels_last
        g.outputs.append(g.add_node("pool2d", (x,), TensorMeta(out, torch.float32), attrs))
    return g


@pytest.mark.parametrize(
    "shape,channels_last",
    [
        ((2, 5, 7, 9), False),  # odd sizes, ragged rows of output vectors
        ((2, 4, 45, 150), False),  # several vector blocks per row; parallel
        ((2, 7, 9, 5), True),  # channels-last: one ragged channel vector
        ((1, 9, 11, 37), True),  # several channel vectors (AVX2: two blocks)
        ((1, 24, 24, 64), True),  # parallel
    ],
)
def test_pool_kernels(
    shape: tuple[int, int, int, int], channels_last: bool, vector_isa: str
) -> None:
    g = _pool_graph(shape, channels_last)
    compiled = compile_graph(g, CompileOptions())
    report = compiled.report
    assert [k.executor for k in report.kernels] == ["native"] * len(POOLS), report.fallbacks
    assert compiled.native_program is not None
    assert f"kv::W == {16 if vector_isa == 'avx512' else 8}" in compiled.native_program.source
    gen = torch.Generator().manual_seed(7)
    negative = -1.0 - torch.rand(shape, generator=gen)  # padding must not win a max
    for x in (negative, torch.randn(shape, generator=gen)):
        nchw = x.permute(0, 3, 1, 2) if channels_last else x
        for node, out in zip(g.nodes, compiled.run_flat([x]), strict=True):
            a = node.attrs
            pool = F.max_pool2d if a["mode"] == "max" else F.avg_pool2d
            eager = pool(nchw, a["kernel"], a["stride"], a["padding"])
            assert_close_to_reference(out, eager.permute(0, 2, 3, 1) if channels_last else eager)


class ConvPools(nn.Module):
    """conv -> 3x3/2 max pool (padded) -> conv -> 3x3/1 average pool (padded) -> conv ->
    2x2/2 max pool (tiling) -> conv; no ReLU, so the pools see negative values."""

    def __init__(self, c: int = 12) -> None:
        super().__init__()
        self.a = nn.Sequential(nn.Conv2d(3, c, 3, padding=1), nn.BatchNorm2d(c))
        self.b = nn.Conv2d(c, c, 3, padding=1)
        self.c = nn.Conv2d(c, 2 * c, 1)
        self.d = nn.Conv2d(2 * c, c, 3, padding=1)

    def forward(self, x: Tensor) -> Tensor:
        y = F.max_pool2d(self.a(x) - 2.0, 3, 2, 1)
        y = F.avg_pool2d(self.b(y), 3, 1, 1)
        return self.d(F.max_pool2d(self.c(y), 2))


@pytest.mark.parametrize("layouts", ["nhwc", "nchw"])
def test_conv_pool_conv(layouts: str, vector_isa: str) -> None:
    """In a channels-last region the pools are members (``pool2d`` on NHWC values): no
    layout conversion inside the region; outside one they run on NCHW values. Every
    kernel but oneDNN's convs is native."""
    torch.manual_seed(0)
    model = ConvPools().eval()
    randomize_norm_stats(model)
    x = torch.randn(2, 3, 15, 19)  # pools to 8x10, 8x10, then 4x5
    compiled = kiln.compile(model, (x,), cache=False, layouts=layouts)  # type: ignore[arg-type]
    assert compiled.program is not None
    graph = compiled.program.graph
    pools = [n.attrs["channels_last"] for n in graph.nodes if n.op == "pool2d"]
    assert pools == [layouts == "nhwc"] * 3
    if layouts == "nhwc":
        permutes = [n for n in graph.nodes if n.op == "permute"]
        assert len(permutes) == 2, graph.summary()  # the image in, the result out
    kernels = compiled.report.kernels
    assert all(k.executor == "native" for k in kernels if "conv" not in k.primitives)
    assert not compiled.report.fallbacks
    for seed in (1, 2):  # fresh inputs
        x = torch.randn(2, 3, 15, 19, generator=torch.Generator().manual_seed(seed))
        with torch.no_grad():
            assert_close_to_reference(compiled(x), model(x))


class Stem(nn.Module):
    """ResNet's stem: 7x7/2 conv, batch norm, ReLU, 3x3/2 max pool with padding 1."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(
            nn.Conv2d(3, 16, 7, 2, 3, bias=False), nn.BatchNorm2d(16), nn.ReLU(),
            nn.MaxPool2d(3, 2, 1),
        )  # fmt: skip

    def forward(self, x: Tensor) -> Tensor:
        return self.body(x)


def test_resnet_stem_runs_without_pytorch() -> None:
    """The stem's padded max pool is a native kernel: no opaque node, no fallback; with
    the region channels-last, no extern either (the stem conv is native too)."""
    torch.manual_seed(0)
    model = Stem().eval()
    randomize_norm_stats(model)
    x = torch.randn(1, 3, 64, 64)
    for layouts in ("auto", "nhwc"):
        compiled = kiln.compile(model, (x,), cache=False, layouts=layouts)  # type: ignore[arg-type]
        assert compiled.program is not None
        assert not any(n.op == "opaque" for n in compiled.program.graph.nodes)
        assert not compiled.report.fallbacks
        kernels = compiled.report.kernels
        table = compiled.report.kernel_table()
        assert [k.executor for k in kernels if "pool2d" in k.primitives] == ["native"], table
        if layouts == "nhwc":
            assert all(k.executor == "native" for k in kernels), table
        fresh = torch.randn(1, 3, 64, 64)
        with torch.no_grad():
            assert_close_to_reference(compiled(fresh), model(fresh))
