"""Attention kernels of a program: a matched ``attention`` candidate run by the fused
flash-attention kernel (``kernels.gpu.attention``) on views of its stored operands."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kiln.compiler.codegen.gpu.expr import FLOAT_DTYPES, Unsupported
from kiln.compiler.fusion.attention import match_attention
from kiln.compiler.fusion.program import Kernel, Program
from kiln.compiler.ir.layout import Access

MAX_HEAD_DIM = 256


@dataclass(frozen=True)
class Operand3:
    """A strided (B, rows, cols) view of a stored root."""

    root: str
    shape: tuple[int, int, int]
    strides: tuple[int, int, int]
    offset: int


@dataclass(frozen=True)
class AttentionCall:
    """``out = softmax(scale * q @ k^T + mask) @ v`` for program kernel ``kernel``."""

    kernel: int
    q: Operand3
    k: Operand3  # (B, N, D)
    v: Operand3
    mask: Operand3 | None  # (B, M, N), stride 0 where broadcast
    out: str
    scale: float


def attention_call(prog: Program, index: int, k: Kernel) -> AttentionCall:
    g = prog.graph
    m = match_attention(g, g.node(k.nodes[-1]))
    if m is None:
        raise Unsupported("not an attention pattern")
    dtypes = {g.meta(v).dtype for v in (m.q, m.kt, m.v)}
    if len(dtypes) != 1 or not dtypes <= set(FLOAT_DTYPES):
        raise Unsupported(f"attention operands of dtypes {dtypes}")
    q, kt, v = (_operand(prog.access(x)) for x in (m.q, m.kt, m.v))
    kk = Operand3(
        kt.root,
        (kt.shape[0], kt.shape[2], kt.shape[1]),
        (kt.strides[0], kt.strides[2], kt.strides[1]),
        kt.offset,
    )
    if max(q.shape[2], v.shape[2]) > MAX_HEAD_DIM:
        raise Unsupported(f"head dims {q.shape[2]}, {v.shape[2]} over {MAX_HEAD_DIM}")
    mask = None
    if m.mask is not None:
        b, rows, cols = q.shape[0], q.shape[1], kk.shape[1]
        a = prog.access(m.mask).broadcast_to(m.score_shape)
        try:  # the mask as (B, M, N) strides, without a copy
            t = torch.empty(0, device="meta").as_strided(a.shape, a.strides, a.offset)
            t3 = t.view(b, rows, cols)
        except RuntimeError:
            raise Unsupported("the mask's batch/head broadcast has no 3-D strides") from None
        mask = Operand3(a.root, (b, rows, cols), tuple(t3.stride()), a.offset)  # type: ignore[arg-type]
    return AttentionCall(index, q, kk, v, mask, m.out, m.scale)


def _operand(a: Access) -> Operand3:
    if len(a.shape) != 3:
        raise Unsupported(f"attention operand of shape {a.shape}")
    return Operand3(a.root, a.shape, a.strides, a.offset)  # type: ignore[arg-type]
