"""Template legality, in/out sets and enumeration of candidate kernels."""

from __future__ import annotations

import itertools

import torch
from hypothesis import HealthCheck, given, settings

from kiln.compiler.fusion.aliases import GraphIndex
from kiln.compiler.fusion.candidates import enumerate_candidates, legal_template, make_candidate
from kiln.compiler.ir.graph import Graph
from kiln.compiler.ir.layout import storage_root
from tests.compiler.fusion.orch_graphs import (
    F32,
    const,
    layernorm,
    meta,
    mm_bias_relu_graph,
    op,
    opaque_gelu,
    random_graphs,
    softmax_graph,
)


def names(g: Graph) -> list[str]:
    return [n.name for n in g.nodes]


def test_softmax_is_one_reduction_kernel() -> None:
    g = softmax_graph()
    assert legal_template(g, names(g)) == "reduction"
    c = make_candidate(g, names(g))
    assert c.outputs == (g.outputs[0],) and c.inputs == ("x",)


def test_layernorm_with_residual_prologue_is_a_reduction() -> None:
    g = Graph()
    x, r = g.add_input("x", meta(8, 32)), g.add_input("r", meta(8, 32))
    s = op(g, "add", (x, r), (8, 32))
    g.outputs = [layernorm(g, s, (8, 32), "ln")]
    assert legal_template(g, names(g)) == "reduction"
    assert make_candidate(g, names(g)).inputs == ("x", "r")  # constants are free


def test_reduction_rules() -> None:
    g = Graph()
    x = g.add_input("x", meta(4, 6, 8))
    a = op(g, "sum", (x,), (4, 1, 1), dims=(1, 2), keepdim=True)  # trailing (1, 2): legal
    b = op(g, "sub", (x, a), (4, 6, 8))
    c = op(g, "sum", (x,), (1, 6, 8), dims=(0,), keepdim=True)  # leading dim
    d = op(g, "sub", (x, c), (4, 6, 8))
    e = op(g, "sum", (x,), (4, 6), dims=(-1,), keepdim=False)
    f = op(g, "exp", (e,), (4, 6))
    m = op(g, "max", (x,), (4, 6, 1), dims=(-1,), keepdim=True)  # other dims than a
    h = op(g, "add", (b, m), (4, 6, 8))
    g.outputs = [d, f, h]
    nm = {v: g.producer(v).name for v in (a, b, c, d, e, f, m, h)}  # type: ignore[union-attr]
    assert legal_template(g, [nm[a], nm[b]]) == "reduction"
    assert legal_template(g, [nm[c]]) == "reduction"  # one reduction: any dims
    assert legal_template(g, [nm[c], nm[d]]) is None  # not trailing
    assert legal_template(g, [nm[e]]) == "reduction"
    assert legal_template(g, [nm[e], nm[f]]) is None  # keepdim=False
    assert legal_template(g, [nm[a], nm[b], nm[m], nm[h]]) is None  # two dims structures


def test_gemm_epilogue_rules() -> None:
    g = mm_bias_relu_graph()
    mm, add, relu = names(g)
    assert legal_template(g, [mm, add, relu]) == "gemm"
    assert legal_template(g, [mm, relu]) is None  # not connected through the kernel
    assert legal_template(g, [add, relu]) == "pointwise"
    # a prologue is not allowed: relu(x) @ w
    g2 = Graph()
    x = g2.add_input("x", meta(8, 16))
    w = g2.add_constant("w", torch.randn(16, 4))
    h = op(g2, "relu", (x,), (8, 16))
    g2.outputs = [op(g2, "mm", (h, w), (8, 4))]
    assert legal_template(g2, names(g2)) is None
    # two GEMMs share a kernel only as a chain (the second reads the first's result)
    g3 = Graph()
    x = g3.add_input("x", meta(8, 16))
    w1, w2 = g3.add_constant("w1", torch.randn(16, 16)), g3.add_constant("w2", torch.randn(16, 4))
    h = op(g3, "mm", (x, w1), (8, 16))
    w3 = g3.add_constant("w3", torch.randn(16, 4))
    g3.outputs = [op(g3, "mm", (h, w2), (8, 4)), op(g3, "mm", (x, w3), (8, 4))]
    mm1, mm2, mm3 = names(g3)
    assert legal_template(g3, [mm1, mm2]) == "chain"
    assert legal_template(g3, [mm1, mm3]) is None  # both read x: not a chain


def conv_graph(bias_shape: tuple[int, ...], order: tuple[str, ...]) -> Graph:
    g = Graph()
    x = g.add_input("x", meta(1, 3, 8, 8))
    w = g.add_constant("w", torch.randn(4, 3, 3, 3))
    y = op(
        g, "conv", (x, w), (1, 4, 6, 6), stride=(1, 1), padding=(0, 0), dilation=(1, 1), groups=1
    )
    b = g.add_constant("b", torch.randn(bias_shape))
    for o in order:
        y = op(g, "add", (y, b), (1, 4, 6, 6)) if o == "add" else op(g, o, (y,), (1, 4, 6, 6))
    g.outputs = [y]
    return g


