"""Lowerings of layout ops (views, permutes, slices, concatenation), identity
ops (clone, alias, eval-mode dropout), dtype casts and constant factories.

Output shapes of the view family are taken from the exported node's own
metadata, which resolves -1 and squeeze rules exactly as ATen did.
"""

from __future__ import annotations

import torch
from torch import fx

from kiln.compiler.capture.builder import Builder, Unsupported, call_args, norm_dim, pos, register

aten = torch.ops.aten


def out_shape(node: fx.Node, index: int | None = None) -> tuple[int, ...]:
    """Static shape of an exported node's (index-th) output."""
    val = node.meta["val"]
    if index is not None:
        val = val[index]
    return tuple(int(s) for s in val.shape)


@register(
    aten.view.default,
    aten._unsafe_view.default,
    aten.reshape.default,
    aten.unsqueeze.default,
    aten.squeeze.default,
    aten.squeeze.dim,
    aten.squeeze.dims,
    aten.flatten.using_ints,
)
def _view(b: Builder, node: fx.Node) -> str:
    x = b.tensor(pos(node)[0])
    shape = out_shape(node)
    if node.target in (aten.reshape.default, aten.flatten.using_ints):
        x = b.contiguous(x)  # reshape copies a strided input; so do we
    return b.view(x, shape)


@register(aten.permute.default)
def _permute(b: Builder, node: fx.Node) -> str:
    return b.permute(b.tensor(pos(node)[0]), pos(node)[1])


@register(aten.transpose.int)
def _transpose(b: Builder, node: fx.Node) -> str:
    x = b.tensor(pos(node)[0])
    rank = len(b.shape(x))
    d0, d1 = (norm_dim(int(d), rank) for d in pos(node)[1:3])
    dims = list(range(rank))
    dims[d0], dims[d1] = d1, d0
    return b.permute(x, dims)


@register(aten.t.default, aten.numpy_T.default)
def _t(b: Builder, node: fx.Node) -> str:
    x = b.tensor(pos(node)[0])
    return b.permute(x, list(reversed(range(len(b.shape(x))))))


@register(aten.expand.default)
def _expand(b: Builder, node: fx.Node) -> str:
    return b.expand(b.tensor(pos(node)[0]), out_shape(node))


def slice_of(b: Builder, x: str, dim: int, start: int | None, end: int | None, step: int) -> str:
    """x[..., start:end:step, ...] along ``dim`` with python clamping rules."""
    size = b.shape(x)[dim]
    lo = 0 if start is None else (start + size if start < 0 else start)
    hi = size if end is None else (end + size if end < 0 else end)
    lo, hi = min(max(lo, 0), size), min(max(hi, 0), size)
    hi = max(hi, lo)
    if lo == 0 and hi == size and step == 1:
        return x
    return b.emit("slice", [x], dim=dim, start=lo, end=hi, step=step)


@register(aten.slice.Tensor)
def _slice(b: Builder, node: fx.Node) -> str:
    a = call_args(node)
    x = b.tensor(a["self"])
    dim = norm_dim(int(a["dim"]), len(b.shape(x)))
    return slice_of(b, x, dim, a["start"], a["end"], int(a["step"]))


@register(aten.select.int)
def _select(b: Builder, node: fx.Node) -> str:
    """select = slice of length 1 + view dropping the dim."""
    x = b.tensor(pos(node)[0])
    shape = b.shape(x)
    dim = norm_dim(int(pos(node)[1]), len(shape))
    i = norm_dim(int(pos(node)[2]), shape[dim])
    return b.view(slice_of(b, x, dim, i, i + 1, 1), out_shape(node))


@register(aten.cat.default)
def _cat(b: Builder, node: fx.Node) -> str:
    a = call_args(node)
    parts = [b.tensor(t) for t in a["tensors"]]
    rank = len(out_shape(node))
    # legacy behaviour: 1-d empty tensors are skipped by cat
    parts = [p for p in parts if not (b.shape(p) == (0,) and rank != 1)]
    if not parts:
        raise Unsupported("cat of empty tensors only")
    if len(parts) == 1:
        return parts[0]
    return b.emit("cat", parts, dim=norm_dim(int(a["dim"]), rank))


