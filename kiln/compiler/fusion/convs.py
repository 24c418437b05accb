"""Which convolutions a template may run.

* ``onednn_post_ops_ok``: a conv with the epilogue oneDNN runs in the same call (the
  ``conv`` template, an extern).
* ``is_depthwise_conv``: the native ``dwconv`` template's convolutions.
* ``is_pointwise_conv``: 1x1 convolutions, which the native ``gemm`` template runs as
  W (C_out, C_in) @ X (C_in, spatial) per image (channels-last: X (pixels, C_in) @ W^T).
* ``is_dense_nhwc_conv``: dense channels-last convs, the native ``dconv`` template's
  (a direct implicit GEMM, ``codegen/cpu/conv_nhwc.py``; zero or reflect padding);
  oneDNN runs the zero-padded ones too.
* ``winograd_ok``: the 3x3 ones the native ``wconv`` template may run instead, by
  Winograd's F(2x2, 3x3) (``codegen/cpu/conv_winograd.py``).
* ``is_channels_last``: a conv on (N, *spatial, C) values (``capture/channels_last.py``),
  whose 1x1 form is a GEMM with the constant weight packed at compile time and whose
  depthwise form vectorises along channels.
* ``onednn_chained``: NCHW depthwise convolutions that would break a channels-last oneDNN
  chain. Consecutive conv externs, each reading only the previous one's output, run as
  one NHWC oneDNN call (``codegen/cpu/entry.conv_chain``), which spares the dense convs
  the NCHW <-> blocked reorders. Taking the depthwise conv out of such a chain splits it
  into NCHW calls: measured on a MobileNetV2 inverted residual (32 -> 192 -> 32
  channels, 28x28, Zen 5, 1 thread) with its 1x1 convs left to oneDNN, the block ran
  1.37x slower with the native depthwise conv than as one chain, although the depthwise
  conv alone runs 4-5x faster natively. So next to a conv only oneDNN runs (dense, not
  1x1), a depthwise conv stays a oneDNN call too; next to 1x1 convs (native GEMMs) it
  does not (that block then runs 1.3-1.6x faster than the chain).
"""

from __future__ import annotations

import torch

from kiln.compiler.fusion.aliases import GraphIndex
from kiln.compiler.ir.graph import Graph, Node, ValueKind, conv_padding, conv_padding_mode
from kiln.compiler.ir.layout import Access, access

# Ops a oneDNN conv kernel may hold after its conv (bias add, relu, hardtanh).
_POST_OPS = frozenset({"add", "relu", "maximum", "minimum"})


def onednn_post_ops_ok(ix: GraphIndex, mask: int, c: int, eps: list[int]) -> bool:
    """Node ``c`` (a conv) and ``eps`` (the other nodes of ``mask``, positions) are
    conv [-> add(per-channel bias constant)] [-> relu | maximum(c) -> minimum(c)] (the
    oneDNN post-ops: bias, relu, hardtanh), storing only the last value, and the conv
    pads with zeros alike on both sides of each dim (oneDNN's call takes one padding per
    dim)."""
    nodes, g = ix.nodes, ix.graph
    if not onednn_pads(nodes[c]):
        return False
    shape = g.meta(nodes[c].output).shape
    chain = [c] + sorted(eps)  # node indices are topological
    ops = [nodes[i].op for i in chain[1:]]
    if ops and ops[0] == "add":
        ops = ops[1:]
    if ops not in ([], ["relu"], ["maximum", "minimum"]):
        return False
    channel_dim = len(shape) - 1 if is_channels_last(nodes[c]) else 1
    for prev, cur in zip(chain, chain[1:]):
        node, prev_out = nodes[cur], nodes[prev].output
        if g.meta(node.output).shape != shape or prev_out not in node.inputs:
            return False
        other = [v for v in node.inputs if v != prev_out]
        if node.op == "add" and (
            len(other) != 1 or not _per_channel_param(ix, other[0], shape, channel_dim)
        ):
            return False
        if node.op in ("maximum", "minimum") and (
            len(other) != 1 or g.values[other[0]].kind != ValueKind.CONST
        ):
            return False
    for i in chain[:-1]:  # oneDNN post-ops do not store intermediates
        out = nodes[i].output
        if out in ix.outputs or any(not mask >> j & 1 for j in ix.consumers[out]):
            return False
    return True


