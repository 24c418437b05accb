"""Hypothesis-generated graphs of pointwise, reduction, GEMM and layout primitives
compile natively (orchestrated by the BLP) and match the ATen reference."""

from __future__ import annotations

import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kiln.compiler.api import compile_graph
from kiln.compiler.ir.graph import Graph, TensorMeta
from kiln.compiler.ir.semantics import run_graph
from tests.support.compare import assert_close_to_reference

F32 = torch.float32
UNARY = ["tanh", "sigmoid", "neg", "relu", "abs", "sin", "erf"]
BINARY = ["add", "mul", "sub", "maximum"]


def _broadcasts(src: tuple[int, ...], dst: tuple[int, ...]) -> bool:
    return len(src) <= len(dst) and all(s in (1, d) for s, d in zip(src[::-1], dst[::-1]))


def _build(data: st.DataObject, m: int, n: int) -> Graph:
    """Grow a random graph over values of shape (m, n), (m, 1) and (n, m)."""
    g = Graph()
    vals = [g.add_input("x", TensorMeta((m, n), F32))]
    steps = data.draw(st.integers(3, 12), label="steps")
    for i in range(steps):
        kind = data.draw(
            st.sampled_from(["unary", "binary", "reduce", "mm", "transpose"]), label=f"kind{i}"
        )
        a = data.draw(st.sampled_from(vals), label=f"a{i}")
        shape = g.meta(a).shape
        if kind == "unary":
            op = data.draw(st.sampled_from(UNARY), label=f"op{i}")
            vals.append(g.add_node(op, (a,), TensorMeta(shape, F32)))
        elif kind == "binary":
            partners = [v for v in vals if _broadcasts(g.meta(v).shape, shape)]
            b = data.draw(st.sampled_from(partners), label=f"b{i}")
            op = data.draw(st.sampled_from(BINARY), label=f"op{i}")
            vals.append(g.add_node(op, (a, b), TensorMeta(shape, F32)))
        elif kind == "reduce" and shape[1] > 1:
            op = data.draw(st.sampled_from(["sum", "max"]), label=f"op{i}")
            vals.append(
                g.add_node(
                    op, (a,), TensorMeta((shape[0], 1), F32), {"dims": (1,), "keepdim": True}
                )
            )
        elif kind == "mm" and shape[1] > 1:
            w = g.add_constant(f"w{i}", torch.randn(shape[1], shape[1]) / shape[1] ** 0.5)
            vals.append(g.add_node("mm", (a, w), TensorMeta(shape, F32)))
        elif kind == "transpose" and shape[1] > 1:
            vals.append(
                g.add_node("permute", (a,), TensorMeta((shape[1], shape[0]), F32), {"dims": (1, 0)})
            )
    g.outputs = [v for v in vals[1:] if not g.consumers()[v]] or [vals[-1]]
    return g


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data(), m=st.integers(1, 9), n=st.integers(2, 40))
def test_random_graph_matches_reference(data: st.DataObject, m: int, n: int) -> None:
    g = _build(data, m, n)
    if not g.nodes:
        return
    x = torch.randn(m, n)
    compiled = compile_graph(g)
    assert_close_to_reference(compiled.run_flat([x]), run_graph(g, [x]), rtol_to_max=1e-4)
