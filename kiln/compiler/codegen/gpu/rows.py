"""Row template: reductions over the trailing dims (softmax, layer/RMS norm, mean
pooling) fused with their pointwise prologue and epilogue.

The input of every reduction has shape ``kept + reduced``; a program owns ``RB`` rows
(flat index over ``kept``) and holds each whole row in registers as an ``(RB, BR)``
tile, ``BR`` the row length padded to a power of two. Values of the full shape are row
tiles; reduction results and values of the ``keepdim`` shape are ``(RB, 1)`` columns
that broadcast against them, so ``x - max(x)`` or ``x * rsqrt(mean + eps)`` fuse as
written. Rows longer than ``MAX_ROW`` elements run through ATen (no loop variant yet).
"""

from __future__ import annotations

import torch

from kiln.compiler.codegen.gpu.expr import Unsupported
from kiln.compiler.codegen.gpu.pointwise import external_inputs
from kiln.compiler.codegen.gpu.source import (
    KernelWriter,
    Launch,
    index_expr,
    next_pow2,
)
from kiln.compiler.fusion.program import Kernel, Program
from kiln.compiler.ir.graph import Node, OpClass, ValueKind

MAX_ROW = 16384  # elements of one row held in registers
TILE = 4096  # elements per program (RB x BR)
_IDENTITY = {"sum": "0.0", "max": '-float("inf")', "min": 'float("inf")'}


def rows(prog: Program, index: int, k: Kernel, nodes: list[Node]) -> Launch:
    g = prog.graph
    reds = [n for n in nodes if n.cls == OpClass.REDUCTION]
    shape_in = g.meta(reds[0].inputs[0]).shape
    nd = len(shape_in)
    dims = sorted({d % nd for d in reds[0].attrs["dims"]})
    if dims != list(range(nd - len(dims), nd)):
        raise Unsupported("reduction over non-trailing dims")
    for r in reds:
        if (
            g.meta(r.inputs[0]).shape != shape_in
            or sorted({d % nd for d in r.attrs["dims"]}) != dims
        ):
            raise Unsupported("reductions over different axes")
        if g.meta(r.inputs[0]).dtype == torch.bool:
            raise Unsupported("reduction of a bool tensor")
    kept, reduced = shape_in[: nd - len(dims)], shape_in[nd - len(dims) :]
    keep_shape = kept + (1,) * len(dims)
    n_rows, row_len = _prod(kept), _prod(reduced)
    if row_len > MAX_ROW:
        raise Unsupported(f"rows of {row_len} elements (> {MAX_ROW})")
    br = next_pow2(row_len, 16)
    rb = max(1, min(next_pow2(n_rows), TILE // br))

    row_values = {
        n.output for n in nodes if n.cls == OpClass.POINTWISE and g.meta(n.output).shape == shape_in
    }
    row_readers = {
        i for n in nodes if n.output in row_values or n.cls == OpClass.REDUCTION for i in n.inputs
    }
    scalar_readers = {
        i
        for n in nodes
        if n.output not in row_values and n.cls != OpClass.REDUCTION
        for i in n.inputs
    }

    w = KernelWriter(g, f"rows_{index}")
    w.emit("rows = tl.program_id(0) * RB + tl.arange(0, RB)[:, None]  # (RB, 1)")
    w.emit("cols = tl.arange(0, BR)[None, :]  # (1, BR)")
    w.emit(f"rmask = rows < {n_rows}")
    w.emit(f"cmask = cols < {row_len}")
    w.emit("mask = rmask & cmask")
    for v in external_inputs(nodes):
        a = prog.access(v)
        if g.values[a.root].kind == ValueKind.CONST:
            c = w.const(a.root)
            assert c is not None
            w.env[v] = c
            continue
        if v in row_readers and v in scalar_readers and g.meta(v).shape != keep_shape:
            raise Unsupported(f"{v} is read both per element and per row")
        if v in row_readers:
            b = a.broadcast_to(shape_in)
            ri = index_expr("rows", kept, b.strides[: len(kept)])
            ci = index_expr("cols", reduced, b.strides[len(kept) :])
            mask = "mask" if ci != "0" else "rmask" if ri != "0" else None
        else:
            b = a.broadcast_to(keep_shape)
            ri, ci = index_expr("rows", kept, b.strides[: len(kept)]), "0"
            mask = "rmask" if ri != "0" else None
        w.env[v] = w.load(v, b.root, f"{b.offset} + {ri} + {ci}", mask)
    for n in nodes:
        if n.cls == OpClass.REDUCTION:
            x, _ = w.env[n.inputs[0]]
            var = w.fresh("r")
            fn = {"sum": "tl.sum", "max": "tl.max", "min": "tl.min"}[n.op]
            w.emit(f"{var} = {fn}(tl.where(mask, {x}, {_IDENTITY[n.op]}), axis=1, keep_dims=True)")
            w.env[n.output] = (var, False)
        else:
            w.compute([n])
    for o in k.outputs:
        if o in row_values:
            w.store(o, f"rows * {row_len} + cols", "mask")
        else:
            if g.meta(o).numel != n_rows:
                raise Unsupported(f"row-kernel output {o} of shape {g.meta(o).shape}")
            w.store(o, "rows", "rmask")
    return w.launch(index, ("RB", "BR"), [((max(1, -(-n_rows // rb)),), {"RB": rb, "BR": br})])


def _prod(shape: tuple[int, ...]) -> int:
    out = 1
    for s in shape:
        out *= s
    return out
