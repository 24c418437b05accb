"""Fused attention ("flash attention") forward: ``out = softmax(scale * q @ k^T + mask) @ v``.

Each program owns ``BLOCK_M`` query rows of one batch entry and streams the keys and values in
``BLOCK_N``-row tiles, so the (M, N) score matrix never exists in memory. Per query row it
keeps a running maximum ``m`` and a running sum ``l`` of ``exp(s - m)`` (the online softmax):
for each key tile, with scores ``s = scale * q @ k^T + mask`` (BLOCK_M, BLOCK_N) in fp32,

    m_new = max(m, rowmax(s));  alpha = exp(m - m_new);  p = exp(s - m_new)
    l     = l * alpha + rowsum(p);  acc = acc * alpha + p @ v;  m = m_new

and at the end ``out = acc / l``. Exponents are taken in the natural-log domain (``tl.exp``),
not pre-scaled by log2(e): an additive mask holding ``finfo.min`` (as Hugging Face models build
them) would overflow to -inf if multiplied, and change fully masked rows' results.

Masking and edge cases:

* Keys past N, query rows past M and head-dim columns past D / Dv are masked loads (zeros);
  keys past N get score -inf. D and Dv are padded to a power of two >= 16 (at most 256).
* ``causal``: key j is visible to query i iff ``j <= i + (N - M)`` (bottom-right aligned; for
  M == N this is torch's ``is_causal``). Key tiles wholly above the diagonal are skipped.
* A row whose every key is masked (all scores -inf) gives NaN, like eager ``torch.softmax``:
  ``acc = 0`` and ``l = 0``. While a row has seen only -inf, its running max is -inf and
  ``exp(-inf - -inf)`` would be NaN, so the subtracted max is replaced by 0 there (``p`` and
  ``alpha`` are then 0): a row whose first key tiles are fully masked but later ones are not
  comes out right. N == 0 gives zeros, like eager (an empty softmax times an empty v).

Precision: fp32 accumulation and softmax; ``p`` is rounded to v's dtype before ``p @ v`` (as
eager fp16/bf16 SDPA kernels do) so the tensor cores take both dots. fp32 inputs use exact fp32
products (``input_precision="ieee"``) unless ``torch.backends.cuda.matmul.allow_tf32`` is set.

The block sizes (:func:`default_config`) are untuned starting points; :func:`attention_configs`
lists candidates worth timing on a GPU. File order follows the Triton tutorials: kernel,
wrapper (validate, allocate, launch), reference. The reference is also the fallback: a call on
CPU tensors without ``TRITON_INTERPRET=1`` runs it.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from torch import Tensor

INPUT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
MAX_HEAD_DIM = 256


# ----------------------------------------------------------------------------------------------
# Kernel
# ----------------------------------------------------------------------------------------------


@triton.jit
def _attention_kernel(
    q_ptr, k_ptr, v_ptr, mask_ptr, o_ptr,
    M, N, D, DV, m_tiles, scale,
    stride_qb, stride_qm, stride_qd,
    stride_kb, stride_kn, stride_kd,
    stride_vb, stride_vn, stride_vd,
    stride_ab, stride_am, stride_an,
    stride_ob, stride_om, stride_od,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
    HAS_MASK: tl.constexpr, CAUSAL: tl.constexpr, UPCAST: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):  # fmt: skip
    """BLOCK_M query rows of one batch entry; 1-D grid of B * m_tiles programs."""
    pid = tl.program_id(0)
    b = (pid // m_tiles).to(tl.int64)  # 64-bit batch offsets: B * stride may pass 2**31
    tile = pid % m_tiles
    if CAUSAL:  # the last row tiles see the most keys: launch them first
        tile = m_tiles - 1 - tile
    offs_m = tile * BLOCK_M + tl.arange(0, BLOCK_M)  # (BM,)
    offs_n = tl.arange(0, BLOCK_N)  # (BN,)
    offs_d = tl.arange(0, BLOCK_D)  # (BD,)
    offs_dv = tl.arange(0, BLOCK_DV)  # (BDV,)
    mask_m = offs_m < M
    mask_d = offs_d < D
    mask_dv = offs_dv < DV
    q_ptrs = q_ptr + b * stride_qb + offs_m[:, None] * stride_qm + offs_d[None, :] * stride_qd
    q = tl.load(q_ptrs, mask=mask_m[:, None] & mask_d[None, :], other=0.0)  # (BM, BD)
    # The interpreter multiplies bf16 dot operands as raw bits (errors of 1e10) and fp16 ones in
    # numpy's fp16; under it (only) the operands go to fp32 first, which is exact for both.
    if UPCAST:
        q = q.to(tl.float32)
    kt_ptrs = k_ptr + b * stride_kb + offs_d[:, None] * stride_kd + offs_n[None, :] * stride_kn
    v_ptrs = v_ptr + b * stride_vb + offs_n[:, None] * stride_vn + offs_dv[None, :] * stride_vd
    a_ptrs = mask_ptr + b * stride_ab + offs_m[:, None] * stride_am + offs_n[None, :] * stride_an
    m_i = tl.full((BLOCK_M,), float("-inf"), dtype=tl.float32)  # running max
    l_i = tl.zeros((BLOCK_M,), dtype=tl.float32)  # running sum of exp(s - m_i)
    acc = tl.zeros((BLOCK_M, BLOCK_DV), dtype=tl.float32)  # running sum of exp(s - m_i) @ v
    hi = N
    if CAUSAL:  # keys past the tile's last row's diagonal are invisible to the whole tile
        hi = tl.minimum(N, (tile + 1) * BLOCK_M + (N - M))
    for n0 in range(0, hi, BLOCK_N):
        keys = n0 + offs_n  # (BN,)
        mask_n = keys < N
        kt = tl.load(kt_ptrs, mask=mask_d[:, None] & mask_n[None, :], other=0.0)  # (BD, BN)
        if UPCAST:
            kt = kt.to(tl.float32)
        s = tl.dot(q, kt, input_precision=DOT_PRECISION) * scale  # (BM, BN) fp32
        if HAS_MASK:
            s += tl.load(a_ptrs, mask=mask_m[:, None] & mask_n[None, :], other=0.0).to(tl.float32)
        visible = mask_n[None, :]
        if CAUSAL:
            visible = visible & (keys[None, :] <= offs_m[:, None] + (N - M))
        s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))  # (BM,)
        m_sub = tl.where(m_new == float("-inf"), 0.0, m_new)  # all -inf so far: see docstring
        p = tl.exp(s - m_sub[:, None])  # (BM, BN)
        alpha = tl.exp(m_i - m_sub)  # (BM,)
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(v_ptrs, mask=mask_n[:, None] & mask_dv[None, :], other=0.0)  # (BN, BDV)
        p_op = p.to(v.dtype)  # tensor-core operand; exact for fp32
        if UPCAST:
            v = v.to(tl.float32)
            p_op = p_op.to(tl.float32)
        acc = tl.dot(p_op, v, acc * alpha[:, None], input_precision=DOT_PRECISION)
        m_i = m_new
        kt_ptrs += BLOCK_N * stride_kn
        v_ptrs += BLOCK_N * stride_vn
        a_ptrs += BLOCK_N * stride_an
    out = acc / l_i[:, None]  # fully masked rows: 0 / 0 = NaN, as eager
    o_ptrs = o_ptr + b * stride_ob + offs_m[:, None] * stride_om + offs_dv[None, :] * stride_od
    tl.store(o_ptrs, out.to(o_ptr.dtype.element_ty), mask=mask_m[:, None] & mask_dv[None, :])


# ----------------------------------------------------------------------------------------------
# Wrapper
# ----------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class AttentionConfig:
    """Launch configuration: query rows and key rows per tile, warps, pipeline stages."""

    block_m: int
    block_n: int
    num_warps: int = 4
    num_stages: int = 2

    def __post_init__(self) -> None:
        for name in ("block_m", "block_n"):
            v = getattr(self, name)
            if v < 16 or v & (v - 1):
                raise ValueError(f"AttentionConfig.{name} must be a power of two >= 16, got {v}")


def _padded(d: int) -> int:
    """The head dim as the kernel tiles it: the next power of two >= 16."""
    return max(16, triton.next_power_of_2(d))


def default_config(d: int, dtype: torch.dtype = torch.float16) -> AttentionConfig:
    """Untuned defaults (no GPU timing yet) that fit an A100's and an H100's shared memory.

    Compiled for sm_80 and sm_90 (Triton 3.9) they take 48-74 KB (fp16/bf16, wgmma) and at most 107 KB
    (fp32, with ieee or tf32 dots, whose operands round-trip through shared memory).
    """
    pd = _padded(d)
    if dtype == torch.float32:
        if pd <= 64:
            return AttentionConfig(64, 32, num_warps=4, num_stages=2)
        if pd <= 128:
            return AttentionConfig(64, 32, num_warps=8, num_stages=2)
        return AttentionConfig(32, 32, num_warps=4, num_stages=2)
    if pd <= 64:
        return AttentionConfig(128, 64, num_warps=4, num_stages=3)
    if pd <= 128:
        return AttentionConfig(128, 64, num_warps=8, num_stages=2)
    return AttentionConfig(64, 64, num_warps=8, num_stages=2)


def attention_configs(d: int) -> list[AttentionConfig]:
    """Candidates worth timing for head dim ``d`` with fp16/bf16 inputs: those whose q tile plus
    staged k and v tiles fit in ~160 KB of shared memory (an H100 has 228 KB per SM). All of
    them compile for sm_90 within 228 KB; fp32 inputs need about twice as much."""
    pd = _padded(d)
    found = []
    for bm in (64, 128):
        for bn in (32, 64, 128):
            for stages in (2, 3, 4):
                if 2 * pd * (bm + 2 * stages * bn) > 160 * 1024:
                    continue
                for warps in (4, 8):
                    found.append(AttentionConfig(bm, bn, num_warps=warps, num_stages=stages))
    return found


def _runs_triton(x: Tensor) -> bool:
    """Kernels run on CUDA tensors, and on CPU tensors under Triton's interpreter."""
    return x.is_cuda or os.environ.get("TRITON_INTERPRET") == "1"


