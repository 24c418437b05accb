"""The channels-last pass (``capture/channels_last.py``): regions, the rewrite checked
against ``run_graph`` of the captured graph, conversions only at region borders, and
conv-free graphs left alone."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from kiln.bench.suite._base import randomize_norm_stats
from kiln.bench.suite.mobilenet import InvertedResidual
from kiln.bench.suite.speech import ConvModule
from kiln.compiler.capture import capture
from kiln.compiler.capture.channels_last import find_regions, to_channels_last
from kiln.compiler.capture.passes import for_cpu_backend
from kiln.compiler.fusion.layouts import choose_layouts
from kiln.compiler.ir.graph import Graph
from kiln.compiler.ir.semantics import run_graph
from tests.support.compare import assert_close_to_reference


def _graph(model: nn.Module, *inputs: Tensor) -> Graph:
    model.eval()
    randomize_norm_stats(model)
    return for_cpu_backend(capture(model, inputs).graph)


def _rewrite_matches(model: nn.Module, *inputs: Tensor) -> Graph:
    """The graph with every region channels-last; asserts it computes what the captured
    graph does, and returns it."""
    g = _graph(model, *inputs)
    regions = find_regions(g)
    assert regions
    cl = to_channels_last(g, regions)
    with torch.no_grad():
        assert_close_to_reference(run_graph(cl, list(inputs)), run_graph(g, list(inputs)))
    convs = [n for n in cl.nodes if n.op == "conv"]
    assert convs and all(n.attrs.get("channels_last") for n in convs)
    return cl


class Head(nn.Module):
    """Conv stem, a residual 3x3 block, BN + ReLU6, then flatten -> Linear (the region's
    output leaves it through a view), and a global average pool as a second output."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Conv2d(3, 12, 3, stride=2, padding=1)
        self.a = nn.Conv2d(12, 12, 3, padding=1)
        self.bn = nn.BatchNorm2d(12)
        self.fc = nn.Linear(12 * 5 * 5, 10)

    def forward(self, x: Tensor) -> tuple[Tensor, Tensor]:
        y = F.relu(self.stem(x))
        y = F.relu6(self.bn(self.a(y)) + y)
        return self.fc(y.flatten(1)), y.mean(dim=(2, 3))


