"""Prefill GEMMs straight from packed weights: ``y = x @ W.T`` for many rows of x.

A prompt of hundreds of tokens makes every linear layer a compute-bound GEMM. The decode
kernels (``woq.h``, ``gguf_blocks.h``) widen each weight in registers for every chunk of
<= 8 rows, which costs as much as the multiply-adds; dequantizing the whole weight in torch
and calling ``F.linear`` writes and re-reads an fp32 copy of it every call. kiln's
``packed_gemm.h`` instead decodes 2 W output channels x K at a time into a float tile that
stays in cache (W: the SIMD lanes) and multiplies it against blocks of rows with a
register-blocked micro-kernel (12 rows x 32 channels of accumulators on AVX-512, 6 x 16 on
AVX2), in fp32, parallel over tiles on torch's OpenMP pool (see the header for the layout).
It reads kiln's INT4 (group-wise asymmetric: also what a GGUF's Q4_0 / Q4_1 load into) and
INT8 weights in the decode kernels' panels (``kiln.kernels.cpu.panels``: the one shared
copy, no new memory) and a GGUF tensor's blocks as stored (every type of
``gguf_blocks.BLOCKS``). For GGUF blocks there is also the 8-bit-activation GEMM
(``gguf_qgemm.h``, ``GgufGemm(activations="int8")``): the tile holds the blocks' codes as
bytes and x is quantized to 8-bit blocks once per call, multiplied by integer dot products
(AVX-512 VNNI ``vpdpbusd``: 64 multiply-adds per instruction against the fp32 kernel's 16;
``vpmaddubsw`` + ``vpmaddwd`` without VNNI).

Which kernel serves which rows is measured (``python -m kiln.bench.prefill --kernels``;
AMD EPYC Zen 4, AVX-512, SmolLM2's layer shapes, 1 thread; figures in ``woq.py`` and
``gguf_blocks.py``): the decode kernels up to 16 rows, this GEMM from ``GEMM_MIN_ROWS``.
Choosing between this kernel and "dequantize tiles, then torch.matmul (MKL)": at 512 rows
the GEMM took 0.7-0.95x the time of MKL's sgemm on the already-dequantized fp32 weight
(the dequantization not even counted), and the tiles path (``gguf_blocks.tiled_linear``)
1.2-1.5x the GEMM's time on GGUF weights at every row count from 16 to 512. Built like ``gguf_blocks.py``'s extension (plain g++,
-march=native); ``isa="avx2"`` builds the AVX2 path on an AVX-512 machine as well
(-mno-avx512f), so the tests check both.
"""

from __future__ import annotations

from pathlib import Path
from types import ModuleType

import torch
from torch import Tensor

from kiln.core import native
from kiln.kernels.cpu.panels import int4_panels, int8_panels
from kiln.kernels.formats import check_int4, check_int8

HERE = Path(__file__).resolve().parent
KERNEL_HEADER = HERE / "packed_gemm.h"
# packed_gemm.cpp (what is compiled), then every header it includes: they all enter the key.
SOURCES = (
    HERE / "packed_gemm.cpp",
    KERNEL_HEADER,
    HERE / "gguf_blocks.h",  # the GGUF block decoders
    HERE / "gguf_qgemm.h",  # the GGUF GEMM with 8-bit activations, and its headers
    HERE / "gguf_q8.h",
    HERE / "gguf_qdot.h",
    native.INCLUDE / "kiln_py.h",
    *(native.INCLUDE / n for n in ("kiln_vec.h", "kiln_vec_pow.h", "kiln_vec_trig.h")),
)
# Below this many rows the decode kernels (woq.h, gguf_blocks.h) are as fast or faster
# (measured: see the module doc); woq.py and gguf_blocks.py dispatch on it.
GEMM_MIN_ROWS = 17


# ------------------------------------------------------------------ build
_EXTENSION = native.IsaExtension("packed_gemm", SOURCES, "KILN_PG_EXT", "prefill GEMMs")


def extension_key(isa: str | None = None) -> str:
    """Cache key of the extension built for ``isa``."""
    return _EXTENSION.key(isa)


def load_extension(isa: str | None = None) -> ModuleType:
    """The prefill GEMMs for ``isa`` ("avx512" / "avx2"; None: this CPU's widest), compiled on
    first use and cached on disk (``native.load_plain_extension``)."""
    return _EXTENSION.load(isa)


# ------------------------------------------------------------------ prepared weights
def _check_x(x: Tensor, k: int) -> Tensor:
    if x.dtype != torch.float32 or not x.is_cpu or x.dim() == 0 or x.shape[-1] != k:
        raise ValueError(f"x must be a float32 CPU tensor (..., {k}), got {x.dtype} "
                         f"{x.device.type} {tuple(x.shape)}")  # fmt: skip
    return x.contiguous()