def test_conv_epilogue_rules() -> None:
    g = conv_graph((4, 1, 1), ("add", "relu"))
    assert legal_template(g, names(g)) == "conv"
    g = conv_graph((1, 4, 1, 1), ("relu",))
    assert legal_template(g, names(g)) == "conv"
    g = conv_graph((4, 6, 6), ("add",))  # not a per-channel bias
    assert legal_template(g, names(g)) is None
    g = conv_graph((4, 1, 1), ("relu", "add"))  # relu then add: not a oneDNN post-op chain
    assert legal_template(g, names(g)) is None
    g = conv_graph((4, 1, 1), ("add", "exp"))
    assert legal_template(g, names(g)) is None


def test_conv_intermediate_may_not_escape() -> None:
    g = conv_graph((4, 1, 1), ("add", "relu"))
    g.outputs = [g.nodes[1].output, g.nodes[2].output]  # the pre-activation is needed too
    assert legal_template(g, names(g)) is None


def test_views_are_never_inside_and_not_read_inside() -> None:
    g = Graph()
    x = g.add_input("x", meta(4, 6))
    a = op(g, "exp", (x,), (4, 6))
    t = op(g, "permute", (a,), (6, 4), dims=(1, 0))
    b = op(g, "relu", (t,), (6, 4))
    g.outputs = [b]
    ea, p, rb = names(g)
    assert legal_template(g, [p]) is None
    assert legal_template(g, [ea, rb]) is None  # relu reads a view of an in-kernel value
    assert storage_root(g, t) == a
    # the view counts as an outside consumer: exp stores its output
    assert make_candidate(g, [ea]).outputs == (a,)
    assert make_candidate(g, [rb]).inputs == (a,)  # storage root, not the view


def test_nonconvex_set_is_illegal() -> None:
    g = Graph()
    x = g.add_input("x", meta(4, 6))
    a = op(g, "exp", (x,), (4, 6))
    b = opaque_gelu(g, a, (4, 6))
    c = op(g, "add", (a, b), (4, 6))
    g.outputs = [c]
    ea, _, ad = names(g)
    assert legal_template(g, [ea, ad]) is None  # exp -> opaque -> add leaves and re-enters


def test_single_and_dtype_rules() -> None:
    g = Graph()
    x = g.add_input("x", meta(4, 6))
    gt = g.add_node("gt", (x, const(g, "z", 0.0)), meta(4, 6, dtype=torch.bool))
    w = op(g, "where", (gt, x, const(g, "o", 1.0)), (4, 6))
    i = g.add_node("cast", (w,), meta(4, 6, dtype=torch.int64), {"dtype": torch.int64})
    o = opaque_gelu(g, w, (4, 6))
    g.outputs = [i, o]
    ngt, nw, ni, no = names(g)
    assert legal_template(g, [ngt, nw]) == "pointwise"  # bool from a comparison is fine
    assert legal_template(g, [nw, ni]) is None  # int64 output: not a native template
    assert legal_template(g, [ni]) == "single"
    assert legal_template(g, [no]) == "single"


def _connected(ix: GraphIndex, mask: int) -> bool:
    start = mask & -mask
    seen = start
    while True:
        grow = seen
        for i in range(len(ix.nodes)):
            if seen >> i & 1:
                grow |= ix.nbr[i] & mask
        if grow == seen:
            return seen == mask
        seen = grow


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(random_graphs(max_nodes=8))
def test_enumeration_equals_brute_force(g: Graph) -> None:
    """Every connected, legal set of live non-view nodes (<= 4), each exactly once
    (GEMM chains come from ``chain_candidates``, not from this enumeration)."""
    ix = GraphIndex(g)
    fusible = [i for i in range(len(ix.nodes)) if ix.fusible >> i & 1]
    expected = set()
    for r in range(1, 5):
        for combo in itertools.combinations(fusible, r):
            mask = sum(1 << i for i in combo)
            template = legal_template(g, ix.names(mask), ix)
            if _connected(ix, mask) and template not in (None, "chain"):
                expected.add(ix.names(mask))
    got = [c.nodes for c in enumerate_candidates(g, max_nodes=4)]
    assert len(got) == len(set(got))
    assert set(got) == expected


def test_every_live_node_has_a_single_candidate() -> None:
    g = softmax_graph()
    dead = op(g, "exp", ("x",), (64, 128))
    singles = {next(iter(c.nodes)) for c in enumerate_candidates(g) if len(c.nodes) == 1}
    assert singles == {n.name for n in g.nodes if n.output != dead}


def test_inputs_and_outputs_follow_the_definitions() -> None:
    g = Graph()
    x = g.add_input("x", meta(4, 6))
    a = op(g, "exp", (x,), (4, 6))
    b = op(g, "add", (a, x), (4, 6))
    c = op(g, "mul", (b, a), (4, 6))
    v = op(g, "view", (b,), (24,), shape=(24,))
    g.outputs = [c, v]
    k = make_candidate(g, names(g)[:3])
    assert k.template == "pointwise" and k.inputs == ("x",)
    assert k.outputs == (b, c)  # b is read by the view (outside), c is a graph output
    assert g.meta(c).dtype == F32
