"""Extern kernels: work the generated program hands back to PyTorch or oneDNN.

An extern receives its inputs as flat 1-D tensors over the *root* storage of each
value it reads (the C++ side wraps raw pointers without copying) and re-applies the
views itself, so strided inputs need no materialisation.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from kiln.compiler.fusion.convs import onednn_pads
from kiln.compiler.fusion.program import Kernel, Program
from kiln.compiler.ir.graph import Graph
from kiln.compiler.ir.layout import Access
from kiln.compiler.ir.semantics import eval_node

Tensor = torch.Tensor


@dataclass
class Extern:
    fn: Callable[..., Tensor]  # (*flat root tensors) -> contiguous output
    roots: list[str]  # stored values passed in, in order
    root_numels: list[int]
    root_dtypes: list[torch.dtype]
    out_shape: tuple[int, ...]
    out_dtype: torch.dtype
    what: str  # for the report: the op(s) it runs


def _reads(g: Graph, k: Kernel, value: str, prog: Program) -> tuple[list[str], list[str]]:
    """Nodes of ``k`` needed for ``value`` (topological) and the external values they read."""
    inside = {g.node(n).output: g.node(n) for n in k.nodes}
    need: list[str] = []
    stack = [value]
    while stack:
        v = stack.pop()
        if v in inside and inside[v].name not in need:
            need.append(inside[v].name)
            stack.extend(inside[v].inputs)
    order = [n for n in k.nodes if n in need]
    ext = dict.fromkeys(
        i for n in order for i in g.node(n).inputs if i not in inside and not g.is_constant(i)
    )
    return order, list(ext)


def _bind(prog: Program, ext: list[str]) -> tuple[list[str], list[Access]]:
    accesses = [prog.access(v) for v in ext]
    roots = list(dict.fromkeys(a.root for a in accesses))
    return roots, accesses


def _make(g: Graph, roots: list[str], fn: Callable[..., Tensor], value: str, what: str) -> Extern:
    metas = [g.meta(r) for r in roots]
    out = g.meta(value)
    return Extern(
        fn, roots, [m.numel for m in metas], [m.dtype for m in metas], out.shape, out.dtype, what
    )


def _views(roots: list[str], accesses: list[Access], flats: tuple[Tensor, ...]) -> list[Tensor]:
    by_root = dict(zip(roots, flats))
    return [by_root[a.root].as_strided(a.shape, a.strides, a.offset) for a in accesses]


def reference_extern(g: Graph, k: Kernel, prog: Program, value: str) -> Extern:
    """Run the kernel's nodes that ``value`` needs through ATen, one op at a time."""
    order, ext = _reads(g, k, value, prog)
    roots, accesses = _bind(prog, ext)
    nodes = [g.node(n) for n in order]

    def run(*flats: Tensor) -> Tensor:
        env: dict[str, Tensor] = dict(zip(ext, _views(roots, accesses, flats)))
        for n in nodes:
            env[n.output] = eval_node(n, [env[i] if i in env else g.constants[i] for i in n.inputs])
        return env[value].contiguous()

    return _make(g, roots, run, value, "+".join(n.op for n in nodes))


ConvFn = Callable[[Tensor], Tensor]


def conv_chain_extern(g: Graph, chain: list[Kernel], prog: Program) -> Extern | None:
    """Consecutive conv kernels, each feeding only the next, as one extern that keeps
    the activations channels-last (NHWC) in between: oneDNN runs NHWC depthwise
    convolutions without the reorders it does around NCHW ones (4-5x faster on a
    depthwise-separable block here, the two conversions at the ends included)."""
    steps = [conv_step(g, k, prog, k.outputs[0], channels_last=True) for k in chain]
    if any(s is None for s in steps):
        return None
    fns = [s[0] for s in steps if s is not None]
    x_access = steps[0][1]  # type: ignore[index]
    nhwc = torch.channels_last

    def run(flat: Tensor) -> Tensor:
        x = flat.as_strided(x_access.shape, x_access.strides, x_access.offset)
        y = x.contiguous(memory_format=nhwc)
        for fn in fns:
            y = fn(y)
        return y.contiguous()

    what = " > ".join(s[2] for s in steps if s is not None)
    return _make(g, [x_access.root], run, chain[-1].outputs[0], what)


