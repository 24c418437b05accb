"""Graph rewrites that fold work into neighbours before orchestration.

* ``fold_conv_affine``: a per-channel scale and shift after a convolution (eval-mode
  batch norm) becomes part of the convolution's weight and bias, so oneDNN runs
  conv + bias (+ ReLU) as one call.
* ``drop_unit_reduction_dims``: reducing over a size-1 dim is a no-op; dropping it
  lets instance norm (a batch-statistics batch norm over (0, 2, 3) with batch 1)
  use the fused row kernel, whose reduced dims must be trailing.
* ``fold_pads_into_convs``: a constant zero pad before a conv (``F.pad``, which
  captures as a ``cat`` with zero blocks) becomes the conv's own padding, uneven where
  the pad is (a causal conv pads only before): the conv kernels read the border as zeros
  anyway, so the copy of the activation goes.
* ``fold_reflection_pads_into_convs``: likewise a reflection pad (``F.pad`` with
  ``mode="reflect"``, captured as a gather per dim) becomes the conv's padding by
  reflection; the dense channels-last conv kernels read the mirrored pixel at the
  border, so the padded copy goes.
* ``merge_index_selects``: gathers with constant indices along the same dim compose
  into one (nearest upsampling then reflection padding, each two gathers along H and W,
  become one along H and one along W).
"""

from __future__ import annotations

import torch

from kiln.compiler.ir.graph import Graph, Node, TensorMeta, conv_padding, conv_padding_mode


def _consumers(graph: Graph) -> dict[str, list[Node]]:
    return graph.consumers()


def _channel_vector(graph: Graph, value: str, channels: int, rank: int) -> torch.Tensor | None:
    """The per-channel vector (C,) if ``value`` is a constant that broadcasts only over
    the channel dim (dim 1) of a rank-``rank`` conv output, else None."""
    if not graph.is_constant(value):
        return None
    t = graph.constants[value]
    if t.dim() == 0:
        return t.expand(channels).clone()
    shape = (1,) * (rank - t.dim()) + tuple(t.shape)
    if (
        len(shape) != rank
        or shape[1] != channels
        or any(s != 1 for i, s in enumerate(shape) if i != 1)
    ):
        return None
    return t.reshape(channels).clone()


def fold_conv_affine(graph: Graph) -> Graph:
    """conv(x, W, b) * s + t  ->  conv(x, W * s, b * s + t) for per-channel constants."""
    users = _consumers(graph)
    for conv in list(graph.nodes):
        if conv.op != "conv" or not graph.is_constant(conv.inputs[1]):
            continue
        w = graph.constants[conv.inputs[1]]
        out_meta = graph.meta(conv.output)
        channels, rank = w.shape[0], len(out_meta.shape)
        bias = (
            graph.constants[conv.inputs[2]]
            if len(conv.inputs) > 2
            else torch.zeros(channels, dtype=w.dtype)
        )
        if len(conv.inputs) > 2 and not graph.is_constant(conv.inputs[2]):
            continue
        scale, shift = torch.ones(channels, dtype=w.dtype), torch.zeros(channels, dtype=w.dtype)
        last = conv
        while len(users[last.output]) == 1 and last.output not in graph.outputs:
            nxt = users[last.output][0]
            other = [i for i in nxt.inputs if i != last.output]
            if (
                nxt.op not in ("mul", "add")
                or len(other) != 1
                or graph.meta(nxt.output) != out_meta
            ):
                break
            vec = _channel_vector(graph, other[0], channels, rank)
            if vec is None:
                break
            if nxt.op == "mul":
                scale, shift = scale * vec, shift * vec
            else:
                shift = shift + vec
            last = nxt
        if last is conv:
            continue
        shape = (channels,) + (1,) * (w.dim() - 1)
        new_w = graph.add_constant(f"{conv.name}_w_folded", (w * scale.reshape(shape)).contiguous())
        new_b = graph.add_constant(f"{conv.name}_b_folded", (bias * scale + shift).contiguous())
        # The folded conv now produces the last affine node's value.
        conv.inputs = (conv.inputs[0], new_w, new_b)
        last_out = last.output
        for n in graph.nodes:
            if n is not conv:
                n.inputs = tuple(conv.output if i == last_out else i for i in n.inputs)
        graph.outputs = [conv.output if o == last_out else o for o in graph.outputs]
        users = _consumers(graph)
    return graph


def _is_zero(graph: Graph, value: str) -> bool:
    """``value`` is a constant of zeros, or a view or broadcast of one."""
    while (p := graph.producer(value)) is not None and p.op in ("expand", "view"):
        value = p.inputs[0]
    return graph.is_constant(value) and not bool(graph.constants[value].any())


