"""Row kernels: reductions fused with their pointwise prologue and epilogue.

The input shape splits into kept dims (the rows, run in parallel) and reduced dims
(one row). Each row is processed in *passes*: pass p computes the row values whose
inputs are ready after p reductions, accumulates the reductions fed by them, then
the per-row scalars that depend on those reductions. Softmax is 3 passes (max; exp
and sum; divide), layer norm 3 (mean; variance; normalise). Row values needed by a
later pass stay in a per-thread scratch row, so the row is read from memory once.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kiln.compiler.codegen.cpu.emit import (
    Operand,
    coalesce,
    load,
    pointwise_expr,
    splat_load,
    store,
)
from kiln.compiler.codegen.cpu.pointwise import PARALLEL_MIN_ELEMS, TASK_ELEMS
from kiln.compiler.ir.graph import Node

_INIT = {"sum": "0.0f", "max": "(-__builtin_inff())", "min": "__builtin_inff()"}
_COMBINE = {"sum": "{a} + {v}", "max": "kv::max({a}, {v})", "min": "kv::min({a}, {v})"}
_FINAL = {"sum": "kv::hsum", "max": "kv::hmax", "min": "kv::hmin"}


@dataclass(frozen=True)
class RowSpec:
    """A row kernel. ``row_in``/``row_out`` operands have strides over kept + reduced
    dims; ``scalar_in``/``scalar_out`` over the kept dims only."""

    kept: tuple[int, ...]  # sizes of kept dims
    reduced: tuple[int, ...]  # sizes of reduced dims
    nodes: tuple[Node, ...]  # topological
    row_values: frozenset[str]  # in-kernel values shaped like the reduction input
    row_in: dict[str, Operand]
    scalar_in: dict[str, Operand]
    consts: dict[str, str]
    row_out: dict[str, Operand]
    scalar_out: dict[str, Operand]
    dtypes: dict[str, torch.dtype]


def _levels(spec: RowSpec) -> dict[str, int]:
    level: dict[str, int] = {}
    for n in spec.nodes:
        base = max((level.get(i, 0) for i in n.inputs), default=0)
        level[n.output] = base + 1 if n.op in _INIT else base
    return level


def emit_rows(spec: RowSpec, threads: int) -> list[str]:
    """C++ lines for one row kernel."""
    level = _levels(spec)
    row_nodes = [n for n in spec.nodes if n.output in spec.row_values]
    reductions = [n for n in spec.nodes if n.op in _INIT]
    scalar_nodes = [n for n in spec.nodes if n.output not in spec.row_values and n.op not in _INIT]
    n_pass = 1 + max(
        [level[n.output] for n in row_nodes] + [level[r.output] - 1 for r in reductions]
    )

    # Coalesce kept dims over every operand, reduced dims over the row operands.
    row_names, sc_names = (
        list(spec.row_in) + list(spec.row_out),
        list(spec.scalar_in) + list(spec.scalar_out),
    )
    all_row = {**spec.row_in, **spec.row_out}
    all_sc = {**spec.scalar_in, **spec.scalar_out}
    nk = len(spec.kept)
    kept_view = [Operand(o.ptr, o.dtype, 0, o.strides[:nk]) for o in all_row.values()]
    kept_view += list(all_sc.values())
    kept, kept_ops = coalesce(spec.kept, kept_view)
    flat = _contiguous(spec.reduced)
    red_view = [Operand("", o.dtype, 0, o.strides[nk:]) for o in all_row.values()]
    red, red_ops = coalesce(spec.reduced, red_view + [Operand("", torch.float32, 0, flat)])
    row_len = 1
    for s in spec.reduced:
        row_len *= s

    # Which row values must survive into a later pass (scratch rows).
    later_use: dict[str, int] = {}
    for n in row_nodes + reductions:
        for i in n.inputs:
            if i in spec.row_values:
                later_use[i] = max(later_use.get(i, -1), _pass_of(n, level))
    scratch = [v for v in later_use if later_use[v] > level[v]]
    scr_slot = {v: m for m, v in enumerate(scratch)}

    n_rows = 1
    for s in kept:
        n_rows *= s
    total = n_rows * row_len
    grain = (
        n_rows if (threads <= 1 or total < PARALLEL_MIN_ELEMS) else max(1, TASK_ELEMS // row_len)
    )

    L = ["auto task = [&](int64_t t0, int64_t t1) {"]
    if scratch:
        L.append(f"  float* scr = kgen::scratch(0, {len(scratch) * row_len});")
    L.append("  for (int64_t t = t0; t < t1; ++t) {")
    L.append("    int64_t r = t;")
    for d in reversed(range(len(kept))):
        L.append(
            f"    const int64_t i{d} = r;"
            if d == 0
            else f"    const int64_t i{d} = r % {kept[d]}; r /= {kept[d]};"
        )
    names_all = row_names + sc_names
    originals = list(all_row.values()) + list(all_sc.values())
    for k, op in enumerate(kept_ops):
        terms = [str(originals[k].offset)]
        terms += [f"i{d} * {op.strides[d]}" for d in range(len(kept)) if op.strides[d]]
        L.append(f"    const int64_t b{k} = {' + '.join(terms)};  // {names_all[k]}")
    col = {v: k for k, v in enumerate(names_all)}
    sym: dict[str, str] = {v: f"kv::splat({lit})" for v, lit in spec.consts.items()}
    for v in spec.scalar_in:
        sym[v] = f"s_{col[v]}"
        L.append(f"    const kv::V s_{col[v]} = {splat_load(all_sc[v], f'b{col[v]}')};")

    def scalar_step(q: int) -> None:
        for n in scalar_nodes:
            if level[n.output] == q:
                expr = pointwise_expr(
                    n, [sym[i] for i in n.inputs], [spec.dtypes[i] for i in n.inputs]
                )
                sym[n.output] = f"z{spec.nodes.index(n)}"
                L.append(f"    const kv::V {sym[n.output]} = {expr};")

    scalar_step(0)
    for p in range(n_pass):
        reds = [n for n in reductions if level[n.output] - 1 == p]
        L.append(f"    // pass {p}")
        for r in reds:
            L.append(f"    float z{spec.nodes.index(r)}_s;")
        L.append("    {")
        for r in reds:
            L.append(f"      kv::V acc{spec.nodes.index(r)} = kv::splat({_INIT[r.op]});")
        L += _row_loop(spec, p, level, row_nodes, reds, red, red_ops, col, sym, scr_slot, row_len)
        for r in reds:
            ri = spec.nodes.index(r)
            sym[r.output] = f"z{ri}"
            L.append(f"      z{ri}_s = {_FINAL[r.op]}(acc{ri});")
        L.append("    }")
        for r in reds:
            ri = spec.nodes.index(r)
            L.append(f"    const kv::V z{ri} = kv::splat(z{ri}_s);")
        scalar_step(p + 1)
    for v, op in spec.scalar_out.items():
        L.append(f"    {op.ptr}[b{col[v]}] = ({op.ctype})(({sym[v]})[0]);")
    L += ["  }", "};", f"kiln::parallel(rt, {n_rows}, {grain}, task);"]
    return L


def _contiguous(shape: tuple[int, ...]) -> tuple[int, ...]:
    out, acc = [], 1
    for s in reversed(shape):
        out.append(acc)
        acc *= s
    return tuple(reversed(out))


def _pass_of(n: Node, level: dict[str, int]) -> int:
    return level[n.output] - 1 if n.op in _INIT else level[n.output]


def _row_loop(
    spec: RowSpec,
    p: int,
    level: dict[str, int],
    row_nodes: list[Node],
    reds: list[Node],
    red: tuple[int, ...],
    red_ops: list[Operand],
    col: dict[str, int],
    sym: dict[str, str],
    scr_slot: dict[str, int],
    row_len: int,
) -> list[str]:
    """The vectorised loop over one row for pass ``p``."""
    here = [n for n in row_nodes if level[n.output] == p]
    needed = {i for n in here + reds for i in n.inputs}
    flat_op = red_ops[-1]
    L: list[str] = []
    depth = len(red) - 1
    ind = "      "
    for d in range(depth):
        L.append(f"{ind}for (int64_t q{d} = 0; q{d} < {red[d]}; ++q{d}) {{")
        ind += "  "
    fterms = ["0"] + [f"q{d} * {flat_op.strides[d]}" for d in range(depth) if flat_op.strides[d]]
    L.append(f"{ind}const int64_t f = {' + '.join(fterms)};")
    inner = red[-1]
    L.append(f"{ind}int64_t j = 0;")

    def body(n: str | None) -> list[str]:
        out: list[str] = []
        loc = dict(sym)
        for v in needed:
            if v in spec.row_in:
                k = col[v]
                op = red_ops[k]
                terms = [f"b{k}"] + [
                    f"q{d} * {op.strides[d]}" for d in range(depth) if op.strides[d]
                ]
                s = op.strides[-1]
                idx = " + ".join(terms) + ("" if s == 0 else (" + j" if s == 1 else f" + j * {s}"))
                src = spec.row_in[v]
                expr = splat_load(src, idx) if s == 0 else load(src, idx, s, n)
                out.append(f"const kv::V r{k} = {expr};")
                loc[v] = f"r{k}"
            elif v in scr_slot and level[v] < p:
                ptr = f"(scr + {scr_slot[v] * row_len} + f + j)"
                out.append(
                    f"const kv::V c{scr_slot[v]} = {f'kv::loadn({ptr}, {n}, 0.0f)' if n else f'kv::load({ptr})'};"
                )
                loc[v] = f"c{scr_slot[v]}"
        for m in here:
            expr = pointwise_expr(m, [loc[i] for i in m.inputs], [spec.dtypes[i] for i in m.inputs])
            nm = f"y{spec.nodes.index(m)}"
            out.append(f"const kv::V {nm} = {expr};")
            loc[m.output] = nm
            if m.output in scr_slot:
                ptr = f"(scr + {scr_slot[m.output] * row_len} + f + j)"
                out.append(f"kv::storen({ptr}, {nm}, {n});" if n else f"kv::store({ptr}, {nm});")
            if m.output in spec.row_out:
                k = col[m.output]
                op = red_ops[k]
                terms = [f"b{k}"] + [
                    f"q{d} * {op.strides[d]}" for d in range(depth) if op.strides[d]
                ]
                s = op.strides[-1]
                idx = " + ".join(terms) + (" + j" if s == 1 else f" + j * {s}")
                out.append(store(spec.row_out[m.output], idx, s, nm, n))
        for r in reds:
            v = loc[r.inputs[0]]
            if n:
                v = f"kv::select(kv::cmp_lt(kv::iota(), kv::splat((float){n})), {v}, kv::splat({_INIT[r.op]}))"
            ri = spec.nodes.index(r)
            out.append(f"acc{ri} = {_COMBINE[r.op].format(a=f'acc{ri}', v=v)};")
        return out

    L.append(f"{ind}for (; j + kv::W <= {inner}; j += kv::W) {{")
    L += [ind + "  " + s for s in body(None)]
    L.append(f"{ind}}}")
    L.append(f"{ind}if (j < {inner}) {{")
    L.append(f"{ind}  const int n = (int)({inner} - j);")
    L += [ind + "  " + s for s in body("n")]
    L.append(f"{ind}}}")
    for _ in range(depth):
        ind = ind[:-2]
        L.append(f"{ind}}}")
    return L