def conv_extern(g: Graph, k: Kernel, prog: Program, value: str) -> Extern | None:
    """A 2-D convolution (+ per-channel bias + ReLU/ReLU6) as one oneDNN call with the
    weight reordered once at compile time. None when the kernel is not of that form."""
    step = conv_step(g, k, prog, value, channels_last=False)
    if step is None:
        return None
    fn, x_access, what = step

    def run(flat: Tensor) -> Tensor:
        return fn(flat.as_strided(x_access.shape, x_access.strides, x_access.offset).contiguous())

    return _make(g, [x_access.root], run, value, what)


def conv_step(
    g: Graph, k: Kernel, prog: Program, value: str, channels_last: bool
) -> tuple[ConvFn, Access, str] | None:
    """The oneDNN call of a conv kernel as ``fn(x) -> y`` (NCHW or NHWC tensors), the
    access of its input, and a description; None when the kernel is not of that form."""
    order, ext = _reads(g, k, value, prog)
    nodes = [g.node(n) for n in order]
    conv = nodes[0]
    w = g.constants.get(conv.inputs[1])
    if conv.op != "conv" or w is None or w.dim() != 4 or w.dtype != torch.float32:
        return None
    bias = g.constants.get(conv.inputs[2]) if len(conv.inputs) > 2 else None
    if len(conv.inputs) > 2 and bias is None:
        return None
    attr, scalars = "none", []
    prev = conv.output
    for n in nodes[1:]:
        other = [i for i in n.inputs if i != prev]
        const = g.constants.get(other[0]) if len(other) == 1 else None
        if n.op == "add" and attr == "none" and const is not None and const.numel() == w.shape[0]:
            bias = const.reshape(-1) + (bias if bias is not None else 0)
        elif n.op == "relu" and attr == "none":
            attr = "relu"
        elif n.op == "maximum" and attr == "none" and const is not None and const.dim() == 0:
            attr, scalars = "hardtanh", [float(const), float("inf")]
        elif n.op == "minimum" and attr == "hardtanh" and const is not None and const.dim() == 0:
            scalars[1] = float(const)
        else:
            return None
        prev = n.output
    a = conv.attrs
    if not onednn_pads(conv):
        return None  # oneDNN's call pads with zeros, alike on both sides
    x_access = prog.access(conv.inputs[0])
    stride, padding, dilation, groups = (
        list(a["stride"]),
        list(a["padding"]),
        list(a["dilation"]),
        a["groups"],
    )
    conv_op = torch.ops.mkldnn._convolution_pointwise
    if attr == "hardtanh" and scalars[1] == float("inf"):
        return None  # a lone maximum is not a oneDNN post-op
    if a.get("channels_last"):
        # The kernel's values are (N, H, W, C) already: oneDNN reads and writes them as
        # NCHW-shaped tensors in channels-last memory format, no reorder on the way. The
        # weight is reordered once here, to the blocked format oneDNN computes with (as
        # channels-last weights it would reorder them on every call: measured 5x slower
        # for a 512-channel 3x3 conv on 4x4 pixels).
        n_, *spatial, c_ = x_access.shape
        try:
            wt = torch.ops.mkldnn._reorder_convolution_weight(
                w.contiguous(), padding, stride, dilation, groups, [n_, c_, *spatial]
            )
        except RuntimeError:
            wt = w.contiguous(memory_format=torch.channels_last)

        def nhwc(x: Tensor) -> Tensor:
            y = x.permute(0, 3, 1, 2).contiguous(memory_format=torch.channels_last)
            y = conv_op(y, wt, bias, padding, stride, dilation, groups, attr, scalars, "")
            return y.permute(0, 2, 3, 1).contiguous()  # a no-op when oneDNN kept NHWC

        return nhwc, x_access, "conv(nhwc)" + ("+bias" if bias is not None else "") + f"+{attr}"
    if channels_last:
        wt = w.contiguous(memory_format=torch.channels_last)
    else:
        try:
            wt = torch.ops.mkldnn._reorder_convolution_weight(
                w.contiguous(), padding, stride, dilation, groups, list(x_access.shape)
            )
        except RuntimeError:
            wt = w.contiguous()

    def fn(x: Tensor) -> Tensor:
        return conv_op(x, wt, bias, padding, stride, dilation, groups, attr, scalars, "")

    return fn, x_access, "conv" + ("+bias" if bias is not None else "") + f"+{attr}"