def _zero_padded(graph: Graph, value: str) -> tuple[str, int, int, int] | None:
    """(x, spatial dim, zeros before, zeros after) when ``value`` is an fp32
    ``cat([zeros..., x, zeros...])`` along a spatial dim of an NCHW-style value."""
    cat = graph.producer(value)
    if cat is None or cat.op != "cat" or graph.meta(value).dtype != torch.float32:
        return None
    shape = graph.meta(value).shape
    dim = cat.attrs["dim"] % len(shape)
    data = [i for i, v in enumerate(cat.inputs) if not _is_zero(graph, v)]
    if dim < 2 or len(data) != 1:
        return None
    k = data[0]
    sizes = [graph.meta(v).shape[dim] for v in cat.inputs]
    return cat.inputs[k], dim - 2, sum(sizes[:k]), sum(sizes[k + 1 :])


def _set_padding(conv: Node, d: int, before: int, after: int, mode: str) -> None:
    """Grow ``conv``'s padding of spatial dim ``d`` by (before, after), in ``mode``."""
    b, a = (list(p) for p in conv_padding(conv.attrs))
    b[d] += before
    a[d] += after
    attrs = {k: v for k, v in conv.attrs.items() if k not in ("padding_end", "padding_mode")}
    attrs["padding"] = tuple(b)
    if a != b:
        attrs["padding_end"] = tuple(a)
    if mode != "zeros":
        attrs["padding_mode"] = mode
    conv.attrs = attrs


def _reflection(idx: torch.Tensor, size: int) -> tuple[int, int] | None:
    """(before, after) when ``idx`` gathers F.pad's reflection of a dim of ``size``."""
    pad = idx.numel() - size
    if idx.dim() != 1 or pad <= 0:
        return None
    for before in range(max(0, pad - size + 1), min(pad, size - 1) + 1):
        j = torch.arange(idx.numel()) - before
        want = torch.where(j < 0, -j, torch.where(j >= size, 2 * (size - 1) - j, j))
        if torch.equal(idx, want):
            return before, pad - before
    return None


def fold_reflection_pads_into_convs(graph: Graph) -> Graph:
    """conv(x[reflect(H)][:, reflect(W)]) -> conv(x) padded by reflection, one gather
    (dim) at a time, when the conv pads nothing else with zeros. Dense convs only (one
    group): the kernels that mirror the border are the dense channels-last ones."""
    for conv in graph.nodes:
        if conv.op != "conv" or conv.attrs.get("channels_last") or conv.attrs["groups"] != 1:
            continue
        while (p := graph.producer(conv.inputs[0])) is not None and p.op == "index_select":
            x, idx = p.inputs
            d = p.attrs["dim"] % len(graph.meta(x).shape) - 2
            before, after = conv_padding(conv.attrs)
            zeros = conv_padding_mode(conv.attrs) == "zeros"
            if d < 0 or before[d] or after[d] or (zeros and any(before + after)):
                break
            if not graph.is_constant(idx) or graph.meta(x).dtype != torch.float32:
                break
            pads = _reflection(graph.constants[idx], graph.meta(x).shape[d + 2])
            if pads is None:
                break
            _set_padding(conv, d, *pads, "reflect")
            conv.inputs = (x, *conv.inputs[1:])
    return graph


def fold_pads_into_convs(graph: Graph) -> Graph:
    """conv(cat([zeros, x, zeros], spatial dim), W) -> conv(x, W) with that dim's padding
    grown by the zeros on each side; nested pads (one cat per dim) fold one by one. The
    cat stays for any other reader (dead code elimination drops it otherwise)."""
    for conv in graph.nodes:
        if conv.op != "conv" or conv.attrs.get("channels_last"):
            continue
        if conv_padding_mode(conv.attrs) != "zeros":
            continue
        while (pad := _zero_padded(graph, conv.inputs[0])) is not None:
            x, d, before, after = pad
            _set_padding(conv, d, before, after, "zeros")
            conv.inputs = (x, *conv.inputs[1:])
    return graph


def drop_unit_reduction_dims(graph: Graph) -> Graph:
    for n in graph.nodes:
        if n.op in ("sum", "max", "min") and n.attrs.get("keepdim"):
            shape = graph.meta(n.inputs[0]).shape
            dims = tuple(d for d in n.attrs["dims"] if shape[d % len(shape)] != 1)
            if dims and dims != tuple(n.attrs["dims"]):
                n.attrs = {**n.attrs, "dims": dims}
    return graph


def _squeeze(shape: tuple[int, ...]) -> tuple[int, ...]:
    return tuple(s for s in shape if s != 1)