class PackedGemm:
    """A packed weight prepared for the prefill GEMM: float32 (..., K) -> (..., N).

    ``block_rows``: rows per block of the kernel (0: its default); for measurements."""

    in_features: int
    out_features: int

    def __init__(self, isa: str | None, block_rows: int) -> None:
        self._ext = load_extension(isa)
        self.block_rows = block_rows

    def _run(self, x: Tensor, m: int, y: Tensor) -> None:
        raise NotImplementedError

    def __call__(self, x: Tensor) -> Tensor:
        x = _check_x(x, self.in_features)
        y = torch.empty(*x.shape[:-1], self.out_features)  # (..., N)
        m = x.numel() // self.in_features
        if m:
            self._run(x, m, y)
        return y

    def rows(self, x: Tensor, m: int) -> Tensor:
        """``self(x)`` for a contiguous float32 x already checked (``woq``'s RowKernel)."""
        y = torch.empty(*x.shape[:-1], self.out_features)
        self._run(x, m, y)
        return y


class Int4Gemm(PackedGemm):
    """kiln's INT4 format (packed uint8 (N, K/2), scale / offset fp16 (N, K/g)), read from
    the decode kernels' shared panels."""

    def __init__(self, packed: Tensor, scale: Tensor, offset: Tensor, group_size: int,
                 isa: str | None = None, block_rows: int = 0) -> None:  # fmt: skip
        super().__init__(isa, block_rows)
        self.out_features, self.in_features = check_int4(packed, scale, offset, group_size)
        self.group_size = group_size
        self._w = int4_panels(packed, scale, offset, group_size, self._ext.lanes())

    def _run(self, x: Tensor, m: int, y: Tensor) -> None:
        self._ext.int4(x.data_ptr(), m, self.in_features, self.out_features, self.group_size,
                       self._w.data_ptr(), y.data_ptr(), self.block_rows)  # fmt: skip


class Int8Gemm(PackedGemm):
    """kiln's INT8 format (qweight int8 (N, K), scale fp32 (N,)), from the shared panels."""

    def __init__(self, qweight: Tensor, scale: Tensor, isa: str | None = None,
                 block_rows: int = 0) -> None:  # fmt: skip
        super().__init__(isa, block_rows)
        self.out_features, self.in_features = check_int8(qweight, scale)
        self._w, self._scale = int8_panels(qweight, scale, self._ext.lanes())

    def _run(self, x: Tensor, m: int, y: Tensor) -> None:
        self._ext.int8(x.data_ptr(), m, self.in_features, self.out_features, self._w.data_ptr(),
                       self._scale.data_ptr(), y.data_ptr(), self.block_rows)  # fmt: skip


class GgufGemm(PackedGemm):
    """A GGUF tensor's blocks as stored (uint8 (N, K / elems * bytes), ggml type: those of
    ``gguf_blocks.BLOCKS``). ``activations="int8"`` quantizes x to 8-bit blocks and
    multiplies by integer dot products (``gguf_qgemm.h``: the decode kernels' arithmetic);
    ``"fp32"`` (the default here) is exact."""

    def __init__(self, blocks: Tensor, ggml_type: int, k: int, isa: str | None = None,
                 block_rows: int = 0, activations: str = "fp32") -> None:  # fmt: skip
        super().__init__(isa, block_rows)
        shape = self._ext.block_shape(ggml_type)  # (elements, bytes) per block, or None
        if shape is None:
            raise ValueError(f"ggml type {ggml_type} has no kiln block kernel")
        elems, nbytes = shape
        ok = k > 0 and k % elems == 0 and blocks.dim() == 2 and blocks.shape[0] > 0
        if not ok or blocks.dtype != torch.uint8 or blocks.shape[1] != k // elems * nbytes:
            raise ValueError(f"the blocks of ggml type {ggml_type} for K = {k} must be uint8 "
                             f"(N, K / {elems} * {nbytes}), got {blocks.dtype} "
                             f"{tuple(blocks.shape)}")  # fmt: skip
        if not blocks.is_cpu:
            raise ValueError(f"the blocks must be on the CPU, got {blocks.device}")
        if activations not in ("int8", "fp32"):
            raise ValueError(f"activations must be 'int8' or 'fp32', got {activations!r}")
        self.out_features, self.in_features, self.ggml_type = int(blocks.shape[0]), k, ggml_type
        self._blocks = blocks.contiguous()
        self.activations = activations
        self._mm = self._ext.gguf_q8 if activations == "int8" else self._ext.gguf

    def _run(self, x: Tensor, m: int, y: Tensor) -> None:
        self._mm(self.ggml_type, x.data_ptr(), m, self.in_features, self.out_features,
                 self._blocks.data_ptr(), y.data_ptr(), self.block_rows)  # fmt: skip
