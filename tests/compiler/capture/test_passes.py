"""The clean-up passes on hand-built graphs, each checked against run_graph."""

from __future__ import annotations

import torch

from kiln.compiler.capture import capture, fallback_report
from kiln.compiler.capture.passes import (
    canonicalize_views,
    eliminate_common_subexpressions,
    eliminate_dead_code,
    enforce_native_dtypes,
    fold_constants,
    optimize,
)
from kiln.compiler.ir.graph import Graph, TensorMeta, ValueKind
from kiln.compiler.ir.semantics import run_graph
from tests.support.compare import assert_close_to_reference

F32 = torch.float32


def meta(*shape: int, dtype: torch.dtype = F32) -> TensorMeta:
    return TensorMeta(tuple(shape), dtype)


def test_fold_transposed_weight_into_contiguous_param() -> None:
    g = Graph()
    x = g.add_input("x", meta(3, 4))
    w = g.add_constant("w", torch.randn(5, 4))
    wt = g.add_node("permute", (w,), meta(4, 5), {"dims": (1, 0)})
    g.outputs = [g.add_node("mm", (x, wt), meta(3, 5))]
    inputs = [torch.randn(3, 4)]
    expected = run_graph(g, inputs)

    folded = fold_constants(g)
    assert [n.op for n in folded.nodes] == ["mm"]
    assert folded.values[wt].kind == ValueKind.PARAM
    assert folded.constants[wt].is_contiguous()
    assert torch.equal(folded.constants[wt], g.constants[w].t())
    assert_close_to_reference(run_graph(folded, inputs), expected)


def test_fold_keeps_scalars_0d_and_skips_big_broadcasts() -> None:
    g = Graph()
    x = g.add_input("x", meta(512, 512))
    a = g.add_constant("a", torch.tensor(2.0))
    b = g.add_constant("b", torch.tensor(3.0))
    ab = g.add_node("mul", (a, b), meta())
    big = g.add_node("expand", (ab,), meta(512, 512), {"shape": (512, 512)})
    g.outputs = [g.add_node("add", (x, big), meta(512, 512))]
    folded = fold_constants(g)
    assert folded.values[ab].kind == ValueKind.CONST
    assert folded.constants[ab].dim() == 0 and folded.constants[ab].item() == 6.0
    assert [n.op for n in folded.nodes] == ["expand", "add"]  # not materialised
    inputs = [torch.randn(512, 512)]
    assert_close_to_reference(run_graph(folded, inputs), run_graph(g, inputs))


def test_dead_code_and_unused_constants_removed() -> None:
    g = Graph()
    x = g.add_input("x", meta(4))
    unused_in = g.add_input("unused", meta(4))
    w = g.add_constant("w", torch.randn(4))
    g.add_constant("dead_param", torch.randn(4))
    g.add_node("exp", (x,), meta(4))  # dead
    g.outputs = [g.add_node("mul", (x, w), meta(4))]
    out = eliminate_dead_code(g)
    assert [n.op for n in out.nodes] == ["mul"]
    assert set(out.constants) == {"w"}
    assert out.inputs == [x, unused_in]  # the call signature is kept


def test_cse_merges_nodes_and_scalar_constants() -> None:
    g = Graph()
    x = g.add_input("x", meta(4))
    c1 = g.add_constant("c1", torch.tensor(2.0))
    c2 = g.add_constant("c2", torch.tensor(2.0))
    a = g.add_node("mul", (x, c1), meta(4))
    b = g.add_node("mul", (x, c2), meta(4))
    e1 = g.add_node("exp", (a,), meta(4))
    e2 = g.add_node("exp", (b,), meta(4))
    g.outputs = [g.add_node("add", (e1, e2), meta(4))]
    out = eliminate_dead_code(eliminate_common_subexpressions(g))
    assert [n.op for n in out.nodes] == ["mul", "exp", "add"]
    inputs = [torch.randn(4)]
    assert_close_to_reference(run_graph(out, inputs), run_graph(g, inputs))


def test_view_canonicalisation() -> None:
    g = Graph()
    x = g.add_input("x", meta(2, 3, 4))
    v1 = g.add_node("view", (x,), meta(6, 4), {"shape": (6, 4)})
    v2 = g.add_node("view", (v1,), meta(24), {"shape": (24,)})
    v3 = g.add_node("view", (v2,), meta(2, 3, 4), {"shape": (2, 3, 4)})  # back to x
    p1 = g.add_node("permute", (v3,), meta(4, 2, 3), {"dims": (2, 0, 1)})
    p2 = g.add_node("permute", (p1,), meta(3, 4, 2), {"dims": (2, 0, 1)})  # = (1, 2, 0)
    ident = g.add_node("permute", (x,), meta(2, 3, 4), {"dims": (0, 1, 2)})
    same = g.add_node("expand", (ident,), meta(2, 3, 4), {"shape": (2, 3, 4)})
    full = g.add_node("slice", (same,), meta(2, 3, 4), dict(dim=1, start=0, end=3, step=1))
    flat = g.add_node("view", (v1,), meta(4, 6), {"shape": (4, 6)})
    g.outputs = [p2, full, flat]
    out = eliminate_dead_code(canonicalize_views(g))
    summary = [(n.op, n.inputs, n.attrs) for n in out.nodes]
    assert summary == [
        ("permute", ("x",), {"dims": (1, 2, 0)}),
        ("view", ("x",), {"shape": (4, 6)}),
    ]
    assert out.outputs[1] == "x"
    inputs = [torch.randn(2, 3, 4)]
    assert_close_to_reference(run_graph(out, inputs), run_graph(g, inputs))