class Styled(nn.Module):
    """Reflection padding (index_select along H and W), instance norm (reductions over
    H, W with per-(N, C) statistics), a channel cat and a channel slice."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(4, 8, 3)
        self.norm = nn.InstanceNorm2d(8, affine=True)
        self.conv2 = nn.Conv2d(12, 6, 1)

    def forward(self, x: Tensor) -> Tensor:
        y = F.relu(self.norm(self.conv(F.pad(x, (1, 1, 1, 1), mode="reflect"))))
        y = torch.cat([y, x], dim=1)
        return self.conv2(y)[:, 2:5] * 2.0


class Tcn(nn.Module):
    """1-D convs: dilated causal conv (left pad by cat), GLU over channels, residual."""

    def __init__(self, c: int) -> None:
        super().__init__()
        self.conv = nn.Conv1d(c, 2 * c, 3, dilation=2)
        self.out = nn.Conv1d(c, c, 1)

    def forward(self, x: Tensor) -> Tensor:
        y = F.glu(self.conv(F.pad(x, (4, 0))), dim=1)
        return x + self.out(y)


@pytest.mark.parametrize(
    "make,shape",
    [
        (lambda: InvertedResidual(16, 16, 1, 6), (2, 16, 9, 11)),
        (lambda: InvertedResidual(16, 24, 2, 6), (1, 16, 12, 12)),
        (Head, (2, 3, 10, 10)),
        (Styled, (1, 4, 9, 7)),
        (lambda: Tcn(6), (2, 6, 17)),
    ],
)
def test_rewrite_computes_the_same(make: type[nn.Module], shape: tuple[int, ...]) -> None:
    torch.manual_seed(0)
    _rewrite_matches(make(), torch.randn(*shape))


def test_conversions_only_at_region_borders() -> None:
    """A MobileNetV2 block converts its input once and its output once; inside, every
    value is (N, H, W, C) and nothing else moves data."""
    torch.manual_seed(0)
    cl = _rewrite_matches(InvertedResidual(8, 8, 1, 6), torch.randn(1, 8, 6, 6))
    moves = [n.op for n in cl.nodes if n.op in ("permute", "copy")]
    assert moves == ["permute", "copy", "permute", "copy"], cl.summary()
    for n in cl.nodes:
        if n.op in ("conv", "maximum", "minimum", "add"):
            assert cl.meta(n.output).shape in ((1, 6, 6, 8), (1, 6, 6, 48)), cl.summary()


def test_per_channel_constants_become_vectors() -> None:
    """A per-channel scale that is not folded into a conv (it follows a residual add) is a
    (C,) vector channels-last, broadcast along the last dim."""
    torch.manual_seed(0)
    scale = torch.rand(1, 6, 1, 1) + 0.5

    class Scaled(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.conv = nn.Conv2d(6, 6, 3, padding=1, groups=6)

        def forward(self, x: Tensor) -> Tensor:
            return (self.conv(x) + x) * scale

    cl = _rewrite_matches(Scaled(), torch.randn(2, 6, 5, 7))
    muls = [n for n in cl.nodes if n.op == "mul"]
    assert [cl.meta(v).shape for v in muls[0].inputs] == [(2, 5, 7, 6), (6,)]


def test_transposes_around_a_region_cancel() -> None:
    """The Conformer conv module transposes (B, T, d) into its convs and back: channels-last,
    both transposes cancel with the conversions, and no data is moved at all."""
    torch.manual_seed(0)
    cl = _rewrite_matches(ConvModule(12, 7), torch.randn(2, 9, 12))
    assert not [n for n in cl.nodes if n.op in ("permute", "copy")], cl.summary()


class Cumsum(nn.Module):
    """Two convs around a cumulative sum along W (an opaque call the pass has no rule for)."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Conv2d(3, 8, 3, padding=1), nn.Conv2d(8, 8, 3, padding=1)

    def forward(self, x: Tensor) -> Tensor:
        return self.b(torch.cumsum(F.relu(self.a(x)), dim=3))


def test_regions_split_at_ops_without_layout_rules() -> None:
    """An op the pass cannot remap (here an opaque cumsum) separates two regions."""
    torch.manual_seed(0)
    g = _graph(Cumsum(), torch.randn(1, 3, 8, 8))
    assert [len(r.convs) for r in find_regions(g)] == [1, 1]
    _rewrite_matches(Cumsum(), torch.randn(1, 3, 8, 8))


def test_pools_and_upsampling_join_the_region() -> None:
    """Max pool, average pool and upsampling run as ATen calls that follow the memory
    format: inside a region they are fed the channels-last view, no conversion around
    (and the 3-channel image enters the stem conv as a view, read in place)."""
    model = nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), nn.MaxPool2d(3, 2, 1),
        nn.Conv2d(8, 8, 3, padding=1), nn.AvgPool2d(3, 2, 1), nn.Upsample(scale_factor=2.0),
        nn.Conv2d(8, 4, 1), nn.Upsample(scale_factor=2.0, mode="bilinear"),
    )  # fmt: skip
    torch.manual_seed(0)
    g = _graph(model, torch.randn(2, 3, 12, 10))
    assert [len(r.convs) for r in find_regions(g)] == [3]
    cl = _rewrite_matches(model, torch.randn(2, 3, 12, 10))
    moves = [n.op for n in cl.nodes if n.op in ("permute", "copy")]
    assert moves == ["permute", "permute", "copy"], cl.summary()


