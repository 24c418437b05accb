"""Round-to-nearest quantizers and the 4-bit packing, on plain tensors.

Formats (shared with ``kiln.kernels.registry``, which runs them):

* INT8: ``qweight`` int8 (N, K) in [-127, 127], ``scale`` fp32 (N,); W = q * scale.
* INT4: ``packed`` uint8 (N, K/2) with q[:, 2j] in the low nibble and q[:, 2j+1] in the
  high one, q in [0, 15]; ``scale``/``offset`` fp16 (N, K/g); W = q * scale + offset.
  Symmetric means offset = -8 * scale. The format's checks, unpacking and dequantization
  live with the kernels (``kiln.kernels.registry``); the quantizers here only produce it.

Scales are rounded to their storage dtype *before* q is computed, so dequantizing the
stored tensors reproduces exactly the values the quantizer chose.
"""

from __future__ import annotations

import torch
from torch import Tensor

INT8_MAX = 127
INT4_LEVELS = 15  # q in [0, 15]
_TINY = 1e-12


def int8_scale(w: Tensor) -> Tensor:
    """Per-output-channel symmetric scale: (N, K) -> (N,) fp32."""
    return (w.abs().amax(dim=1).float() / INT8_MAX).clamp_min(_TINY)


def int8_round(w: Tensor, scale: Tensor) -> Tensor:
    """(N, K) or (N,) weights with matching scale -> int8 codes."""
    s = scale if w.dim() == 1 else scale[:, None]
    return torch.clamp(torch.round(w.float() / s), -INT8_MAX, INT8_MAX).to(torch.int8)


def quantize_int8(w: Tensor) -> tuple[Tensor, Tensor]:
    """Round-to-nearest INT8: (N, K) -> (qweight int8 (N, K), scale fp32 (N,))."""
    scale = int8_scale(w)
    return int8_round(w, scale), scale


def int4_group_params(w: Tensor, symmetric: bool) -> tuple[Tensor, Tensor]:
    """Scale and offset for groups along the last dim: (..., g) -> two fp16 (...,) tensors.

    Symmetric uses all 16 levels: the scale is the smallest with -8 s <= min and
    7 s >= max. Asymmetric spans [min, max] with 15 steps and offset = min.
    """
    w = w.float()
    lo = w.amin(dim=-1).clamp_max(0.0) if symmetric else w.amin(dim=-1)
    hi = w.amax(dim=-1).clamp_min(0.0) if symmetric else w.amax(dim=-1)
    if symmetric:
        scale = torch.maximum(-lo / 8, hi / 7).clamp_min(_TINY).half()
        offset = -8 * scale  # exact in fp16: a power-of-two multiple
    else:
        scale = ((hi - lo) / INT4_LEVELS).clamp_min(_TINY).half()
        offset = lo.half()
    return scale, offset


def int4_round(w: Tensor, scale: Tensor, offset: Tensor) -> Tensor:
    """Codes in [0, 15] (uint8) for weights w with broadcastable fp16 scale/offset."""
    q = torch.round((w.float() - offset.float()) / scale.float())
    return torch.clamp(q, 0, INT4_LEVELS).to(torch.uint8)


def quantize_int4(w: Tensor, group_size: int, symmetric: bool) -> tuple[Tensor, Tensor, Tensor]:
    """Round-to-nearest INT4: (N, K) -> (q uint8 (N, K), scale fp16 (N, G), offset fp16 (N, G))."""
    n, k = w.shape
    check_int4_shape(k, group_size)
    groups = w.reshape(n, k // group_size, group_size)  # (N, G, g)
    scale, offset = int4_group_params(groups, symmetric)
    q = int4_round(groups, scale[..., None], offset[..., None])
    return q.reshape(n, k), scale, offset


def dequantize_int4_codes(q: Tensor, scale: Tensor, offset: Tensor) -> Tensor:
    """Unpacked codes (N, K) + per-group params (N, G) -> fp32 weights (N, K)."""
    n, k = q.shape
    g = k // scale.shape[1]
    w = q.reshape(n, -1, g).float() * scale.float()[..., None] + offset.float()[..., None]
    return w.reshape(n, k)


def check_int4_shape(k: int, group_size: int) -> None:
    if k % group_size:
        raise ValueError(f"input dim {k} is not a multiple of group_size {group_size}")


def mask_24_magnitude(w: Tensor) -> Tensor:
    """Keep the 2 largest |w| of every 4 consecutive inputs: (N, K) -> bool mask (N, K)."""
    return mask_24_from_scores(w.abs())


def mask_24_from_scores(scores: Tensor) -> Tensor:
    """Keep the 2 highest-scoring of every 4 consecutive columns: (N, K) -> bool (N, K)."""
    n, k = scores.shape
    if k % 4:
        raise ValueError(f"2:4 sparsity needs an input dim divisible by 4, got {k}")
    groups = scores.reshape(n, k // 4, 4)
    keep = torch.zeros_like(groups, dtype=torch.bool)
    keep.scatter_(-1, groups.topk(2, dim=-1).indices, True)
    return keep.reshape(n, k)
