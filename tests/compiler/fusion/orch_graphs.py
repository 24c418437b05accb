"""Primitive graphs for the orchestration tests, built directly with the IR.

``vit_like`` writes out a ViT encoder the way capture splits it into primitives
(decomposed layernorm, softmax and erf-gelu; views for the head split), so
enumeration and the BLP see realistic 500+-node graphs without running capture.
"""

from __future__ import annotations

import math

import torch
from hypothesis import strategies as st

from kiln.compiler.ir.graph import Graph, TensorMeta
from kiln.compiler.ir.semantics import TensorArg

F32 = torch.float32


def meta(*shape: int, dtype: torch.dtype = F32) -> TensorMeta:
    return TensorMeta(tuple(shape), dtype)


def op(g: Graph, name: str, inputs: tuple[str, ...], out: tuple[int, ...], **attrs: object) -> str:
    return g.add_node(name, inputs, meta(*out), dict(attrs) or None)


def const(g: Graph, name: str, value: float) -> str:
    return g.add_constant(name, torch.tensor(value))


def softmax_rows(g: Graph, x: str, shape: tuple[int, ...]) -> str:
    """max -> sub -> exp -> sum -> div over the last dim, keepdim."""
    row = shape[:-1] + (1,)
    m = op(g, "max", (x,), row, dims=(-1,), keepdim=True)
    e = op(g, "exp", (op(g, "sub", (x, m), shape),), shape)
    s = op(g, "sum", (e,), row, dims=(-1,), keepdim=True)
    return op(g, "div", (e, s), shape)


def softmax_graph(rows: int = 64, cols: int = 128) -> Graph:
    g = Graph()
    x = g.add_input("x", meta(rows, cols))
    g.outputs = [softmax_rows(g, x, (rows, cols))]
    return g


def mm_bias_relu_graph(m: int = 8, k: int = 64, n: int = 32) -> Graph:
    g = Graph()
    x = g.add_input("x", meta(m, k))
    w = g.add_constant("w", torch.randn(k, n))
    b = g.add_constant("b", torch.randn(n))
    y = op(g, "mm", (x, w), (m, n))
    g.outputs = [op(g, "relu", (op(g, "add", (y, b), (m, n)),), (m, n))]
    return g


def layernorm(g: Graph, x: str, shape: tuple[int, int], tag: str) -> str:
    """(x - mean) * rsqrt(var + eps) * gamma + beta over the last dim: 11 primitives."""
    t, d = shape
    row = (t, 1)
    inv_d, eps = const(g, f"{tag}_invd", 1.0 / d), const(g, f"{tag}_eps", 1e-5)
    gamma = g.add_constant(f"{tag}_g", torch.rand(d) + 0.5)
    beta = g.add_constant(f"{tag}_b", torch.randn(d) * 0.1)
    mean = op(g, "mul", (op(g, "sum", (x,), row, dims=(-1,), keepdim=True), inv_d), row)
    xc = op(g, "sub", (x, mean), shape)
    sq = op(g, "sum", (op(g, "mul", (xc, xc), shape),), row, dims=(-1,), keepdim=True)
    var = op(g, "mul", (sq, inv_d), row)
    rstd = op(g, "rsqrt", (op(g, "add", (var, eps), row),), row)
    y = op(g, "mul", (op(g, "mul", (xc, rstd), shape), gamma), shape)
    return op(g, "add", (y, beta), shape)


def linear(g: Graph, x: str, t: int, d_in: int, d_out: int, tag: str) -> str:
    w = g.add_constant(f"{tag}_w", torch.randn(d_in, d_out) / math.sqrt(d_in))
    b = g.add_constant(f"{tag}_bias", torch.randn(d_out) * 0.1)
    return op(g, "add", (op(g, "mm", (x, w), (t, d_out)), b), (t, d_out))


def gelu(g: Graph, x: str, shape: tuple[int, ...], tag: str) -> str:
    half, rs2, one = (
        const(g, f"{tag}_h", 0.5),
        const(g, f"{tag}_r", 0.5**0.5),
        const(g, f"{tag}_1", 1.0),
    )
    erf = op(g, "erf", (op(g, "mul", (x, rs2), shape),), shape)
    return op(g, "mul", (op(g, "mul", (x, half), shape), op(g, "add", (erf, one), shape)), shape)


