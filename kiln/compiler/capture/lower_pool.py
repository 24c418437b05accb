"""Lowerings of 2-D pooling that has a primitive form: non-overlapping windows
(stride == kernel, no padding) and adaptive pooling to a divisor of the input
size become ``view`` + ``sum``/``max`` over the window dims. Anything else
(overlap, padding, ceil mode) runs through PyTorch as an opaque node."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import fx

from kiln.compiler.capture.builder import Builder, Unsupported, call_args, pos, register
from kiln.compiler.capture.lower_layout import slice_of

aten = torch.ops.aten


def _pair(v: Any) -> tuple[int, int]:
    if isinstance(v, int):
        return v, v
    seq = [int(s) for s in v]
    if len(seq) == 1:
        return seq[0], seq[0]
    return seq[0], seq[1]


def window_reduce(b: Builder, x: str, kernel: tuple[int, int], op: str) -> str:
    """x (*, H, W) -> (*, H // kh, W // kw): reduce each kh x kw window.
    ``op`` is "max" or "mean"."""
    kh, kw = kernel
    *lead, h, w = b.shape(x)
    oh, ow = h // kh, w // kw
    rank = len(lead) + 2
    if (oh, ow) == (1, 1) and (kh, kw) == (h, w):  # global pool: reduce (H, W) keepdim
        r = b.reduce("max" if op == "max" else "sum", x, (rank - 2, rank - 1), keepdim=True)
        return r if op == "max" else b.scale(r, 1.0 / (kh * kw))
    x = slice_of(b, slice_of(b, x, rank - 2, 0, oh * kh, 1), rank - 1, 0, ow * kw, 1)
    tiles = b.view(b.contiguous(x), (*lead, oh, kh, ow, kw))  # (*, oh, kh, ow, kw)
    dims = (len(lead) + 1, len(lead) + 3)
    r = b.reduce("max" if op == "max" else "sum", tiles, dims, keepdim=False)  # (*, oh, ow)
    return r if op == "max" else b.scale(r, 1.0 / (kh * kw))


def _check_plain(kernel: tuple[int, int], stride: Sequence[int], padding: Any) -> None:
    if tuple(stride) and _pair(stride) != kernel:
        raise Unsupported(f"pooling with stride {tuple(stride)} != kernel {kernel}")
    if any(_pair(padding)):
        raise Unsupported("pooling with padding")


@register(aten.avg_pool2d.default)
def _avg_pool2d(b: Builder, node: fx.Node) -> str:
    a = call_args(node)
    kernel = _pair(a["kernel_size"])
    _check_plain(kernel, a["stride"], a["padding"])
    if a["ceil_mode"] or a["divisor_override"] is not None:
        raise Unsupported("avg_pool2d with ceil_mode or divisor_override")
    return window_reduce(b, b.tensor(a["self"]), kernel, "mean")


@register(aten.max_pool2d_with_indices.default)
def _max_pool2d(b: Builder, node: fx.Node) -> list[str | None]:
    """(values, indices): values as a window max; indices run through torch."""
    a = call_args(node)
    kernel = _pair(a["kernel_size"])
    _check_plain(kernel, a["stride"], a["padding"])
    if a["ceil_mode"] or _pair(a["dilation"]) != (1, 1):
        raise Unsupported("max_pool2d with ceil_mode or dilation")
    return [window_reduce(b, b.tensor(a["self"]), kernel, "max"), None]


@register(aten._adaptive_avg_pool2d.default, aten.adaptive_avg_pool2d.default)
def _adaptive_avg_pool2d(b: Builder, node: fx.Node) -> str:
    """Output sizes that divide the input: equal windows, a window mean
    ((1, 1): a mean over (H, W))."""
    x = b.tensor(pos(node)[0])
    h, w = b.shape(x)[-2:]
    oh, ow = _pair(pos(node)[1])
    if h % oh or w % ow:
        raise Unsupported(f"adaptive_avg_pool2d {h}x{w} -> {oh}x{ow} has unequal windows")
    if (oh, ow) == (h, w):
        return x
    return window_reduce(b, x, (h // oh, w // ow), "mean")
