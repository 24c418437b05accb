"""Lowerings of elementwise ATen ops: arithmetic, math functions, comparisons,
logic, clamps and activations (gelu, silu) written as primitive chains."""

from __future__ import annotations

import math

import torch
from torch import fx

from kiln.compiler.capture.builder import Builder, Unsupported, call_args, pos, register

aten = torch.ops.aten

_UNARY = {
    aten.neg: "neg",
    aten.abs: "abs",
    aten.exp: "exp",
    aten.log: "log",
    aten.sqrt: "sqrt",
    aten.rsqrt: "rsqrt",
    aten.reciprocal: "reciprocal",
    aten.tanh: "tanh",
    aten.sigmoid: "sigmoid",
    aten.erf: "erf",
    aten.relu: "relu",
    aten.sin: "sin",
    aten.cos: "cos",
    aten.log1p: "log1p",
    aten.expm1: "expm1",
    aten.floor: "floor",
    aten.ceil: "ceil",
    aten.sign: "sign",
    aten.logical_not: "logical_not",
}


def _unary(b: Builder, node: fx.Node) -> str:
    op = _UNARY[node.target.overloadpacket]  # type: ignore[union-attr]
    return b.emit(op, [b.tensor(pos(node)[0])])


for _packet in _UNARY:
    register(_packet.default)(_unary)


@register(aten.round.default)
def _round(b: Builder, node: fx.Node) -> str:
    return b.emit("round", [b.tensor(pos(node)[0])])


def _two(b: Builder, node: fx.Node) -> tuple[str, str]:
    """Both operands of a binary call; scalars become typed 0-d constants."""
    x, y = pos(node)[:2]
    if isinstance(x, fx.Node):
        a = b.tensor(x)
        return a, b.operand(y, like=a)
    c = b.tensor(y)
    return b.operand(x, like=c), c


def _neutral(node: fx.Node, neutral: float) -> bool:
    """True if the call is ``tensor op scalar`` with the op's neutral scalar
    (x * 1, x / 1, x + 0, x - 0) and keeps the tensor's dtype: the identity."""
    x, y = pos(node)[:2]
    if not isinstance(x, fx.Node) or isinstance(y, (fx.Node, bool)) or y != neutral:
        return False
    return x.meta["val"].dtype == node.meta["val"].dtype


def _with_alpha(b: Builder, node: fx.Node, op: str) -> str:
    """add/sub with ``alpha``: a op (alpha * b)."""
    if _neutral(node, 0):
        return b.tensor(pos(node)[0])
    x, y = _two(b, node)
    alpha = node.kwargs.get("alpha", 1)
    if alpha != 1:
        y = b.emit("mul", [y, b.operand(alpha, like=y)])
    return b.emit(op, [x, y])


@register(aten.add.Tensor, aten.add.Scalar)
def _add(b: Builder, node: fx.Node) -> str:
    return _with_alpha(b, node, "add")


@register(aten.sub.Tensor, aten.sub.Scalar)
def _sub(b: Builder, node: fx.Node) -> str:
    return _with_alpha(b, node, "sub")


_BINARY = {
    aten.mul.Tensor: "mul",
    aten.mul.Scalar: "mul",
    aten.div.Tensor: "div",
    aten.div.Scalar: "div",
    aten.maximum.default: "maximum",
    aten.minimum.default: "minimum",
    aten.pow.Tensor_Tensor: "pow",
    aten.logical_and.default: "logical_and",
    aten.logical_or.default: "logical_or",
    **{getattr(aten, c).Tensor: c for c in ("eq", "ne", "lt", "le", "gt", "ge")},
    **{getattr(aten, c).Scalar: c for c in ("eq", "ne", "lt", "le", "gt", "ge")},
}


@register(*_BINARY)
def _binary(b: Builder, node: fx.Node) -> str:
    op = _BINARY[node.target]  # type: ignore[index]
    if op in ("mul", "div") and _neutral(node, 1):
        return b.tensor(pos(node)[0])
    x, y = _two(b, node)
    return b.emit(op, [x, y])


@register(aten.isnan.default)
def _isnan(b: Builder, node: fx.Node) -> str:
    """NaN is the only value unequal to itself."""
    x = b.tensor(pos(node)[0])
    return b.emit("ne", [x, x])


@register(aten.isinf.default)
def _isinf(b: Builder, node: fx.Node) -> str:
    x = b.tensor(pos(node)[0])
    if not b.dtype(x).is_floating_point:
        raise Unsupported("isinf on an integer tensor")
    return b.emit("eq", [b.emit("abs", [x]), b.operand(math.inf, like=x)])


@register(aten.div.Tensor_mode, aten.div.Scalar_mode)
def _div_mode(b: Builder, node: fx.Node) -> str:
    mode = node.kwargs.get("rounding_mode")
    x, y = _two(b, node)
    if mode is None:
        return b.emit("div", [x, y])
    if mode == "floor" and b.dtype(x).is_floating_point:
        return b.emit("floor", [b.emit("div", [x, y])])
    raise Unsupported(f"div with rounding_mode={mode!r} on {b.dtype(x)}")


