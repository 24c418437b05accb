"""CPU weight-only quantized matmuls (INT8 per channel, INT4 group-wise) for decode.

At decode a linear layer sees a few rows of activations and is memory-bound: the time is
the weight bytes streamed from DRAM. Three backends compute ``y = x @ W.T`` here:

* ``"kiln"``: kiln's C++ kernel (``woq.h``, its Python module ``woq.cpp``; SIMD through
  ``kiln_vec.h``, shared with the decode step): weights repacked once into panels of W
  output channels, up to 8 activation rows per pass with all accumulators in registers,
  weights widened to fp32 in registers and accumulated in fp32. Built with plain ``g++``
  (-march=native: AVX2 or AVX-512 by the build machine) as a tiny CPython extension, cached
  on disk by a hash of its sources, flags, compiler, CPU flags and Python. It takes plain
  integers (METH_FASTCALL, no tensor parsing): a whole call on a tiny layer measured
  4.4 us under co-tenant load, of which torch.empty for the output is ~2.5 us (a tiny
  F.linear: 5.2 us); a torch cpp_extension would parse tensors and build in ~30 s.
* ``"torch"``: torch's packed kernels ``aten._weight_int8pack_mm`` /
  ``aten._weight_int4pack_mm_for_cpu`` (int4 codes repacked by
  ``_convert_weight_to_int4pack_for_cpu``; scales_and_zeros (G, N, 2) fp32 with
  ``dequant = (q - 8) * scale + zero``, so ``zero = offset + 8 * scale``).
* ``"dequant"``: ``F.linear(x, dequantize(...))`` per call: the reference, and the best for
  many rows (long prefill, M > 256), where the matmul is compute-bound and MKL's sgemm wins.

``"auto"`` (what ``kiln.kernels.registry`` uses) picks by rows M = x.numel() // K, by measurement
(kiln/bench/quant_matmul.py, 1 thread: one decode step of SmolLM2-135M = 210 linears with
distinct weights streamed from DRAM; step ms, AMD EPYC Zen 3 AVX2 with co-tenants, torch
2.13 / Intel Xeon AVX-512, torch 2.11):

    M    fp32 F.linear   kiln int8    kiln int4 g32   torch int8pack   torch int4pack g32
    1    44.5 / 32.5     14.2 / 14.2  14.5 / 13.1     163 / 204        337 / 299
    4    83.5 / 50.9     24.5 / 20.3  25.0 / 21.7     686 / 681        1332 / 1402
    8    98.9 / 72.3     39.1 / 29.8  45.2 / 33.5     1674 / 662       3518 / 2166

torch's packed kernels are 5-50x slower than kiln's on both CPUs, so kiln's kernel serves
M <= ``KILN_MAX_ROWS`` and torch's only stand in when the C++ extension cannot be built
(no compiler), with a warning. More rows (prefill) go to ``"gemm"``: kiln's prefill GEMM
(``kiln.kernels.cpu.packed_gemm``), which decodes the same panels once per block of rows
into a cache-resident float tile and multiplies it with a register-blocked micro-kernel.
On SmolLM2's layers (576 x 1536, 1536 x 576, 576 x 192; AMD EPYC Zen 4, AVX-512, 1 thread,
best of 30) the decode kernel took, relative to the GEMM, INT4 g32: 0.93-1.08x the time at
8 rows, 1.01-1.17x at 16, 1.14-1.33x at 24, 1.2-1.45x from 48 rows up; INT8: 0.84-0.96x at
8, 0.92-1.04x at 16, 1.04-1.17x at 24, 1.1-1.3x from 64 up. At 512 rows the INT4 GEMM ran
85-113 GFLOP/s, a little faster than MKL's sgemm on the fp32 weight alone, and 1.2-1.9x
faster than the old large-M path (``"dequant"``: dequantize in torch, then F.linear;
``python -m kiln.bench.prefill --kernels`` prints the table).
``"dequant"`` stays the reference, and the large-M fallback when the GEMM cannot be built.
"""

from __future__ import annotations

import functools
import warnings
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import Literal

import torch
import torch.nn.functional as F
from torch import Tensor

from kiln.core import native
from kiln.kernels.cpu import packed_gemm
from kiln.kernels.cpu.panels import int4_panels, int8_panels
from kiln.kernels.formats import (
    check_input,
    check_int4,
    check_int8,
    dequantize_int4,
    dequantize_int8,
    unpack_int4,
)

Backend = Literal["auto", "kiln", "gemm", "torch", "dequant"]

