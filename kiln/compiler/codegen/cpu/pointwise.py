"""Pointwise kernels: a fused DAG of elementwise ops in one vectorised loop nest.

The loop nest iterates the kernel's output shape (after coalescing dims); the
innermost dim is vectorised with ``kv::W`` lanes and a masked tail; outer dims and
blocks of the inner dim are split across torch's thread pool when the work is
large enough to pay for a parallel region.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from kiln.compiler.codegen.cpu.emit import (
    Operand,
    coalesce,
    load,
    pointwise_expr,
    splat_load,
    store,
)

# A body receives, per operand, the element index of the current vector and the
# operand's inner stride, plus the tail lane count (None for a full vector).
Body = Callable[[list[str], list[int], "str | None"], list[str]]

PARALLEL_MIN_ELEMS = 32768  # below this a parallel region costs more than it saves
TASK_ELEMS = 16384  # elements per parallel chunk, at least


def loop_nest(
    sizes: tuple[int, ...], operands: list[Operand], body: Body, threads: int
) -> list[str]:
    """C++ lines running ``body`` over every position of ``sizes``."""
    sizes, ops = coalesce(sizes, operands)
    inner, outer = sizes[-1], sizes[:-1]
    n_outer = 1
    for s in outer:
        n_outer *= s
    total = n_outer * inner
    blk = inner
    if threads > 1 and total >= PARALLEL_MIN_ELEMS and n_outer < 4 * threads:
        # Few long rows: split the inner dim into blocks so every thread gets work.
        blk = max(1024, -(-inner // (4 * threads)))
        blk = -(-blk // 16) * 16
    nb = -(-inner // blk)
    tasks = n_outer * nb
    per_task = blk if nb > 1 else inner
    grain = (
        tasks if (threads <= 1 or total < PARALLEL_MIN_ELEMS) else max(1, TASK_ELEMS // per_task)
    )

    lines = ["auto task = [&](int64_t t0, int64_t t1) {", "  for (int64_t t = t0; t < t1; ++t) {"]
    lines.append("    int64_t r = t;")
    lines.append(
        f"    const int64_t jb = r % {nb}; r /= {nb};" if nb > 1 else "    const int64_t jb = 0;"
    )
    for d in reversed(range(len(outer))):
        if d == 0:
            lines.append(f"    const int64_t i{d} = r;")
        else:
            lines.append(f"    const int64_t i{d} = r % {outer[d]}; r /= {outer[d]};")
    for k, op in enumerate(ops):
        terms = [str(op.offset)] + [
            f"i{d} * {op.strides[d]}" for d in range(len(outer)) if op.strides[d]
        ]
        lines.append(f"    const int64_t b{k} = {' + '.join(terms)};")
    lines.append(f"    int64_t j = jb * {blk};")
    lines.append(f"    const int64_t jend = std::min<int64_t>({inner}, j + {blk});")

    inner_strides = [op.strides[-1] for op in ops]

    def idx(k: int) -> str:
        s = inner_strides[k]
        return f"b{k}" if s == 0 else (f"b{k} + j" if s == 1 else f"b{k} + j * {s}")

    idxs = [idx(k) for k in range(len(ops))]
    lines.append("    for (; j + kv::W <= jend; j += kv::W) {")
    lines += ["      " + s for s in body(idxs, inner_strides, None)]
    lines.append("    }")
    lines.append("    if (j < jend) {")
    lines.append("      const int n = (int)(jend - j);")
    lines += ["      " + s for s in body(idxs, inner_strides, "n")]
    lines.append("    }")
    lines.append("  }")
    lines.append("};")
    lines.append(f"kiln::parallel(rt, {tasks}, {grain}, task);")
    return lines


def read(op: Operand, idx: str, stride: int, n: str | None) -> str:
    """Vector expression reading operand ``op`` at ``idx``."""
    return splat_load(op, idx) if stride == 0 else load(op, idx, stride, n)


def emit_pointwise(
    nodes: list,  # list[Node], topological
    in_ops: dict[str, Operand],  # external value -> operand (strides over the kernel shape)
    consts: dict[str, str],  # 0-d constant value -> C++ float literal
    out_ops: dict[str, Operand],  # in-kernel value written to memory -> operand
    dtypes: dict[str, torch.dtype],
    shape: tuple[int, ...],
    threads: int,
) -> list[str]:
    """Emit one fused pointwise kernel over ``shape``."""
    ext = list(in_ops)
    outs = list(out_ops)
    operands = [in_ops[v] for v in ext] + [out_ops[v] for v in outs]

    def body(idxs: list[str], strides: list[int], n: str | None) -> list[str]:
        names: dict[str, str] = {}
        lines = []
        for k, v in enumerate(ext):
            names[v] = f"x{k}"
            lines.append(f"const kv::V x{k} = {read(operands[k], idxs[k], strides[k], n)};")
        for v, lit in consts.items():
            names[v] = f"kv::splat({lit})"
        for m, node in enumerate(nodes):
            args = [names[i] for i in node.inputs]
            expr = pointwise_expr(node, args, [dtypes[i] for i in node.inputs])
            names[node.output] = f"y{m}"
            lines.append(f"const kv::V y{m} = {expr};")
        for k, v in enumerate(outs):
            j = len(ext) + k
            lines.append(store(operands[j], idxs[j], strides[j], names[v], n))
        return lines

    return loop_nest(shape, operands, body, threads)


def emit_copy(src: Operand, dst: Operand, shape: tuple[int, ...], threads: int) -> list[str]:
    """Copy a strided tensor into another strided tensor of the same shape."""

    def body(idxs: list[str], strides: list[int], n: str | None) -> list[str]:
        return [store(dst, idxs[1], strides[1], read(src, idxs[0], strides[0], n), n)]

    return loop_nest(shape, [src, dst], body, threads)