@register(aten.logical_xor.default)
def _logical_xor(b: Builder, node: fx.Node) -> str:
    x, y = (b.cast(b.tensor(a), torch.bool) for a in pos(node)[:2])
    return b.emit("ne", [x, y])


@register(aten.bitwise_and.Tensor, aten.bitwise_or.Tensor, aten.bitwise_not.default)
def _bitwise_bool(b: Builder, node: fx.Node) -> str:
    xs = [b.tensor(a) for a in pos(node)]
    if any(b.dtype(x) != torch.bool for x in xs):
        raise Unsupported("bitwise op on non-bool tensors")
    name = node.target.overloadpacket.__name__  # type: ignore[union-attr]
    return b.emit(name.replace("bitwise", "logical"), xs)


@register(aten.pow.Tensor_Scalar)
def _pow_scalar(b: Builder, node: fx.Node) -> str:
    """Small exponents become multiplications or roots (exact and cheaper)."""
    x, e = b.tensor(pos(node)[0]), pos(node)[1]
    if not isinstance(e, (int, float)) or isinstance(e, bool):
        raise Unsupported(f"pow exponent {e!r}")
    if e == 1:
        return x
    if e == 2:
        return b.emit("mul", [x, x])
    if e == 3:
        return b.emit("mul", [b.emit("mul", [x, x]), x])
    if e == 0.5 and b.dtype(x).is_floating_point:
        return b.emit("sqrt", [x])
    if e == -0.5 and b.dtype(x).is_floating_point:
        return b.emit("rsqrt", [x])
    if e == -1 and b.dtype(x).is_floating_point:
        return b.emit("reciprocal", [x])
    return b.emit("pow", [x, b.operand(e, like=x)])


@register(aten.pow.Scalar)
def _pow_base(b: Builder, node: fx.Node) -> str:
    e = b.tensor(pos(node)[1])
    return b.emit("pow", [b.operand(pos(node)[0], like=e), e])


def _clamp_to(b: Builder, x: str, lo: object, hi: object) -> str:
    """clamp(x, lo, hi) = minimum(maximum(x, lo), hi); None bounds are skipped."""
    if lo is not None:
        x = b.emit("maximum", [x, b.operand(lo, like=x)])
    if hi is not None:
        x = b.emit("minimum", [x, b.operand(hi, like=x)])
    return x


@register(aten.clamp.default, aten.clamp.Tensor)
def _clamp(b: Builder, node: fx.Node) -> str:
    a = call_args(node)
    return _clamp_to(b, b.tensor(a["self"]), a["min"], a["max"])


@register(aten.clamp_min.default, aten.clamp_min.Tensor)
def _clamp_min(b: Builder, node: fx.Node) -> str:
    return _clamp_to(b, b.tensor(pos(node)[0]), pos(node)[1], None)


@register(aten.clamp_max.default, aten.clamp_max.Tensor)
def _clamp_max(b: Builder, node: fx.Node) -> str:
    return _clamp_to(b, b.tensor(pos(node)[0]), None, pos(node)[1])


@register(aten.hardtanh.default)
def _hardtanh(b: Builder, node: fx.Node) -> str:
    a = call_args(node)
    return _clamp_to(b, b.tensor(a["self"]), a["min_val"], a["max_val"])


@register(aten.where.self, aten.where.ScalarSelf, aten.where.ScalarOther, aten.where.Scalar)
def _where(b: Builder, node: fx.Node) -> str:
    cond = b.tensor(pos(node)[0])
    x, y = pos(node)[1:3]
    if isinstance(x, fx.Node):
        xv = b.tensor(x)
        yv = b.operand(y, like=xv)
    elif isinstance(y, fx.Node):
        yv = b.tensor(y)
        xv = b.operand(x, like=yv)
    else:
        raise Unsupported("where with two scalar branches")
    return b.emit("where", [cond, xv, yv])


@register(aten.gelu.default)
def _gelu(b: Builder, node: fx.Node) -> str:
    """exact: 0.5 x (1 + erf(x / sqrt 2));
    tanh: 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3)))."""
    x = b.tensor(pos(node)[0])
    approximate = node.kwargs.get("approximate", "none")
    one = b.operand(1.0, like=x)
    if approximate == "tanh":
        cube = b.emit("mul", [b.emit("mul", [x, x]), x])
        inner = b.emit("add", [x, b.scale(cube, 0.044715)])
        t = b.emit("tanh", [b.scale(inner, math.sqrt(2.0 / math.pi))])
        gate = b.emit("add", [t, one])
    else:
        gate = b.emit("add", [b.emit("erf", [b.scale(x, 1.0 / math.sqrt(2.0))]), one])
    return b.scale(b.emit("mul", [x, gate]), 0.5)


@register(aten.silu.default)
def _silu(b: Builder, node: fx.Node) -> str:
    x = b.tensor(pos(node)[0])
    return b.emit("mul", [x, b.emit("sigmoid", [x])])