HERE = Path(__file__).resolve().parent
# The SIMD headers of kiln.core.native.INCLUDE, included by woq.h.
VEC_HEADERS = tuple(native.INCLUDE / n for n in ("kiln_vec.h", "kiln_vec_pow.h", "kiln_vec_trig.h"))
KERNEL_HEADER = HERE / "woq.h"  # the kernels, also included by the decode step
# woq.cpp (what is compiled), then every header it includes: they all enter the cache key.
PY_HEADER = native.INCLUDE / "kiln_py.h"  # the Python-boundary helpers, shared with decode
SOURCES = (HERE / "woq.cpp", KERNEL_HEADER, PY_HEADER, *VEC_HEADERS)
FLAGS = (
    "-O3",
    "-march=native",
    "-fno-math-errno",
    "-fopenmp",  # links libgomp.so.1: torch's already-loaded copy, i.e. torch's thread pool
    "-shared",
    "-fPIC",
    "-std=c++17",
)
# "auto" uses kiln's decode kernel up to this many rows, the prefill GEMM above (measured).
KILN_MAX_ROWS = packed_gemm.GEMM_MIN_ROWS - 1


# ------------------------------------------------------------------ build
def extension_key() -> str:
    """Cache key of the extension: everything that changes its binary or its ABI."""
    return native.extension_key(SOURCES, FLAGS)


@functools.cache
def load_extension() -> ModuleType:
    """kiln's weight-only matmul extension, compiled on first use and cached on disk
    (``native.load_plain_extension``)."""
    return native.load_plain_extension("woq", SOURCES, FLAGS)


# ------------------------------------------------------------------ backends
# A backend maps a contiguous float32 x (..., K) holding M = x.numel() // K rows to (..., N).
# (Leading dims are kept as they are: no reshape/view on kiln's path, ~1-2 us each here.)
RowKernel = Callable[[Tensor, int], Tensor]


class _KilnInt8:
    def __init__(self, qweight: Tensor, scale: Tensor):
        self._ext = load_extension()
        self.n, self.k = qweight.shape
        self._w, self._scale = int8_panels(qweight, scale, self._ext.lanes())  # (P, K, W)
        self._w_ptr, self._scale_ptr = self._w.data_ptr(), self._scale.data_ptr()

    def __call__(self, x: Tensor, m: int) -> Tensor:
        y = torch.empty(*x.shape[:-1], self.n)  # (..., N)
        self._ext.int8_mm(
            x.data_ptr(), m, self.k, self.n, self._w_ptr, self._scale_ptr, y.data_ptr()
        )
        return y


class _KilnInt4:
    def __init__(self, packed: Tensor, scale: Tensor, offset: Tensor, group_size: int):
        self._ext = load_extension()
        self.n, self.k, self.g = packed.shape[0], 2 * packed.shape[1], group_size
        self._w = int4_panels(packed, scale, offset, group_size, self._ext.lanes())
        self._w_ptr = self._w.data_ptr()

    def __call__(self, x: Tensor, m: int) -> Tensor:
        y = torch.empty(*x.shape[:-1], self.n)  # (..., N)
        self._ext.int4_mm(x.data_ptr(), m, self.k, self.n, self.g, self._w_ptr, y.data_ptr())
        return y


def _torch_int8(qweight: Tensor, scale: Tensor) -> RowKernel:
    n, k = qweight.shape

    def run(x: Tensor, m: int) -> Tensor:
        y = torch.ops.aten._weight_int8pack_mm(x.reshape(m, k), qweight, scale)  # (M, N)
        return y.view(x.shape[:-1] + (n,))

    return run


def _torch_int4(packed: Tensor, scale: Tensor, offset: Tensor, group_size: int) -> RowKernel:
    n, k = packed.shape[0], 2 * packed.shape[1]
    if n % 16:
        raise ValueError(f"torch's INT4 CPU kernel needs N % 16 == 0, got N = {n}")
    codes = unpack_int4(packed).to(torch.int32)  # (N, K)
    wp = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes, 1)
    s = scale.float()
    zeros = offset.float() + 8 * s  # torch dequantizes (q - 8) * scale + zero
    sz = torch.stack((s, zeros), dim=-1).transpose(0, 1).contiguous()  # (G, N, 2)

    def run(x: Tensor, m: int) -> Tensor:
        y = torch.ops.aten._weight_int4pack_mm_for_cpu(x.reshape(m, k), wp, group_size, sz)
        return y.view(x.shape[:-1] + (n,))  # (..., N)

    return run


# ------------------------------------------------------------------ the kernel object
class CpuWeightOnlyKernel:
    """float32 (..., K) -> (..., N) through ``small`` for M <= max_small_rows, else ``large``."""

    def __init__(
        self, k: int, n: int, small: tuple[str, RowKernel], large: tuple[str, RowKernel],
        max_small_rows: int,
    ):  # fmt: skip
        self.in_features, self.out_features = k, n
        (self._small_name, self._small), (self._large_name, self._large) = small, large
        self._max_small = max_small_rows

    def backend(self, rows: int) -> str:
        """The backend serving an input of ``rows`` rows (M = x.numel() // K)."""
        return self._small_name if rows <= self._max_small else self._large_name

    def __call__(self, x: Tensor) -> Tensor:
        k = self.in_features
        if x.dtype != torch.float32 or not x.is_cpu or x.dim() == 0 or x.shape[-1] != k:
            check_input(x, k, torch.device("cpu"))  # raises the precise error
        if not x.is_contiguous():
            x = x.contiguous()
        m = x.numel() // k
        if m == 0:
            return torch.empty(*x.shape[:-1], self.out_features)
        return self._small(x, m) if m <= self._max_small else self._large(x, m)


