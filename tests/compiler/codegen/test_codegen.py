"""Generated C++ kernels of every kind against the ATen reference, over ragged shapes.

Each test builds a primitive graph by hand, compiles it natively (the solver's
choice, and where it matters one kernel per node), and compares with
``run_graph`` — the reference semantics — and with plain PyTorch.
"""

from __future__ import annotations

import pytest
import torch

from kiln.compiler.api import compile_graph
from kiln.compiler.codegen.cpu import build
from kiln.compiler.codegen.cpu.codegen import CppProgram
from kiln.compiler.codegen.cpu.gemm import packed_floats
from kiln.compiler.codegen.cpu.pack import nr as panel_width
from kiln.compiler.fusion.program import Kernel
from kiln.compiler.ir.graph import Graph, TensorMeta
from kiln.compiler.ir.semantics import run_graph
from tests.support.compare import assert_close_to_reference

F32, BOOL = torch.float32, torch.bool


def _meta(shape: tuple[int, ...], dtype: torch.dtype = F32) -> TensorMeta:
    return TensorMeta(tuple(shape), dtype)


def _singles(g: Graph) -> list[Kernel]:
    """One kernel per non-view node: every template runs alone."""
    views = {"view", "permute", "expand", "slice"}
    return [
        Kernel("single", (n.name,), (n.output,), tuple(n.inputs))
        for n in g.nodes
        if n.op not in views
    ]


def _check(g: Graph, inputs: list[torch.Tensor], singles: bool = True) -> None:
    expected = run_graph(g, inputs)
    for kernels in [None, _singles(g)] if singles else [None]:
        compiled = compile_graph(g, kernels=kernels)
        native = [k.executor for k in compiled.report.kernels]
        assert "fallback" not in native, compiled.report.summary()
        assert_close_to_reference(compiled.run_flat(inputs), expected, rtol_to_max=1e-5)


@pytest.mark.parametrize("shape", [(1,), (7,), (3, 5), (2, 3, 17), (64, 1000)])
def test_pointwise_chain_with_broadcasts(shape: tuple[int, ...]) -> None:
    g = Graph()
    x = g.add_input("x", _meta(shape))
    b = g.add_input("b", _meta((1, shape[-1])))
    half = g.add_constant("half", torch.tensor(0.5))
    zero = g.add_constant("zero", torch.tensor(0.0))
    full = _meta((1, *shape) if len(shape) == 1 else shape)
    pos = g.add_node("gt", (x, zero), _meta(shape, BOOL))
    e = g.add_node("exp", (g.add_node("neg", (x,), _meta(shape)),), _meta(shape))
    t = g.add_node("mul", (e, g.add_node("tanh", (x,), _meta(shape))), _meta(shape))
    w = g.add_node("where", (pos, t, g.add_node("erf", (x,), _meta(shape))), _meta(shape))
    s = g.add_node(
        "mul", (g.add_node("sigmoid", (b,), _meta((1, shape[-1]))), half), _meta((1, shape[-1]))
    )
    y = g.add_node("add", (w, s), full)
    g.outputs = [y, pos]
    x_t = torch.randn(shape) * 3
    _check(g, [x_t, torch.randn(1, shape[-1])])


@pytest.mark.parametrize("rows,cols", [(1, 1), (3, 17), (8, 100), (33, 256)])
def test_softmax_and_layernorm_rows(rows: int, cols: int) -> None:
    g = Graph()
    x = g.add_input("x", _meta((rows, cols)))
    gamma = g.add_constant("gamma", torch.randn(cols))
    eps = g.add_constant("eps", torch.tensor(1e-5))
    inv = g.add_constant("inv", torch.tensor(1.0 / cols))
    col = _meta((rows, 1))
    full = _meta((rows, cols))
    m = g.add_node("max", (x,), col, {"dims": (1,), "keepdim": True})
    e = g.add_node("exp", (g.add_node("sub", (x, m), full),), full)
    sm = g.add_node("div", (e, g.add_node("sum", (e,), col, {"dims": (1,), "keepdim": True})), full)
    mean = g.add_node(
        "mul", (g.add_node("sum", (x,), col, {"dims": (1,), "keepdim": True}), inv), col
    )
    d = g.add_node("sub", (x, mean), full)
    var = g.add_node(
        "mul",
        (
            g.add_node(
                "sum", (g.add_node("mul", (d, d), full),), col, {"dims": (1,), "keepdim": True}
            ),
            inv,
        ),
        col,
    )
    ln = g.add_node(
        "mul",
        (
            g.add_node(
                "mul", (d, g.add_node("rsqrt", (g.add_node("add", (var, eps), col),), col)), full
            ),
            gamma,
        ),
        full,
    )
    g.outputs = [sm, ln, m]
    x_t = torch.randn(rows, cols) * 4
    _check(g, [x_t])
    expected = [
        torch.softmax(x_t, -1),
        torch.nn.functional.layer_norm(x_t, (cols,), g.constants[gamma], None, 1e-5),
    ]
    got = compile_graph(g).run_flat([x_t])
    assert_close_to_reference(got[:2], expected, rtol_to_max=1e-5)