def vit_like(layers: int = 10, tokens: int = 50, dim: int = 64, heads: int = 4) -> Graph:
    """A ViT encoder stack; about 53 nodes per layer (45 compute + 8 views)."""
    g = Graph()
    dh = dim // heads
    x = g.add_input("x", meta(tokens, dim))
    scale = const(g, "scale", dh**-0.5)
    for i in range(layers):
        h = layernorm(g, x, (tokens, dim), f"l{i}a")
        qkv = linear(g, h, tokens, dim, 3 * dim, f"l{i}qkv")
        split = op(g, "view", (qkv,), (tokens, 3, heads, dh), shape=(tokens, 3, heads, dh))
        perm = op(g, "permute", (split,), (3, heads, tokens, dh), dims=(1, 2, 0, 3))
        q, k, v = (
            op(
                g,
                "view",
                (
                    op(
                        g,
                        "slice",
                        (perm,),
                        (1, heads, tokens, dh),
                        dim=0,
                        start=j,
                        end=j + 1,
                        step=1,
                    ),
                ),
                (heads, tokens, dh),
                shape=(heads, tokens, dh),
            )
            for j in range(3)
        )
        kt = op(g, "permute", (k,), (heads, dh, tokens), dims=(0, 2, 1))
        s = op(
            g,
            "mul",
            (op(g, "bmm", (q, kt), (heads, tokens, tokens)), scale),
            (heads, tokens, tokens),
        )
        p = softmax_rows(g, s, (heads, tokens, tokens))
        o = op(g, "bmm", (p, v), (heads, tokens, dh))
        o2 = op(
            g,
            "view",
            (op(g, "permute", (o,), (tokens, heads, dh), dims=(1, 0, 2)),),
            (tokens, dim),
            shape=(tokens, dim),
        )
        x = op(g, "add", (linear(g, o2, tokens, dim, dim, f"l{i}proj"), x), (tokens, dim))
        h = layernorm(g, x, (tokens, dim), f"l{i}b")
        f = gelu(g, linear(g, h, tokens, dim, 4 * dim, f"l{i}fc1"), (tokens, 4 * dim), f"l{i}g")
        x = op(g, "add", (linear(g, f, tokens, 4 * dim, dim, f"l{i}fc2"), x), (tokens, dim))
    g.outputs = [layernorm(g, x, (tokens, dim), "final")]
    return g


def opaque_gelu(g: Graph, x: str, shape: tuple[int, ...]) -> str:
    """An op kiln does not split: runs through PyTorch."""
    args = (TensorArg(0),)
    return g.add_node(
        "opaque", (x,), meta(*shape), {"target": torch.ops.aten.gelu.default, "args": args}
    )


@st.composite
def random_graphs(draw: st.DrawFn, max_nodes: int = 8) -> Graph:
    """Small random primitive graphs mixing pointwise, reduction, mm, view, opaque,
    comparison/where nodes; outputs are the sinks (sometimes fewer: dead code)."""
    g = Graph()
    pool: list[str] = [g.add_input("x", meta(4, 6))]
    if draw(st.booleans()):
        pool.append(g.add_input("y", meta(4, 6)))
    zero = const(g, "zero", 0.0)
    n_nodes = draw(st.integers(1, max_nodes))
    for i in range(n_nodes):
        floats = [v for v in pool if g.meta(v).dtype == F32]
        bools = [v for v in pool if g.meta(v).dtype == torch.bool]
        kind = draw(
            st.sampled_from(
                ["unary", "binary", "binary", "reduce", "mm", "view", "opaque", "cmp", "where"]
            )
        )
        v = draw(st.sampled_from(floats))
        shape = g.meta(v).shape
        if kind == "binary":
            same = [w for w in floats if _broadcasts(g.meta(w).shape, shape)]
            w = draw(
                st.sampled_from(same + [zero, g.add_constant(f"p{i}", torch.randn(shape[-1]))])
            )
            out = op(g, draw(st.sampled_from(["add", "mul", "sub"])), (v, w), shape)
        elif kind == "reduce" and len(shape) == 2:
            keep = draw(st.booleans()) or draw(st.booleans())  # mostly keepdim rows
            dims = draw(st.sampled_from([(-1,), (-1,), (0,)]))
            red = tuple(1 if d in {x % 2 for x in dims} else s for d, s in enumerate(shape))
            red = (
                red
                if keep
                else tuple(s for d, s in enumerate(shape) if d not in {x % 2 for x in dims})
            )
            out = op(g, draw(st.sampled_from(["sum", "max"])), (v,), red, dims=dims, keepdim=keep)
        elif kind == "mm" and len(shape) == 2:
            n = draw(st.sampled_from([3, 6]))
            w = g.add_constant(f"w{i}", torch.randn(shape[1], n))
            out = op(g, "mm", (v, w), (shape[0], n))
        elif kind == "view" and len(shape) == 2:
            if draw(st.booleans()):
                out = op(g, "permute", (v,), (shape[1], shape[0]), dims=(1, 0))
            else:
                out = op(g, "view", (v,), (shape[1], shape[0]), shape=(shape[1], shape[0]))
        elif kind == "opaque":
            out = opaque_gelu(g, v, shape)
        elif kind == "cmp":
            out = g.add_node("gt", (v, zero), meta(*shape, dtype=torch.bool))
        elif kind == "where" and any(g.meta(b).shape == shape for b in bools):
            b = draw(st.sampled_from([b for b in bools if g.meta(b).shape == shape]))
            out = op(g, "where", (b, v, zero), shape)
        else:
            out = op(g, draw(st.sampled_from(["exp", "relu", "neg"])), (v,), shape)
        pool.append(out)
    consumed = {i for n in g.nodes for i in n.inputs}
    sinks = [n.output for n in g.nodes if n.output not in consumed]
    keep_all = draw(st.booleans()) or len(sinks) == 1
    g.outputs = sinks if keep_all else sinks[: draw(st.integers(1, len(sinks) - 1))]
    return g


