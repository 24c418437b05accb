"""GEMM chains on the CPU: ``mm_1 -> epilogue_1 -> mm_2 -> ... -> mm_L`` (an MLP) in one
parallel region, row block by row block.

Row i of a GEMM's output depends only on row i of its left operand, so the chain's rows
split into blocks and each thread carries its own blocks through every stage: stage s
multiplies the block's rows of stage s-1's result (kept in a per-thread scratch, never
stored) by its weight, packed at compile time, applies the stage's epilogue on
registers, keeps the result for stage s+1 and stores whatever other kernels read. A
stage's left operand may be a ``cat`` of the previous result and values from outside (a
skip connection feeding the input back in): the result goes into its columns of the
scratch rows and the outside pieces' rows are copied beside it.
Separate ``gemm`` kernels open one parallel region per layer and split its columns
between the threads, so each layer waits for the slowest thread of the one before; in
a chain no thread waits until the end. Each thread reads every weight instead of its
share of the columns; ``fusion/cpu_cost.py`` weighs that against the regions saved.

The row blocks (``fusion.chains.chain_row_blocks``) have near-equal heights; within a
block, each weight panel runs over the block's rows in register blocks as
``kg::gemm_panel`` splits them.
"""

from __future__ import annotations

from typing import Protocol

import torch

from kiln.compiler.codegen.cpu.dwconv import KernelState
from kiln.compiler.codegen.cpu.emit import FLOAT, Operand, supports_pointwise
from kiln.compiler.codegen.cpu.gemm import GemmSpec, epilogue_lambda
from kiln.compiler.fusion.chains import chain_row_blocks
from kiln.compiler.fusion.cpu_cost import register_rows
from kiln.compiler.fusion.program import Kernel
from kiln.compiler.ir.graph import Node, OpClass

SCRATCH_SLOTS = (3, 4)  # kgen::scratch slots of the ping-pong stage results
GATHER_SLOT = 5  # ... of the first stage's left operand when it is strided along K


class ChainState(KernelState, Protocol):
    """What the chain lowering needs of the program being generated."""

    def packed_b(self, b_val: str, batched: bool) -> str | None: ...


def split_stages(nodes: list[Node]) -> tuple[list[tuple[Node, list[Node]]], dict[str, Node]]:
    """(mm, its epilogue nodes) per stage, in order, and the ``cat`` producing a stage's
    left operand (by its output); ValueError unless every node is an mm, a pointwise op
    reading values of exactly one stage, or such a cat."""
    stages: list[tuple[Node, list[Node]]] = []
    stage_of: dict[str, int] = {}
    cats: dict[str, Node] = {}
    for n in nodes:
        if n.op == "mm":
            stages.append((n, []))
            stage_of[n.output] = len(stages) - 1
            continue
        own = {stage_of[v] for v in n.inputs if v in stage_of}
        if n.op == "cat" and len(own) == 1:
            cats[n.output] = n
            stage_of[n.output] = own.pop()
            continue
        if n.cls != OpClass.POINTWISE or not supports_pointwise(n) or len(own) != 1:
            raise ValueError(f"{n.op} is not the epilogue of one chain stage")
        s = own.pop()
        stages[s][1].append(n)
        stage_of[n.output] = s
    if len(stages) < 2 or nodes[0].op != "mm":
        raise ValueError("a chain is two or more mm nodes, the first one first")
    return stages, cats


def _block_rows(op: Operand) -> Operand:
    """``op`` (strides (m, n)) as (batch 0, m, n) strides from the row block's first row."""
    sm = op.strides[0]
    ptr = f"({op.ptr} + r0 * {sm})" if sm else op.ptr
    return Operand(ptr, op.dtype, op.offset, (0, *op.strides))


