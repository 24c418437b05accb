"""Channels-last convolution kernels against eager PyTorch: depthwise (``dwconv_nhwc.py``),
1x1 as a GEMM with a packed constant weight (``pointconv.py``), dense direct convs
(``conv_nhwc.py``, the ``dconv`` template) and oneDNN's NHWC call, each with its epilogue
fused, in models compiled with every conv region channels-last (``layouts="nhwc"``).
Several convs share one model, so the C++ builds stay few."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn

import kiln
from kiln.bench.suite._base import randomize_norm_stats
from kiln.bench.suite.mobilenet import InvertedResidual
from kiln.compiler.api import CompileOptions, compile_graph
from kiln.compiler.fusion.program import Kernel
from kiln.compiler.ir.graph import Graph, TensorMeta
from kiln.compiler.ir.semantics import run_graph
from tests.support.compare import assert_close_to_reference


def _compile(model: nn.Module, *inputs: Tensor, natively: bool = True) -> kiln.CompiledModule:
    """Compile channels-last and check against eager; every conv must run natively (or,
    unless ``natively``, through oneDNN's NHWC call, where the cost model prefers it)."""
    model.eval()
    randomize_norm_stats(model)
    compiled = kiln.compile(model, inputs, cache=False, layouts="nhwc")
    with torch.no_grad():
        expected = model(*inputs)
    assert_close_to_reference(compiled(*inputs), expected)
    table = compiled.report.kernel_table()
    convs = [k for k in compiled.report.kernels if "conv" in k.primitives]
    allowed = ("native",) if natively else ("native", "extern")
    assert convs and all(k.executor in allowed for k in convs), table
    assert any("layout: NHWC" in note for note in compiled.report.notes)
    return compiled


def _templates(compiled: kiln.CompiledModule) -> list[str]:
    return [k.template for k in compiled.report.kernels if "conv" in k.primitives]


class Depthwise(nn.Module):
    """Depthwise convs side by side over one input: + bias + ReLU6, + a residual (or a
    clamp), SiLU gated by the first one's output; ``c`` channels (ragged vector tails
    when not a multiple of the vector width)."""

    def __init__(self, dims: int, c: int, k: int, stride: int, dil: int) -> None:
        super().__init__()
        conv = nn.Conv1d if dims == 1 else nn.Conv2d
        pad = dil * (k - 1) // 2
        self.a = conv(c, c, k, stride=stride, padding=pad, dilation=dil, groups=c)
        self.b = conv(c, c, k, stride=stride, padding=pad, dilation=dil, groups=c, bias=False)
        self.c = conv(c, c, k, stride=stride, padding=pad, dilation=dil, groups=c)
        self.residual = stride == 1

    def forward(self, x: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        a = F.relu6(self.a(x))
        b = self.b(x) + x if self.residual else self.b(x).clamp(-0.5, 0.5)
        return a, b, F.silu(self.c(x)) * a


@pytest.mark.parametrize(
    "dims,c,k,stride,dil,spatial",
    [
        (2, 24, 3, 1, 1, (9, 13)),
        (2, 40, 3, 2, 1, (14, 15)),
        (2, 7, 5, 1, 2, (11, 8)),
        (2, 33, 5, 2, 2, (17, 17)),
        (1, 20, 31, 1, 1, (40,)),
        (1, 16, 3, 2, 3, (23,)),
    ],
)
def test_depthwise_nhwc(
    dims: int, c: int, k: int, stride: int, dil: int, spatial: tuple[int, ...]
) -> None:
    torch.manual_seed(0)
    compiled = _compile(Depthwise(dims, c, k, stride, dil), torch.randn(2, c, *spatial))
    assert _templates(compiled) == ["dwconv"] * 3, compiled.report.kernel_table()
    assert all(len(k.primitives) > 1 for k in compiled.report.kernels if k.template == "dwconv")


def test_depthwise_nhwc_isas(vector_isa: str) -> None:
    """The AVX2 code path too (8 lanes: other tails and register blocks)."""
    torch.manual_seed(0)
    compiled = _compile(Depthwise(2, 21, 3, 2, 1), torch.randn(1, 21, 10, 9))
    source = compiled.native_program.source if compiled.native_program else ""
    assert f"kv::W == {16 if vector_isa == 'avx512' else 8}" in source


class Pointwise(nn.Module):
    """1x1 conv + bias -> ReLU6 -> + residual, and a bias-free 1x1 conv."""

    def __init__(self, dims: int, c_in: int, c_out: int) -> None:
        super().__init__()
        conv = nn.Conv1d if dims == 1 else nn.Conv2d
        self.a = conv(c_in, c_out, 1)
        self.b = conv(c_in, c_out, 1, bias=False)

    def forward(self, x: Tensor, r: Tensor) -> tuple[Tensor, Tensor]:
        return F.relu6(self.a(x)) + r, self.b(x)


@pytest.mark.parametrize(
    "dims,batch,c_in,c_out,spatial",
    [(2, 1, 16, 40, (5, 7)), (2, 2, 33, 8, (6, 6)), (1, 2, 12, 20, (19,))],
)
def test_pointwise_nhwc_is_a_gemm_with_a_packed_weight(
    dims: int, batch: int, c_in: int, c_out: int, spatial: tuple[int, ...]
) -> None:
    torch.manual_seed(0)
    x, r = torch.randn(batch, c_in, *spatial), torch.randn(batch, c_out, *spatial)
    compiled = _compile(Pointwise(dims, c_in, c_out), x, r)
    assert _templates(compiled) == ["gemm", "gemm"], compiled.report.kernel_table()
    source = compiled.native_program.source if compiled.native_program else ""
    assert "kg::pack_b(" not in source  # the weight is packed at compile time, nothing per call


class Dense(nn.Module):
    """Dense convs, channels-last: a 3-channel 3x3 stride-2 stem (+ReLU), a dilated 3x3
    with a residual add, a 1x1 stride-2 projection, a 5x5 to a ragged channel count."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Conv2d(3, 32, 3, stride=2, padding=1)
        self.mid = nn.Conv2d(32, 32, 3, padding=2, dilation=2)
        self.down = nn.Conv2d(32, 48, 1, stride=2)
        self.ragged = nn.Conv2d(48, 21, 5, padding=1, bias=False)

    def forward(self, x: Tensor) -> tuple[Tensor, Tensor]:
        y = F.relu(self.stem(x))
        y = F.relu(self.mid(y) + y)
        d = self.down(y)
        return d, torch.tanh(self.ragged(d))


def test_dense_nhwc_model(vector_isa: str) -> None:
    torch.manual_seed(0)
    compiled = _compile(Dense(), torch.randn(2, 3, 17, 19), natively=False)
    assert "dconv" in _templates(compiled), compiled.report.kernel_table()


@pytest.mark.parametrize(
    "c_in,c_out,hw,k,stride,pad,dil,image",
    [
        (3, 32, (17, 19), (3, 3), 2, 1, 1, True),  # a stem reading the NCHW image in place
        (3, 20, (23, 16), (7, 7), 2, 3, 1, True),
        (16, 21, (9, 11), (3, 3), 1, 2, 2, False),  # ragged C_out, dilation
        (24, 40, (8, 7), (1, 1), 2, 0, 1, False),  # 1x1 stride 2 (not a GEMM)
        (5, 9, (1, 30), (1, 5), 1, 2, 1, False),  # 1-D as one row
        # few outputs (conv_narrow: vectorised along C_in): an RGB output layer's 9x9,
        # one output at stride 2, dilation, 1-D
        (32, 3, (12, 13), (9, 9), 1, 4, 1, False),
        (16, 1, (9, 11), (3, 3), 2, 1, 1, False),
        (48, 4, (7, 10), (3, 3), 1, 2, 2, False),
        (16, 2, (1, 30), (1, 5), 1, 2, 1, False),
    ],
)
def test_dense_nhwc_kernel(
    c_in: int,
    c_out: int,
    hw: tuple[int, int],
    k: tuple[int, int],
    stride: int,
    pad: int,
    dil: int,
    image: bool,
    vector_isa: str,
) -> None:
    """The ``dconv`` template alone (forced: the cost model may prefer oneDNN for some
    shapes): conv + bias, then a residual-style add of a per-channel constant and ReLU;
    with few outputs and whole vectors of inputs, the narrow kernel."""
    torch.manual_seed(0)
    g = Graph()
    n, (h, w) = 2, hw
    if image:  # the NCHW image, read in place through the channels-last view
        src = g.add_input("img", TensorMeta((n, c_in, h, w), torch.float32))
        x = g.add_node("permute", (src,), TensorMeta((n, h, w, c_in), torch.float32),
                       {"dims": (0, 2, 3, 1)}, name="x")  # fmt: skip
    else:
        x = g.add_input("x", TensorMeta((n, h, w, c_in), torch.float32))
    oh = (h + 2 * (pad if k[0] > 1 else 0) - dil * (k[0] - 1) - 1) // (
        stride if k[0] > 1 else 1
    ) + 1
    ow = (w + 2 * pad - dil * (k[1] - 1) - 1) // stride + 1
    out = TensorMeta((n, oh, ow, c_out), torch.float32)
    attrs = {
        "stride": (stride if k[0] > 1 else 1, stride),
        "padding": (pad if k[0] > 1 else 0, pad),
        "dilation": (dil if k[0] > 1 else 1, dil),
        "groups": 1,
        "channels_last": True,
    }
    wt = g.add_constant("w", torch.randn(c_out, c_in, *k) / (c_in * k[0] * k[1]) ** 0.5)
    b, shift = g.add_constant("b", torch.randn(c_out)), g.add_constant("s", torch.randn(c_out))
    y = g.add_node("conv", (x, wt, b), out, attrs, name="c")
    y = g.add_node("add", (y, shift), out, name="a")
    g.outputs = [g.add_node("relu", (y,), out, name="r")]
    kernel = Kernel("dconv", ("c", "a", "r"), tuple(g.outputs), (g.inputs[0],))
    compiled = compile_graph(g, CompileOptions(), kernels=[kernel])
    assert compiled.report.kernels[0].executor == "native", compiled.report.fallbacks
    source = compiled.native_program.source if compiled.native_program else ""
    narrow = c_out <= 4 and c_in % (16 if vector_isa == "avx512" else 8) == 0
    assert ("conv_narrow emitted" in source) == narrow
    inputs = [torch.randn(g.meta(g.inputs[0]).shape)]
    assert_close_to_reference(compiled.run_flat(inputs), run_graph(g, inputs))


def test_dense_nhwc_1d() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv1d(5, 24, 7, padding=3), nn.ReLU(), nn.Conv1d(24, 9, 3, stride=2))
    compiled = _compile(model, torch.randn(2, 5, 30))
    assert _templates(compiled) == ["dconv", "dconv"], compiled.report.kernel_table()


class UnevenPads(nn.Module):
    """Convs after explicit zero pads, each folded into its conv as uneven padding: a
    causal dilated 1-D conv, a TF-style "same" stride-2 conv (one zero after), a narrow
    conv (2 outputs over 16 inputs), and an uneven depthwise one."""

    def __init__(self, dims: int) -> None:
        super().__init__()
        conv = nn.Conv1d if dims == 1 else nn.Conv2d
        self.dims = dims
        self.causal = conv(16, 24, 3, dilation=2)
        self.strided = conv(24, 16, 3, stride=2)
        self.narrow = conv(16, 2, 3)
        self.depthwise = conv(16, 16, 3, groups=16)

    def _pad(self, x: Tensor, before: int, after: int) -> Tensor:
        return F.pad(x, (before, after) * self.dims)

    def forward(self, x: Tensor) -> tuple[Tensor, Tensor]:
        y = F.relu(self.causal(self._pad(x, 4, 0)))
        y = self.strided(self._pad(y, 0, 1))
        z = self.depthwise(self._pad(y, 2, 1)) + self.narrow(self._pad(y, 1, 2)).sum(1, True)
        return y, z


@pytest.mark.parametrize("dims", [1, 2])
def test_uneven_padding_runs_natively(dims: int) -> None:
    torch.manual_seed(0)
    x = torch.randn(1, 16, *([19] * dims))
    compiled = _compile(UnevenPads(dims), x)
    assert compiled.program is not None
    convs = [n for n in compiled.program.graph.nodes if n.op == "conv"]
    assert sum("padding_end" in n.attrs for n in convs) == 4
    assert "cat" not in [n.op for n in compiled.program.graph.nodes]


class Reflected(nn.Module):
    """Style-transfer-like convs after reflection pads, folded into each conv: a 9x9 stem
    reading the NCHW image in place, a stride-2 3x3, an uneven 3x3 and a narrow 9x9 back
    to 3 channels (the ``conv_narrow`` kernel)."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Conv2d(3, 16, 9)
        self.down = nn.Conv2d(16, 32, 3, stride=2)
        self.uneven = nn.Conv2d(32, 16, 3)
        self.out = nn.Conv2d(16, 3, 9)

    def forward(self, x: Tensor) -> Tensor:
        y = F.relu(self.stem(F.pad(x, (4, 4, 4, 4), mode="reflect")))
        y = F.relu(self.down(F.pad(y, (1, 1, 1, 1), mode="reflect")))
        y = F.relu(self.uneven(F.pad(y, (2, 0, 1, 1), mode="reflect")))
        y = F.interpolate(y, scale_factor=2.0, mode="nearest")
        return self.out(F.pad(y, (4, 4, 4, 4), mode="reflect"))


def test_reflection_padding_runs_natively(vector_isa: str) -> None:
    torch.manual_seed(0)
    compiled = _compile(Reflected(), torch.randn(1, 3, 21, 19))
    assert compiled.program is not None
    convs = [n for n in compiled.program.graph.nodes if n.op == "conv"]
    assert [n.attrs.get("padding_mode") for n in convs] == ["reflect"] * 4
    assert _templates(compiled) == ["dconv"] * 4, compiled.report.kernel_table()
    source = compiled.native_program.source if compiled.native_program else ""
    assert "conv_narrow emitted" in source


def test_uneven_padding_in_nchw() -> None:
    # Captured layout: the depthwise conv natively, oneDNN's call refuses uneven pads
    # (the dense convs run through PyTorch instead), the result still eager's.
    torch.manual_seed(0)
    model = UnevenPads(2).eval()
    x = torch.randn(2, 16, 13, 13)
    compiled = kiln.compile(model, (x,), cache=False, layouts="nchw")
    assert_close_to_reference(compiled(x), model(x))
    assert "dwconv" in _templates(compiled), compiled.report.kernel_table()


def test_onednn_nhwc_call() -> None:
    """A channels-last conv kernel run by oneDNN (the ``conv`` template: conv + bias + ReLU6
    in one call) matches the IR's meaning."""
    torch.manual_seed(0)
    g = Graph()
    x = g.add_input("x", TensorMeta((2, 9, 11, 8), torch.float32))
    w, b = g.add_constant("w", torch.randn(16, 8, 3, 3)), g.add_constant("b", torch.randn(16))
    lo, hi = g.add_constant("lo", torch.tensor(0.0)), g.add_constant("hi", torch.tensor(6.0))
    out = TensorMeta((2, 5, 6, 16), torch.float32)
    attrs = {"stride": (2, 2), "padding": (1, 1), "dilation": (1, 1), "groups": 1}
    y = g.add_node("conv", (x, w, b), out, {**attrs, "channels_last": True}, name="c")
    y1 = g.add_node("maximum", (y, lo), out, name="lo_")
    y2 = g.add_node("minimum", (y1, hi), out, name="hi_")
    g.outputs = [y2]
    kernel = Kernel("conv", ("c", "lo_", "hi_"), (y2,), (x,))
    compiled = compile_graph(g, CompileOptions(), kernels=[kernel])
    inputs = [torch.randn(2, 9, 11, 8)]
    assert compiled.report.kernels[0].executor == "extern"
    assert_close_to_reference(compiled.run_flat(inputs), run_graph(g, inputs))


def test_mobilenet_block_all_native() -> None:
    """MobileNetV2 inverted residual: 1x1 expand + ReLU6, 3x3 depthwise + ReLU6, 1x1
    project + residual, all native channels-last kernels with their epilogues fused."""
    torch.manual_seed(0)
    compiled = _compile(InvertedResidual(24, 24, 1, 6), torch.randn(1, 24, 14, 14))
    assert _templates(compiled) == ["gemm", "dwconv", "gemm"], compiled.report.kernel_table()


class Classifier(nn.Module):
    """A conv region whose output leaves it through flatten -> Linear (converted back to
    NCHW order) and through a global average pool."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(
            nn.Conv2d(3, 16, 3, stride=2, padding=1), nn.BatchNorm2d(16), nn.ReLU6(),
            nn.Conv2d(16, 16, 3, padding=1, groups=16), nn.ReLU6(), nn.Conv2d(16, 8, 1),
        )  # fmt: skip
        self.fc = nn.Linear(8 * 6 * 5, 10)

    def forward(self, x: Tensor) -> tuple[Tensor, Tensor]:
        y = self.body(x)
        return self.fc(y.flatten(1)), y.mean(dim=(2, 3))


def test_region_output_feeds_flatten_and_linear() -> None:
    torch.manual_seed(0)
    _compile(Classifier(), torch.randn(2, 3, 12, 10))


class Tcn(nn.Module):
    """A 1-D conv model: causal dilated depthwise conv, GLU over channels, 1x1 convs."""

    def __init__(self, c: int) -> None:
        super().__init__()
        self.inp = nn.Conv1d(c, 2 * c, 1)
        self.dw = nn.Conv1d(c, c, 3, dilation=2, groups=c)
        self.out = nn.Conv1d(c, c, 1)

    def forward(self, x: Tensor) -> Tensor:
        y = F.glu(self.inp(x), dim=1)
        y = F.silu(self.dw(F.pad(y, (4, 0))))
        return x + self.out(y)


def test_1d_conv_model() -> None:
    torch.manual_seed(0)
    compiled = _compile(Tcn(20), torch.randn(2, 20, 33))
    assert sorted(_templates(compiled)) == ["dwconv", "gemm", "gemm"], (
        compiled.report.kernel_table()
    )


def test_layouts_option() -> None:
    """``layouts="nchw"`` compiles the graph as captured; ``auto`` notes its decision."""
    torch.manual_seed(0)
    block = InvertedResidual(16, 16, 1, 6).eval()
    x = torch.randn(1, 16, 10, 10)
    plain = kiln.compile(block, (x,), cache=False, layouts="nchw")
    assert plain.program is not None
    assert not any(n.attrs.get("channels_last") for n in plain.program.graph.nodes)
    auto = kiln.compile(block, (x,), cache=False)
    assert any(note.startswith("layout: ") for note in auto.report.notes)
    assert "layout: " in auto.report.summary()
    with pytest.raises(ValueError, match="layouts"):
        kiln.compile(block, (x,), layouts="blocked")  # type: ignore[arg-type]


class ResNetStem(nn.Module):
    """ResNet's stem (7x7/2 conv over the 3-channel image, read in place, BN, ReLU, 3x3/2
    max pool: an ATen call fed channels-last) and a basic block with a 1x1/2 shortcut."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Sequential(
            nn.Conv2d(3, 16, 7, 2, 3, bias=False), nn.BatchNorm2d(16), nn.ReLU(),
            nn.MaxPool2d(3, 2, 1),
        )  # fmt: skip
        self.a = nn.Sequential(nn.Conv2d(16, 32, 3, 2, 1), nn.BatchNorm2d(32), nn.ReLU())
        self.b = nn.Sequential(nn.Conv2d(32, 32, 3, 1, 1), nn.BatchNorm2d(32))
        self.short = nn.Conv2d(16, 32, 1, 2)

    def forward(self, x: Tensor) -> Tensor:
        y = self.stem(x)
        return F.relu(self.b(self.a(y)) + self.short(y)).mean(dim=(2, 3))


