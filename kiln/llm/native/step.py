"""Build, load and feed kiln's whole-model CPU decode step (``decode.cpp``).

The extension is a tiny CPython module compiled with plain ``g++`` (as ``woq.py``'s: no
torch headers, METH_FASTCALL taking plain integers, so a call costs well under a
microsecond of binding work). It includes ``woq.h`` (kiln/kernels/cpu, on the include
path) for the INT8 / INT4 kernels, ``gguf_blocks.h`` / ``gguf_q8.h`` / ``gguf_qdot.h`` (next
to it) for GGUF blocks, and ``kiln_vec.h`` for the SIMD math, and links libgomp
(``-fopenmp``), which resolves to the copy torch has loaded: torch's one thread pool. The
``.so`` is cached under ``<kiln cache>/decode/`` by a hash of every source it includes
(``SOURCES``: decode.cpp, decode_*.h, woq.h, gguf_*.h, kiln_py.h, kiln_vec*.h), the flags,
the compiler, torch and Python versions and the CPU's vector ISA flags (AVX2 here, AVX-512
elsewhere).

The model reaches C++ as a flat int64 *descriptor* (layout in decode_desc.h's header
comment) built by ``Descriptor``: integers, floats as their double bits, tensors as data
pointers. ``Descriptor`` keeps every tensor it points to alive. One linear layer is a
``LinearArgs`` record (dense fp32 / bf16 / fp16, INT8 / INT4 packed, or a GGUF tensor's
blocks as stored, with 8-bit or fp32 activations); ``linear`` runs one such record alone
(tests, measurements).
"""

from __future__ import annotations

import functools
import struct
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType

import torch
from torch import Tensor

from kiln.core import native
from kiln.kernels.cpu import gguf_blocks, woq
from kiln.kernels.cpu.panels import int4_panels, int8_panels
from kiln.kernels.formats import check_int4, check_int8

HERE = Path(__file__).resolve().parent
# decode.cpp (what is compiled), then every header it includes: they all enter the cache key.
SOURCES = (
    *(HERE / name for name in ("decode.cpp", "decode_desc.h", "decode_linear.h", "decode_ops.h",
                               "decode_team.h", "decode_gemv.h", "decode_half.h")),
    woq.KERNEL_HEADER,
    gguf_blocks.KERNEL_HEADER,
    *gguf_blocks.QDOT_HEADERS,
    woq.PY_HEADER,
    *woq.VEC_HEADERS,
)  # fmt: skip
INCLUDE_DIRS = (woq.KERNEL_HEADER.parent,)  # woq.h (kiln_vec*.h are on every extension's path)
FLAGS = (
    "-O3",
    "-march=native",
    "-fno-math-errno",
    "-fopenmp",  # libgomp.so.1: the copy torch has already loaded (torch's thread pool)
    "-shared",
    "-fPIC",
    "-std=c++17",  # ISO mode: no implicit FMA contraction (products round like torch's)
)

KIND_NONE, KIND_FP32, KIND_INT8, KIND_INT4, KIND_BF16, KIND_FP16, KIND_GGUF, KIND_GGUF_Q8 = range(
    -1, 7
)
GGUF_KINDS = {"fp32": KIND_GGUF, "int8": KIND_GGUF_Q8}  # by the layer's activations
LAYOUT_MAGIC = 0x6B696C6E64656302  # decode_desc.h kMagic
# Storage codes of decode_half.h (the embedding table, the KV cache) and dense linear kinds.
STORAGE = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}
DENSE_KINDS = {torch.float32: KIND_FP32, torch.bfloat16: KIND_BF16, torch.float16: KIND_FP16}
LAYER_END = 0x6C61796572656E64  # decode.cpp kLayerEnd


# ------------------------------------------------------------------ build
def extension_key() -> str:
    """Cache key of the extension: everything that changes its binary or its ABI."""
    return native.extension_key(SOURCES, FLAGS)


@functools.cache
def load_extension() -> ModuleType:
    """The decode extension, compiled on first use (~10 s) and cached on disk
    (``native.load_plain_extension``)."""
    return native.load_plain_extension("decode", SOURCES, FLAGS, INCLUDE_DIRS)


# ------------------------------------------------------------------ linear records
def _ptr(t: Tensor | None) -> int:
    return 0 if t is None else t.data_ptr()


def _check_fp32(name: str, t: Tensor, shape: tuple[int, ...]) -> Tensor:
    if t.dtype != torch.float32 or t.device.type != "cpu" or tuple(t.shape) != shape:
        raise ValueError(
            f"{name} must be a float32 CPU tensor of shape {shape}, "
            f"got {t.dtype} {t.device.type} {tuple(t.shape)}"
        )
    return t.detach().contiguous()


@dataclass(frozen=True)
class LinearArgs:
    """One linear layer as decode.cpp runs it: y (M, n) = x (M, k) @ W.T + bias.

    ``weight`` is the dense (n, k) weight itself (fp32, bf16 or fp16), or woq.h's panel
    layout (INT8: int8 (P, k, lanes) with ``scale`` (P * lanes,); INT4: uint8 group records,
    ``group`` the group size). The record holds pointers; this object keeps the tensors alive.
    """

    kind: int
    n: int
    k: int
    group: int
    weight: Tensor
    scale: Tensor | None
    bias: Tensor | None

    def record(self) -> list[int]:
        """The 7-int64 LIN record of decode.cpp: kind, N, K, group, weight, scale, bias."""
        return [self.kind, self.n, self.k, self.group, _ptr(self.weight), _ptr(self.scale),
                _ptr(self.bias)]  # fmt: skip


