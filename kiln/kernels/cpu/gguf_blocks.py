"""GGUF quantized weights used as stored: ``y = x @ W.T`` straight from a tensor's blocks.

A GGUF tensor of a block type is, row after row, K / elems blocks of ``bytes`` bytes each
(``BLOCKS``: Q4_0, Q4_1, Q5_0, Q5_1 and Q8_0 in blocks of 32 elements, the K-quants Q4_K,
Q5_K and Q6_K in super-blocks of 256 with 8 or 16 sub-block scales; ``gguf_blocks.h``
describes each layout). kiln keeps such a weight as one uint8 tensor (N, K / elems * bytes),
the file's bytes, and computes with it three ways:

* ``"kiln"``: the C++ decode kernels, parallel over output rows on torch's OpenMP pool, for
  decode-sized inputs (M <= ``KILN_MAX_ROWS`` rows), where a step streams the weight bytes
  once. Two arithmetics (``ACTIVATIONS``):

  - ``"int8"`` (the default, ``DEFAULT_ACTIVATIONS``): x is quantized once per call to
    8-bit blocks of 32 (int8 values, d = max|x| / 127), and each weight block is
    multiplied by integer dot products (AVX-512 VNNI, else AVX2 maddubs), scaled in fp32
    (``gguf_q8.h``, ``gguf_qdot.h``). This is llama.cpp's own arithmetic on these files;
    it moves each activation by at most max|x| / 254 of its block, an error below the
    weights' own quantization error, and is ~2x faster at decode (the fp32 path is
    compute-bound, not bandwidth-bound, on these formats).
  - ``"fp32"``: exact: every weight is decoded to fp32 in registers and FMAed with the
    fp32 activations (``gguf_blocks.h``): the dequantized model's results up to fp32
    rounding.

  Built like ``woq.py``'s extension with plain g++ and -march=native (AVX-512 or AVX2 by
  the build machine); ``isa="avx2"`` builds the AVX2 path on an AVX-512 machine too
  (-mno-avx512f), so both are tested here.
* ``"gemm"`` / ``"gemm-int8"`` (more rows: prefill): kiln's prefill GEMMs
  (``kiln.kernels.cpu.packed_gemm``). In fp32 (``"gemm"``), 2 W output channels of blocks
  are decoded at a time into a cache-resident float tile (transposed in registers) and
  multiplied with a register-blocked micro-kernel. On a 1536 x 576 layer (AMD EPYC Zen 4,
  AVX-512, 1 thread) the decode kernel took 0.86-1.11x its time at 16 rows, 1.0-1.3x at 24
  and 1.2-2.2x from 128 rows up; ``"tiles"`` 1.2-1.5x at every row count from 16 to 512.
  With ``activations="int8"`` (``"gemm-int8"``, ``gguf_qgemm.h``) the tile holds the
  blocks' codes as bytes and the rows are 8-bit blocks, multiplied by integer dot products
  (VNNI, else maddubs): the decode kernels' arithmetic, 2.0-2.8x the fp32 GEMM's speed on
  SmolLM2's layer shapes at 512 rows (same machine, 1 thread, VNNI).
* ``"tiles"``: ``TILE_ROWS`` output rows at a time are dequantized (by the C++ decoder) and
  multiplied with ``F.linear``, so the float weight is never whole: the fallback for many
  rows when the GEMM cannot be built.
* ``reference_dequantize``: pure torch, written from the format definition: the tests'
  reference (next to the gguf package's ``dequantize``) and the fallback where no C++
  compiler is found, or the weight is not on the CPU.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from pathlib import Path
from types import ModuleType

import torch
import torch.nn.functional as F
from torch import Tensor

from kiln.core import native
from kiln.kernels.cpu import packed_gemm

# ggml_type id -> (name, elements per block, bytes per block): the types these kernels read.
BLOCKS: dict[int, tuple[str, int, int]] = {
    2: ("Q4_0", 32, 18), 3: ("Q4_1", 32, 20), 6: ("Q5_0", 32, 22), 7: ("Q5_1", 32, 24),
    8: ("Q8_0", 32, 34), 12: ("Q4_K", 256, 144), 13: ("Q5_K", 256, 176), 14: ("Q6_K", 256, 210),
}  # fmt: skip
TYPE_IDS = {name: t for t, (name, _, _) in BLOCKS.items()}

HERE = Path(__file__).resolve().parent
VEC_HEADERS = tuple(native.INCLUDE / n for n in ("kiln_vec.h", "kiln_vec_pow.h", "kiln_vec_trig.h"))
KERNEL_HEADER = HERE / "gguf_blocks.h"  # the kernels, also included by the decode step
# the 8-bit-activation kernels, also included by the decode step
QDOT_HEADERS = (HERE / "gguf_q8.h", HERE / "gguf_qdot.h")
SOURCES = (HERE / "gguf_blocks.cpp", KERNEL_HEADER, *QDOT_HEADERS, native.INCLUDE / "kiln_py.h",
           *VEC_HEADERS)  # fmt: skip
KILN_MAX_ROWS = packed_gemm.GEMM_MIN_ROWS - 1  # the decode kernel's rows; the GEMM above
TILE_ROWS = 256  # output rows dequantized at a time for more rows
ACTIVATIONS = ("int8", "fp32")  # the decode kernels' arithmetic (module doc)
DEFAULT_ACTIVATIONS = "int8"
QBLOCK = 32  # activation elements per 8-bit block


# ------------------------------------------------------------------ build
_EXTENSION = native.IsaExtension("gguf_blocks", SOURCES, "KILN_GGUF_EXT", "GGUF kernels")


def extension_key(isa: str | None = None) -> str:
    """Cache key of the extension built for ``isa``."""
    return _EXTENSION.key(isa)


def load_extension(isa: str | None = None) -> ModuleType:
    """The GGUF block kernels for ``isa`` ("avx512" / "avx2"; None: this CPU's widest), compiled on
    first use and cached on disk (``native.load_plain_extension``)."""
    return _EXTENSION.load(isa)


# ------------------------------------------------------------------ wrapper
def block_shape(ggml_type: int) -> tuple[int, int]:
    """(elements, bytes) per block of ``ggml_type``; ValueError for a type not in BLOCKS."""
    if ggml_type not in BLOCKS:
        names = ", ".join(name for name, _, _ in BLOCKS.values())
        raise ValueError(f"ggml type {ggml_type} has no kiln block kernel (kiln reads {names})")
    _, elems, nbytes = BLOCKS[ggml_type]
    return elems, nbytes


def row_bytes(ggml_type: int, k: int) -> int:
    """Bytes of one row of K elements of ``ggml_type``; K must be whole blocks."""
    elems, nbytes = block_shape(ggml_type)
    if k <= 0 or k % elems:
        name = BLOCKS[ggml_type][0]
        raise ValueError(f"{name} rows hold whole blocks of {elems}: K = {k} is not a multiple")
    return k // elems * nbytes


def check_blocks(blocks: Tensor, ggml_type: int, k: int) -> int:
    """Validate a tensor's blocks (uint8 (N, row_bytes)) for K input features; returns N."""
    want = row_bytes(ggml_type, k)
    if blocks.dtype != torch.uint8 or blocks.dim() != 2 or blocks.shape[1] != want:
        raise ValueError(
            f"{BLOCKS[ggml_type][0]} blocks for K = {k} must be uint8 (N, {want}), got "
            f"{blocks.dtype} {tuple(blocks.shape)}"
        )
    if blocks.shape[0] == 0:
        raise ValueError("the weight has no rows")
    return int(blocks.shape[0])


def check_activations(activations: str) -> str:
    """``activations`` if it is one of ``ACTIVATIONS``, else ValueError."""
    if activations not in ACTIVATIONS:
        raise ValueError(f"activations must be one of {ACTIVATIONS}, got {activations!r}")
    return activations


def _check_x(x: Tensor, k: int) -> None:
    if x.dtype != torch.float32 or not x.is_cpu or x.dim() == 0 or x.shape[-1] != k:
        raise ValueError(f"x must be a float32 CPU tensor (..., {k}), got {x.dtype} "
                         f"{x.device.type} {tuple(x.shape)}")  # fmt: skip


def gguf_matmul(
    x: Tensor, blocks: Tensor, ggml_type: int, isa: str | None = None,
    activations: str = DEFAULT_ACTIVATIONS,
) -> Tensor:  # fmt: skip
    """x float32 (..., K) @ dequant(blocks).T -> (..., N) by the C++ decode kernel of
    ``activations`` (module doc; any number of rows, it is meant for a few). ``blocks``:
    the tensor's bytes (N, K / elems * bytes)."""
    k = x.shape[-1] if x.dim() else 0
    n = check_blocks(blocks, ggml_type, k)
    _check_x(x, k)
    check_activations(activations)
    if not blocks.is_cpu:
        raise ValueError(f"the blocks must be on the CPU, got {blocks.device}")
    x, blocks = x.contiguous(), blocks.contiguous()
    y = torch.empty(*x.shape[:-1], n)  # (..., N)
    m = x.numel() // k
    if m:
        ext = load_extension(isa)
        mm = ext.qmm if activations == "int8" else ext.mm
        mm(ggml_type, x.data_ptr(), m, k, n, blocks.data_ptr(), y.data_ptr())
    return y


def quantize_activations(x: Tensor, isa: str | None = None) -> tuple[Tensor, Tensor]:
    """The 8-bit blocks the ``"int8"`` kernels multiply with: x float32 (M, K), K a multiple
    of 32 -> int8 values (M, K) and float32 scales (M, K / 32), x ~ scale * value."""
    if x.dim() != 2 or x.shape[1] % QBLOCK:
        raise ValueError(f"x must be (M, K) with K a multiple of {QBLOCK}, got {tuple(x.shape)}")
    _check_x(x, x.shape[1])
    x = x.contiguous()
    m, k = x.shape
    q, d = torch.empty(m, k, dtype=torch.int8), torch.empty(m, k // QBLOCK)
    load_extension(isa).quantize(x.data_ptr(), m, k, q.data_ptr(), d.data_ptr())
    return q, d


def dequantize_rows(blocks: Tensor, ggml_type: int, k: int, isa: str | None = None) -> Tensor:
    """The weight's values, float32 (N, K), decoded by the C++ kernels (on the CPU)."""
    n = check_blocks(blocks, ggml_type, k)
    blocks = blocks.contiguous()
    out = torch.empty(n, k)
    load_extension(isa).dequantize(ggml_type, blocks.data_ptr(), n, k, out.data_ptr())
    return out


Dequantizer = Callable[[Tensor], Tensor]  # blocks (rows, row bytes) -> float32 (rows, K)


def tiled_linear(
    x: Tensor, blocks: Tensor, dequant: Dequantizer, dtype: torch.dtype | None = None
) -> Tensor:
    """x (..., K) @ W.T with W dequantized ``TILE_ROWS`` output rows at a time (cast to
    ``dtype``, default x's): the float weight is never whole in memory. -> (..., N)."""
    n = blocks.shape[0]
    x2 = x.reshape(-1, x.shape[-1])  # (M, K)
    dtype = dtype or x.dtype
    y = torch.empty(x2.shape[0], n, dtype=dtype, device=x.device)  # (M, N)
    for n0 in range(0, n, TILE_ROWS):
        tile = dequant(blocks[n0 : n0 + TILE_ROWS]).to(dtype)  # (rows, K)
        y[:, n0 : n0 + tile.shape[0]] = F.linear(x2.to(dtype), tile)
    return y.reshape(*x.shape[:-1], n)


class GgufKernel:
    """A prepared GGUF weight: float32 (..., K) -> (..., N) on the CPU; the C++ decode
    kernel of ``activations`` (module doc) for M <= ``max_rows`` rows, the prefill GEMM
    above (in ``activations``; ``tiled_linear`` with the C++ decoder where the GEMM cannot be built, with a warning)."""

    def __init__(
        self, blocks: Tensor, ggml_type: int, k: int, max_rows: int = KILN_MAX_ROWS,
        activations: str = DEFAULT_ACTIVATIONS,
    ) -> None:  # fmt: skip
        self.out_features = check_blocks(blocks, ggml_type, k)
        if not blocks.is_cpu:
            raise ValueError(f"GgufKernel runs on the CPU; the blocks are on {blocks.device}")
        self.in_features, self.ggml_type, self.max_rows = k, ggml_type, max_rows
        self.activations = check_activations(activations)
        self._blocks = blocks.contiguous()
        self._ext = load_extension()
        self._mm = self._ext.qmm if activations == "int8" else self._ext.mm
        self._gemm: packed_gemm.GgufGemm | None = None
        try:
            self._gemm = packed_gemm.GgufGemm(self._blocks, ggml_type, k, activations=activations)
        except (native.KilnCompileError, RuntimeError, OSError) as err:
            warnings.warn(
                f"kiln's prefill GEMM is unavailable ({err}); dequantizing tiles for many rows",
                RuntimeWarning,
                stacklevel=2,
            )

    def backend(self, rows: int) -> str:
        """The path serving an input of ``rows`` rows."""
        if rows <= self.max_rows:
            return "kiln"
        if self._gemm is None:
            return "tiles"
        return "gemm-int8" if self._gemm.activations == "int8" else "gemm"

    def _dequant(self, rows: Tensor) -> Tensor:
        out = torch.empty(rows.shape[0], self.in_features)
        self._ext.dequantize(self.ggml_type, rows.data_ptr(), rows.shape[0], self.in_features,
                             out.data_ptr())  # fmt: skip
        return out

    def __call__(self, x: Tensor) -> Tensor:
        k, n = self.in_features, self.out_features
        _check_x(x, k)
        x = x.contiguous()
        m = x.numel() // k
        if m > self.max_rows:
            if self._gemm is not None:
                return self._gemm.rows(x, m)
            return tiled_linear(x, self._blocks, self._dequant)
        y = torch.empty(*x.shape[:-1], n)  # (..., N)
        if m:
            self._mm(self.ggml_type, x.data_ptr(), m, k, n, self._blocks.data_ptr(), y.data_ptr())
        return y


class TiledKernel:
    """``tiled_linear`` with the pure-torch reference dequantizer, in ``dtype``: any device."""

    def __init__(self, blocks: Tensor, ggml_type: int, k: int, dtype: torch.dtype):
        self.out_features = check_blocks(blocks, ggml_type, k)
        self.in_features, self.ggml_type, self.dtype, self._blocks = k, ggml_type, dtype, blocks

    def _dequant(self, rows: Tensor) -> Tensor:
        return reference_dequantize(rows, self.ggml_type, self.in_features)

    def __call__(self, x: Tensor) -> Tensor:
        return tiled_linear(x, self._blocks, self._dequant, self.dtype)


def gguf_kernel(
    blocks: Tensor, ggml_type: int, k: int, dtype: torch.dtype = torch.float32,
    activations: str = DEFAULT_ACTIVATIONS,
) -> GgufKernel | TiledKernel:  # fmt: skip
    """``x @ dequant(blocks).T`` for x (..., K) of ``dtype``: kiln's C++ kernels on the CPU
    (float32; ``activations`` picks the decode kernels' arithmetic, module doc), else
    (another device, or no compiler: with a warning) the reference dequantizer a tile of
    rows at a time, in ``dtype`` (exact, whatever ``activations`` says)."""
    check_blocks(blocks, ggml_type, k)
    check_activations(activations)
    if blocks.is_cpu and dtype == torch.float32:
        try:
            return GgufKernel(blocks, ggml_type, k, activations=activations)
        except (native.KilnCompileError, RuntimeError, OSError) as err:
            warnings.warn(
                f"kiln's GGUF block kernels are unavailable ({err}); dequantizing tiles in torch",
                RuntimeWarning,
                stacklevel=2,
            )
    return TiledKernel(blocks, ggml_type, k, dtype)


# ------------------------------------------------------------------ reference
def _f16(raw: Tensor, at: int) -> Tensor:
    """The fp16 at byte ``at`` of every block, float32 (B, 1)."""
    return raw[:, at : at + 2].contiguous().view(torch.float16).float()


def _nibbles(qs: Tensor) -> Tensor:
    """16 bytes per block -> 32 codes: element j low nibble of byte j, j + 16 high. (B, 32)"""
    return torch.cat((qs & 15, qs >> 4), dim=1)


def _bits(raw: Tensor) -> Tensor:
    """Every bit of (B, nbytes) bytes, little-endian: bit j of byte i at i * 8 + j. (B, 8n)"""
    shifts = torch.arange(8, dtype=torch.uint8, device=raw.device)
    return ((raw[:, :, None] >> shifts) & 1).reshape(raw.shape[0], -1)


def _scale_min_k4(s: Tensor) -> tuple[Tensor, Tensor]:
    """Q4_K / Q5_K: the 12 scale bytes (B, 12) -> 6-bit scales and mins (B, 8) each.
    j < 4: scale s[j] & 63, min s[j + 4] & 63; j >= 4: the low 4 bits from s[j + 4] (scale:
    low nibble, min: high nibble) and the top 2 from the top bits of s[j - 4] / s[j]."""
    s = s.to(torch.int32)
    lo, mid, hi = s[:, 0:4], s[:, 4:8], s[:, 8:12]
    sc = torch.cat((lo & 63, (hi & 15) | ((lo >> 6) << 4)), dim=1)
    mn = torch.cat((mid & 63, (hi >> 4) | ((mid >> 6) << 4)), dim=1)
    return sc.float(), mn.float()


def _q_small(raw: Tensor, name: str) -> Tensor:
    """The 32-element types: blocks (B, bytes) -> values (B, 32)."""
    d = _f16(raw, 0)
    if name == "Q8_0":  # d, 32 int8
        return d * raw[:, 2:34].contiguous().view(torch.int8).float()
    if name == "Q4_0":  # d, 16 bytes of nibbles; w = d (q - 8)
        return d * (_nibbles(raw[:, 2:18]).float() - 8)
    if name == "Q4_1":  # d, m, nibbles; w = d q + m
        return d * _nibbles(raw[:, 4:20]).float() + _f16(raw, 2)
    hi_at, qs_at = (2, 6) if name == "Q5_0" else (4, 8)  # Q5_1 has m before its 5th bits
    q = _nibbles(raw[:, qs_at : qs_at + 16]) | (_bits(raw[:, hi_at : hi_at + 4]) << 4)
    if name == "Q5_0":  # w = d (q - 16)
        return d * (q.float() - 16)
    return d * q.float() + _f16(raw, 2)  # Q5_1


def _q_k(raw: Tensor, name: str) -> Tensor:
    """The 256-element super-blocks: blocks (B, bytes) -> values (B, 256)."""
    b = raw.shape[0]
    if name == "Q6_K":  # ql[128], qh[64], int8 scales[16], d
        ql = raw[:, :128].reshape(b, 2, 2, 32)  # (half, run, l): element 128h + 32 run + l ...
        nib = torch.stack((ql & 15, ql >> 4), dim=2).reshape(b, 2, 4, 32)  # ... + 64 (high)
        qh = raw[:, 128:192].reshape(b, 2, 1, 32)
        shifts = torch.tensor([0, 2, 4, 6], dtype=torch.uint8, device=raw.device)
        high = (qh >> shifts[:, None]) & 3  # (B, 2, 4, 32): bits 2i..2i+1 for quarter i
        q = (nib | (high << 4)).reshape(b, 16, 16).float() - 32
        sc = raw[:, 192:208].contiguous().view(torch.int8).float()  # (B, 16)
        return ((_f16(raw, 208) * sc)[:, :, None] * q).reshape(b, 256)
    d, dmin = _f16(raw, 0), _f16(raw, 2)
    sc, mn = _scale_min_k4(raw[:, 4:16])
    qs_at = 16 if name == "Q4_K" else 48
    runs = raw[:, qs_at : qs_at + 128].reshape(b, 4, 1, 32)  # sub-blocks 2c (low), 2c + 1 (high)
    q = torch.cat((runs & 15, runs >> 4), dim=2).reshape(b, 8, 32)
    if name == "Q5_K":  # bit s of qh[l]: the 5th bit of element 32 s + l
        q = q | (_bits(raw[:, 16:48]).reshape(b, 32, 8).transpose(1, 2) << 4)
    return ((d * sc)[:, :, None] * q.float() - (dmin * mn)[:, :, None]).reshape(b, 256)


def reference_dequantize(blocks: Tensor, ggml_type: int, k: int) -> Tensor:
    """The values of a tensor's blocks (N, K / elems * bytes), float32 (N, K), in pure torch
    from the format definition (``gguf_blocks.h`` lists the layouts); any device."""
    n = check_blocks(blocks, ggml_type, k)
    name, elems, nbytes = BLOCKS[ggml_type]
    raw = blocks.reshape(n * (k // elems), nbytes)  # (blocks, bytes)
    values = _q_small(raw, name) if elems == 32 else _q_k(raw, name)
    return values.reshape(n, k)
