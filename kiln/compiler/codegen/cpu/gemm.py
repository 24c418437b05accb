"""GEMM kernels: ``mm``/``bmm`` (and 1x1 convs, see ``pointconv.py``) with a fused
pointwise epilogue.

The micro-kernel (``kiln_gemm.h``) keeps a block of output rows in registers and
hands each finished row of a column panel (2 vectors wide) to the epilogue, which
applies the fused pointwise ops (bias, activation, residual, gating) on registers
and stores. Constant right-hand sides are packed into column panels at compile time;
others are packed per call into a per-thread scratch buffer.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kiln.compiler.codegen.cpu.emit import Operand, load, pointwise_expr, splat_load, store
from kiln.compiler.ir.graph import Node


@dataclass(frozen=True)
class GemmSpec:
    batch: int  # 1 for mm
    m: int
    k: int
    n: int
    a: Operand  # strides (batch, m, k)
    b: Operand | None  # runtime rhs, strides (batch, k, n); None when packed
    b_packed: str | None  # C++ pointer of the packed constant rhs (batch panels back to back)
    acc_value: str  # the mm/bmm output value
    epilogue: tuple[Node, ...]
    ext: dict[str, Operand]  # epilogue operands, strides (batch, m, n)
    consts: dict[str, str]
    outs: dict[str, Operand]  # written values, strides (batch, m, n)
    dtypes: dict[str, torch.dtype]
    row_bias: str | None = None  # C++ pointer of m floats added to the rows (a conv's bias)
    copies: tuple[tuple[str, Operand], ...] = ()  # further stores of values (scratch rows)


def packed_floats(k: int, n: int, nr: int) -> int:
    """Floats in one packed (k, n) matrix: panels of nr columns, zero padded."""
    return -(-n // nr) * nr * k


def emit_gemm(spec: GemmSpec, nr: int, threads: int) -> list[str]:
    s = spec
    panel_floats = packed_floats(s.k, s.n, nr)
    L = ["{"]
    a_contig_k = s.a.strides[2] == 1 or s.k == 1
    lda = s.a.strides[1] if a_contig_k else s.k

    def a_ptr(batch_expr: str) -> list[str]:
        base = f"{s.a.ptr} + {s.a.offset} + ({batch_expr}) * {s.a.strides[0]}"
        if a_contig_k:
            return [f"const float* A = {base};"]
        # Strided along K: gather A into a contiguous (m, k) scratch first.
        return [
            f"float* A = kgen::scratch(2, {s.m * s.k});",
            f"for (int64_t i = 0; i < {s.m}; ++i) for (int64_t q = 0; q < {s.k}; ++q)",
            f"  A[i * {s.k} + q] = ({base})[i * {s.a.strides[1]} + q * {s.a.strides[2]}];",
        ]

    def b_ptr(batch_expr: str) -> list[str]:
        if s.b is None:
            return [f"const float* Bp = {s.b_packed} + ({batch_expr}) * {panel_floats};"]
        b = s.b
        return [
            f"float* Bp = kgen::scratch(1, {panel_floats});",
            f"kg::pack_b({b.ptr} + {b.offset} + ({batch_expr}) * {b.strides[0]}, "
            f"{b.strides[1]}, {b.strides[2]}, {s.k}, {s.n}, Bp);",
        ]

    if s.batch == 1:
        L += ["  " + x for x in a_ptr("0") + b_ptr("0") + epilogue_lambda(s, "0")]
        L.append(f"  kg::gemm(rt, A, {lda}, {s.m}, Bp, {s.k}, {s.n}, epi);")
    else:
        panels = -(-s.n // nr)
        grain = max(1, (1 << 16) // max(1, s.m * s.n * s.k)) if threads > 1 else s.batch
        L.append("  auto task = [&](int64_t t0, int64_t t1) {")
        L.append("    for (int64_t bi = t0; bi < t1; ++bi) {")
        L += ["      " + x for x in a_ptr("bi") + b_ptr("bi") + epilogue_lambda(s, "bi")]
        L.append(f"      for (int64_t p = 0; p < {panels}; ++p)")
        L.append(f"        kg::gemm_panel(A, {lda}, Bp, {s.k}, 0, {s.m}, p, epi);")
        L.append("    }")
        L.append("  };")
        L.append(f"  kiln::parallel(rt, {s.batch}, {grain}, task);")
    L.append("}")
    return L


def epilogue_lambda(s: GemmSpec, batch_expr: str) -> list[str]:
    """``auto epi = [&](i, c0, a0, a1)``: the micro-kernel's row callback, applying the
    spec's epilogue to both vectors of a finished row (``i``: its row in ``s.outs`` and
    ``s.ext``) and storing them, the N tail masked."""
    out = ["auto epi = [&](int64_t i, int64_t c0, kv::V a0, kv::V a1) {"]
    for h in (0, 1):
        out.append("  {")
        out.append(f"    const int64_t c = c0 + {h} * kv::W;")
        out.append(f"    if (c < {s.n}) {{")
        bias = f" + kv::splat({s.row_bias}[i])" if s.row_bias else ""
        out.append(f"      const kv::V acc = a{h}{bias};")
        out.append(f"      if (c + kv::W <= {s.n}) {{")
        out += ["        " + x for x in _epilogue(s, batch_expr, None)]
        out.append("      } else {")
        out.append(f"        const int n = (int)({s.n} - c);")
        out += ["        " + x for x in _epilogue(s, batch_expr, "n")]
        out.append("      }")
        out.append("    }")
        out.append("  }")
    out.append("};")
    return out


def _epilogue(s: GemmSpec, batch_expr: str, n: str | None) -> list[str]:
    names: dict[str, str] = {s.acc_value: "acc"}
    out: list[str] = []
    for v, lit in s.consts.items():
        names[v] = f"kv::splat({lit})"

    def index(op: Operand) -> tuple[str, int]:
        sb, sm, sn = op.strides
        terms = [str(op.offset)]
        if sb:
            terms.append(f"({batch_expr}) * {sb}")
        if sm:
            terms.append(f"i * {sm}")
        if sn:
            terms.append("c" if sn == 1 else f"c * {sn}")
        return " + ".join(terms), sn

    for k, (v, op) in enumerate(s.ext.items()):
        idx, sn = index(op)
        expr = splat_load(op, idx) if sn == 0 else load(op, idx, sn, n)
        out.append(f"const kv::V e{k} = {expr};")
        names[v] = f"e{k}"
    for m, node in enumerate(s.epilogue):
        expr = pointwise_expr(
            node, [names[i] for i in node.inputs], [s.dtypes[i] for i in node.inputs]
        )
        out.append(f"const kv::V y{m} = {expr};")
        names[node.output] = f"y{m}"
    for v, op in [*s.outs.items(), *s.copies]:
        idx, sn = index(op)
        out.append(store(op, idx, sn, names[v], n))
    return out