def _split_at(b: Builder, x: str, dim: int, sizes: list[int]) -> list[str | None]:
    out: list[str | None] = []
    start = 0
    for s in sizes:
        out.append(slice_of(b, x, dim, start, start + s, 1))
        start += s
    return out


@register(aten.split_with_sizes.default)
def _split_with_sizes(b: Builder, node: fx.Node) -> list[str | None]:
    a = call_args(node)
    x = b.tensor(a["self"])
    dim = norm_dim(int(a["dim"]), len(b.shape(x)))
    return _split_at(b, x, dim, [int(s) for s in a["split_sizes"]])


@register(aten.split.Tensor)
def _split(b: Builder, node: fx.Node) -> list[str | None]:
    a = call_args(node)
    x = b.tensor(a["self"])
    dim = norm_dim(int(a["dim"]), len(b.shape(x)))
    n, step = b.shape(x)[dim], int(a["split_size"])
    return _split_at(b, x, dim, [min(step, n - s) for s in range(0, n, step)])


@register(aten.unbind.int)
def _unbind(b: Builder, node: fx.Node) -> list[str | None]:
    x = b.tensor(pos(node)[0])
    shape = b.shape(x)
    dim = norm_dim(int(pos(node)[1]) if len(pos(node)) > 1 else 0, len(shape))
    rest = shape[:dim] + shape[dim + 1 :]
    return [b.view(slice_of(b, x, dim, i, i + 1, 1), rest) for i in range(shape[dim])]


@register(aten.clone.default)
def _clone(b: Builder, node: fx.Node) -> str:
    """A clone only matters for strided views: it materialises them."""
    return b.contiguous(b.tensor(pos(node)[0]))


@register(aten.alias.default, aten.detach.default, aten.lift_fresh_copy.default)
def _identity(b: Builder, node: fx.Node) -> str:
    return b.tensor(pos(node)[0])


@register(aten.dropout.default)
def _dropout(b: Builder, node: fx.Node) -> str:
    if pos(node)[2]:
        raise Unsupported("dropout in training mode")
    return b.tensor(pos(node)[0])


@register(aten.native_dropout.default)
def _native_dropout(b: Builder, node: fx.Node) -> list[str | None]:
    if pos(node)[2] is not False:
        raise Unsupported("native_dropout in training mode")
    return [b.tensor(pos(node)[0]), None]


@register(aten._to_copy.default)
def _to_copy(b: Builder, node: fx.Node) -> str:
    """Only dtype changes on the same device: a cast (or nothing)."""
    x = b.tensor(pos(node)[0])
    val = node.meta["val"]
    if val.device != torch.device("cpu"):
        raise Unsupported(f"_to_copy to device {val.device}")
    if val.dtype == b.dtype(x):
        return b.contiguous(x)
    return b.cast(x, val.dtype)


def _filled(b: Builder, node: fx.Node, value: object) -> str:
    """A constant tensor of the node's shape/dtype: a 0-d CONST broadcast by
    ``expand`` (constant folding materialises it when it is small)."""
    val = node.meta["val"]
    if val.device != torch.device("cpu"):
        raise Unsupported(f"factory on device {val.device}")
    if not isinstance(value, (bool, int, float)):
        raise Unsupported(f"fill value {value!r}")
    dtype = val.dtype
    v = bool(value) if dtype == torch.bool else value if dtype.is_floating_point else int(value)
    return b.expand(b.const(v, dtype), out_shape(node))


@register(aten.full.default, aten.new_full.default, aten.full_like.default)
def _full(b: Builder, node: fx.Node) -> str:
    return _filled(b, node, call_args(node)["fill_value"])


@register(aten.scalar_tensor.default)
def _scalar_tensor(b: Builder, node: fx.Node) -> str:
    return _filled(b, node, pos(node)[0])


@register(aten.zeros.default, aten.zeros_like.default, aten.new_zeros.default)
def _zeros(b: Builder, node: fx.Node) -> str:
    return _filled(b, node, 0)


@register(aten.ones.default, aten.ones_like.default, aten.new_ones.default)
def _ones(b: Builder, node: fx.Node) -> str:
    return _filled(b, node, 1)


