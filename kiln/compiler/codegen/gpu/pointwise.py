"""Pointwise template: a fused group of same-shape elementwise nodes (and the ``copy``
kernels that materialise views), one lane per output element.

Each operand is read through its strided access (a view, a broadcast, a slice), so a
kernel never needs its inputs contiguous; outputs are written contiguously.
"""

from __future__ import annotations

import torch

from kiln.compiler.codegen.gpu.source import KernelWriter, Launch, index_expr
from kiln.compiler.fusion.program import Kernel, Program
from kiln.compiler.ir.graph import Node, ValueKind
from kiln.compiler.ir.layout import Access, access

BLOCK = 1024  # lanes per program: 4 warps x 8 elements each


def bind_operand(
    w: KernelWriter, prog: Program, value: str, shape: tuple[int, ...], flat: str, mask: str | None
) -> None:
    """Load ``value`` seen as ``shape`` at the row-major index ``flat`` into ``w.env``
    (a 0-d constant, or a view of one, becomes a literal)."""
    if value in w.env:
        return
    a = prog.access(value)
    if prog.graph.values[a.root].kind == ValueKind.CONST:
        c = w.const(a.root)
        assert c is not None
        w.env[value] = c
        return
    b = a.broadcast_to(shape)
    idx = index_expr(flat, shape, b.strides)
    if idx == "0":  # one element broadcast everywhere: a scalar load
        w.env[value] = w.load(value, b.root, str(b.offset), None)
    else:
        w.env[value] = w.load(value, b.root, f"{b.offset} + {idx}", mask)


def external_inputs(nodes: list[Node]) -> list[str]:
    inside = {n.output for n in nodes}
    return list(dict.fromkeys(i for n in nodes for i in n.inputs if i not in inside))


def pointwise(prog: Program, index: int, k: Kernel, nodes: list[Node]) -> Launch:
    g = prog.graph
    shape = g.meta(nodes[-1].output).shape
    numel = g.meta(nodes[-1].output).numel
    w = KernelWriter(g, f"pointwise_{index}")
    _head(w, numel)
    for v in external_inputs(nodes):
        bind_operand(w, prog, v, shape, "offs", "mask")
    w.compute(nodes)
    for o in k.outputs:
        w.store(o, "offs", "mask")
    return _launch(w, index, numel)


def copy(prog: Program, index: int, k: Kernel) -> Launch:
    """Materialise a view chain contiguously, reading it through the views that lead
    to it from stored data (the value itself is not stored yet)."""
    g = prog.graph
    v = k.outputs[0]
    meta = g.meta(v)
    a = access(g, v, [s for s in prog.storage if s != v])
    assert isinstance(a, Access)
    w = KernelWriter(g, f"copy_{index}")
    _head(w, meta.numel)
    offset = f"{a.offset} + {index_expr('offs', meta.shape, a.strides)}"
    w.env[v] = w.load(v, a.root, offset, "mask")
    w.store(v, "offs", "mask")
    return _launch(w, index, meta.numel)


def _head(w: KernelWriter, numel: int) -> None:
    w.emit("offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)")
    w.emit(f"mask = offs < {numel}")


def _launch(w: KernelWriter, index: int, numel: int) -> Launch:
    return w.launch(index, ("BLOCK",), [((max(1, -(-numel // BLOCK)),), {"BLOCK": BLOCK})])


def cat(prog: Program, index: int, k: Kernel, node: Node) -> Launch:
    """``cat`` along ``dim``: each output element reads the one piece that covers its
    coordinate along ``dim`` (every piece through its own strided access)."""
    g = prog.graph
    meta = g.meta(node.output)
    shape, dim = meta.shape, node.attrs["dim"] % len(meta.shape)
    inner = 1
    for s in shape[dim + 1 :]:
        inner *= s
    w = KernelWriter(g, f"cat_{index}")
    _head(w, meta.numel)
    w.emit(f"outer = offs // {shape[dim] * inner}")
    w.emit(f"c = (offs // {inner}) % {shape[dim]}  # coordinate along the cat dim")
    w.emit(f"r = offs % {inner}")
    acc, start = "", 0
    for piece in node.inputs:
        size = g.meta(piece).shape[dim]
        a = prog.access(piece)
        pshape = shape[:dim] + (size,) + shape[dim + 1 :]
        pflat = f"(outer * {size * inner} + (c - {start}) * {inner} + r)"
        sel = f"mask & (c >= {start}) & (c < {start + size})"
        var, _ = w.load(piece, a.root, f"{a.offset} + {index_expr(pflat, pshape, a.strides)}", sel)
        acc = f"tl.where(c >= {start}, {var}, {acc})" if acc else var
        start += size
    w.env[node.output] = (acc, g.meta(node.output).dtype == torch.bool)
    w.store(node.output, "offs", "mask")
    return _launch(w, index, meta.numel)
