"""Weight-only quantized linear layers on the GPU: INT8 per-channel and INT4 group-wise.

Both kernels are dequantize-in-the-loop GEMMs, ``y = x @ W.T`` with ``W`` never materialised:
each program owns a ``(BLOCK_M, BLOCK_N)`` tile of ``y``, streams the compressed weight tile by
tile along K, turns it into the activation's dtype in registers and feeds the tensor cores,
accumulating in fp32. Decode (M = 1..16 rows) reads each weight byte once, so its floor is
the weight bytes over memory bandwidth: a half (INT8) or a quarter (INT4) of fp16's. Any M is
correct; large M simply runs more row tiles (the tiles are tuned for decode only).

Measured on an H100 (``kiln/bench/gpu_quant.py``, fp16 x, CUDA-graph replay, L2 flushed): at
4096x11008 INT8 streams 1.9 TB/s (copy ceiling 3.0) and is 1.55x faster than fp16 cuBLAS;
INT4 is bound by its dequantization work, not bytes: 1.35x (g128) and 0.9x (g32). SmolLM2's
layers (<= 1.8 MB of fp16) take 4-11 us with every method: latency, not bandwidth, and
cuBLAS fp16 is fastest there (INT8 0.86-0.95x, INT4 g32 0.53-0.80x).

Weight formats (the contract with ``kiln.compress``):

* INT8: ``qweight`` int8 (N, K) in [-127, 127], ``scale`` float32 (N,);
  ``W[n, k] = qweight[n, k] * scale[n]``. The scale is per output channel, so it is applied once
  to the accumulated tile: ``y[m, n] = scale[n] * sum_k x[m, k] * qweight[n, k]``.
* INT4: ``packed`` uint8 (N, K // 2) with ``packed[n, j] = q[n, 2j] | q[n, 2j + 1] << 4``,
  q in [0, 15]; ``scale``, ``offset`` float16 (N, K // g), g in {32, 64, 128};
  ``W[n, k] = q[n, k] * scale[n, k // g] + offset[n, k // g]``. A K tile spans several groups;
  the packed tile is loaded as (groups, g / 2, BLOCK_N) so each group's scale and offset
  broadcast over its rows, and ``q * scale + offset`` is rounded once to the activation's
  dtype: the dot sees exactly the dense fp16/bf16/fp32 weight ``W.to(x.dtype)``. Low nibbles pair with the even columns of x and high nibbles with the odd ones,
  so nibbles are never interleaved: two half-width dots, ``x[:, 0::2] @ lo + x[:, 1::2] @ hi``.

The tiles and the INT4 tile shape were picked by a sweep of kernel time (L2 flushed) on an H100:
the (groups, g/2, N) tile beat one-group-per-iteration loops and batched per-group dots by
1.2-3x. See :func:`choose_tiles`.

File order follows the Triton tutorials: kernels, wrappers (validate, allocate, launch),
references. The references (dequantize in fp32 + ``torch.matmul``) are also the fallback: a
wrapper called on CPU tensors without ``TRITON_INTERPRET=1`` (or with bf16 ones, which the
interpreter computes wrongly) runs them.
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from torch import Tensor

from kiln.kernels.formats import (
    check_int4,
    check_int8,
    dequantize_int4,
    dequantize_int8,
)

ACTIVATION_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


# ----------------------------------------------------------------------------------------------
# Kernels
# ----------------------------------------------------------------------------------------------


@triton.jit
def _int8_matmul_kernel(
    x_ptr, q_ptr, s_ptr, y_ptr,
    M, N, K,
    stride_xm, stride_xk, stride_qn, stride_qk, stride_ym, stride_yn,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):  # fmt: skip
    """One (BLOCK_M, BLOCK_N) tile of y = (x @ q.T) * scale; grid (N tiles, M tiles)."""
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)  # (BM,)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)  # (BN,)
    offs_k = tl.arange(0, BLOCK_K)  # (BK,)
    mask_m = offs_m < M
    mask_n = offs_n < N
    x_ptrs = x_ptr + offs_m[:, None] * stride_xm + offs_k[None, :] * stride_xk  # (BM, BK)
    q_ptrs = q_ptr + offs_k[:, None] * stride_qk + offs_n[None, :] * stride_qn  # (BK, BN) of W.T
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        mask_k = (k0 + offs_k) < K
        x = tl.load(x_ptrs, mask=mask_m[:, None] & mask_k[None, :], other=0.0)
        q = tl.load(q_ptrs, mask=mask_k[:, None] & mask_n[None, :], other=0)
        # int8 -> x's dtype is exact: |q| <= 127 is within fp16's and bf16's integer range.
        acc = tl.dot(x, q.to(x.dtype), acc, input_precision=DOT_PRECISION)
        x_ptrs += BLOCK_K * stride_xk
        q_ptrs += BLOCK_K * stride_qk
    scale = tl.load(s_ptr + offs_n, mask=mask_n, other=0.0)  # (BN,) fp32
    y = acc * scale[None, :]
    y_ptrs = y_ptr + offs_m[:, None] * stride_ym + offs_n[None, :] * stride_yn
    tl.store(y_ptrs, y.to(y_ptr.dtype.element_ty), mask=mask_m[:, None] & mask_n[None, :])


@triton.jit
def _int4_matmul_kernel(
    x_ptr, p_ptr, s_ptr, o_ptr, y_ptr,
    M, N, K,
    stride_xm, stride_xk, stride_pn, stride_pk, stride_ym, stride_yn,
    GROUP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    DEQUANT: tl.constexpr, DOT_PRECISION: tl.constexpr,
):  # fmt: skip
    """One (BLOCK_M, BLOCK_N) tile of y = x @ W.T; BLOCK_K is a multiple of GROUP.

    scale/offset are contiguous (N, K // GROUP). ``q * scale + offset`` is computed in DEQUANT
    (fp16 for fp16 x: exact inputs, one rounding; fp32 otherwise) and rounded to x's dtype.
    Grid (N tiles, M tiles).
    """
    HALF_K: tl.constexpr = BLOCK_K // 2
    HALF_G: tl.constexpr = GROUP // 2
    GROUPS: tl.constexpr = BLOCK_K // GROUP  # groups per K tile
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)  # (BM,)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)  # (BN,)
    offs_k = tl.arange(0, BLOCK_K)  # (BK,)
    offs_g = tl.arange(0, GROUPS)  # (G,) group within the tile
    offs_h = tl.arange(0, HALF_G)  # (g/2,) packed byte within a group
    mask_m = offs_m < M
    mask_n = offs_n < N
    n_groups = K // GROUP
    x_ptrs = x_ptr + offs_m[:, None] * stride_xm + offs_k[None, :] * stride_xk  # (BM, BK)
    # byte j of the tile, as (group, byte in group): (G, g/2, BN)
    p_ptrs = (
        p_ptr
        + (offs_g[:, None, None] * HALF_G + offs_h[None, :, None]) * stride_pk
        + offs_n[None, None, :] * stride_pn
    )
    so_ptrs = offs_n[None, None, :] * n_groups + offs_g[:, None, None]  # (G, 1, BN)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        mask_k = (k0 + offs_k) < K
        x = tl.load(x_ptrs, mask=mask_m[:, None] & mask_k[None, :], other=0.0)  # (BM, BK)
        x_even, x_odd = tl.split(tl.reshape(x, (BLOCK_M, HALF_K, 2)))  # (BM, BK/2) each
        mask_g = (k0 // GROUP + offs_g[:, None, None] < n_groups) & mask_n[None, None, :]
        p = tl.load(p_ptrs, mask=mask_g, other=0)  # (G, g/2, BN) uint8
        g0 = k0 // GROUP
        s = tl.load(s_ptr + so_ptrs + g0, mask=mask_g, other=0.0).to(DEQUANT)  # (G, 1, BN)
        o = tl.load(o_ptr + so_ptrs + g0, mask=mask_g, other=0.0).to(DEQUANT)  # (G, 1, BN)
        lo = ((p & 0xF).to(DEQUANT) * s + o).to(x.dtype)  # (G, g/2, BN)
        hi = ((p >> 4).to(DEQUANT) * s + o).to(x.dtype)
        lo = tl.reshape(lo, (HALF_K, BLOCK_N))  # rows 2j of W.T
        hi = tl.reshape(hi, (HALF_K, BLOCK_N))  # rows 2j + 1 of W.T
        acc = tl.dot(x_even, lo, acc, input_precision=DOT_PRECISION)
        acc = tl.dot(x_odd, hi, acc, input_precision=DOT_PRECISION)
        x_ptrs += BLOCK_K * stride_xk
        p_ptrs += HALF_K * stride_pk
    y_ptrs = y_ptr + offs_m[:, None] * stride_ym + offs_n[None, :] * stride_yn
    tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=mask_m[:, None] & mask_n[None, :])


# ----------------------------------------------------------------------------------------------
# Wrappers
# ----------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Tiles:
    """Launch configuration of one kernel call; INT4 needs block_k a multiple of the group."""

    block_m: int
    block_n: int
    block_k: int
    num_warps: int = 4
    num_stages: int = 3

    def __post_init__(self) -> None:
        for name in ("block_m", "block_n", "block_k"):
            v = getattr(self, name)
            if v < 16 or v & (v - 1):
                raise ValueError(f"Tiles.{name} must be a power of two >= 16, got {v}")


@functools.lru_cache(maxsize=1024)  # a pure function of its arguments; saves host time per call
def choose_tiles(m: int, k: int, group_size: int | None = None) -> Tiles:
    """Tiles for m activation rows over K (``group_size`` for INT4, None for INT8).

    Decode (m <= 16) is bound by the weight stream. On an H100, block_n = 32 gave the most
    bytes in flight for 576..11008 outputs; block_k = 256 (128 for INT4 g32, whose per-group
    work is heavier) was best or within 10%. Beyond 16 rows: 64-wide tiles, 128 deep.
    """
    cap = 128 if m > 16 or group_size == 32 else 256
    block_k = max(group_size or 16, min(cap, triton.next_power_of_2(k)))
    if m <= 16:
        return Tiles(16, 32, block_k, num_warps=4, num_stages=3)
    return Tiles(32 if m <= 32 else 64, 64, block_k, num_warps=4, num_stages=3)


def _runs_triton(x: Tensor) -> bool:
    """Kernels run on CUDA tensors, and on CPU tensors under Triton's interpreter, except bf16:
    the interpreter multiplies bf16 dot operands as raw bits (wrong numbers), so those take the
    reference."""
    if x.is_cuda:
        return True
    return os.environ.get("TRITON_INTERPRET", "0") == "1" and x.dtype != torch.bfloat16


def _dot_precision(dtype: torch.dtype) -> str:
    # fp32 activations get exact fp32 products (tf32 would cost ~3e-4 relative error).
    return "ieee" if dtype == torch.float32 else "tf32"


def _check_activation(x: Tensor, k: int, name: str) -> None:
    if x.dtype not in ACTIVATION_DTYPES:
        raise ValueError(f"{name}: x must be float32/float16/bfloat16, got {x.dtype}")
    if x.dim() < 1 or x.shape[-1] != k:
        raise ValueError(f"{name}: x must be (..., K) with K = {k}, got {tuple(x.shape)}")


def _check_same_device(name: str, x: Tensor, others: dict[str, Tensor]) -> None:
    device = x.device
    for what, t in others.items():
        if t.device != device:
            raise ValueError(f"{name}: {what} is on {t.device} but x is on {device}")


def int8_matmul(x: Tensor, qweight: Tensor, scale: Tensor) -> Tensor:
    """``x @ W.T`` with W stored as INT8 per output channel: (..., K) -> (..., N) in x's dtype.

    qweight: int8 (N, K); scale: float32 (N,). Runs the Triton kernel on CUDA (or under
    ``TRITON_INTERPRET=1``), :func:`int8_matmul_reference` on other devices.
    """
    n, k = check_int8(qweight, scale)
    _check_activation(x, k, "int8_matmul")
    _check_same_device("int8_matmul", x, {"qweight": qweight, "scale": scale})
    if not _runs_triton(x):
        return int8_matmul_reference(x, qweight, scale)
    x2 = x.reshape(-1, k)  # (M, K)
    y = torch.empty((x2.shape[0], n), device=x.device, dtype=x.dtype)  # (M, N)
    if y.numel() > 0:
        launch_int8(x2, qweight, scale.contiguous(), y, choose_tiles(x2.shape[0], k))
    return y.reshape(*x.shape[:-1], n)


def launch_int8(x: Tensor, qweight: Tensor, scale: Tensor, y: Tensor, tiles: Tiles) -> None:
    """Launch the INT8 kernel on validated 2-D operands: x (M, K), qweight (N, K), y (M, N)."""
    m, k = x.shape
    n = qweight.shape[0]
    grid = (triton.cdiv(n, tiles.block_n), triton.cdiv(m, tiles.block_m))
    _int8_matmul_kernel[grid](
        x, qweight, scale, y,
        m, n, k,
        x.stride(0), x.stride(1), qweight.stride(0), qweight.stride(1), y.stride(0), y.stride(1),
        BLOCK_M=tiles.block_m, BLOCK_N=tiles.block_n, BLOCK_K=tiles.block_k,
        DOT_PRECISION=_dot_precision(x.dtype),
        num_warps=tiles.num_warps, num_stages=tiles.num_stages,
    )  # fmt: skip


def int4_matmul(
    x: Tensor, packed: Tensor, scale: Tensor, offset: Tensor, group_size: int
) -> Tensor:
    """``x @ W.T`` with W stored as group-wise INT4: (..., K) -> (..., N) in x's dtype.

    packed: uint8 (N, K // 2), two 4-bit codes per byte (low nibble = even column);
    scale, offset: float16 (N, K // group_size); group_size in {32, 64, 128}. Runs the Triton
    kernel on CUDA (or under ``TRITON_INTERPRET=1``), :func:`int4_matmul_reference` elsewhere.
    """
    n, k = check_int4(packed, scale, offset, group_size)
    _check_activation(x, k, "int4_matmul")
    _check_same_device("int4_matmul", x, {"packed": packed, "scale": scale, "offset": offset})
    if not _runs_triton(x):
        return int4_matmul_reference(x, packed, scale, offset, group_size)
    x2 = x.reshape(-1, k)  # (M, K)
    y = torch.empty((x2.shape[0], n), device=x.device, dtype=x.dtype)  # (M, N)
    if y.numel() > 0:
        tiles = choose_tiles(x2.shape[0], k, group_size)
        launch_int4(x2, packed, scale.contiguous(), offset.contiguous(), group_size, y, tiles)
    return y.reshape(*x.shape[:-1], n)


def launch_int4(
    x: Tensor,
    packed: Tensor,
    scale: Tensor,
    offset: Tensor,
    group_size: int,
    y: Tensor,
    tiles: Tiles,
) -> None:
    """Launch the INT4 kernel on validated operands: x (M, K), packed (N, K // 2), y (M, N);
    scale and offset contiguous (N, K // group_size); tiles.block_k a multiple of group_size."""
    if tiles.block_k % group_size:
        raise ValueError(f"launch_int4: block_k {tiles.block_k} is not a multiple of {group_size}")
    m, k = x.shape
    n = packed.shape[0]
    grid = (triton.cdiv(n, tiles.block_n), triton.cdiv(m, tiles.block_m))
    _int4_matmul_kernel[grid](
        x, packed, scale, offset, y,
        m, n, k,
        x.stride(0), x.stride(1), packed.stride(0), packed.stride(1), y.stride(0), y.stride(1),
        GROUP=group_size, BLOCK_M=tiles.block_m, BLOCK_N=tiles.block_n, BLOCK_K=tiles.block_k,
        DEQUANT=tl.float16 if x.dtype == torch.float16 else tl.float32,
        DOT_PRECISION=_dot_precision(x.dtype),
        num_warps=tiles.num_warps, num_stages=tiles.num_stages,
    )  # fmt: skip


# ----------------------------------------------------------------------------------------------
# References (and the fallback off the GPU)
# ----------------------------------------------------------------------------------------------


def int8_matmul_reference(x: Tensor, qweight: Tensor, scale: Tensor) -> Tensor:
    """Dequantize, then ``x @ W.T`` in float32; the result in x's dtype."""
    w = dequantize_int8(qweight, scale)  # (N, K)
    return torch.matmul(x.to(torch.float32), w.T).to(x.dtype)


def int4_matmul_reference(
    x: Tensor, packed: Tensor, scale: Tensor, offset: Tensor, group_size: int
) -> Tensor:
    """Dequantize, then ``x @ W.T`` in float32; the result in x's dtype."""
    w = dequantize_int4(packed, scale, offset, group_size)  # (N, K)
    return torch.matmul(x.to(torch.float32), w.T).to(x.dtype)