def _per_channel_param(
    ix: GraphIndex, value: str, out_shape: tuple[int, ...], channel_dim: int
) -> bool:
    """``value`` is a parameter broadcast along every dim of ``out_shape`` but the
    channels' (dim 1 of NCHW values, the last of channels-last ones)."""
    g = ix.graph
    if g.values[ix.root[value]].kind != ValueKind.PARAM:
        return False
    shape = g.meta(value).shape
    if len(shape) > len(out_shape) or len(out_shape) < 2:
        return False
    padded = (1,) * (len(out_shape) - len(shape)) + tuple(shape)
    c = channel_dim
    return padded[c] in (1, out_shape[c]) and all(s == 1 for d, s in enumerate(padded) if d != c)


def is_channels_last(node: Node) -> bool:
    """A conv whose activations are (N, *spatial, C) (see ``ir/graph.py``)."""
    return node.op == "conv" and bool(node.attrs.get("channels_last", False))


def zero_padded(node: Node) -> bool:
    """A conv whose padding is zeros (not a reflection of the border)."""
    return conv_padding_mode(node.attrs) == "zeros"


def onednn_pads(node: Node) -> bool:
    """A conv oneDNN's call can pad: zeros, alike on both sides of each dim."""
    before, after = conv_padding(node.attrs)
    return before == after and zero_padded(node)


def is_depthwise_conv(graph: Graph, node: Node) -> bool:
    """A 1-D or 2-D fp32 zero-padded conv with groups == C_in == C_out (channel multiplier
    1) and constant weight and bias: what the native ``dwconv`` template runs."""
    if node.op != "conv" or not all(graph.is_constant(v) for v in node.inputs[1:]):
        return False
    if not zero_padded(node):
        return False
    w, x = graph.meta(node.inputs[1]).shape, graph.meta(node.inputs[0]).shape
    channels = x[-1] if is_channels_last(node) else x[1]
    return (
        len(x) in (3, 4)
        and node.attrs["groups"] == channels == w[0]
        and w[1] == 1
        and all(graph.meta(v).dtype == torch.float32 for v in (*node.inputs, node.output))
    )


def is_pointwise_conv(graph: Graph, node: Node) -> bool:
    """A 1-D or 2-D fp32 1x1 conv (stride 1, no padding, one group) with constant weight
    and bias."""
    if node.op != "conv" or not all(graph.is_constant(v) for v in node.inputs[1:]):
        return False
    a, w = node.attrs, graph.meta(node.inputs[1]).shape
    return (
        len(w) in (3, 4)
        and all(k == 1 for k in w[2:])
        and a["groups"] == 1
        and all(s == 1 for s in a["stride"])
        and not any(p for pads in conv_padding(a) for p in pads)
        and all(graph.meta(v).dtype == torch.float32 for v in (*node.inputs, node.output))
    )


def is_dense_nhwc_conv(graph: Graph, node: Node) -> bool:
    """A 1-D or 2-D fp32 channels-last conv with one group and constant weight and bias,
    not a stride-1 1x1 (a GEMM): what the native ``dconv`` template runs."""
    if not is_channels_last(node) or not all(graph.is_constant(v) for v in node.inputs[1:]):
        return False
    return (
        len(graph.meta(node.inputs[1]).shape) in (3, 4)
        and node.attrs["groups"] == 1
        and not is_pointwise_conv(graph, node)
        and all(graph.meta(v).dtype == torch.float32 for v in (*node.inputs, node.output))
    )


WINOGRAD_MIN_TILES = 25  # 2x2 output tiles of a batch, at least (a 10x10 image)
WINOGRAD_MIN_CHANNELS = 32  # input and output channels, at least each


