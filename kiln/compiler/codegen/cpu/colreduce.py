"""Column reductions: a sum/max/min over leading or middle dims of a value whose last
dim is kept and contiguous, vectorised along that last dim.

Channels-last values reduce this way: global average pooling and instance norm's
statistics of an (N, H, W, C) value sum over H and W for each channel, and each pixel's
channels are contiguous. The row kernels (``reduction.py``) vectorise along the reduced
dims instead, which here would gather one element per channel stride. A task owns one
position of the kept outer dims and a block of up to ``CB`` vectors of the last dim; it
walks every reduced position, accumulating in registers, then stores the block.
"""

from __future__ import annotations

import math
from typing import Protocol

from kiln.compiler.codegen.cpu.emit import Operand
from kiln.compiler.ir.graph import Graph, Node
from kiln.compiler.ir.layout import contiguous_strides

CB = 4  # vectors of the last dim per task
_INIT = {
    "sum": "kv::splat(0.0f)",
    "max": "kv::splat(-__builtin_inff())",
    "min": "kv::splat(__builtin_inff())",
}
_COMBINE = {"sum": "{a} + {x}", "max": "kv::max({a}, {x})", "min": "kv::min({a}, {x})"}
MIN_TASK_ELEMS = 16384  # elements a parallel chunk reads at least


class ColumnState(Protocol):
    """What the lowering needs of the program being generated (``codegen._Gen``)."""

    g: Graph
    threads: int

    def operand(self, value: str, shape: tuple[int, ...]) -> Operand: ...
    def out_operand(self, value: str, strides: tuple[int, ...] | None = None) -> Operand: ...


def column_reduction(gen: ColumnState, node: Node, lanes: int) -> list[str] | None:
    """C++ lines for a lone reduction ``node`` that reduces neither its last dim nor only
    trailing dims (those are row kernels), reading that last dim contiguously; None when
    it is not of that form."""
    g = gen.g
    shape = g.meta(node.inputs[0]).shape
    r = len(shape)
    dims = sorted({d % r for d in node.attrs["dims"]}) if r else []
    if (
        r < 2
        or not dims
        or r - 1 in dims
        or g.meta(node.output).dtype != g.meta(node.inputs[0]).dtype
    ):
        return None
    x = gen.operand(node.inputs[0], shape)
    if x.strides[-1] != 1 or x.ctype != "float":
        return None
    kept = [d for d in range(r - 1) if d not in dims]  # outer kept dims (the last is vectorised)
    out_shape = tuple(1 if d in dims else s for d, s in enumerate(shape))  # keepdim view
    y = gen.out_operand(node.output, contiguous_strides(out_shape))
    return _emit(node.op, shape, kept, dims, x, y, lanes, gen.threads)


def _emit(
    op: str,
    shape: tuple[int, ...],
    kept: list[int],
    dims: list[int],
    x: Operand,
    y: Operand,
    lanes: int,
    threads: int,
) -> list[str]:
    c = shape[-1]
    vecs = -(-c // lanes)
    blocks = -(-vecs // CB)
    last_nv, tail = vecs - (blocks - 1) * CB, c - (vecs - 1) * lanes
    outer = math.prod(shape[d] for d in kept)
    reduced = math.prod(shape[d] for d in dims)
    tasks = outer * blocks
    per_task = reduced * min(c, CB * lanes)
    grain = tasks if threads <= 1 else max(1, -(-MIN_TASK_ELEMS // per_task))
    L = [
        f'static_assert(kv::W == {lanes}, "column reduction emitted for another vector width");',
        "auto task = [&](int64_t t0, int64_t t1) {",
        "  for (int64_t t = t0; t < t1; ++t) {",
        f"    const int64_t cb = t % {blocks};",
        f"    int64_t o = t / {blocks};",
    ]
    xb, yb = [str(x.offset)], [str(y.offset)]
    for d in reversed(kept):
        L.append(f"    const int64_t k{d} = o % {shape[d]}; o /= {shape[d]};")
        xb.append(f"k{d} * {x.strides[d]}")
        yb.append(f"k{d} * {y.strides[d]}")
    L.append(f"    const float* xs = {x.ptr} + {' + '.join(xb)} + cb * {CB * lanes};")
    L.append(f"    float* ys = {y.ptr} + {' + '.join(yb)} + cb * {CB * lanes};")
    full = _block(op, shape, dims, x, CB, None, lanes)
    part = _block(op, shape, dims, x, last_nv, tail if tail < lanes else None, lanes)
    if blocks == 1:
        L += ["    " + line for line in part]
    elif full == part:
        L += ["    " + line for line in full]
    else:
        L.append(f"    if (cb < {blocks - 1}) {{")
        L += ["      " + line for line in full]
        L.append("    } else {")
        L += ["      " + line for line in part]
        L.append("    }")
    L += ["  }", "};", f"kiln::parallel(rt, {tasks}, {grain}, task);"]
    return L


def _block(
    op: str,
    shape: tuple[int, ...],
    dims: list[int],
    x: Operand,
    nv: int,
    tail: int | None,
    lanes: int,
) -> list[str]:
    """Reduce ``nv`` vectors from ``xs`` over the reduced dims into ``ys`` (the last one
    ``tail`` lanes wide; None: full)."""
    L = [f"kv::V a{j} = {_INIT[op]};" for j in range(nv)]
    depth, idx = "", []
    for d in dims:
        L.append(f"{depth}for (int64_t r{d} = 0; r{d} < {shape[d]}; ++r{d}) {{")
        depth += "  "
        idx.append(f"r{d} * {x.strides[d]}")
    L.append(f"{depth}const float* p = xs + {' + '.join(idx)};")
    for j in range(nv):
        ptr = f"p + {j * lanes}"
        load = f"kv::loadn({ptr}, {tail}, 0.0f)" if tail and j == nv - 1 else f"kv::load({ptr})"
        L.append(f"{depth}a{j} = {_COMBINE[op].format(a=f'a{j}', x=load)};")
    for _ in dims:
        depth = depth[:-2]
        L.append(f"{depth}}}")
    for j in range(nv):
        if tail and j == nv - 1:
            L.append(f"kv::storen(ys + {j * lanes}, a{j}, {tail});")
        else:
            L.append(f"kv::store(ys + {j * lanes}, a{j});")
    return L
