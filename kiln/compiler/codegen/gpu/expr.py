"""Primitive nodes as Triton expressions, and the literals and dtypes they need.

Generated kernels compute every float value in fp32 registers whatever the tensor's
dtype (loads upcast, stores round once), as inductor does: a fused fp16/bf16 chain is
then closer to the fp32 result than eager's per-op rounding, and within the dtype's
tolerance of it. Bool values are ``tl.int1``; bool tensors are stored as bytes.

Only ``triton.language`` core functions are used, never ``libdevice``: the interpreter
(``TRITON_INTERPRET=1``, how every kernel is tested without a GPU) has no libdevice, so
``tanh``, ``log1p``, ``expm1`` and ``round`` are written out from core functions.
"""

from __future__ import annotations

import math

import torch

from kiln.compiler.ir.graph import Node

TL_DTYPES: dict[torch.dtype, str] = {
    torch.float32: "tl.float32",
    torch.float16: "tl.float16",
    torch.bfloat16: "tl.bfloat16",
    torch.bool: "tl.int1",
    torch.int64: "tl.int64",
    torch.int32: "tl.int32",
}
FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
KERNEL_DTYPES = (*FLOAT_DTYPES, torch.bool)  # what generated kernels load and store


class Unsupported(Exception):
    """A kernel the Triton templates cannot express; it runs through ATen instead."""


def literal(x: float | bool) -> str:
    """An exact fp32 Triton literal (inf/nan included)."""
    if isinstance(x, bool):
        return "True" if x else "False"
    if math.isnan(x):
        return 'float("nan")'
    if math.isinf(x):
        return 'float("inf")' if x > 0 else '(-float("inf"))'
    return repr(float(torch.tensor(x, dtype=torch.float32).item()))


_UNARY = {
    "neg": "(-{0})",
    "abs": "tl.abs({0})",
    "exp": "tl.exp({0})",
    "log": "tl.log({0})",
    "sqrt": "tl.sqrt({0})",
    "rsqrt": "tl.rsqrt({0})",
    "reciprocal": "(1.0 / {0})",
    "sigmoid": "tl.sigmoid({0})",
    "erf": "tl.math.erf({0})",
    "relu": "tl.maximum({0}, 0.0)",
    "sin": "tl.sin({0})",
    "cos": "tl.cos({0})",
    "floor": "tl.floor({0})",
    "ceil": "tl.ceil({0})",
    # exp(-2|x|) keeps tanh accurate at both ends (no overflow, no 1 - 1 at large |x|)
    "tanh": "tl.where({0} < 0, -1.0, 1.0) * (1.0 - tl.exp(-2.0 * tl.abs({0}))) "
    "/ (1.0 + tl.exp(-2.0 * tl.abs({0})))",
    "log1p": "tl.log(1.0 + {0})",
    "expm1": "(tl.exp({0}) - 1.0)",
    "sign": "tl.where({0} > 0, 1.0, tl.where({0} < 0, -1.0, 0.0))",
    # round half to even, as torch.round
    "round": "tl.where((tl.floor({0} + 0.5) - {0} == 0.5) & "
    "(tl.floor({0} + 0.5) - 2.0 * tl.floor(0.5 * tl.floor({0} + 0.5)) != 0.0), "
    "tl.floor({0} + 0.5) - 1.0, tl.floor({0} + 0.5))",
    "copy": "{0}",
}
_BINARY = {
    "add": "({0} + {1})",
    "sub": "({0} - {1})",
    "mul": "({0} * {1})",
    "div": "({0} / {1})",
    "maximum": "tl.maximum({0}, {1})",
    "minimum": "tl.minimum({0}, {1})",
    "eq": "({0} == {1})",
    "ne": "({0} != {1})",
    "lt": "({0} < {1})",
    "le": "({0} <= {1})",
    "gt": "({0} > {1})",
    "ge": "({0} >= {1})",
    "logical_and": "({0} & {1})",
    "logical_or": "({0} | {1})",
}


def as_bool(expr: str, is_bool: bool) -> str:
    return expr if is_bool else f"({expr} != 0.0)"


def as_float(expr: str, is_bool: bool) -> str:
    return f"{expr}.to(tl.float32)" if is_bool else expr


def node_expr(node: Node, args: list[str], bools: list[bool], consts: dict[int, float]) -> str:
    """The Triton expression of one pointwise node over argument expressions ``args``
    (``bools[i]``: argument i is ``tl.int1``; ``consts``: argument index -> the value
    of a 0-d constant argument, for ``pow``'s exponent)."""
    op = node.op
    if op == "logical_not":
        return f"(~{as_bool(args[0], bools[0])})"
    if op in ("logical_and", "logical_or"):
        return _BINARY[op].format(*(as_bool(a, b) for a, b in zip(args, bools)))
    if op == "cast":
        if node.attrs["dtype"] == torch.bool:
            return as_bool(args[0], bools[0])
        if node.attrs["dtype"] not in FLOAT_DTYPES:
            raise Unsupported(f"cast to {node.attrs['dtype']}")
        return as_float(args[0], bools[0])
    if op == "where":
        return f"tl.where({as_bool(args[0], bools[0])}, {as_float(args[1], bools[1])}, " + (
            f"{as_float(args[2], bools[2])})"
        )
    if op == "pow":
        return _pow(as_float(args[0], bools[0]), args[1], consts.get(1))
    fl = [as_float(a, b) for a, b in zip(args, bools)]
    if op in ("eq", "ne") and all(bools):
        return _BINARY[op].format(*args)
    if op in _UNARY:
        return _UNARY[op].format(fl[0])
    if op in _BINARY:
        return _BINARY[op].format(*fl)
    raise Unsupported(f"pointwise op {op!r}")


def _pow(base: str, exponent: str, value: float | None) -> str:
    """x ** c for a constant c: multiplications for small integers (negative bases
    stay right), sqrt for 1/2, exp(c log x) otherwise (NaN for x < 0, as torch)."""
    if value is None:
        raise Unsupported("pow with a tensor exponent")
    if value == 0.5:
        return f"tl.sqrt({base})"
    if value == int(value) and abs(value) <= 4:
        n = int(abs(value))
        prod = " * ".join([base] * n) if n else "1.0"
        return f"(1.0 / ({prod}))" if value < 0 else f"({prod})"
    return f"tl.exp({exponent} * tl.log({base}))"