def test_tiling_max_pools_join_the_region() -> None:
    """2x2/2 max pools (a U-Net encoder's, the second over an odd width) are ``pool2d``
    nodes that compute channels-last in the region: no conversion around them."""
    model = nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
        nn.Conv2d(8, 8, 3, padding=1), nn.MaxPool2d(2), nn.Conv2d(8, 4, 1),
    )  # fmt: skip
    torch.manual_seed(0)
    g = _graph(model, torch.randn(2, 3, 12, 18))
    assert [len(r.convs) for r in find_regions(g)] == [3]
    cl = _rewrite_matches(model, torch.randn(2, 3, 12, 18))
    pools = [(n.attrs["kernel"], n.attrs["channels_last"]) for n in cl.nodes if n.op == "pool2d"]
    assert pools == [((2, 2), True)] * 2
    permutes = [n for n in cl.nodes if n.op == "permute"]
    assert len(permutes) == 2, cl.summary()  # the image in, the result out


class UpSkip(nn.Module):
    """A U-Net decoder step: 2x2 stride-2 transposed conv (bias), concatenated with the
    encoder's features at that scale, then a 3x3 conv."""

    def __init__(self) -> None:
        super().__init__()
        self.enc = nn.Conv2d(3, 6, 3, padding=1)
        self.down = nn.Conv2d(6, 12, 3, stride=2, padding=1)
        self.up = nn.ConvTranspose2d(12, 6, 2, stride=2)
        self.dec = nn.Conv2d(12, 4, 3, padding=1)

    def forward(self, x: Tensor) -> Tensor:
        e = F.relu(self.enc(x))
        return self.dec(torch.cat([self.up(F.relu(self.down(e))), e], dim=1))


def test_transposed_conv_spreads_its_tiles_with_one_copy() -> None:
    """Inside a region the upsampling's 1x1 conv computes (N, H, W, 2*2*C) tap-major, so
    spreading each pixel over its 2x2 tile is the one copy: no conversion to NCHW and back
    around it (the channel-major lowering took three)."""
    torch.manual_seed(0)
    g = _graph(UpSkip(), torch.randn(2, 3, 8, 10))
    assert [len(r.convs) for r in find_regions(g)] == [4]
    cl = _rewrite_matches(UpSkip(), torch.randn(2, 3, 8, 10))
    copies = [n for n in cl.nodes if n.op == "copy"]
    # the spreading, and the result's conversion out (the stem reads the image in place)
    shapes = [cl.meta(n.output).shape for n in copies]
    assert shapes == [(2, 4, 2, 5, 2, 6), (2, 4, 8, 10)], cl.summary()  # (N, H, kh, W, kw, C)


def test_conv_free_graph_is_unchanged() -> None:
    model = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.LayerNorm(32), nn.Linear(32, 4))
    g = _graph(model, torch.randn(5, 16))
    assert find_regions(g) == []
    assert to_channels_last(g, []) is g

    def never(_: Graph) -> float:
        raise AssertionError("no region: nothing to decide")

    choice = choose_layouts(g, never)
    assert choice.graph is g and choice.notes == []


def test_choice_follows_the_objective() -> None:
    """``auto`` converts a region only when the objective predicts a gain; ``nchw`` and
    ``nhwc`` override, and every decision is noted."""
    torch.manual_seed(0)
    g = _graph(InvertedResidual(8, 8, 1, 6), torch.randn(1, 8, 6, 6))

    def prefers_nhwc(graph: Graph) -> float:
        return 50.0 if any(n.attrs.get("channels_last") for n in graph.nodes) else 100.0

    def prefers_nchw(graph: Graph) -> float:
        return 150.0 - prefers_nhwc(graph)

    on = choose_layouts(g, prefers_nhwc)
    assert any(n.attrs.get("channels_last") for n in on.graph.nodes)
    assert len(on.notes) == 1 and on.notes[0].startswith("layout: NHWC")
    off = choose_layouts(g, prefers_nchw)
    assert off.graph is not None and off.notes[0].startswith("layout: NCHW")
    assert not any(n.attrs.get("channels_last") for n in off.graph.nodes)
    assert choose_layouts(g, prefers_nhwc, "nchw").graph is g
    forced = choose_layouts(g, prefers_nchw, "nhwc").graph
    assert any(n.attrs.get("channels_last") for n in forced.nodes)
