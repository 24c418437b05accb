"""Lowerings of reductions and of everything built on them: mean, var, softmax,
log_softmax and the normalisations (layer, batch in eval mode, instance via
batch statistics, group).

Every reduction whose result is broadcast back against its input is emitted
with keepdim=True, so fused kernels read it with plain broadcasting.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch
from torch import fx

from kiln.compiler.capture.builder import Builder, Unsupported, call_args, norm_dim, pos, register

aten = torch.ops.aten


def _dims(b: Builder, x: str, dims: Any) -> tuple[int, ...]:
    """Normalised reduction dims; None or [] means all dims."""
    rank = len(b.shape(x))
    if dims is None or (isinstance(dims, (list, tuple)) and len(dims) == 0):
        return tuple(range(rank))
    if isinstance(dims, int):
        dims = [dims]
    return tuple(sorted(norm_dim(int(d), rank) for d in dims))


def _count(b: Builder, x: str, dims: Sequence[int]) -> int:
    n = 1
    for d in dims:
        n *= b.shape(x)[d]
    return n


def _inverse(n: float) -> float:
    """1 / n, with 1 / 0 = inf so that empty means and single-sample variances
    come out NaN (0 * inf) as in torch."""
    return math.inf if n <= 0 else 1.0 / n


def mean(b: Builder, x: str, dims: Sequence[int], keepdim: bool = True) -> str:
    """sum over dims (keepdim) times 1/n."""
    s = b.scale(b.reduce("sum", x, dims, keepdim=True), _inverse(_count(b, x, dims)))
    return s if keepdim else _drop(b, s, dims)


def _drop(b: Builder, v: str, dims: Sequence[int]) -> str:
    """View a keepdim result to drop the reduced (size-1) dims."""
    return b.view(v, [s for i, s in enumerate(b.shape(v)) if i not in dims])


def moments(b: Builder, x: str, dims: Sequence[int], correction: float = 0) -> tuple[str, str, str]:
    """(mean, x - mean, var), mean and var with keepdim=True; two-pass variance
    sum((x - mean)^2) / (n - correction)."""
    m = mean(b, x, dims)
    d = b.emit("sub", [x, m])
    ss = b.reduce("sum", b.emit("mul", [d, d]), dims, keepdim=True)
    return m, d, b.scale(ss, _inverse(_count(b, x, dims) - correction))


def _float_input(b: Builder, x: str, dtype: object) -> str:
    if isinstance(dtype, torch.dtype):
        return b.cast(x, dtype)
    return x


@register(aten.sum.dim_IntList, aten.sum.default)
def _sum(b: Builder, node: fx.Node) -> str:
    a = call_args(node)
    x = _float_input(b, b.tensor(a["self"]), a["dtype"])
    if b.dtype(x) == torch.bool or not b.dtype(x).is_floating_point:
        x = b.cast(x, torch.int64)  # integer sums accumulate in int64, as in torch
    return b.reduce("sum", x, _dims(b, x, a.get("dim")), bool(a.get("keepdim")))


@register(aten.mean.dim, aten.mean.default)
def _mean(b: Builder, node: fx.Node) -> str:
    a = call_args(node)
    x = _float_input(b, b.tensor(a["self"]), a["dtype"])
    return mean(b, x, _dims(b, x, a.get("dim")), bool(a.get("keepdim")))


@register(aten.amax.default, aten.amin.default)
def _amax(b: Builder, node: fx.Node) -> str:
    a = call_args(node)
    x = b.tensor(a["self"])
    op = "max" if node.target is aten.amax.default else "min"
    return b.reduce(op, x, _dims(b, x, a["dim"]), bool(a["keepdim"]))


@register(aten.max.default, aten.min.default)
def _max_all(b: Builder, node: fx.Node) -> str:
    x = b.tensor(pos(node)[0])
    op = "max" if node.target is aten.max.default else "min"
    return b.reduce(op, x, None, keepdim=False)


@register(aten.max.dim, aten.min.dim)
def _max_dim(b: Builder, node: fx.Node) -> list[str | None]:
    """(values, indices): values are a reduction, indices run through torch."""
    a = call_args(node)
    x = b.tensor(a["self"])
    op = "max" if node.target is aten.max.dim else "min"
    return [b.reduce(op, x, _dims(b, x, a["dim"]), bool(a["keepdim"])), None]


@register(aten.any.dim, aten.any.dims, aten.any.default)
def _any(b: Builder, node: fx.Node) -> str:
    """any(x) = max(float(x != 0)) > 0, in float32 so kernels see no int/bool math."""
    a = call_args(node)
    x = b.tensor(a["self"])
    mask = x if b.dtype(x) == torch.bool else b.emit("ne", [x, b.operand(0, like=x)])
    f = b.cast(mask, torch.float32)
    m = b.reduce("max", f, _dims(b, x, a.get("dim")), bool(a.get("keepdim")))
    return b.emit("gt", [m, b.const(0.0, torch.float32)])


@register(aten.var.correction, aten.var_mean.correction)
def _var(b: Builder, node: fx.Node) -> str | list[str | None]:
    a = call_args(node)
    x = b.tensor(a["self"])
    dims = _dims(b, x, a["dim"])
    corr = 1 if a["correction"] is None else a["correction"]
    m, _, v = moments(b, x, dims, corr)
    keep = bool(a["keepdim"])
    var = v if keep else _drop(b, v, dims)
    if node.target is aten.var.correction:
        return var
    return [var, m if keep else _drop(b, m, dims)]


@register(aten._softmax.default)
def _softmax(b: Builder, node: fx.Node) -> str:
    """exp(x - max) / sum(exp(x - max)) over one dim."""
    x = b.tensor(pos(node)[0])
    dim = norm_dim(int(pos(node)[1]), len(b.shape(x)))
    e = b.emit("exp", [b.emit("sub", [x, b.reduce("max", x, [dim], keepdim=True)])])
    return b.emit("div", [e, b.reduce("sum", e, [dim], keepdim=True)])


@register(aten._log_softmax.default)
def _log_softmax(b: Builder, node: fx.Node) -> str:
    """(x - max) - log(sum(exp(x - max)))."""
    x = b.tensor(pos(node)[0])
    dim = norm_dim(int(pos(node)[1]), len(b.shape(x)))
    s = b.emit("sub", [x, b.reduce("max", x, [dim], keepdim=True)])
    lse = b.emit("log", [b.reduce("sum", b.emit("exp", [s]), [dim], keepdim=True)])
    return b.emit("sub", [s, lse])


def _affine(b: Builder, y: str, w: object, bias: object, channel_shape: Sequence[int]) -> str:
    """y * w + bias with w/bias (optional) viewed to ``channel_shape``."""
    if w is not None:
        y = b.emit("mul", [y, b.view(b.tensor(w), channel_shape)])
    if bias is not None:
        y = b.emit("add", [y, b.view(b.tensor(bias), channel_shape)])
    return y


def _normalize(b: Builder, x: str, dims: Sequence[int], eps: float) -> tuple[str, str, str]:
    """(normalised x, mean, rstd) over ``dims`` (keepdim)."""
    m, d, v = moments(b, x, dims)
    rstd = b.emit("rsqrt", [b.emit("add", [v, b.operand(float(eps), like=v)])])
    return b.emit("mul", [d, rstd]), m, rstd


@register(aten.native_layer_norm.default)
def _layer_norm(b: Builder, node: fx.Node) -> list[str | None]:
    """Outputs (y, mean, rstd), mean/rstd keepdim as in ATen."""
    x, shape, w, bias, eps = pos(node)
    xv = b.tensor(x)
    rank = len(b.shape(xv))
    dims = tuple(range(rank - len(shape), rank))
    y, m, rstd = _normalize(b, xv, dims, float(eps))
    return [_affine(b, y, w, bias, list(shape)), m, rstd]


def _channel_shape(b: Builder, x: str) -> list[int]:
    """(C, 1, ..., 1): per-channel parameters broadcast against (N, C, *)."""
    shape = b.shape(x)
    return [shape[1]] + [1] * (len(shape) - 2)


@register(aten._native_batch_norm_legit_no_training.default)
def _batch_norm_eval(b: Builder, node: fx.Node) -> list[str | None]:
    """y = x * scale + shift with scale = w / sqrt(var + eps) and
    shift = b - mean * scale; both fold to constants for PARAM statistics."""
    x, w, bias, rmean, rvar, _momentum, eps = pos(node)
    xv = b.tensor(x)
    cs = _channel_shape(b, xv)
    var = b.tensor(rvar)
    scale = b.emit("rsqrt", [b.emit("add", [var, b.operand(float(eps), like=var)])])
    if w is not None:
        scale = b.emit("mul", [scale, b.tensor(w)])
    shift = b.emit("neg", [b.emit("mul", [b.tensor(rmean), scale])])
    if bias is not None:
        shift = b.emit("add", [shift, b.tensor(bias)])
    y = b.emit("mul", [xv, b.view(scale, cs)])
    return [b.emit("add", [y, b.view(shift, cs)]), None, None]


@register(aten._native_batch_norm_legit.no_stats, aten._native_batch_norm_legit.default)
def _batch_norm_batch_stats(b: Builder, node: fx.Node) -> list[str | None]:
    """Normalisation with the batch's own statistics over (N, *spatial) — what
    instance norm becomes after export. Outputs (y, mean (C,), rstd (C,))."""
    a = call_args(node)
    if not a["training"]:
        raise Unsupported("_native_batch_norm_legit with training=False")
    if a.get("running_mean") is not None:
        raise Unsupported("batch norm that updates running statistics")
    xv = b.tensor(a["input"])
    rank = len(b.shape(xv))
    dims = (0, *range(2, rank))
    y, m, rstd = _normalize(b, xv, dims, float(a["eps"]))
    y = _affine(b, y, a["weight"], a["bias"], _channel_shape(b, xv))
    return [y, _drop(b, m, dims), _drop(b, rstd, dims)]


@register(aten.native_group_norm.default)
def _group_norm(b: Builder, node: fx.Node) -> list[str | None]:
    """View (N, C, *) as (N, G, C/G * HxW), normalise the last dim, view back.
    Outputs (y, mean (N, G), rstd (N, G))."""
    x, w, bias, n, c, hxw, groups, eps = pos(node)
    xv = b.tensor(x)
    shape = b.shape(xv)
    if shape[0] != n or shape[1] != c:
        raise Unsupported("group norm shape arguments disagree with the input")
    grouped = b.view(xv, [n, groups, (c // groups) * hxw])
    y, m, rstd = _normalize(b, grouped, [2], float(eps))
    y = _affine(b, b.view(y, shape), w, bias, _channel_shape(b, xv))
    return [y, _drop(b, m, [2]), _drop(b, rstd, [2])]