def winograd_pays(
    c_in: int, c_out: int, kernel: tuple[int, ...], stride: tuple[int, ...],
    dilation: tuple[int, ...], out_hw: tuple[int, ...], batch: int,
) -> bool:  # fmt: skip
    """Whether Winograd's F(2x2, 3x3) (the ``wconv`` template, ``codegen/cpu/conv_winograd.py``)
    may pay for a dense conv: 2-D, 3x3, stride 1, undilated, with enough channels and 2x2
    output tiles that its 2.25x fewer multiplies can outweigh the transforms and the
    larger transformed weight (below these, measured no faster than the direct kernel).
    Where it is offered, the cost model (or a measurement) decides against ``dconv``."""
    if tuple(kernel) != (3, 3) or any(s != 1 for s in stride) or any(d != 1 for d in dilation):
        return False
    tiles = batch * -(-out_hw[0] // 2) * -(-out_hw[1] // 2)
    return min(c_in, c_out) >= WINOGRAD_MIN_CHANNELS and tiles >= WINOGRAD_MIN_TILES


def winograd_ok(graph: Graph, node: Node) -> bool:
    """A dense channels-last conv (``is_dense_nhwc_conv``) the ``wconv`` template may run:
    ``winograd_pays`` for its shape, its input channels contiguous (read as vectors)."""
    w, out = graph.meta(node.inputs[1]).shape, graph.meta(node.output).shape
    if len(w) != 4 or not is_dense_nhwc_conv(graph, node):
        return False
    a, x = node.attrs, access(graph, node.inputs[0])
    if isinstance(x, Access) and x.strides[-1] != 1:  # an NCHW image read in place
        return False
    return winograd_pays(
        w[1], w[0], tuple(w[2:]), tuple(a["stride"]), tuple(a["dilation"]), out[1:3], out[0]
    )


NARROW_CONV_MAX_OUT = 4  # outputs of a dense channels-last conv run along C_in, at most


def is_narrow_conv(c_in: int, c_out: int, lanes: int) -> bool:
    """A dense channels-last conv the ``dconv`` template runs vectorised along its input
    channels (``codegen/cpu/conv_narrow.py``): few outputs, whole vectors of inputs. The
    cost model prices it at its exact FLOPs."""
    return c_out <= NARROW_CONV_MAX_OUT and c_in % lanes == 0


def onednn_chained(graph: Graph) -> set[str]:
    """Names of the 2-D NCHW depthwise convs that feed, or are fed by, a dense 2-D conv
    through oneDNN post-ops only, every value on the way read by that one node
    (channels-last convs run in oneDNN without reorders: no chain to keep)."""
    users = graph.consumers()

    def dense_2d(n: Node) -> bool:  # a 2-D conv only oneDNN runs
        is_2d = n.op == "conv" and len(graph.meta(n.inputs[1]).shape) == 4
        return is_2d and not is_depthwise_conv(graph, n) and not is_pointwise_conv(graph, n)

    def sole(v: str) -> Node | None:
        return users[v][0] if len(users[v]) == 1 and v not in graph.outputs else None

    def variable_input(n: Node) -> str | None:
        ins = [v for v in n.inputs if not graph.is_constant(v)]
        return ins[0] if len(ins) == 1 else None

    def fed_by_conv(v: str) -> bool:
        while sole(v) is not None and (p := graph.producer(v)) is not None:
            if dense_2d(p):
                return True
            nxt = variable_input(p) if p.op in _POST_OPS else None
            if nxt is None:
                return False
            v = nxt
        return False

    def feeds_conv(v: str) -> bool:
        while (c := sole(v)) is not None:
            if dense_2d(c):
                return c.inputs[0] == v
            if c.op not in _POST_OPS or variable_input(c) != v:
                return False
            v = c.output
        return False

    return {
        n.name
        for n in graph.nodes
        if is_depthwise_conv(graph, n)
        and not is_channels_last(n)
        and len(graph.meta(n.output).shape) == 4
        and (fed_by_conv(n.inputs[0]) or feeds_conv(n.output))
    }
