"""Lowerings of matrix products and convolutions to the ``mm``/``bmm``/``conv``
primitives. A weight transpose is emitted as a ``permute`` of the PARAM;
constant folding turns it into a contiguous (K, N) PARAM."""

from __future__ import annotations

import torch
from torch import fx

from kiln.compiler.capture.builder import Builder, Unsupported, call_args, pos, register

aten = torch.ops.aten


def _rows(b: Builder, x: str) -> str:
    """View (*, K) as (M, K), materialising a strided input first."""
    shape = b.shape(x)
    if len(shape) == 2:
        return x
    m = 1
    for s in shape[:-1]:
        m *= s
    return b.view(b.contiguous(x), (m, shape[-1]))


@register(aten.mm.default)
def _mm(b: Builder, node: fx.Node) -> str:
    return b.emit("mm", [b.tensor(pos(node)[0]), b.tensor(pos(node)[1])])


@register(aten.bmm.default)
def _bmm(b: Builder, node: fx.Node) -> str:
    return b.emit("bmm", [b.tensor(pos(node)[0]), b.tensor(pos(node)[1])])


@register(aten.addmm.default)
def _addmm(b: Builder, node: fx.Node) -> str:
    """beta * bias + alpha * (m1 @ m2)."""
    a = call_args(node)
    r = b.scale(b.emit("mm", [b.tensor(a["mat1"]), b.tensor(a["mat2"])]), a["alpha"])
    if a["beta"] == 0:
        return r
    return b.emit("add", [r, b.scale(b.tensor(a["self"]), a["beta"])])


@register(aten.mv.default)
def _mv(b: Builder, node: fx.Node) -> str:
    mat, vec = b.tensor(pos(node)[0]), b.tensor(pos(node)[1])
    col = b.view(vec, (b.shape(vec)[0], 1))
    return b.view(b.emit("mm", [mat, col]), (b.shape(mat)[0],))


@register(aten.linear.default)
def _linear(b: Builder, node: fx.Node) -> str:
    """x (*, K) @ w.T (K, N) + bias (N,) -> (*, N)."""
    a = call_args(node)
    x, w = b.tensor(a["input"]), b.tensor(a["weight"])
    if len(b.shape(w)) != 2 or not b.shape(x):
        raise Unsupported("linear with a non-matrix weight or a 0-d input")
    y = b.emit("mm", [_rows(b, x), b.permute(w, (1, 0))])  # (M, N)
    if a["bias"] is not None:
        y = b.emit("add", [y, b.tensor(a["bias"])])
    return b.view(y, (*b.shape(x)[:-1], b.shape(w)[0]))


def _batched(b: Builder, x: str, batch: tuple[int, ...], n: int) -> str:
    """Broadcast x (*, R, C) to (batch, R, C) and view it as (n, R, C)."""
    r, c = b.shape(x)[-2:]
    x = b.contiguous(b.expand(x, (*batch, r, c)))
    return b.view(x, (n, r, c))


@register(aten.matmul.default)
def _matmul(b: Builder, node: fx.Node) -> str:
    """2-D: mm; (*, M, K) @ (K, N): rows view + mm; otherwise broadcast the
    batch dims, view to 3-D, bmm and view back."""
    x, y = b.tensor(pos(node)[0]), b.tensor(pos(node)[1])
    xs, ys = b.shape(x), b.shape(y)
    if len(xs) < 2 or len(ys) < 2:
        raise Unsupported("matmul with a vector operand")
    if len(ys) == 2:
        return b.view(b.emit("mm", [_rows(b, x), y]), (*xs[:-1], ys[1]))
    batch = tuple(torch.broadcast_shapes(xs[:-2], ys[:-2]))
    n = 1
    for s in batch:
        n *= s
    out = b.emit("bmm", [_batched(b, x, batch, n), _batched(b, y, batch, n)])
    return b.view(out, (*batch, xs[-2], ys[-1]))


@register(aten.convolution.default)
def _convolution(b: Builder, node: fx.Node) -> str:
    a = call_args(node)
    if a["transposed"]:
        raise Unsupported("transposed convolution")
    inputs = [b.tensor(a["input"]), b.tensor(a["weight"])]
    if a["bias"] is not None:
        inputs.append(b.tensor(a["bias"]))
    return b.emit(
        "conv",
        inputs,
        stride=tuple(int(s) for s in a["stride"]),
        padding=tuple(int(p) for p in a["padding"]),
        dilation=tuple(int(d) for d in a["dilation"]),
        groups=int(a["groups"]),
    )