def test_resnet_stem_and_block() -> None:
    torch.manual_seed(0)
    compiled = _compile(ResNetStem(), torch.randn(1, 3, 40, 36), natively=False)
    assert compiled.program is not None
    copies = [n for n in compiled.program.graph.nodes if n.op == "copy"]
    assert not copies, compiled.program.graph.summary()  # image read in place, pool output NHWC


@pytest.mark.parametrize(
    "shape,dims,keepdim",
    [((2, 5, 7, 37), (1, 2), True), ((1, 4, 4, 70), (1, 2), False), ((3, 9, 16), (0, 1), True)],
)
def test_column_reductions(shape: tuple[int, ...], dims: tuple[int, ...], keepdim: bool) -> None:
    """sum / max / min over the pixels of channels-last values (global pooling, instance
    norm statistics), vectorised along the kept last dim (``colreduce.py``)."""
    g = Graph()
    x = g.add_input("x", TensorMeta(shape, torch.float32))
    out_shape = tuple(1 if d in dims else s for d, s in enumerate(shape))
    if not keepdim:
        out_shape = tuple(s for d, s in enumerate(shape) if d not in dims)
    attrs = {"dims": dims, "keepdim": keepdim}
    g.outputs = [
        g.add_node(op, (x,), TensorMeta(out_shape, torch.float32), attrs, name=op)
        for op in ("sum", "max", "min")
    ]
    kernels = [Kernel("reduction", (op,), (op,), (x,)) for op in ("sum", "max", "min")]
    compiled = compile_graph(g, CompileOptions(), kernels=kernels)
    assert compiled.native_program is not None
    assert "column reduction" in compiled.native_program.source
    inputs = [torch.randn(*shape)]
    assert_close_to_reference(compiled.run_flat(inputs), run_graph(g, inputs))