@register(aten.repeat.default)
def _repeat(b: Builder, node: fx.Node) -> str:
    """view to (1, s0, 1, s1, ...), expand to (r0, s0, r1, s1, ...), copy,
    view to (r0 * s0, r1 * s1, ...)."""
    x = b.tensor(pos(node)[0])
    reps = [int(r) for r in pos(node)[1]]
    shape = (1,) * (len(reps) - len(b.shape(x))) + b.shape(x)
    if all(r == 1 for r in reps):
        return b.view(x, shape)
    inter = [d for s in shape for d in (1, s)]
    big = [d for r, s in zip(reps, shape, strict=True) for d in (r, s)]
    tiled = b.emit("copy", [b.expand(b.view(x, inter), big)])
    return b.view(tiled, out_shape(node))


@register(aten.index_select.default)
def _index_select(b: Builder, node: fx.Node) -> str:
    x, dim, idx = pos(node)[:3]
    xv, iv = b.tensor(x), b.tensor(idx)
    if b.dtype(iv) != torch.int64 or len(b.shape(iv)) != 1:
        raise Unsupported("index_select needs a 1-D int64 index")
    return b.emit("index_select", [xv, iv], dim=norm_dim(int(dim), len(b.shape(xv))))


@register(aten.embedding.default)
def _embedding(b: Builder, node: fx.Node) -> str:
    """weight[indices]: a row gather over the flattened indices, then a view."""
    weight, indices = b.tensor(pos(node)[0]), b.tensor(pos(node)[1])
    if b.dtype(indices) != torch.int64:
        raise Unsupported("embedding indices must be int64")
    idx_shape = b.shape(indices)
    flat = indices if len(idx_shape) == 1 else b.view(b.contiguous(indices), (_numel(idx_shape),))
    rows = b.emit("index_select", [weight, flat], dim=0)
    return b.view(rows, (*idx_shape, b.shape(weight)[1]))


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


@register(aten.index.Tensor)
def _index(b: Builder, node: fx.Node) -> str:
    """x[:, ..., idx, ...] with a single 1-D int64 index tensor: an index_select.
    (torch's decompositions turn reflection/replication padding and nearest
    upsampling into exactly this form, with constant indices.)"""
    x_arg, indices = pos(node)[:2]
    x = b.tensor(x_arg)
    used = [(d, i) for d, i in enumerate(indices) if i is not None]
    if len(used) != 1:
        raise Unsupported("advanced indexing with several index tensors")
    dim, idx_arg = used[0]
    idx = b.tensor(idx_arg)
    if b.dtype(idx) != torch.int64 or len(b.shape(idx)) != 1:
        raise Unsupported("index tensor is not 1-D int64")
    return b.emit("index_select", [x, idx], dim=dim)


@register(aten.constant_pad_nd.default)
def _constant_pad(b: Builder, node: fx.Node) -> str:
    """``F.pad(x, pad, value=c)``: pads are (left, right) pairs from the last dim
    backwards. A negative pad crops (a slice); a positive one concatenates a constant
    block (a 0-d CONST expanded to the block's shape, so it stores nothing) on that side.
    A causal 1-D conv's left pad thus stays a native ``cat`` feeding the conv."""
    a = call_args(node)
    x = b.tensor(a["self"])
    pads = [int(p) for p in a["pad"]]
    value = a.get("value", 0)
    if not isinstance(value, (bool, int, float)):
        raise Unsupported(f"pad value {value!r}")
    dtype = b.dtype(x)
    fill = bool(value) if dtype == torch.bool else value if dtype.is_floating_point else int(value)
    rank = len(b.shape(x))
    for i in range(len(pads) // 2):
        dim = rank - 1 - i
        left, right = pads[2 * i], pads[2 * i + 1]
        size = b.shape(x)[dim]
        x = slice_of(b, x, dim, max(-left, 0), size - max(-right, 0), 1)
        parts = []
        for width, after in ((left, False), (right, True)):
            if width > 0:
                shape = list(b.shape(x))
                shape[dim] = width
                parts.append((after, b.expand(b.const(fill, dtype), shape)))
        if parts:
            x = b.emit(
                "cat",
                [p for after, p in parts if not after] + [x] + [p for after, p in parts if after],
                dim=dim,
            )
    return x
