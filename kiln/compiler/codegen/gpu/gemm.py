"""GEMM templates: one mm/bmm with a fused pointwise epilogue, and chains of GEMMs
whose intermediates never leave the chip.

``gemm``: a program owns a ``(BM, BN)`` tile of ``C = A @ B`` (one batch entry for
bmm), streams ``K`` in ``BK`` slices through ``tl.dot`` with fp32 accumulation, then
applies the epilogue nodes (bias, activation, residual, scale, cast) to the tile and
stores what the kernel writes. A and B are read through their strided accesses, so a
transposed weight (``permute`` view of ``W``) is read in place.

``chain``: ``mm_1 -> epilogue_1 -> mm_2 -> ... -> mm_L -> epilogue_L`` (an MLP). A
program owns ``BM`` rows: stage 1 streams its ``K`` like ``gemm`` into a full-width
``(BM, N_1)`` accumulator; each later stage multiplies the previous stage's result,
still in registers, by its whole weight (``N_{i-1} x N_i``, at most ``MAX_WIDTH``
each way), so only the chain's input, weights, epilogue operands and outputs touch
memory — the proposal's cross-GEMM fusion for memory-bound small GEMMs.

Dot operands stay in their dtype (tensor cores for fp16/bf16). fp32 operands multiply
at IEEE precision unless the user allowed TF32 (``torch.backends.cuda.matmul.
allow_tf32``), so results are as faithful as eager's by default. Under the interpreter
bf16 operands are upcast first: its ``tl.dot`` multiplies bf16 as raw bits.
"""

from __future__ import annotations

import torch

from kiln.compiler.codegen.gpu.expr import FLOAT_DTYPES, TL_DTYPES, Unsupported
from kiln.compiler.codegen.gpu.pointwise import bind_operand, external_inputs
from kiln.compiler.codegen.gpu.source import KernelWriter, Launch, interpreting, next_pow2
from kiln.compiler.fusion.program import Kernel, Program
from kiln.compiler.ir.graph import Node, ValueKind

MAX_WIDTH = 256  # widest chain intermediate held in registers


def _dot(a: str, b: str, dtype: torch.dtype) -> str:
    """``tl.dot`` of two operand tiles of ``dtype`` with fp32 accumulation (see the module
    docstring for the precision and interpreter rules)."""
    if dtype == torch.float32:
        precision = "tf32" if torch.backends.cuda.matmul.allow_tf32 else "ieee"
        return f'tl.dot({a}, {b}, input_precision="{precision}")'
    if interpreting() and dtype == torch.bfloat16:
        return f"tl.dot({a}.to(tl.float32), {b}.to(tl.float32))"
    return f"tl.dot({a}, {b})"


def _operand_dtype(prog: Program, mm: Node) -> torch.dtype:
    dts = {prog.graph.meta(v).dtype for v in mm.inputs}
    if len(dts) != 1 or next(iter(dts)) not in FLOAT_DTYPES:
        raise Unsupported(f"{mm.op} of dtypes {sorted(str(d) for d in dts)}")
    return dts.pop()


def _strided(prog: Program, value: str, batched: bool) -> tuple[str, int, tuple[int, int, int]]:
    """(root, offset, (batch, row, col) strides) of a 2-D/3-D GEMM operand."""
    a = prog.access(value)
    if prog.graph.values[a.root].kind == ValueKind.CONST:
        raise Unsupported(f"GEMM operand {value} is a scalar constant")
    st = a.strides if batched else (0, *a.strides)
    return a.root, a.offset, (st[0], st[1], st[2])


