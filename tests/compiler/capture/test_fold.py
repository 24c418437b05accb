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