def chain_kernel(gen: ChainState, k: Kernel, nodes: list[Node]) -> list[str]:
    """Lower a ``chain`` kernel to C++ lines; ValueError when it is not of that form."""
    g = gen.g
    stages, cats = split_stages(nodes)
    for mm, _ in stages:
        if any(g.meta(v).dtype != torch.float32 for v in mm.inputs):
            raise ValueError("non-fp32 gemm in a chain")
    m = g.meta(stages[0][0].output).shape[0]
    mr = register_rows("avx512" if gen.nr == 32 else "avx2")
    units = chain_row_blocks(m, gen.threads, mr)
    rows_max = -(-m // units)
    scratch = rows_max * max(g.meta(mm.inputs[0]).shape[1] for mm, _ in stages[1:])
    stage_values = {n.output for n in nodes}
    body = [
        f"float* const H0 = kgen::scratch({SCRATCH_SLOTS[0]}, {scratch});",
        f"float* const H1 = kgen::scratch({SCRATCH_SLOTS[1]}, {scratch});",
        "for (int64_t u = u0; u < u1; ++u) {",
        f"  const int64_t r0 = u * {m} / {units}, rows = (u + 1) * {m} / {units} - r0;",
    ]
    for s in range(len(stages)):
        body += ["  " + x for x in _stage(gen, k, stages, cats, s, stage_values, rows_max)]
    body.append("}")
    lines = ["{", "  auto task = [&](int64_t u0, int64_t u1) {"]
    lines += ["    " + x for x in body]
    lines += ["  };", f"  kiln::parallel(rt, {units}, 1, task);", "}"]
    return lines


def _stage(
    gen: ChainState,
    k: Kernel,
    stages: list[tuple[Node, list[Node]]],
    cats: dict[str, Node],
    s: int,
    stage_values: set[str],
    rows_max: int,
) -> list[str]:
    """One stage over the row block ``[r0, r0 + rows)``: its left operand (the kernel's
    input, or the previous stage's scratch rows), every panel through the micro-kernel,
    the epilogue storing the stage's outputs and the next stage's operand (into its
    columns of a cat, whose outside pieces are then copied beside it)."""
    g = gen.g
    mm, epi = stages[s]
    a_val, b_val = mm.inputs
    kk, n = g.meta(a_val).shape[1], g.meta(mm.output).shape[1]
    b_packed = gen.packed_b(b_val, False)
    if b_packed is None:
        raise ValueError("a chain stage's right operand must be a constant")
    lines = ["{"]
    if s > 0:
        lines.append(f"  const float* A = H{(s - 1) % 2};")
        lda = kk
    else:
        a = gen.operand(a_val, g.meta(a_val).shape)
        base = f"{a.ptr} + {a.offset}"
        if a.strides[1] == 1 or kk == 1:
            lines.append(f"  const float* A = {base} + r0 * {a.strides[0]};")
            lda = a.strides[0] if kk > 1 else 1
        else:  # strided along K: gather the block's rows contiguously
            lines += [
                f"  float* A = kgen::scratch({GATHER_SLOT}, {rows_max * kk});",
                f"  for (int64_t i = 0; i < rows; ++i) for (int64_t q = 0; q < {kk}; ++q)",
                f"    A[i * {kk} + q] = ({base})[(r0 + i) * {a.strides[0]} + q * {a.strides[1]}];",
            ]
            lda = kk
    shape = g.meta(mm.output).shape
    ext = [v for v in gen.external_inputs(epi) if v not in stage_values]
    consts = gen.consts(ext)
    copies: tuple[tuple[str, Operand], ...] = ()
    pieces: list[str] = []  # C++ copying a cat's outside pieces into the scratch rows
    if s + 1 < len(stages):
        carry = stages[s + 1][0].inputs[0]
        width = g.meta(carry).shape[1]
        column, carry_at = 0, -1
        for piece in cats[carry].inputs if carry in cats else (carry,):
            p_width = g.meta(piece).shape[1]
            if piece in stage_values:
                carry, carry_at = piece, column
            else:
                pieces += _copy_rows(gen.operand(piece, g.meta(piece).shape), f"H{s % 2}",
                                     width, column, p_width)  # fmt: skip
            column += p_width
        if carry_at < 0:
            raise ValueError("a chain stage's left operand holds no value of the stage before")
        copies = ((carry, Operand(f"H{s % 2}", FLOAT, carry_at, (0, width, 1))),)
    own = {mm.output} | {e.output for e in epi}
    spec = GemmSpec(
        batch=1,
        m=rows_max,
        k=kk,
        n=n,
        a=Operand("A", FLOAT, 0, (0, lda, 1)),
        b=None,
        b_packed=b_packed,
        acc_value=mm.output,
        epilogue=tuple(epi),
        ext={v: _block_rows(gen.operand(v, shape)) for v in ext if v not in consts},
        consts=consts,
        outs={v: _block_rows(gen.out_operand(v)) for v in k.outputs if v in own},
        dtypes=gen.dtypes(),
        copies=copies,
    )
    panels = -(-n // gen.nr)
    lines += ["  " + x for x in epilogue_lambda(spec, "0")]
    lines.append(f"  const float* Bp = {b_packed};")
    lines.append(f"  for (int64_t p = 0; p < {panels}; ++p)")
    lines.append(f"    kg::gemm_panel(A, {lda}, Bp, {kk}, 0, rows, p, epi);")
    lines += ["  " + x for x in pieces]
    lines.append("}")
    return lines


def _copy_rows(src: Operand, dst: str, width: int, column: int, n: int) -> list[str]:
    """Copy the row block's rows of ``src`` (strides (m, n), ``n`` columns) into columns
    ``[column, column + n)`` of the scratch rows ``dst`` (``width`` floats each)."""
    sm, sn = src.strides
    return [
        "for (int64_t i = 0; i < rows; ++i)",
        f"  for (int64_t q = 0; q < {n}; ++q)",
        f"    {dst}[i * {width} + {column} + q] = "
        f"{src.ptr}[{src.offset} + (r0 + i) * {sm} + q * {sn}];",
    ]
