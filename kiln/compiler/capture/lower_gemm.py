"""Lowerings of matrix products and convolutions to the ``mm``/``bmm``/``conv``
primitives. A weight transpose is emitted as a ``permute`` of the PARAM;
constant folding turns it into a contiguous (K, N) PARAM."""

from __future__ import annotations

from typing import Any

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
        return _transposed_convolution(b, a)
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


def _transposed_convolution(b: Builder, a: dict[str, Any]) -> str:
    """A transposed conv whose kernel equals its stride (a U-Net's 2x2 stride-2 upsampling,
    no padding, dilation or groups): the output tiles do not overlap, so it is a 1x1 conv
    to kh x kw x C_out channels (filters ordered tap-major), then each pixel's channels
    spread over its output tile, written in channels-last order:

        y (B, kh*kw*C_out, H, W) -> (B, H, W, kh, kw, C_out) -> (B, H, kh, W, kw, C_out)
          -> (B, H*kh, W*kw, C_out), viewed back as (B, C_out, H*kh, W*kw)

    Inside a channels-last region (``channels_last``) the conv already computes
    (B, H, W, kh*kw*C_out), so the first step is a view and the spreading is the one copy,
    whose output the region reads without another (a channel-major order would leave the
    region, convert to NCHW, spread, and convert back: three copies). Other transposed
    convs stay PyTorch calls."""
    x, w = b.tensor(a["input"]), b.tensor(a["weight"])
    kernel = tuple(b.shape(w)[2:])  # weight (C_in, C_out, *kernel)
    stride = tuple(int(s) for s in a["stride"])
    plain = (
        kernel == stride
        and all(int(p) == 0 for p in a["padding"])
        and all(int(p) == 0 for p in a["output_padding"])
        and all(int(d) == 1 for d in a["dilation"])
        and int(a["groups"]) == 1
        and len(kernel) in (1, 2)
    )
    if not plain:
        raise Unsupported("transposed convolution with overlapping tiles, padding or groups")
    c_in, c_out = b.shape(w)[:2]
    n = len(kernel)
    taps = 1
    for k in kernel:
        taps *= k
    # weight -> (*kernel, C_out, C_in) -> 1x1 conv filters (taps * C_out, C_in, 1[, 1])
    wt = b.contiguous(b.permute(w, [*range(2, 2 + n), 1, 0]))
    wt = b.view(wt, (taps * c_out, c_in, *(1,) * n))
    ones = (1,) * n
    y = b.emit("conv", [x, wt], stride=ones, padding=(0,) * n, dilation=ones, groups=1)
    spatial, batch = tuple(b.shape(x)[2:]), b.shape(x)[0]
    y = b.contiguous(b.permute(y, [0, *range(2, 2 + n), 1]))  # (B, *spatial, taps * C_out)
    y = b.view(y, (batch, *spatial, *kernel, c_out))
    # (B, s0[, s1], k0[, k1], C_out) -> (B, s0, k0[, s1, k1], C_out)
    order = [0, *(d for i in range(n) for d in (1 + i, 1 + n + i)), 1 + 2 * n]
    y = b.contiguous(b.permute(y, order))
    out_spatial = tuple(s * k for s, k in zip(spatial, kernel, strict=True))
    y = b.view(y, (batch, *out_spatial, c_out))
    y = b.permute(y, [0, n + 1, *range(1, n + 1)])  # (B, C_out, *out_spatial), a view
    if a["bias"] is not None:
        bias = b.view(b.tensor(a["bias"]), (1, c_out, *ones))
        y = b.emit("add", [y, bias])
    return y