def _bias(bias: Tensor | None, n: int) -> Tensor | None:
    return None if bias is None else _check_fp32("bias", bias.float(), (n,))


def dense_args(weight: Tensor, bias: Tensor | None) -> LinearArgs:
    """A dense linear layer, weight (N, K) fp32, bf16 or fp16 on the CPU, used in place (no
    copy when contiguous); the kernel widens 16-bit weights to fp32 as it loads them."""
    if weight.dim() != 2:
        raise ValueError(f"weight must be 2-D (N, K), got shape {tuple(weight.shape)}")
    if weight.dtype not in DENSE_KINDS or weight.device.type != "cpu":
        raise ValueError(
            f"weight must be a float32, bfloat16 or float16 CPU tensor, got {weight.dtype} "
            f"on {weight.device.type}"
        )
    n, k = weight.shape
    w = weight.detach().contiguous()
    return LinearArgs(DENSE_KINDS[w.dtype], n, k, 0, w, None, _bias(bias, n))


def int8_args(qweight: Tensor, scale: Tensor, bias: Tensor | None) -> LinearArgs:
    """An INT8 weight-only layer (kiln.kernels.registry format), in woq's panels (the copy
    the layer's own kernel uses, when it has made one)."""
    n, k = check_int8(qweight, scale)
    w, padded = int8_panels(qweight, scale, load_extension().lanes())  # (P, K, lanes)
    return LinearArgs(KIND_INT8, n, k, 0, w, padded, _bias(bias, n))


def int4_args(
    packed: Tensor, scale: Tensor, offset: Tensor, group_size: int, bias: Tensor | None
) -> LinearArgs:
    """An INT4 weight-only layer (kiln.kernels.registry format), in woq's records (shared
    with the layer's own kernel)."""
    n, k = check_int4(packed, scale, offset, group_size)
    w = int4_panels(packed, scale, offset, group_size, load_extension().lanes())
    return LinearArgs(KIND_INT4, n, k, group_size, w, None, _bias(bias, n))


def gguf_args(
    blocks: Tensor, ggml_type: int, k: int, bias: Tensor | None,
    activations: str = gguf_blocks.DEFAULT_ACTIVATIONS,
) -> LinearArgs:  # fmt: skip
    """A GGUF tensor's blocks as stored (uint8 (N, K / elems * bytes), ggml type
    ``ggml_type``: ``kiln.kernels.cpu.gguf_blocks``), used in place: the record's group is
    the type, and the kernel decodes the blocks in registers, multiplied with x quantized
    to 8-bit blocks (``activations="int8"``: integer dot products, kind 6) or exactly in
    fp32 (``"fp32"``, kind 5)."""
    n = gguf_blocks.check_blocks(blocks, ggml_type, k)
    kind = GGUF_KINDS[gguf_blocks.check_activations(activations)]
    if not blocks.is_cpu:
        raise ValueError(f"the blocks must be on the CPU, got {blocks.device}")
    return LinearArgs(kind, n, k, ggml_type, blocks.contiguous(), None, _bias(bias, n))


NO_LINEAR = [KIND_NONE, 0, 0, 0, 0, 0, 0]


def linear(args: LinearArgs, x: Tensor, threads: int | None = None) -> Tensor:
    """Run one record alone: x float32 (M, K) -> (M, N), through decode.cpp's dispatch.

    ``threads``: None picks like a step (torch's thread count; 1 below a few MB of
    weights), a number forces that many."""
    if x.dim() != 2:
        raise ValueError(f"x must be 2-D (M, {args.k}), got shape {tuple(x.shape)}")
    x = _check_fp32("x", x, (x.shape[0], args.k))
    rec = torch.tensor(args.record(), dtype=torch.int64)
    y = torch.empty(x.shape[0], args.n)
    load_extension().linear(rec.data_ptr(), x.data_ptr(), x.shape[0], y.data_ptr(), threads or 0)
    return y


# ------------------------------------------------------------------ descriptor
@dataclass
class Descriptor:
    """The int64 descriptor of a model under construction (decode.cpp's layout)."""

    words: list[int] = field(default_factory=list)
    keep: list[object] = field(default_factory=list)  # tensors pointed to
    linears: list[tuple[int, LinearArgs]] = field(default_factory=list)  # (first word, record)

    def ints(self, *values: int) -> None:
        self.words.extend(int(v) for v in values)

    def float(self, value: float) -> None:
        """A float, stored as its double's bits."""
        self.words.append(struct.unpack("<q", struct.pack("<d", float(value)))[0])

    def tensor(self, t: Tensor | None) -> None:
        """A pointer to ``t`` (0 for None); ``t`` must already be contiguous."""
        if t is not None:
            if not t.is_contiguous() or t.device.type != "cpu":
                raise ValueError(f"descriptor tensors must be contiguous CPU tensors: {t.shape}")
            self.keep.append(t)
        self.words.append(_ptr(t))

    def norm(self, weight: Tensor | None, bias: Tensor | None) -> None:
        """NORM: weight and bias pointers (fp32, contiguous)."""
        for t in (weight, bias):
            self.tensor(None if t is None else t.detach().float().contiguous())

    def linear(self, args: LinearArgs | None) -> None:
        """LIN: a linear layer's record (kind -1 for an absent one)."""
        if args is None:
            self.words.extend(NO_LINEAR)
            return
        self.linears.append((len(self.words), args))
        self.words.extend(args.record())

    def to_tensor(self) -> Tensor:
        """The descriptor as C++ reads it."""
        return torch.tensor(self.words, dtype=torch.int64)