def _same_elements(w: tuple[int, ...], s: tuple[int, ...], u: tuple[int, ...]) -> bool:
    """Does operand shape ``w`` broadcast to ``u`` exactly as it broadcast to ``s``
    and then reshaped to ``u``? (Checked on an index tensor: cheap, and exact.)"""
    try:
        idx = torch.arange(max(1, _numel(w)), dtype=torch.int32).reshape(w)
        return torch.equal(idx.expand(s).reshape(u), idx.expand(u))
    except RuntimeError:
        return False


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def _unviewed(graph: Graph, v: str, u: tuple[int, ...]) -> str:
    """The source of ``v`` if ``v`` is a view of a ``u``-shaped value, else ``v``."""
    p = graph.producer(v)
    if p is not None and p.op == "view" and graph.meta(p.inputs[0]).shape == u:
        return p.inputs[0]
    return v


def sink_unit_views(graph: Graph) -> Graph:
    """pointwise(view(u), ...) where the view only adds or drops size-1 dims becomes
    view(pointwise(u, ...)): the op runs in u's shape, so it can join u's kernel (a
    kernel never reads a view of a value it computes)."""
    from kiln.compiler.ir.graph import OpClass, Value, ValueKind

    i = 0
    while i < len(graph.nodes):
        n = graph.nodes[i]
        i += 1
        if n.cls != OpClass.POINTWISE:
            continue
        s = graph.meta(n.output).shape
        for pos_, v in enumerate(n.inputs):
            p = graph.producer(v)
            if p is None or p.op != "view" or graph.is_constant(p.inputs[0]):
                continue
            u = graph.meta(p.inputs[0]).shape
            if u == s or _squeeze(u) != _squeeze(s):
                continue
            # other operands: a unit view of a u-shaped value reads that value itself
            # (both halves of x * erf(x) sunk: the product joins them), else broadcast
            ins = [
                p.inputs[0] if j == pos_ else _unviewed(graph, w, u) for j, w in enumerate(n.inputs)
            ]
            others = [w for j, w in enumerate(ins) if j != pos_]
            if not all(graph.meta(w).shape == u or _same_elements(graph.meta(w).shape, s, u)
                       for w in others):  # fmt: skip
                continue
            # n' = op(u, others...) in shape u, then n becomes view(n', s).
            name = f"{n.name}_sunk"
            inputs = tuple(ins)
            meta = type(graph.meta(n.output))(u, graph.meta(n.output).dtype)
            graph.values[name] = Value(name, meta, ValueKind.INTERMEDIATE, producer=name)
            graph.nodes.insert(i - 1, Node(name, n.op, inputs, name, dict(n.attrs)))
            n.op, n.inputs, n.attrs = "view", (name,), {"shape": s}
            i += 1
            break
    return graph


def _gather(graph: Graph, n: Node | None, users: dict[str, list[Node]]) -> torch.Tensor | None:
    """The constant indices of ``n`` if it is an ``index_select`` whose output feeds one
    node and is not a graph output (so it may be rewritten), else None."""
    if n is None or n.op != "index_select" or not graph.is_constant(n.inputs[1]):
        return None
    if len(users[n.output]) != 1 or n.output in graph.outputs:
        return None
    return graph.constants[n.inputs[1]]


def _dim(graph: Graph, n: Node) -> int:
    return int(n.attrs["dim"]) % len(graph.meta(n.inputs[0]).shape)


def merge_index_selects(graph: Graph) -> Graph:
    """Compose ``index_select``s with constant indices. Along one dim,
    ``sel(sel(x, d, i), d, j) = sel(x, d, i[j])``; gathers along different dims commute,
    so ``sel(sel(sel(x, d, i), e, k), d, j)`` becomes ``sel(sel(x, d, i[j]), e, k)``. The
    gathers left without readers go with dead-code elimination."""
    users = _consumers(graph)
    for n in list(graph.nodes):
        if n.op != "index_select" or not graph.is_constant(n.inputs[1]):
            continue
        j, d = graph.constants[n.inputs[1]], _dim(graph, n)
        p = graph.producer(n.inputs[0])
        i = _gather(graph, p, users)
        if p is None or i is None:
            continue
        if _dim(graph, p) == d:  # one gather: x[i][j]
            n.inputs = (p.inputs[0], graph.add_constant(f"{n.name}_merged", i[j].contiguous()))
        else:
            q = graph.producer(p.inputs[0])
            k = _gather(graph, q, users)
            if q is None or k is None or _dim(graph, q) != d:
                continue
            # p gathers x along d (composed), n gathers p's output along p's old dim
            e, x = _dim(graph, p), q.inputs[0]
            shape = list(graph.meta(x).shape)
            shape[d] = len(j)
            graph.values[p.output].meta = TensorMeta(tuple(shape), graph.meta(x).dtype)
            merged = graph.add_constant(f"{p.name}_merged", k[j].contiguous())
            n.inputs, n.attrs = (p.output, p.inputs[1]), {**n.attrs, "dim": e}
            p.inputs, p.attrs = (x, merged), {**p.attrs, "dim": d}
        users = _consumers(graph)
    return graph
