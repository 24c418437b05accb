"""3x3 convolutions by Winograd's F(2x2, 3x3) (``codegen/cpu/conv_winograd.py``, the ``wconv``
template): the transforms against direct correlation, the kernel alone against the
reference over ragged tiles, ragged channel vectors, zero and reflect padding, batches
and both vector ISAs, and the BLP choosing it inside a compiled model."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import kiln
from kiln.compiler.api import CompileOptions, compile_graph
from kiln.compiler.codegen.cpu.conv_winograd import block_sizes, pack_winograd, skewed
from kiln.compiler.fusion.candidates import CPU_TARGET
from kiln.compiler.fusion.convs import winograd_ok, winograd_pays
from kiln.compiler.fusion.cost import dconv_flops
from kiln.compiler.fusion.program import Kernel
from kiln.compiler.ir.graph import Graph, TensorMeta
from kiln.compiler.ir.semantics import run_graph
from tests.support.compare import assert_close_to_reference


def test_transformed_filter_reproduces_correlation() -> None:
    """``A^T [(G g G^T) (.) (B^T d B)] A`` of a 4x4 patch is the 2x2 valid correlation,
    with the packed panels holding ``G g G^T`` per (position, input, output channel)."""
    torch.manual_seed(0)
    c_in, c_out, lanes = 3, 5, 16
    w, d = torch.randn(c_out, c_in, 3, 3), torch.randn(c_in, 4, 4, dtype=torch.float64)
    flat = pack_winograd(w, None, lanes)
    u = flat[: 16 * c_in * lanes].reshape(16, c_in, lanes)[..., :c_out].double()  # one block
    bt = torch.tensor([[1, 0, -1, 0], [0, 1, 1, 0], [0, -1, 1, 0], [0, 1, 0, -1]]).double()
    at = torch.tensor([[1, 1, 1, 0], [0, 1, -1, -1]]).double()
    v = (bt @ d @ bt.T).reshape(c_in, 16)  # (C_in, 16)
    m = torch.einsum("ei,eio->oe", v.T, u).reshape(c_out, 4, 4)
    y = at @ m @ at.T  # (C_out, 2, 2)
    expected = F.conv2d(d[None], w.double())[0]
    torch.testing.assert_close(y, expected, rtol=1e-5, atol=1e-5)


def test_scratch_strides_and_block_heights() -> None:
    for floats in (1, 16, 4096, 8192, 12288, 100):
        s = skewed(floats)
        assert s >= floats and s % 16 == 0 and (s // 16) % 2 == 1
        sets = {(e * s * 4 // 64) % 64 for e in range(16)}  # 64 sets of 64-byte lines
        assert len(sets) == 16
    assert block_sizes(12) == [12, 6, 3, 2, 1]
    assert block_sizes(1) == [1]


def _graph(
    n: int, hw: tuple[int, int], c_in: int, c_out: int, pad: int, reflect: bool
) -> tuple[Graph, Kernel]:
    """conv (3x3, stride 1) + bias, + a per-channel shift, ReLU: channels-last."""
    g = Graph()
    x = g.add_input("x", TensorMeta((n, *hw, c_in), torch.float32))
    oh, ow = hw[0] + 2 * pad - 2, hw[1] + 2 * pad - 2
    out = TensorMeta((n, oh, ow, c_out), torch.float32)
    attrs = {"stride": (1, 1), "padding": (pad, pad), "dilation": (1, 1), "groups": 1,
             "channels_last": True}  # fmt: skip
    if reflect:
        attrs["padding_mode"] = "reflect"
    wt = g.add_constant("w", torch.randn(c_out, c_in, 3, 3) / (c_in * 9) ** 0.5)
    b, shift = g.add_constant("b", torch.randn(c_out)), g.add_constant("s", torch.randn(c_out))
    y = g.add_node("conv", (x, wt, b), out, attrs, name="c")
    y = g.add_node("add", (y, shift), out, name="a")
    g.outputs = [g.add_node("relu", (y,), out, name="r")]
    return g, Kernel("wconv", ("c", "a", "r"), tuple(g.outputs), (g.inputs[0],))


@pytest.mark.parametrize(
    ("n", "hw", "c_in", "c_out", "pad", "reflect"),
    [
        (1, (12, 12), 32, 32, 1, False),  # whole tiles, one channel block
        (2, (11, 9), 40, 36, 1, False),  # odd edges, ragged channel vectors, a batch
        (1, (16, 12), 64, 96, 0, False),  # no padding, three channel blocks
        (1, (10, 13), 48, 32, 1, True),  # reflect padding
    ],
)
def test_winograd_kernel(
    n: int, hw: tuple[int, int], c_in: int, c_out: int, pad: int, reflect: bool,
    vector_isa: str,
) -> None:  # fmt: skip
    torch.manual_seed(0)
    g, kernel = _graph(n, hw, c_in, c_out, pad, reflect)
    assert winograd_ok(g, g.node("c"))
    compiled = compile_graph(g, CompileOptions(), kernels=[kernel])
    assert compiled.report.kernels[0].executor == "native", compiled.report.fallbacks
    assert compiled.native_program is not None
    assert "conv_winograd emitted" in compiled.native_program.source
    for _ in range(2):  # fresh inputs through the same scratch
        inputs = [torch.randn(g.meta(g.inputs[0]).shape)]
        assert_close_to_reference(compiled.run_flat(inputs), run_graph(g, inputs))


def test_winograd_is_offered_only_where_it_pays() -> None:
    assert winograd_pays(64, 64, (3, 3), (1, 1), (1, 1), (28, 28), 1)
    assert not winograd_pays(64, 64, (3, 3), (2, 2), (1, 1), (28, 28), 1)  # strided
    assert not winograd_pays(64, 64, (3, 3), (1, 1), (2, 2), (28, 28), 1)  # dilated
    assert not winograd_pays(64, 64, (5, 5), (1, 1), (1, 1), (28, 28), 1)
    assert not winograd_pays(16, 64, (3, 3), (1, 1), (1, 1), (28, 28), 1)  # few channels
    assert not winograd_pays(256, 256, (3, 3), (1, 1), (1, 1), (7, 7), 1)  # 16 tiles
    assert winograd_pays(256, 256, (3, 3), (1, 1), (1, 1), (7, 7), 2)  # 32 tiles


def test_cost_model_prices_the_transformed_work() -> None:
    g, _ = _graph(1, (28, 28), 64, 64, 1, False)
    conv = g.node("c")
    direct, wino = dconv_flops(conv, g, 16), dconv_flops(conv, g, 16, winograd=True)
    assert direct == 2 * 28 * 28 * 64 * 64 * 9
    assert direct / 2.25 < wino < direct  # fewer multiplies, plus transforms, at a discount


class _Stack(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Conv2d(32, 48, 3, padding=1)
        self.b = nn.Conv2d(48, 48, 3, padding=1)
        self.c = nn.Conv2d(48, 32, 3, stride=2, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.relu(self.a(x))
        return self.c(F.relu(self.b(y)) + y)


def test_compiled_model_chooses_winograd_and_matches_eager() -> None:
    torch.manual_seed(0)
    model, x = _Stack().eval(), torch.randn(2, 32, 20, 18)
    compiled = kiln.compile(model, (x,), cache=False, layouts="nhwc")
    templates = [k.template for k in compiled.report.kernels if "conv" in k.primitives]
    assert templates.count("wconv") == 2, compiled.report.kernel_table()  # not the strided one
    assert CPU_TARGET.winograd
    for _ in range(2):
        x = torch.randn(2, 32, 20, 18)
        with torch.no_grad():
            assert_close_to_reference(compiled(x), model(x))