@pytest.mark.parametrize(
    "shape,dims,keepdim,op",
    [
        ((4, 5, 6), (0,), False, "sum"),
        ((4, 5, 6), (1,), True, "max"),
        ((4, 5, 6), (0, 2), False, "min"),
        ((2, 8, 3, 3), (2, 3), True, "sum"),
        ((1000,), (0,), False, "sum"),
    ],  # fmt: skip
)
def test_general_reductions(
    shape: tuple[int, ...], dims: tuple[int, ...], keepdim: bool, op: str
) -> None:
    g = Graph()
    x = g.add_input("x", _meta(shape))
    ref = {"sum": torch.sum, "max": torch.amax, "min": torch.amin}[op](
        torch.zeros(shape), dim=dims, keepdim=keepdim
    )
    y = g.add_node(op, (x,), _meta(tuple(ref.shape)), {"dims": dims, "keepdim": keepdim})
    g.outputs = [y]
    _check(g, [torch.randn(shape)], singles=False)


@pytest.mark.parametrize(
    "m,k,n", [(1, 1, 1), (3, 7, 5), (8, 64, 40), (13, 300, 17), (64, 128, 300)]
)
def test_gemm_with_epilogue(m: int, k: int, n: int) -> None:
    g = Graph()
    x = g.add_input("x", _meta((m, k)))
    res = g.add_input("res", _meta((m, n)))
    w = g.add_constant("w", torch.randn(k, n) / k**0.5)
    bias = g.add_constant("bias", torch.randn(n))
    y = g.add_node("mm", (x, w), _meta((m, n)))
    y = g.add_node("relu", (g.add_node("add", (y, bias), _meta((m, n))),), _meta((m, n)))
    y = g.add_node("add", (y, res), _meta((m, n)))
    g.outputs = [y]
    x_t, r_t = torch.randn(m, k), torch.randn(m, n)
    _check(g, [x_t, r_t])
    want = torch.relu(x_t @ g.constants["w"] + g.constants["bias"]) + r_t
    assert_close_to_reference(compile_graph(g).run_flat([x_t, r_t])[0], want, rtol_to_max=1e-5)


@pytest.mark.parametrize("b,m,k,n", [(1, 1, 4, 3), (6, 5, 16, 9), (4, 17, 8, 33)])
def test_bmm_with_runtime_operands_and_strided_views(b: int, m: int, k: int, n: int) -> None:
    g = Graph()
    q = g.add_input("q", _meta((b, m, k)))
    kt = g.add_input("kt", _meta((b, n, k)))  # read transposed through a permute view
    kv = g.add_node("permute", (kt,), _meta((b, k, n)), {"dims": (0, 2, 1)})
    s = g.add_node("bmm", (q, kv), _meta((b, m, n)))
    scale = g.add_constant("scale", torch.tensor(0.25))
    y = g.add_node("mul", (s, scale), _meta((b, m, n)))
    g.outputs = [y]
    q_t, k_t = torch.randn(b, m, k), torch.randn(b, n, k)
    _check(g, [q_t, k_t])


def test_layout_copies_cat_and_non_strided_reshape() -> None:
    g = Graph()
    x = g.add_input("x", _meta((2, 3, 4)))
    e = g.add_node("exp", (x,), _meta((2, 3, 4)))
    p = g.add_node("permute", (e,), _meta((3, 2, 4)), {"dims": (1, 0, 2)})
    v = g.add_node("view", (p,), _meta((3, 8)), {"shape": (3, 8)})  # needs a copy first
    z = g.add_node("neg", (v,), _meta((3, 8)))
    c = g.add_node("cat", (z, v), _meta((3, 16)), {"dim": 1})
    sl = g.add_node("slice", (c,), _meta((3, 5)), {"dim": 1, "start": 2, "end": 12, "step": 2})
    g.outputs = [c, sl, p]
    _check(g, [torch.randn(2, 3, 4)])


