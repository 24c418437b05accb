"""Shared pieces of C++ emission: strided operands, dim coalescing, op expressions.

Generated kernels compute in ``kv::V`` float vectors (``kiln_vec.h``); bool tensors
are uint8 in memory and 0/1 floats in registers. An ``Operand`` is a strided tensor a
loop nest reads or writes; its strides are given per loop dimension.
"""

from __future__ import annotations

import math
import struct
from dataclasses import dataclass

import torch

from kiln.compiler.ir.graph import Node

FLOAT, BOOL = torch.float32, torch.bool
NATIVE_DTYPES = (FLOAT, BOOL)


@dataclass(frozen=True)
class Operand:
    """A strided tensor in a loop nest: ``ptr`` is a C++ expression for the root's
    base pointer; element (i_0, .., i_d) lives at ``offset + sum(i_k * strides[k])``."""

    ptr: str
    dtype: torch.dtype
    offset: int
    strides: tuple[int, ...]

    @property
    def ctype(self) -> str:
        return "uint8_t" if self.dtype == BOOL else "float"


def coalesce(
    sizes: tuple[int, ...], operands: list[Operand]
) -> tuple[tuple[int, ...], list[Operand]]:
    """Drop size-1 dims and merge adjacent dims that every operand walks contiguously
    (stride[i] == stride[i+1] * size[i+1]), so loops run long and vectorise."""
    keep = [i for i, s in enumerate(sizes) if s != 1]
    dims = [sizes[i] for i in keep]
    strides = [[op.strides[i] for i in keep] for op in operands]
    i = len(dims) - 2
    while i >= 0:
        if all(st[i] == st[i + 1] * dims[i + 1] for st in strides):
            dims[i] *= dims[i + 1]
            del dims[i + 1]
            for st in strides:
                del st[i]  # the merged dim steps like the inner one
        i -= 1
    if not dims:
        dims, strides = [1], [[0] for _ in operands]
    ops = [Operand(op.ptr, op.dtype, op.offset, tuple(st)) for op, st in zip(operands, strides)]
    return tuple(dims), ops


def cfloat(x: float) -> str:
    """An exact C++ float literal."""
    if math.isnan(x):
        return '__builtin_nanf("")'
    if math.isinf(x):
        return "__builtin_inff()" if x > 0 else "(-__builtin_inff())"
    f = struct.unpack("f", struct.pack("f", x))[0]
    return f"{float(f).hex()}f"


_UNARY = {
    "neg": "(-{0})",
    "abs": "kv::abs({0})",
    "exp": "kv::exp({0})",
    "log": "kv::log({0})",
    "sqrt": "kv::sqrt({0})",
    "rsqrt": "kv::rsqrt({0})",
    "reciprocal": "kv::recip({0})",
    "tanh": "kv::tanh({0})",
    "sigmoid": "kv::sigmoid({0})",
    "erf": "kv::erf({0})",
    "relu": "kv::relu({0})",
    "sin": "kv::sin({0})",
    "cos": "kv::cos({0})",
    "log1p": "kv::log1p({0})",
    "expm1": "kv::expm1({0})",
    "floor": "kv::floor({0})",
    "ceil": "kv::ceil({0})",
    "round": "kv::round({0})",
    "sign": "kv::sign({0})",
    "logical_not": "kv::logical_not({0})",
    "copy": "{0}",
}
_BINARY = {
    "add": "({0} + {1})",
    "sub": "({0} - {1})",
    "mul": "({0} * {1})",
    "div": "({0} / {1})",
    "maximum": "kv::max({0}, {1})",
    "minimum": "kv::min({0}, {1})",
    "pow": "kv::pow({0}, {1})",
    "eq": "kv::cmp_eq({0}, {1})",
    "ne": "kv::cmp_ne({0}, {1})",
    "lt": "kv::cmp_lt({0}, {1})",
    "le": "kv::cmp_le({0}, {1})",
    "gt": "kv::cmp_gt({0}, {1})",
    "ge": "kv::cmp_ge({0}, {1})",
    "logical_and": "kv::logical_and({0}, {1})",
    "logical_or": "kv::logical_or({0}, {1})",
}


