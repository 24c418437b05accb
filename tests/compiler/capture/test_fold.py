"""Graph rewrites in capture/fold.py keep the graph's meaning and enable fusion."""

from __future__ import annotations

import torch

from kiln.compiler.capture import capture
from kiln.compiler.capture.fold import sink_unit_views
from kiln.compiler.ir.graph import Graph, TensorMeta
from kiln.compiler.ir.semantics import run_graph
from tests.support.compare import assert_close_to_reference

F32 = torch.float32


def test_batchnorm_folds_into_the_conv() -> None:
    model = torch.nn.Sequential(
        torch.nn.Conv2d(3, 8, 3, padding=1), torch.nn.BatchNorm2d(8), torch.nn.ReLU6()
    ).eval()
    with torch.no_grad():
        model[1].running_mean.uniform_(-1, 1)
        model[1].running_var.uniform_(0.5, 2)
        model[1].weight.uniform_(0.5, 1.5)
    x = torch.randn(1, 3, 10, 10)
    g = capture(model, (x,)).graph
    ops = [n.op for n in g.nodes]
    assert ops.count("conv") == 1 and "mul" not in ops and "add" not in ops, ops
    assert_close_to_reference(run_graph(g, [x])[0], model(x), rtol_to_max=1e-5)


def test_instance_norm_reduces_over_trailing_dims_only() -> None:
    model = torch.nn.InstanceNorm2d(4, affine=True).eval()
    x = torch.randn(1, 4, 6, 6)
    g = capture(model, (x,)).graph
    dims = {tuple(n.attrs["dims"]) for n in g.nodes if n.op == "sum"}
    assert dims == {(2, 3)}
    assert_close_to_reference(run_graph(g, [x])[0], model(x), rtol_to_max=1e-5)


def test_unit_views_sink_below_pointwise_ops() -> None:
    g = Graph()
    x = g.add_input("x", TensorMeta((4, 8), F32))
    e = g.add_node("exp", (x,), TensorMeta((4, 8), F32))
    v = g.add_node("view", (e,), TensorMeta((4, 1, 8), F32), {"shape": (4, 1, 8)})
    bias = g.add_constant("bias", torch.randn(8))
    y = g.add_node("add", (v, bias), TensorMeta((4, 1, 8), F32))
    g.outputs = [y]
    inputs = [torch.randn(4, 8)]
    before = run_graph(g, inputs)
    g = sink_unit_views(g)
    add = next(n for n in g.nodes if n.op == "add")
    assert add.inputs[0] == e and g.meta(add.output).shape == (4, 8)
    assert g.producer(g.outputs[0]).op == "view"  # type: ignore[union-attr]
    assert_close_to_reference(run_graph(g, inputs), before, rtol_to_max=0)


class _PadThenConv(torch.nn.Module):
    def __init__(self, pads: tuple[int, ...], conv: torch.nn.Module) -> None:
        super().__init__()
        self.pads, self.conv = pads, conv

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.conv(torch.nn.functional.pad(x, self.pads)))


def test_a_causal_pad_becomes_the_convs_own_padding() -> None:
    # F.pad(x, (4, 0)) before a dilated conv: a cat of zeros in front of x, folded into
    # the conv as 4 zeros before the time axis and none after.
    model = _PadThenConv((4, 0), torch.nn.Conv1d(16, 32, 3, dilation=2, padding=1)).eval()
    x = torch.randn(2, 16, 50)
    g = capture(model, (x,)).graph
    conv = next(n for n in g.nodes if n.op == "conv")
    assert "cat" not in [n.op for n in g.nodes]
    assert conv.inputs[0] == g.inputs[0]
    assert conv.attrs["padding"] == (5,) and conv.attrs["padding_end"] == (1,)
    assert_close_to_reference(run_graph(g, [x])[0], model(x), rtol_to_max=1e-5)


def test_uneven_2d_pads_fold_one_dim_at_a_time() -> None:
    # TF-style "same" padding for a stride-2 conv: one zero after W and after H.
    model = _PadThenConv((0, 1, 2, 1), torch.nn.Conv2d(8, 16, 3, stride=2)).eval()
    x = torch.randn(1, 8, 17, 17)
    g = capture(model, (x,)).graph
    conv = next(n for n in g.nodes if n.op == "conv")
    assert "cat" not in [n.op for n in g.nodes]
    assert conv.attrs["padding"] == (2, 0) and conv.attrs["padding_end"] == (1, 1)
    assert_close_to_reference(run_graph(g, [x])[0], model(x), rtol_to_max=1e-5)


def test_a_pad_with_another_reader_or_a_nonzero_value_stays() -> None:
    class Both(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.conv = torch.nn.Conv1d(4, 4, 3)

        def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            p = torch.nn.functional.pad(x, (2, 0))
            q = torch.nn.functional.pad(x, (2, 0), value=1.0)
            return self.conv(p) + p[..., 1:-1], self.conv(q)

    model = Both().eval()
    x = torch.randn(1, 4, 12)
    g = capture(model, (x,)).graph
    convs = [n for n in g.nodes if n.op == "conv"]
    # the zero pad folds into its conv (the slice still reads the cat); the ones stay
    assert sorted(c.attrs.get("padding_end", c.attrs["padding"]) for c in convs) == [(0,), (0,)]
    assert sorted(c.attrs["padding"] for c in convs) == [(0,), (2,)]
    assert [n.op for n in g.nodes].count("cat") == 2
    assert_close_to_reference(run_graph(g, [x]), list(model(x)), rtol_to_max=1e-5)


class _ReflectThenConv(torch.nn.Module):
    def __init__(self, pads: tuple[int, ...], conv: torch.nn.Module) -> None:
        super().__init__()
        self.pads, self.conv = pads, conv

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.conv(torch.nn.functional.pad(x, self.pads, mode="reflect"))


def test_a_reflection_pad_becomes_the_convs_padding() -> None:
    # F.pad(..., mode="reflect") captures as a gather per dim; uneven pads stay uneven.
    model = _ReflectThenConv((1, 1, 2, 0), torch.nn.Conv2d(8, 16, 3)).eval()
    x = torch.randn(1, 8, 9, 11)
    g = capture(model, (x,)).graph
    conv = next(n for n in g.nodes if n.op == "conv")
    assert [n.op for n in g.nodes] == ["conv"]
    assert conv.attrs["padding_mode"] == "reflect"
    assert conv.attrs["padding"] == (2, 1) and conv.attrs["padding_end"] == (0, 1)
    assert_close_to_reference(run_graph(g, [x])[0], model(x), rtol_to_max=1e-5)


def test_reflection_stays_where_the_conv_pads_zeros_or_is_depthwise() -> None:
    # A conv with zero padding of its own cannot also mirror; nor a depthwise conv (its
    # kernel pads with zeros): their gathers stay and the graph means what eager does.
    for conv in (torch.nn.Conv2d(8, 8, 3, padding=1), torch.nn.Conv2d(8, 8, 3, groups=8)):
        model = _ReflectThenConv((1, 1, 1, 1), conv).eval()
        x = torch.randn(1, 8, 9, 11)
        g = capture(model, (x,)).graph
        assert [n.op for n in g.nodes].count("index_select") == 2
        assert all("padding_mode" not in n.attrs for n in g.nodes)
        assert_close_to_reference(run_graph(g, [x])[0], model(x), rtol_to_max=1e-5)