def _broadcasts(src: tuple[int, ...], dst: tuple[int, ...]) -> bool:
    """numpy broadcasting of ``src`` to ``dst`` without changing ``dst``."""
    if len(src) > len(dst):
        return False
    return all(s in (1, d) for s, d in zip(src[::-1], dst[::-1]))


def conv_bn(
    g: Graph, x: str, cin: int, cout: int, hw: int, stride: int, tag: str, folded: bool
) -> str:
    """conv (3x3, or 1x1 when cin != cout and stride 2 for the shortcut) then batch norm:
    folded into the conv's bias, or as capture writes it (mul/add by (C, 1, 1) views)."""
    k = 1 if tag.endswith("down") else 3
    pad = k // 2
    out_hw = (hw + 2 * pad - k) // stride + 1
    shape = (1, cout, out_hw, out_hw)
    w = g.add_constant(f"{tag}_w", torch.randn(cout, cin, k, k) * (2.0 / (cin * k * k)) ** 0.5)
    conv = dict(stride=(stride, stride), padding=(pad, pad), dilation=(1, 1), groups=1)
    if folded:
        b = g.add_constant(f"{tag}_b", torch.randn(cout) * 0.1)
        return op(g, "conv", (x, w, b), shape, **conv)
    y = op(g, "conv", (x, w), shape, **conv)
    scale = g.add_constant(f"{tag}_scale", torch.rand(cout) + 0.5)
    shift = g.add_constant(f"{tag}_shift", torch.randn(cout) * 0.1)
    sv = op(g, "view", (scale,), (cout, 1, 1), shape=(cout, 1, 1))
    tv = op(g, "view", (shift,), (cout, 1, 1), shape=(cout, 1, 1))
    return op(g, "add", (op(g, "mul", (y, sv), shape), tv), shape)


def resnet_like(
    widths: tuple[int, ...] = (16, 32, 64, 128), hw: int = 32, folded: bool = False
) -> Graph:
    """ResNet-18's structure at a small size: stem, 4 stages of 2 basic blocks, head."""
    g = Graph()
    x = g.add_input("x", meta(1, 3, hw, hw))
    h = op(g, "relu", (conv_bn(g, x, 3, widths[0], hw, 1, "stem", folded),), (1, widths[0], hw, hw))
    args = (TensorArg(0), [3, 3], [2, 2], [1, 1])
    hw = hw // 2
    h = g.add_node(
        "opaque",
        (h,),
        meta(1, widths[0], hw, hw),
        {"target": torch.ops.aten.max_pool2d.default, "args": args},
    )
    cin = widths[0]
    for s, c in enumerate(widths):
        for blk in range(2):
            stride = 2 if s > 0 and blk == 0 else 1
            tag = f"s{s}b{blk}"
            a = conv_bn(g, h, cin, c, hw, stride, f"{tag}c1", folded)
            hw = hw // stride
            shape = (1, c, hw, hw)
            a = conv_bn(g, op(g, "relu", (a,), shape), c, c, hw, 1, f"{tag}c2", folded)
            short = (
                conv_bn(g, h, cin, c, hw * stride, stride, f"{tag}down", folded) if cin != c else h
            )
            h = op(g, "relu", (op(g, "add", (a, short), shape),), shape)
            cin = c
    pooled = op(g, "sum", (h,), (1, cin, 1, 1), dims=(2, 3), keepdim=True)
    pooled = op(g, "mul", (pooled, const(g, "inv_hw", 1.0 / (hw * hw))), (1, cin, 1, 1))
    flat = op(g, "view", (pooled,), (1, cin), shape=(1, cin))
    g.outputs = [linear(g, flat, 1, cin, 10, "fc")]
    return g