def _check(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, out: Tensor | None) -> None:
    for name, t in (("q", q), ("k", k), ("v", v)):
        if t.dim() != 3:
            raise ValueError(f"attention: {name} must be 3-D, got shape {tuple(t.shape)}")
        if t.dtype not in INPUT_DTYPES:
            raise ValueError(f"attention: {name} must be float32/float16/bfloat16, got {t.dtype}")
        if t.device != q.device:
            raise ValueError(f"attention: {name} is on {t.device} but q is on {q.device}")
    if k.dtype != q.dtype or v.dtype != q.dtype:
        raise ValueError(f"attention: q, k, v dtypes differ: {q.dtype}, {k.dtype}, {v.dtype}")
    (b, m, d), (n, dv) = q.shape, v.shape[1:]
    if k.shape[0] != b or k.shape[2] != d:
        raise ValueError(
            f"attention: k must be (B, N, D) = ({b}, N, {d}) to match q {tuple(q.shape)}, "
            f"got {tuple(k.shape)}"
        )
    if v.shape[0] != b or v.shape[1] != k.shape[1]:
        raise ValueError(
            f"attention: v must be (B, N, Dv) = ({b}, {k.shape[1]}, Dv) to match k "
            f"{tuple(k.shape)}, got {tuple(v.shape)}"
        )
    if max(d, dv) > MAX_HEAD_DIM:
        raise ValueError(f"attention: head dims must be <= {MAX_HEAD_DIM}, got D={d}, Dv={dv}")
    if mask is not None:
        if not mask.is_floating_point():
            raise ValueError(f"attention: mask must be additive (floating), got {mask.dtype}")
        if mask.device != q.device:
            raise ValueError(f"attention: mask is on {mask.device} but q is on {q.device}")
        try:
            ok = torch.broadcast_shapes(mask.shape, (b, m, n)) == (b, m, n)
        except RuntimeError:
            ok = False
        if not ok:
            raise ValueError(
                f"attention: mask {tuple(mask.shape)} does not broadcast to (B, M, N) = {(b, m, n)}"
            )
    if out is not None:
        if out.shape != (b, m, dv):
            raise ValueError(
                f"attention: out must be (B, M, Dv) = {(b, m, dv)}, got {tuple(out.shape)}"
            )
        if out.dtype not in INPUT_DTYPES:
            raise ValueError(f"attention: out must be float32/float16/bfloat16, got {out.dtype}")
        if out.device != q.device:
            raise ValueError(f"attention: out is on {out.device} but q is on {q.device}")


def attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    scale: float = 1.0,
    mask: Tensor | None = None,
    causal: bool = False,
    out: Tensor | None = None,
    config: AttentionConfig | None = None,
) -> Tensor:
    """``softmax(scale * q @ k^T + mask) @ v`` for q (B, M, D), k (B, N, D), v (B, N, Dv).

    Any strides (no copies are made). ``mask``: additive, broadcastable to (B, M, N);
    ``causal``: key j visible to query i iff ``j <= i + (N - M)``; ``out``: a (B, M, Dv)
    destination of any float dtype and strides, else one in q's dtype is allocated. Fully
    masked rows are NaN, like eager. Runs the Triton kernel on CUDA (or under
    ``TRITON_INTERPRET=1``), :func:`attention_reference` on other devices.
    """
    _check(q, k, v, mask, out)
    (b, m, d), (n, dv) = q.shape, v.shape[1:]
    if not _runs_triton(q):
        ref = _reference_fp32(q, k, v, scale=scale, mask=mask, causal=causal)
        return ref.to(q.dtype) if out is None else out.copy_(ref)
    if out is None:
        out = torch.empty((b, m, dv), device=q.device, dtype=q.dtype)
    if out.numel() == 0:
        return out
    if n == 0:  # an empty softmax times an empty v: zeros, as eager
        return out.zero_()
    cfg = config or default_config(max(d, dv), q.dtype)
    full = mask.expand(b, m, n) if mask is not None else None  # a view: stride 0 where broadcast
    a_strides = full.stride() if full is not None else (0, 0, 0)
    fp32_dot = q.dtype == torch.float32 and not torch.backends.cuda.matmul.allow_tf32
    m_tiles = triton.cdiv(m, cfg.block_m)
    _attention_kernel[(b * m_tiles,)](
        q, k, v, full if full is not None else q, out,
        m, n, d, dv, m_tiles, float(scale),
        *q.stride(), *k.stride(), *v.stride(), *a_strides, *out.stride(),
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_D=_padded(d), BLOCK_DV=_padded(dv),
        HAS_MASK=full is not None, CAUSAL=bool(causal),
        UPCAST=os.environ.get("TRITON_INTERPRET") == "1",
        DOT_PRECISION="ieee" if fp32_dot else "tf32",  # half operands: tensor cores either way
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )  # fmt: skip
    return out


# ----------------------------------------------------------------------------------------------
# Reference (and the fallback off the GPU)
# ----------------------------------------------------------------------------------------------


def _reference_fp32(
    q: Tensor, k: Tensor, v: Tensor, *, scale: float, mask: Tensor | None, causal: bool
) -> Tensor:
    s = scale * (q.float() @ k.float().transpose(1, 2))  # (B, M, N)
    if mask is not None:
        s = s + mask.float()
    if causal:
        m, n = s.shape[-2:]
        visible = torch.ones(m, n, dtype=torch.bool, device=s.device).tril(n - m)
        s = s.masked_fill(~visible, float("-inf"))
    return torch.softmax(s, dim=-1) @ v.float()


def attention_reference(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    scale: float = 1.0,
    mask: Tensor | None = None,
    causal: bool = False,
) -> Tensor:
    """Plain PyTorch in fp32 (the (M, N) scores materialised), the result in q's dtype."""
    return _reference_fp32(q, k, v, scale=scale, mask=mask, causal=causal).to(q.dtype)