def test_opaque_op_runs_inside_the_native_program() -> None:
    from kiln.compiler.ir.semantics import TensorArg

    g = Graph()
    x = g.add_input("x", _meta((4, 6)))
    e = g.add_node("exp", (x,), _meta((4, 6)))
    c = g.add_node(
        "opaque",
        (e,),
        _meta((4, 6)),
        {"target": torch.ops.aten.cumsum.default, "args": (TensorArg(0), 1)},
    )
    y = g.add_node("mul", (c, e), _meta((4, 6)))
    g.outputs = [y]
    compiled = compile_graph(g)
    assert [k.executor for k in compiled.report.kernels].count("extern") == 1
    x_t = torch.randn(4, 6)
    want = torch.cumsum(x_t.exp(), 1) * x_t.exp()
    assert_close_to_reference(compiled.run_flat([x_t])[0], want, rtol_to_max=1e-5)


@pytest.mark.parametrize("dim", [0, 1])
def test_index_select_rows_and_columns(dim: int) -> None:
    g = Graph()
    x = g.add_input("x", _meta((5, 7)))
    idx = g.add_input("idx", TensorMeta((4,), torch.int64))
    n_out = (4, 7) if dim == 0 else (5, 4)
    y = g.add_node("index_select", (x, idx), _meta(n_out), {"dim": dim})
    z = g.add_node("exp", (y,), _meta(n_out))
    g.outputs = [z]
    i_t = torch.tensor([3, 0, 3, 4]) if dim == 0 else torch.tensor([6, 0, -1, 2])
    x_t = torch.randn(5, 7)
    compiled = compile_graph(g)
    want = x_t.index_select(dim, i_t % x_t.shape[dim]).exp()
    assert_close_to_reference(compiled.run_flat([x_t, i_t])[0], want, rtol_to_max=1e-6)
    with pytest.raises(IndexError, match="input 1 .* holds 99"):  # as eager raises
        compiled.run_flat([x_t, torch.tensor([0, 1, 99, 2])])


def test_embedding_model_is_fully_native() -> None:
    import kiln

    class Bag(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.emb = torch.nn.Embedding(50, 8)

        def forward(self, ids: torch.Tensor) -> torch.Tensor:
            return self.emb(ids).mean(1)

    model = Bag().eval()
    ids = torch.randint(0, 50, (3, 6))
    compiled = kiln.compile(model, (ids,))
    assert not compiled.report.fallbacks, compiled.report.summary()
    assert_close_to_reference(compiled(ids), model(ids), rtol_to_max=1e-6)
    bad = ids.clone()
    bad[1, 2] = 50  # one past the table, as a user's tokenizer might produce
    with pytest.raises(IndexError):
        model(bad)  # what eager raises
    with pytest.raises(IndexError, match=r"input 0 \(ids\) holds 50.*50 rows.*-50\.\.49"):
        compiled(bad)
    bad[1, 2] = -51
    with pytest.raises(IndexError, match="holds -51"):
        compiled(bad)


def test_depthwise_separable_conv_chain_matches_eager() -> None:
    """On NCHW values (``layouts="nchw"``), consecutive convs with a depthwise one run as
    one channels-last oneDNN chain (dense 3x3 convs around it: 1x1 ones would run
    natively, and the depthwise one too)."""
    import kiln

    block = torch.nn.Sequential(
        torch.nn.Conv2d(8, 24, 3, padding=1), torch.nn.BatchNorm2d(24), torch.nn.ReLU6(),
        torch.nn.Conv2d(24, 24, 3, padding=1, groups=24), torch.nn.ReLU6(),
        torch.nn.Conv2d(24, 8, 3, padding=1),
    ).eval()  # fmt: skip
    x = torch.randn(1, 8, 12, 12)
    compiled = kiln.compile(block, (x,), cache=False, layouts="nchw")
    program = compiled.native_program
    assert program is not None and any(" > " in e.what for e in program.externs)
    assert_close_to_reference(compiled(x), block(x), rtol_to_max=1e-5)


def test_a_weight_used_by_several_gemms_is_packed_once() -> None:
    """The steps of an unrolled recurrence multiply by the same weight: one packed copy
    (which stays in cache from step to step), not one per step."""
    g = Graph()
    h = g.add_input("h", _meta((1, 48)))
    w = g.add_constant("w", torch.randn(48, 48) / 48**0.5)
    for _ in range(4):
        h = g.add_node("tanh", (g.add_node("mm", (h, w), _meta((1, 48))),), _meta((1, 48)))
    g.outputs = [h]
    x = torch.randn(1, 48)
    compiled = compile_graph(g)
    # four GEMMs (separate kernels, or stages of a chain) read one packed copy
    assert sum(k.primitives.count("mm") for k in compiled.report.kernels) == 4
    cpp = compiled.native_program
    assert isinstance(cpp, CppProgram)
    packed = packed_floats(48, 48, panel_width(build.isa()))
    assert [p.numel() for p in cpp.params].count(packed) == 1
    assert_close_to_reference(compiled.run_flat([x]), run_graph(g, [x]), rtol_to_max=1e-5)
