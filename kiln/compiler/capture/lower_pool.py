"""Lowerings of 2-D pooling and nearest upsampling. A max or average pool of a 4-D value
(and an adaptive average pool to a divisor of the input size) becomes one ``pool2d``
primitive, run by its own native kernel (``codegen/cpu/pool.py``) in either layout; a
pool whose window is the whole image is a reduction over (H, W) (it fuses with its
neighbours into a row or column kernel). Non-overlapping pools of other ranks become
``view`` + ``sum``/``max`` over the window dims. (That view form used to serve 4-D
values too; its reduction over non-trailing dims fuses with nothing and ran about 6x
slower than ``pool2d`` on NCHW U-Net sizes, 50 vs 8 us for 16x64x64, and its rank-6
view broke channels-last regions.) Ceil mode, dilation, a divisor override and average
pools that leave padding out of the count run through PyTorch as opaque nodes. Nearest
upsampling by whole factors is two ``index_select``s with constant indices."""

from __future__ import annotations

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


def _window(a: dict[str, Any]) -> tuple[tuple[int, int], tuple[int, int], tuple[int, int]]:
    """(kernel, stride, padding) of a pooling call (an empty stride means the kernel)."""
    kernel = _pair(a["kernel_size"])
    stride = _pair(a["stride"]) if tuple(a["stride"] or ()) else kernel
    return kernel, stride, _pair(a["padding"])


def pool(
    b: Builder,
    x: str,
    mode: str,
    window: tuple[tuple[int, int], tuple[int, int], tuple[int, int]],
) -> str:
    """A max ("max") or average ("avg") pool of ``x`` (*, H, W) with ``window``'s
    (kernel, stride, padding): a reduction over (H, W) when the window is the whole
    image, one ``pool2d`` on a 4-D value, else the window reduction if the windows tile
    the input."""
    kernel, stride, padding = window
    reduce_op = "max" if mode == "max" else "mean"
    if padding == (0, 0) and kernel == b.shape(x)[-2:]:
        return window_reduce(b, x, kernel, reduce_op)  # global: fuses into a row kernel
    if len(b.shape(x)) == 4:
        attrs = {"mode": mode, "kernel": kernel, "stride": stride, "padding": padding}
        return b.emit("pool2d", [b.contiguous(x)], **attrs, channels_last=False)
    if stride != kernel or padding != (0, 0):
        raise Unsupported(f"overlapping or padded pooling of a {len(b.shape(x))}-D value")
    return window_reduce(b, x, kernel, reduce_op)


@register(aten.avg_pool2d.default)
def _avg_pool2d(b: Builder, node: fx.Node) -> str:
    a = call_args(node)
    if a["ceil_mode"] or a["divisor_override"] is not None:
        raise Unsupported("avg_pool2d with ceil_mode or divisor_override")
    if not a["count_include_pad"] and any(_window(a)[2]):
        raise Unsupported("avg_pool2d with padding left out of the count")
    return pool(b, b.tensor(a["self"]), "avg", _window(a))


@register(aten.max_pool2d_with_indices.default)
def _max_pool2d(b: Builder, node: fx.Node) -> list[str | None]:
    """(values, indices): the values as primitives; the indices, only when something
    reads them, through torch (an opaque node of their own, made by the capture)."""
    a = call_args(node)
    if a["ceil_mode"] or _pair(a["dilation"]) != (1, 1):
        raise Unsupported("max_pool2d with ceil_mode or dilation")
    return [pool(b, b.tensor(a["self"]), "max", _window(a)), None]


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
    kernel = (h // oh, w // ow)
    return pool(b, x, "avg", (kernel, kernel, (0, 0)))


@register(aten.upsample_nearest2d.vec, aten.upsample_nearest2d.default)
def _upsample_nearest2d(b: Builder, node: fx.Node) -> str:
    """Nearest upsampling of (N, C, H, W) by whole factors (sh, sw): output row i is input
    row i // sh, column j input column j // sw, which is what PyTorch computes when the
    output is exactly (H * sh, W * sw). Two ``index_select``s with constant indices
    (along H, then W): native kernels that stay inside a channels-last region, where a
    PyTorch call cost 350 us for a 2x upsample of 64x36x36 in style transfer. Other sizes
    stay PyTorch calls."""
    x = b.tensor(pos(node)[0])
    if len(b.shape(x)) != 4:
        raise Unsupported("upsample_nearest2d of a value that is not 4-D")
    h, w = b.shape(x)[-2:]
    oh, ow = (int(s) for s in node.meta["val"].shape[-2:])
    if oh % h or ow % w:
        raise Unsupported(f"nearest upsampling {h}x{w} -> {oh}x{ow} by a fractional factor")
    for dim, (size, out) in ((2, (h, oh)), (3, (w, ow))):
        if out != size:
            idx = torch.arange(out, dtype=torch.int64) // (out // size)
            x = b.emit("index_select", [x, b.graph.add_constant(b.fresh("nearest"), idx)], dim=dim)
    return x
