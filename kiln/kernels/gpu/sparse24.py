"""2:4 semi-structured sparse linear layers, through torch's ``SparseSemiStructuredTensor``.

A weight (N, K) is 2:4 sparse when every group of 4 consecutive entries along K (the input
dim) holds at most 2 nonzeros. Ampere and newer GPUs (compute capability >= 8.0) multiply such
a weight, compressed to its kept half plus 2-bit position metadata, on the sparse tensor
cores: half the weight bytes and, at large M, up to twice the dense rate.

torch (read in 2.13's source, run with 2.11 on an H100) exposes this as
``torch.sparse.to_sparse_semi_structured``, with two
backends chosen at conversion time: cuSPARSELt (the default; float16, bfloat16, int8,
float8_e4m3fn) and CUTLASS (when ``SparseSemiStructuredTensor._FORCE_CUTLASS`` is set; float16,
bfloat16, float32, int8). Its constraints, which this file checks or handles:

* the weight is a contiguous 2-D CUDA tensor whose (N, K) are multiples of the backend's
  sparse minimum for the dtype (cuSPARSELt 16 x 16 for fp16/bf16, CUTLASS 32 x 64), else the
  conversion raises; :func:`to_sparse24` keeps such a weight dense instead;
* the activation is 2-D with the weight's dtype, and its rows are padded to the backend's dense
  minimum (8 for fp16/bf16, 16 for int8): :func:`sparse24_linear` flattens leading dims, casts,
  pads M and slices the result back (torch 2.11/2.13 pad too; doing it here does not depend
  on that);
* ``F.linear(x, w_sparse, bias)`` is the supported call (it maps to the sparse ``addmm``).

On every other device, dtype or shape the weight stays an ordinary dense tensor and
:func:`sparse24_linear` is plain ``F.linear``: the same numbers, no speed-up.

Measured on an H100 (``kiln/bench/gpu_quant.py``, fp16, CUDA-graph replay): at decode sizes
(M <= 16) the cuSPARSELt kernel was slower than dense cuBLAS everywhere, dense / sparse time
0.26 (1536x576) to 0.98 (4096x11008), and an eager call spends ~1 ms of host time (a
cuSPARSELt plan per call). 2:4 can pay only at larger M, which that benchmark does not cover.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.sparse import (
    SparseSemiStructuredTensor,
    SparseSemiStructuredTensorCUSPARSELT,
    SparseSemiStructuredTensorCUTLASS,
    to_sparse_semi_structured,
)


def _backend() -> type[SparseSemiStructuredTensor] | None:
    """The subclass ``to_sparse_semi_structured`` will build, or None if it cannot run."""
    if SparseSemiStructuredTensor._FORCE_CUTLASS:
        return SparseSemiStructuredTensorCUTLASS
    if torch.backends.cusparselt.is_available():
        return SparseSemiStructuredTensorCUSPARSELT
    return None


def sparse24_supported(
    device: torch.device, dtype: torch.dtype, shape: tuple[int, int] | None = None
) -> bool:
    """Whether a (N, K) weight of this dtype on this device can run as semi-structured sparse.

    Needs a CUDA device of compute capability >= 8.0 and a torch backend that takes the dtype;
    with ``shape`` given, also that (N, K) are multiples of the backend's minimum block.
    """
    if device.type != "cuda" or not torch.cuda.is_available():
        return False
    if torch.cuda.get_device_capability(device) < (8, 0):
        return False
    backend = _backend()
    if backend is None or dtype not in backend._DTYPE_SHAPE_CONSTRAINTS:
        return False
    if shape is None:
        return True
    rows, cols = shape
    limits = backend._DTYPE_SHAPE_CONSTRAINTS[dtype]
    return (
        rows >= limits.sparse_min_rows
        and cols >= limits.sparse_min_cols
        and rows % limits.sparse_min_rows == 0
        and cols % limits.sparse_min_cols == 0
    )


def is_sparse24(weight: Tensor) -> bool:
    """True when the (N, K) weight has at most 2 nonzeros in every group of 4 along K."""
    if weight.dim() != 2 or weight.shape[1] % 4:
        return False
    nonzeros = (weight != 0).reshape(weight.shape[0], -1, 4).sum(dim=-1)  # (N, K // 4)
    return bool((nonzeros <= 2).all())


def to_sparse24(weight: Tensor) -> Tensor:
    """A 2:4-sparse (N, K) weight in the fastest form this device runs.

    Raises ValueError unless the weight is 2-D with K a multiple of 4 and at most 2 nonzeros
    in each group of 4 along K (prune it first). Returns torch's ``SparseSemiStructuredTensor``
    where :func:`sparse24_supported` holds for its device, dtype and shape; otherwise the weight
    itself, dense (contiguous), which :func:`sparse24_linear` computes with ``F.linear``.
    Check ``isinstance(result, torch.sparse.SparseSemiStructuredTensor)`` to know which.
    """
    if weight.dim() != 2 or weight.shape[1] % 4:
        raise ValueError(
            f"to_sparse24: weight must be (N, K) with K % 4 == 0, got {tuple(weight.shape)}"
        )
    if not is_sparse24(weight):
        nonzeros = (weight != 0).reshape(weight.shape[0], -1, 4).sum(dim=-1)  # (N, K // 4)
        bad = int((nonzeros > 2).sum())
        row, group = (int(i) for i in (nonzeros > 2).nonzero()[0])
        raise ValueError(
            f"to_sparse24: {bad} group(s) of 4 along K hold more than 2 nonzeros "
            f"(first: row {row}, columns {4 * group}..{4 * group + 3}); prune to 2:4 first"
        )
    weight = weight.contiguous()
    if not sparse24_supported(weight.device, weight.dtype, (weight.shape[0], weight.shape[1])):
        return weight
    try:
        return to_sparse_semi_structured(weight)
    except RuntimeError as err:  # a torch constraint this file does not know of
        raise ValueError(f"to_sparse24: torch refused the conversion: {err}") from err


def sparse24_linear(x: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
    """``x @ weight.T + bias`` for x (..., K) and a weight from :func:`to_sparse24`: (..., N).

    The product is computed in the weight's dtype (x and bias are cast to it) and returned in
    x's dtype: float32 activations with a float16 sparse weight run on the fp16 sparse tensor
    cores. A semi-structured weight takes torch's sparse kernel with M padded to the backend's
    row multiple; a dense weight takes ``F.linear``.
    """
    if weight.dim() != 2:
        raise ValueError(f"sparse24_linear: weight must be (N, K), got {tuple(weight.shape)}")
    n, k = weight.shape
    if x.dim() < 1 or x.shape[-1] != k:
        raise ValueError(f"sparse24_linear: x must be (..., {k}), got {tuple(x.shape)}")
    if x.device != weight.device:
        raise ValueError(
            f"sparse24_linear: x is on {x.device} but the weight is on {weight.device}"
        )
    if bias is not None and tuple(bias.shape) != (n,):
        raise ValueError(f"sparse24_linear: bias must be ({n},), got {tuple(bias.shape)}")
    b = None if bias is None else bias.to(weight.dtype)
    if not isinstance(weight, SparseSemiStructuredTensor):
        return F.linear(x.to(weight.dtype), weight, b).to(x.dtype)
    x2 = x.reshape(-1, k).to(weight.dtype).contiguous()  # (M, K)
    m = x2.shape[0]
    pad = (-m) % type(weight)._DTYPE_SHAPE_CONSTRAINTS[weight.dtype].dense_min_rows
    if pad:
        x2 = F.pad(x2, (0, 0, 0, pad))  # (M + pad, K), zero rows
    y = F.linear(x2, weight, b)[:m]  # (M, N)
    return y.reshape(*x.shape[:-1], n).to(x.dtype)
