"""The weight formats shared by ``kiln.compress`` (which writes them) and the kernels (which read them).

* INT8, per output channel, symmetric: ``qweight`` int8 (N, K) in [-127, 127], ``scale``
  float32 (N,); ``W[n, k] = qweight[n, k] * scale[n]``.
* INT4, group-wise along K (group size g in ``INT4_GROUP_SIZES``, K % g == 0): ``packed``
  uint8 (N, K // 2) with ``packed[n, j] = q[n, 2j] | q[n, 2j + 1] << 4`` (q in [0, 15]);
  ``scale`` and ``offset`` float16 (N, K // g); ``W[n, k] = q[n, k] * scale[n, k // g] +
  offset[n, k // g]`` in fp32. Symmetric INT4 is the case offset = -8 * scale.

This module checks them, packs and unpacks the 4-bit codes, and dequantizes: the
dequantized weight is the reference every weight-only kernel must match.
"""

from __future__ import annotations

import torch
from torch import Tensor

INT4_GROUP_SIZES = (32, 64, 128)  # the group sizes along K that the kernels support


# ------------------------------------------------------------------ validation
def check_int8(qweight: Tensor, scale: Tensor) -> tuple[int, int]:
    """Validate the INT8 format; returns (N, K). Raises ValueError on any mismatch."""
    if qweight.dtype != torch.int8 or qweight.dim() != 2:
        raise ValueError(
            f"qweight must be a 2-D int8 tensor (N, K), got {qweight.dtype} {tuple(qweight.shape)}"
        )
    n, k = qweight.shape
    if scale.dtype != torch.float32 or tuple(scale.shape) != (n,):
        raise ValueError(
            f"scale must be float32 of shape ({n},) (one per output channel), "
            f"got {scale.dtype} {tuple(scale.shape)}"
        )
    if scale.device != qweight.device:
        raise ValueError(f"scale is on {scale.device} but qweight is on {qweight.device}")
    if n == 0 or k == 0:
        raise ValueError(f"qweight must be non-empty, got shape {tuple(qweight.shape)}")
    return n, k


def check_int4(packed: Tensor, scale: Tensor, offset: Tensor, group_size: int) -> tuple[int, int]:
    """Validate the INT4 format; returns (N, K). Raises ValueError on any mismatch."""
    if packed.dtype != torch.uint8 or packed.dim() != 2:
        raise ValueError(
            f"packed must be a 2-D uint8 tensor (N, K // 2), got {packed.dtype} "
            f"{tuple(packed.shape)}"
        )
    n, k = packed.shape[0], 2 * packed.shape[1]
    if n == 0 or k == 0:
        raise ValueError(f"packed must be non-empty, got shape {tuple(packed.shape)}")
    if (
        not isinstance(group_size, int)
        or isinstance(group_size, bool)
        or (group_size not in INT4_GROUP_SIZES)
    ):
        raise ValueError(f"group_size must be one of {INT4_GROUP_SIZES}, got {group_size!r}")
    if k % group_size:
        raise ValueError(
            f"K = {k} (2 x packed columns) is not a multiple of group_size {group_size}"
        )
    groups = (n, k // group_size)
    for name, t in (("scale", scale), ("offset", offset)):
        if t.dtype != torch.float16 or tuple(t.shape) != groups:
            raise ValueError(
                f"{name} must be float16 of shape {groups} (N, K // group_size), "
                f"got {t.dtype} {tuple(t.shape)}"
            )
        if t.device != packed.device:
            raise ValueError(f"{name} is on {t.device} but packed is on {packed.device}")
    return n, k


def check_input(x: Tensor, k: int, device: torch.device) -> None:
    """Validate an activation: float32 (..., K) on the weights' device."""
    if x.dtype != torch.float32:
        raise ValueError(f"x must be float32, got {x.dtype}")
    if x.dim() == 0 or x.shape[-1] != k:
        raise ValueError(f"x must have shape (..., {k}), got {tuple(x.shape)}")
    if x.device != device:
        raise ValueError(f"x is on {x.device} but the weights are on {device}")


# ------------------------------------------------------------------ packing and reference
def dequantize_int8(qweight: Tensor, scale: Tensor) -> Tensor:
    """The INT8 weight as float32 (N, K): ``qweight * scale[:, None]``."""
    check_int8(qweight, scale)
    return qweight.float() * scale[:, None]


def pack_int4(q: Tensor) -> Tensor:
    """(N, K) codes in [0, 15] -> (N, K // 2) uint8, even k in the low nibble."""
    if q.shape[-1] % 2:
        raise ValueError(f"INT4 packing needs an even input dim, got {q.shape[-1]}")
    q = q.to(torch.uint8)
    return q[..., 0::2] | (q[..., 1::2] << 4)


def unpack_int4(packed: Tensor) -> Tensor:
    """The 4-bit codes of ``packed`` (N, K // 2) as uint8 (N, K), values in [0, 15]."""
    low, high = packed & 15, packed >> 4
    return torch.stack((low, high), dim=-1).reshape(packed.shape[0], -1)  # (N, K)


def dequantize_int4(packed: Tensor, scale: Tensor, offset: Tensor, group_size: int) -> Tensor:
    """The INT4 weight as float32 (N, K): ``q * scale + offset`` per group, in fp32."""
    n, k = check_int4(packed, scale, offset, group_size)
    q = unpack_int4(packed).float().view(n, k // group_size, group_size)  # (N, G, g)
    w = q * scale.float()[:, :, None] + offset.float()[:, :, None]
    return w.reshape(n, k)