def pointwise_expr(node: Node, args: list[str], in_dtypes: list[torch.dtype]) -> str:
    """C++ expression computing a pointwise node from its operands' vector names."""
    op = node.op
    if op in _UNARY:
        return _UNARY[op].format(*args)
    if op in _BINARY:
        return _BINARY[op].format(*args)
    if op == "where":
        return f"kv::select({args[0]}, {args[1]}, {args[2]})"
    if op == "cast":
        to = node.attrs["dtype"]
        if to == BOOL and in_dtypes[0] != BOOL:
            return f"kv::cmp_ne({args[0]}, kv::splat(0.0f))"
        if to in NATIVE_DTYPES:
            return args[0]  # bool -> float is the same 0/1 value in registers
    raise NotImplementedError(f"no native code for pointwise {op!r}")


def supports_pointwise(node: Node) -> bool:
    if node.op in _UNARY or node.op in _BINARY or node.op == "where":
        return True
    return node.op == "cast" and node.attrs["dtype"] in NATIVE_DTYPES


def load(op: Operand, idx: str, inner_stride: int, n: str | None) -> str:
    """Vector load of W consecutive loop positions starting at element index ``idx``
    (a C++ expression that already includes the offset and outer strides); ``n`` is
    the valid lane count for a tail, None for a full vector."""
    p = f"({op.ptr} + {idx})"
    if op.dtype == BOOL:
        if inner_stride == 1:
            return f"kv::load_u8n({p}, {n})" if n else f"kv::load_u8({p})"
        return f"kgen::gather_u8({p}, {inner_stride}, {n or 'kv::W'})"
    if inner_stride == 1:
        return f"kv::loadn({p}, {n}, 0.0f)" if n else f"kv::load({p})"
    return (
        f"kv::gathern({p}, {inner_stride}, {n}, 0.0f)" if n else f"kv::gather({p}, {inner_stride})"
    )


def splat_load(op: Operand, idx: str) -> str:
    """Broadcast of the single element at ``idx`` (inner stride 0)."""
    return f"kv::splat((float){op.ptr}[{idx}])"


def store(op: Operand, idx: str, inner_stride: int, value: str, n: str | None) -> str:
    p = f"({op.ptr} + {idx})"
    if inner_stride != 1:
        return f"kgen::scatter({p}, {inner_stride}, {value}, {n or 'kv::W'});"
    if op.dtype == BOOL:
        return f"kv::store_u8n({p}, {value}, {n});" if n else f"kv::store_u8({p}, {value});"
    return f"kv::storen({p}, {value}, {n});" if n else f"kv::store({p}, {value});"


PRELUDE = r"""
#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>
#include "kiln_rt.h"
#include "kiln_vec.h"
#include "kiln_gemm.h"
#include "kiln_rnn.h"

namespace kgen {
// Strided reads/writes that kiln_vec.h does not cover (rare layouts only).
inline kv::V gather_u8(const uint8_t* p, int64_t s, int n) {
  alignas(64) float t[kv::W] = {};
  for (int l = 0; l < n; ++l) t[l] = p[l * s] ? 1.0f : 0.0f;
  return kv::load(t);
}
template <class T>
inline void scatter(T* p, int64_t s, kv::V v, int n) {
  alignas(64) float t[kv::W];
  kv::store(t, v);
  for (int l = 0; l < n; ++l) p[l * s] = (T)(std::is_same<T, uint8_t>::value ? (t[l] != 0.0f) : t[l]);
}
// A per-thread scratch area of at least n floats.
inline float* scratch(int slot, int64_t n) {
  static thread_local std::vector<float> bufs[8];
  std::vector<float>& b = bufs[slot];
  if ((int64_t)b.size() < n + 16) b.resize(n + 16);
  return b.data();
}
}  // namespace kgen
"""
