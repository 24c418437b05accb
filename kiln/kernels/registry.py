"""Weight-only quantized matmuls: one registry from (format, device) to a kernel.

A kernel is built once per weight and called every forward; it computes ``y = x @ W.T``
for float32 ``x`` (..., K) -> ``y`` (..., N), where W is the weight in one of the formats
of ``kiln.kernels.formats``::

    kernel = int4_weight_only(packed, scale, offset, group_size=64)  # repacks once
    y = kernel(x)                                                    # every forward

``_KERNELS`` maps (format, device type) to the module and builder that run it: CUDA weights
go to the Triton kernels of ``kiln.kernels.gpu.woq_triton``, CPU weights to
``kiln.kernels.cpu.woq`` (kiln's C++ kernel for decode-sized inputs, chosen by measurement
over torch's packed kernels). Modules are imported only when such a kernel is built.
``formats.dequantize_int8`` / ``dequantize_int4`` are the reference every kernel must match.
GGUF weights kept as their file's blocks (``gguf_weight_only``) run on kiln's C++ block
kernels (``kiln.kernels.cpu.gguf_blocks``, whose pure-torch dequantizer is their reference).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

import torch
from torch import Tensor

from kiln.kernels.formats import check_input, check_int4, check_int8


class WeightOnlyKernel(Protocol):
    """A prepared weight-only quantized linear map: float32 (..., K) -> float32 (..., N)."""

    def __call__(self, x: Tensor) -> Tensor: ...


# ------------------------------------------------------------------ dispatch
class _CudaKernel:
    """Calls a Triton kernel of kiln.kernels.gpu.woq_triton with the weights bound."""

    def __init__(self, fn: Callable[..., Tensor], k: int, device: torch.device, *weights: object):
        self._fn, self._k, self._device, self._weights = fn, k, device, weights

    def __call__(self, x: Tensor) -> Tensor:
        check_input(x, self._k, self._device)
        y = self._fn(x.reshape(-1, self._k), *self._weights)  # (M, N)
        return y.reshape(*x.shape[:-1], y.shape[-1])


def int8_weight_only(qweight: Tensor, scale: Tensor) -> WeightOnlyKernel:
    """A kernel computing ``x @ dequantize_int8(qweight, scale).T`` on the weights' device.

    qweight int8 (N, K), scale float32 (N,). Raises ValueError for a malformed format or an
    unsupported device (CPU and CUDA are supported).
    """
    _, k = check_int8(qweight, scale)
    if qweight.device.type == "cuda":
        from kiln.kernels.gpu.woq_triton import int8_matmul

        return _CudaKernel(int8_matmul, k, qweight.device, qweight, scale)
    if qweight.device.type == "cpu":
        from kiln.kernels.cpu.woq import cpu_int8_kernel

        return cpu_int8_kernel(qweight, scale)
    raise ValueError(f"weight-only INT8 kernels run on cpu or cuda, not {qweight.device}")


def int4_weight_only(
    packed: Tensor, scale: Tensor, offset: Tensor, group_size: int
) -> WeightOnlyKernel:
    """A kernel computing ``x @ dequantize_int4(packed, scale, offset, group_size).T``.

    packed uint8 (N, K // 2), scale and offset float16 (N, K // group_size). Raises
    ValueError for a malformed format or an unsupported device (CPU and CUDA are supported).
    """
    _, k = check_int4(packed, scale, offset, group_size)
    if packed.device.type == "cuda":
        from kiln.kernels.gpu.woq_triton import int4_matmul

        return _CudaKernel(int4_matmul, k, packed.device, packed, scale, offset, group_size)
    if packed.device.type == "cpu":
        from kiln.kernels.cpu.woq import cpu_int4_kernel

        return cpu_int4_kernel(packed, scale, offset, group_size)
    raise ValueError(f"weight-only INT4 kernels run on cpu or cuda, not {packed.device}")


def gguf_weight_only(
    blocks: Tensor, ggml_type: int, k: int, dtype: torch.dtype = torch.float32,
    activations: str = "int8",
) -> WeightOnlyKernel:  # fmt: skip
    """A kernel computing ``x @ W.T`` for x (..., K) of ``dtype``, W a GGUF tensor's blocks
    as stored: uint8 (N, K / elems * bytes) of ggml type ``ggml_type`` (Q4_0 .. Q6_K,
    ``kiln.kernels.cpu.gguf_blocks.BLOCKS``). CPU and float32: kiln's C++ block kernels,
    for a few rows with x quantized to 8-bit blocks (``activations="int8"``, llama.cpp's
    arithmetic) or exact in fp32 (``"fp32"``); otherwise (any device, any dtype) the
    reference dequantizer a tile of rows at a time. Raises ValueError for a malformed or
    unsupported weight."""
    from kiln.kernels.cpu.gguf_blocks import gguf_kernel

    return gguf_kernel(blocks, ggml_type, k, dtype, activations)


def gguf_dequantize(blocks: Tensor, ggml_type: int, k: int) -> Tensor:
    """The values of a GGUF tensor's blocks, float32 (N, K), on the blocks' device (kiln's
    C++ decoder on the CPU when it builds, else the pure-torch reference)."""
    from kiln.core.native import KilnCompileError
    from kiln.kernels.cpu.gguf_blocks import dequantize_rows, reference_dequantize

    if blocks.is_cpu:
        try:
            return dequantize_rows(blocks, ggml_type, k)
        except (KilnCompileError, RuntimeError, OSError):
            pass  # no compiler here: the reference gives the same values
    return reference_dequantize(blocks, ggml_type, k)