def gemm(prog: Program, index: int, k: Kernel, nodes: list[Node]) -> Launch:
    g = prog.graph
    mm = nodes[0]
    if mm.op not in ("mm", "bmm") or any(n.op in ("mm", "bmm") for n in nodes[1:]):
        raise Unsupported("a gemm kernel starts with its one mm/bmm")
    dtype = _operand_dtype(prog, mm)
    batched = mm.op == "bmm"
    out_shape = g.meta(mm.output).shape
    bt, m, n = out_shape if batched else (1, *out_shape)
    kk = g.meta(mm.inputs[0]).shape[-1]
    epi = nodes[1:]
    for e in epi:
        if g.meta(e.output).shape != out_shape:
            raise Unsupported(f"epilogue {e.op} of shape {g.meta(e.output).shape}")

    w = KernelWriter(g, f"gemm_{index}")
    w.emit("pid = tl.program_id(0)")
    w.emit("bid = tl.program_id(1)")
    w.emit("rm = (pid // GRID_N) * BM + tl.arange(0, BM)[:, None]  # (BM, 1)")
    w.emit("rn = (pid % GRID_N) * BN + tl.arange(0, BN)[None, :]  # (1, BN)")
    _k_loop(w, prog, mm, kk, dtype, batched, "rn", f"rn < {n}", m, "BN", "acc")
    w.emit(f"mask = (rm < {m}) & (rn < {n})")
    _epilogue(w, prog, epi, mm.output, "acc", out_shape, batched)
    for o in k.outputs:
        w.store(o, f"bid * {m * n} + rm * {n} + rn", "mask")
    variants = []
    for bm, bn, bk, warps in _gemm_configs(m, n, kk):
        grid_n = -(-n // bn)
        grid = (-(-m // bm) * grid_n, bt)
        opts = {"BM": bm, "BN": bn, "BK": bk, "GRID_N": grid_n, "num_warps": warps}
        variants.append((grid, opts))
    return w.launch(index, ("BM", "BN", "BK", "GRID_N"), variants)


def _k_loop(
    w: KernelWriter,
    prog: Program,
    mm: Node,
    kk: int,
    dtype: torch.dtype,
    batched: bool,
    rn: str,
    nmask: str,
    m: int,
    width: str,
    acc: str,
) -> None:
    """Emit ``acc = A[rm, :] @ B[:, rn]`` streamed over K in BK slices."""
    a_root, a_off, sa = _strided(prog, mm.inputs[0], batched)
    b_root, b_off, sb = _strided(prog, mm.inputs[1], batched)
    pa, pb = w.ptr(a_root), w.ptr(b_root)
    w.emit(f"{acc} = tl.zeros((BM, {width}), tl.float32)")
    w.emit("rk = tl.arange(0, BK)")
    w.emit(f"for k0 in range(0, {kk}, BK):")
    w.emit("    ka = k0 + rk[None, :]  # (1, BK)")
    w.emit("    kb = k0 + rk[:, None]  # (BK, 1)")
    w.emit(
        f"    a = tl.load({pa} + {a_off} + bid * {sa[0]} + rm * {sa[1]} + ka * {sa[2]}, "
        f"mask=(rm < {m}) & (ka < {kk}), other=0.0)"
    )
    w.emit(
        f"    b = tl.load({pb} + {b_off} + bid * {sb[0]} + kb * {sb[1]} + {rn} * {sb[2]}, "
        f"mask=(kb < {kk}) & ({nmask}), other=0.0)"
    )
    w.emit(f"    {acc} += {_dot('a', 'b', dtype)}")


def _epilogue(
    w: KernelWriter,
    prog: Program,
    epi: list[Node],
    acc_value: str,
    acc: str,
    shape: tuple[int, ...],
    batched: bool,
    rn: str = "rn",
) -> None:
    """Bind the accumulator to ``acc_value`` and compute ``epi`` on the tile, loading
    external operands at (bid, rm, rn) through their strides."""
    g = prog.graph
    w.env[acc_value] = (acc, False)
    for v in external_inputs(epi):
        if v in w.env:
            continue
        a = prog.access(v)
        if g.values[a.root].kind == ValueKind.CONST:
            bind_operand(w, prog, v, shape, "", None)
            continue
        b = a.broadcast_to(shape)
        st = b.strides if batched else (0, *b.strides)
        w.env[v] = w.load(
            v, b.root, f"{b.offset} + bid * {st[0]} + rm * {st[1]} + {rn} * {st[2]}", "mask"
        )
    w.compute(epi)


def _gemm_configs(m: int, n: int, k: int) -> list[tuple[int, int, int, int]]:
    """(BM, BN, BK, warps) worth timing for this shape; the first is the default."""
    bm0, bn0 = min(64, next_pow2(m, 16)), min(64, next_pow2(n, 16))
    bk0 = min(32, next_pow2(k, 16))
    out = [(bm0, bn0, bk0, 4)]
    for bm, bn, bk, warps in (
        (128, 64, 32, 4),
        (64, 128, 32, 4),
        (128, 128, 32, 8),
        (32, 64, 64, 4),
        (16, 64, 128, 4),
        (128, 256, 64, 8),
    ):
        c = (min(bm, next_pow2(m, 16)), min(bn, next_pow2(n, 16)), min(bk, next_pow2(k, 16)), warps)
        if c not in out:
            out.append(c)
    return out


def chain(prog: Program, index: int, k: Kernel, nodes: list[Node]) -> Launch:
    g = prog.graph
    mms = [n for n in nodes if n.op in ("mm", "bmm")]
    if len(mms) < 2 or any(n.op != "mm" for n in mms) or nodes[0] is not mms[0]:
        raise Unsupported("a chain is two or more mm nodes, the first one first")
    stage = {mm.output: i for i, mm in enumerate(mms)}
    epis: list[list[Node]] = [[] for _ in mms]
    for n in nodes:
        if n in mms:
            continue
        own = [stage[v] for v in n.inputs if v in stage]
        if not own:
            raise Unsupported(f"chain node {n.name} reads nothing of the chain")
        stage[n.output] = max(own)
        epis[max(own)].append(n)
    widths = [g.meta(mm.output).shape[1] for mm in mms]
    if max(widths) > MAX_WIDTH:
        raise Unsupported(f"chain widths {widths} exceed {MAX_WIDTH}")
    m = g.meta(mms[0].output).shape[0]
    w = KernelWriter(g, f"chain_{index}")
    w.emit("bid = 0")
    w.emit("rm = tl.program_id(0) * BM + tl.arange(0, BM)[:, None]  # (BM, 1)")
    prev = ""
    for i, mm in enumerate(mms):
        dtype = _operand_dtype(prog, mm)
        np_ = next_pow2(widths[i], 16)
        rn, n_i = f"rn{i}", widths[i]
        w.emit(f"{rn} = tl.arange(0, {np_})[None, :]  # (1, N{i})")
        for e in epis[i]:
            if g.meta(e.output).shape != (m, n_i):
                raise Unsupported(f"chain node {e.name} is not of its stage's shape")
        if i == 0:
            k0 = g.meta(mm.inputs[0]).shape[1]
            _k_loop(w, prog, mm, k0, dtype, False, rn, f"{rn} < {n_i}", m, str(np_), f"acc{i}")
        else:
            if mm.inputs[0] not in w.env or stage.get(mm.inputs[0]) != i - 1:
                raise Unsupported(f"{mm.name} does not read the previous stage")
            h, _ = w.env[mm.inputs[0]]
            kp, k_i = next_pow2(widths[i - 1], 16), widths[i - 1]
            b_root, b_off, sb = _strided(prog, mm.inputs[1], False)
            w.emit(f"h = tl.where({prev} < {k_i}, {h}, 0.0).to({TL_DTYPES[dtype]})  # (BM, K{i})")
            w.emit(f"kb = tl.arange(0, {kp})[:, None]")
            w.emit(
                f"wt = tl.load({w.ptr(b_root)} + {b_off} + kb * {sb[1]} + {rn} * {sb[2]}, "
                f"mask=(kb < {k_i}) & ({rn} < {n_i}), other=0.0)"
            )
            w.emit(f"acc{i} = {_dot('h', 'wt', dtype)}")
        w.emit(f"mask = (rm < {m}) & ({rn} < {n_i})")
        _epilogue(w, prog, epis[i], mm.output, f"acc{i}", (m, n_i), False, rn)
        for o in k.outputs:
            if stage.get(o) == i:
                w.store(o, f"rm * {n_i} + {rn}", "mask")
        prev = rn
    variants = []
    for bm, warps in ((64, 4), (32, 4), (128, 8), (16, 4)):
        bk = min(32, next_pow2(g.meta(mms[0].inputs[0]).shape[1], 16))
        variants.append(((-(-m // bm),), {"BM": bm, "BK": bk, "num_warps": warps}))
    return w.launch(index, ("BM", "BK"), variants)