def _large(gemm: Callable[[], RowKernel], dequant: RowKernel) -> tuple[str, RowKernel]:
    """The backend for many rows: kiln's prefill GEMM, or dequantize + F.linear when it
    cannot be built (a warning says why)."""
    try:
        return "gemm", gemm()
    except (native.KilnCompileError, RuntimeError, OSError) as err:
        warnings.warn(
            f"kiln's prefill GEMM is unavailable ({err}); dequantizing in torch for many rows",
            RuntimeWarning,
            stacklevel=4,
        )
        return "dequant", dequant


def _choose(
    backend: Backend, kiln: Callable[[], RowKernel], gemm: Callable[[], RowKernel],
    torch_: Callable[[], RowKernel], dequant: RowKernel, k: int, n: int,
) -> CpuWeightOnlyKernel:  # fmt: skip
    if backend == "dequant":
        return CpuWeightOnlyKernel(k, n, ("dequant", dequant), ("dequant", dequant), 0)
    if backend == "torch":
        kern = torch_()
        return CpuWeightOnlyKernel(k, n, ("torch", kern), ("torch", kern), 0)
    if backend == "kiln":
        kern = kiln()
        return CpuWeightOnlyKernel(k, n, ("kiln", kern), ("kiln", kern), 0)
    if backend == "gemm":
        kern = gemm()
        return CpuWeightOnlyKernel(k, n, ("gemm", kern), ("gemm", kern), 0)
    if backend != "auto":
        raise ValueError(f"backend must be auto, kiln, gemm, torch or dequant, got {backend!r}")
    try:
        small = ("kiln", kiln())
    except (native.KilnCompileError, RuntimeError, OSError) as err:
        warnings.warn(
            f"kiln's weight-only CPU kernel is unavailable ({err}); using torch's kernels",
            RuntimeWarning,
            stacklevel=3,
        )
    else:
        return CpuWeightOnlyKernel(k, n, small, _large(gemm, dequant), KILN_MAX_ROWS)
    try:
        return CpuWeightOnlyKernel(k, n, ("torch", torch_()), ("dequant", dequant), KILN_MAX_ROWS)
    except (ValueError, RuntimeError):  # torch rejects some shapes; the reference always works
        return CpuWeightOnlyKernel(k, n, ("dequant", dequant), ("dequant", dequant), 0)


def cpu_int8_kernel(
    qweight: Tensor, scale: Tensor, backend: Backend = "auto"
) -> CpuWeightOnlyKernel:
    """An INT8 weight-only kernel on the CPU (format: kiln.kernels.registry); see the module doc."""
    n, k = check_int8(qweight, scale)
    if qweight.device.type != "cpu":
        raise ValueError(f"cpu_int8_kernel needs CPU tensors, got {qweight.device}")
    qweight, scale = qweight.contiguous(), scale.contiguous()

    def dequant(x: Tensor, m: int) -> Tensor:
        return F.linear(x, dequantize_int8(qweight, scale))

    return _choose(
        backend,
        lambda: _KilnInt8(qweight, scale),
        lambda: packed_gemm.Int8Gemm(qweight, scale).rows,
        lambda: _torch_int8(qweight, scale),
        dequant,
        k,
        n,
    )


def cpu_int4_kernel(
    packed: Tensor, scale: Tensor, offset: Tensor, group_size: int, backend: Backend = "auto"
) -> CpuWeightOnlyKernel:
    """An INT4 weight-only kernel on the CPU (format: kiln.kernels.registry); see the module doc."""
    n, k = check_int4(packed, scale, offset, group_size)
    if packed.device.type != "cpu":
        raise ValueError(f"cpu_int4_kernel needs CPU tensors, got {packed.device}")
    packed, scale, offset = packed.contiguous(), scale.contiguous(), offset.contiguous()

    def dequant(x: Tensor, m: int) -> Tensor:
        return F.linear(x, dequantize_int4(packed, scale, offset, group_size))

    return _choose(
        backend,
        lambda: _KilnInt4(packed, scale, offset, group_size),
        lambda: packed_gemm.Int4Gemm(packed, scale, offset, group_size).rows,
        lambda: _torch_int4(packed, scale, offset, group_size),
        dequant,
        k,
        n,
    )