def test_copy_of_computed_value_is_dropped_but_copy_of_permute_kept() -> None:
    g = Graph()
    x = g.add_input("x", meta(3, 4))
    e = g.add_node("exp", (x,), meta(3, 4))
    c1 = g.add_node("copy", (e,), meta(3, 4))
    p = g.add_node("permute", (c1,), meta(4, 3), {"dims": (1, 0)})
    c2 = g.add_node("copy", (p,), meta(4, 3))
    g.outputs = [c2]
    out = eliminate_dead_code(canonicalize_views(g))
    assert [n.op for n in out.nodes] == ["exp", "permute", "copy"]


def test_non_float_compute_becomes_opaque() -> None:
    g = Graph()
    i = g.add_input("i", meta(6, dtype=torch.int64))
    one = g.add_constant("one", torch.tensor(1))
    v = g.add_node("view", (i,), meta(2, 3, dtype=torch.int64), {"shape": (2, 3)})
    s = g.add_node("add", (v, one), meta(2, 3, dtype=torch.int64))
    r = g.add_node("sum", (s,), meta(2, 1, dtype=torch.int64), {"dims": (1,), "keepdim": True})
    f = g.add_node("cast", (r,), meta(2, 1), {"dtype": F32})
    g.outputs = [g.add_node("exp", (f,), meta(2, 1))]
    out = enforce_native_dtypes(g)
    assert [n.op for n in out.nodes] == ["view", "opaque", "opaque", "cast", "exp"]
    assert [fb.aten_op for fb in fallback_report(out)] == [
        "aten.add.Tensor",
        "aten.sum.dim_IntList",
    ]
    assert all("int64" in fb.reason for fb in fallback_report(out))
    inputs = [torch.arange(6)]
    assert_close_to_reference(run_graph(out, inputs), run_graph(g, inputs))


def test_half_precision_pools_become_aten_pools() -> None:
    """The C++ backend computes in fp32: a bf16 ``pool2d`` runs as ATen's pool."""
    g = Graph()
    x = g.add_input("x", meta(1, 3, 9, 7, dtype=torch.bfloat16))
    for mode in ("max", "avg"):
        attrs = {"mode": mode, "kernel": (3, 3), "stride": (2, 2), "padding": (1, 1)}
        out = meta(1, 3, 5, 4, dtype=torch.bfloat16)
        g.outputs.append(g.add_node("pool2d", (x,), out, {**attrs, "channels_last": False}))
    out = enforce_native_dtypes(g)
    assert [fb.aten_op for fb in fallback_report(out)] == [
        "aten.max_pool2d.default",
        "aten.avg_pool2d.default",
    ]
    inputs = [-1.0 - torch.rand(1, 3, 9, 7).to(torch.bfloat16)]
    assert_close_to_reference(run_graph(out, inputs), run_graph(g, inputs))


def test_optimize_pipeline_validates() -> None:
    g = Graph()
    x = g.add_input("x", meta(2, 4))
    w = g.add_constant("w", torch.randn(3, 4))
    wt1 = g.add_node("permute", (w,), meta(4, 3), {"dims": (1, 0)})
    wt2 = g.add_node("permute", (w,), meta(4, 3), {"dims": (1, 0)})  # duplicate
    a = g.add_node("mm", (x, wt1), meta(2, 3))
    b = g.add_node("mm", (x, wt2), meta(2, 3))
    g.outputs = [g.add_node("add", (a, b), meta(2, 3))]
    out = optimize(g)
    assert [n.op for n in out.nodes] == ["mm", "add"]
    assert len(out.constants) == 1
    inputs = [torch.randn(2, 4)]
    assert_close_to_reference(run_graph(out, inputs), run_graph(g, inputs))


def test_gathers_compose_along_each_dim() -> None:
    """Nearest 2x upsampling then reflection padding: four gathers with constant indices
    (H, W, H, W) become one along H and one along W, exactly."""

    class UpPad(torch.nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            up = torch.nn.functional.interpolate(x, scale_factor=2.0, mode="nearest")
            return torch.nn.functional.pad(up, (1, 2, 2, 1), mode="reflect")

    x = torch.randn(2, 3, 5, 6)
    result = capture(UpPad(), (x,))
    gathers = [n for n in result.graph.nodes if n.op == "index_select"]
    assert sorted(n.attrs["dim"] % 4 for n in gathers) == [2, 3], result.graph.summary()
    got = result.unflatten(run_graph(result.graph, [x]))
    assert torch.equal(got, UpPad()(x))


def test_gelu_after_a_linear_runs_in_the_gemm_shape() -> None:
    """Linear on (1, T, F) is a (T, F) GEMM viewed as (1, T, F); GELU's
    0.5 * x * (1 + erf(x / sqrt 2)) reads x twice, and its product of two views is sunk
    too, so every pointwise op runs on (T, F): one kernel with the GEMM can hold them."""
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU()).eval()
    x = torch.randn(1, 5, 8)
    result = capture(model, (x,))
    pointwise = [n for n in result.graph.nodes if n.op in ("mul", "add", "erf")]
    assert pointwise and all(result.graph.meta(n.output).shape == (5, 16) for n in pointwise)
    with torch.no_grad():
        assert_close_to_reference(result.unflatten(run_graph(result.graph, [x])), model(x))
