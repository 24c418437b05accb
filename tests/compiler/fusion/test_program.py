"""The program builder: storage assignment, arena plan, view materialisation."""

from __future__ import annotations

import torch

from kiln.compiler.fusion.program import Kernel, Slot, build_program
from kiln.compiler.ir.graph import Graph, TensorMeta
from kiln.compiler.ir.layout import Access, access, storage_root

F32 = torch.float32


def _chain(n: int, size: int = 1000) -> Graph:
    g = Graph()
    x = g.add_input("x", TensorMeta((size,), F32))
    for _ in range(n):
        x = g.add_node("exp", (x,), TensorMeta((size,), F32))
    g.outputs = [x]
    return g


def _one_per_node(g: Graph) -> list[Kernel]:
    return [Kernel("single", (n.name,), (n.output,), tuple(n.inputs)) for n in g.nodes]


def test_arena_reuses_dead_buffers() -> None:
    g = _chain(6)
    prog = build_program(g, _one_per_node(g))
    # A chain needs two live intermediates at a time, not five.
    assert prog.arena_bytes <= 2 * 4096
    assert prog.storage[g.outputs[0]].slot == Slot.OUTPUT


def test_live_buffers_never_overlap() -> None:
    g = Graph()
    x = g.add_input("x", TensorMeta((64, 64), F32))
    a = g.add_node("exp", (x,), TensorMeta((64, 64), F32))
    b = g.add_node("neg", (x,), TensorMeta((64, 64), F32))
    c = g.add_node("add", (a, b), TensorMeta((64, 64), F32))
    d = g.add_node("mul", (c, a), TensorMeta((64, 64), F32))
    g.outputs = [d]
    prog = build_program(g, _one_per_node(g))
    oa, ob, oc = (prog.storage[v].offset for v in (a, b, c))
    size = 64 * 64 * 4
    # a, b and c are all live while c is computed.
    spans = sorted([(oa, oa + size), (ob, ob + size), (oc, oc + size)])
    assert all(spans[i][1] <= spans[i + 1][0] for i in range(2))


def test_view_access_and_materialisation() -> None:
    g = Graph()
    x = g.add_input("x", TensorMeta((2, 3, 4), F32))
    y = g.add_node("exp", (x,), TensorMeta((2, 3, 4), F32))
    p = g.add_node("permute", (y,), TensorMeta((3, 2, 4), F32), {"dims": (1, 0, 2)})
    v = g.add_node("view", (p,), TensorMeta((3, 8), F32), {"shape": (3, 8)})
    z = g.add_node("neg", (v,), TensorMeta((3, 8), F32))
    g.outputs = [z]
    a = access(g, p)
    assert isinstance(a, Access) and a.root == y and a.strides == (4, 12, 1)
    assert storage_root(g, v) == y
    # A reshape of a permuted view needs the permuted value materialised first.
    assert access(g, v) == p
    kernels = [
        Kernel("single", (g.values[y].producer,), (y,), (x,)),
        Kernel("single", (g.values[z].producer,), (z,), (y,)),
    ]
    prog = build_program(g, kernels)
    assert [k.template for k in prog.kernels] == ["single", "copy", "single"]
    assert prog.kernels[1].outputs == (p,)
    assert prog.access(v) == Access(p, (3, 8), (8, 1), 0)


def test_output_that_is_an_input_is_copied() -> None:
    g = Graph()
    x = g.add_input("x", TensorMeta((4,), F32))
    y = g.add_node("exp", (x,), TensorMeta((4,), F32))
    g.outputs = [y, x, y]
    prog = build_program(g, _one_per_node(g))
    assert prog.final_copies == [(1, x), (2, y)]
