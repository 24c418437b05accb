"""Depthwise convolutions (groups == channels, multiplier 1), 1-D and 2-D, NCHW, with a
fused pointwise epilogue (channels-last ones: ``dwconv_nhwc.py``, lowered here too).

One task per (image, channel) plane, run in parallel. A task first copies its input
plane into a per-thread scratch buffer, zero-padded and split by the column stride
into ``stride_w`` phases (phase ``p`` holds padded columns ``p, p + s, p + 2s, ...``),
so every tap of every output vector is one contiguous unaligned load and the borders
need no tests. Then each output row is computed in blocks of up to ``BLOCK`` vectors of
``kv::W`` columns kept in registers: per tap, one broadcast weight and one FMA per
vector. The epilogue (bias from folded batch norm is the conv's own bias; activations,
gating with another operand, residual adds) runs on the registers before the store;
the last vector of a row is stored masked (ragged widths).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import torch

from kiln.compiler.codegen.cpu.dwconv_nhwc import (
    DwNhwcSpec,
    NhwcEpilogue,
    emit_dwconv_nhwc,
    pack_filters,
)
from kiln.compiler.codegen.cpu.emit import (
    Operand,
    load,
    pointwise_expr,
    splat_load,
    store,
    supports_pointwise,
)
from kiln.compiler.fusion.convs import is_channels_last, is_depthwise_conv
from kiln.compiler.fusion.program import Kernel
from kiln.compiler.ir.graph import Graph, Node

BLOCK = 4  # output vectors per register block (AVX-512: 4 accumulators + loads)
MIN_TASK_FMAS = 1 << 12  # vector FMAs a parallel chunk holds at least (~3 µs of work)
SCRATCH_SLOT = 3  # kgen::scratch slot (gemm uses 1 and 2, row kernels 0)


@dataclass(frozen=True)
class DwSpec:
    batch: int
    channels: int
    in_hw: tuple[int, int]  # (1, L) for 1-D
    out_hw: tuple[int, int]
    kernel: tuple[int, int]
    stride: tuple[int, int]
    padding: tuple[int, int]
    dilation: tuple[int, int]
    x: Operand  # strides (n, c, h, w)
    weights: str  # C++ pointer: C * KH * KW weights, then C biases when ``has_bias``
    has_bias: bool
    acc_value: str  # the conv's output value
    epilogue: tuple[Node, ...]
    ext: dict[str, Operand]  # epilogue operands, strides (n, c, oh, ow)
    consts: dict[str, str]
    outs: dict[str, Operand]  # written values, strides (n, c, oh, ow)
    dtypes: dict[str, torch.dtype]


def as_2d(values: tuple[int, ...], fill: int) -> tuple[int, int]:
    """A 1-D conv's per-axis attribute as a 2-D one over (1, L)."""
    return (fill, values[0]) if len(values) == 1 else (values[0], values[1])


def operand_4d(op: Operand) -> Operand:
    """Strides over (n, c, w) as strides over (n, c, 1, w)."""
    if len(op.strides) == 4:
        return op
    n, c, w = op.strides
    return Operand(op.ptr, op.dtype, op.offset, (n, c, 0, w))


def scratch_layout(s: DwSpec, lanes: int) -> tuple[int, int, int]:
    """(rows, phase row length, max column offset) of the padded, phase-split plane."""
    (oh, ow), (kh, kw) = s.out_hw, s.kernel
    (sh, sw), (dh, dw) = s.stride, s.dilation
    rows = (oh - 1) * sh + (kh - 1) * dh + 1
    max_off = (kw - 1) * dw // sw
    n_vec = -(-ow // lanes)
    row_len = -(-(n_vec * lanes + max_off) // 16) * 16
    return rows, row_len, max_off


def emit_dwconv(s: DwSpec, lanes: int, threads: int) -> list[str]:
    """The kernel body for ``lanes`` floats per vector (``kv::W``, checked at compile time)."""
    oh, ow = s.out_hw
    sw = s.stride[1]
    rows, row_len, _ = scratch_layout(s, lanes)
    x = s.x
    taps = s.kernel[0] * s.kernel[1]
    plane_fmas = oh * -(-ow // lanes) * taps
    tasks = s.batch * s.channels
    grain = tasks if threads <= 1 else max(1, -(-MIN_TASK_FMAS // plane_fmas))
    L = [
        f'static_assert(kv::W == {lanes}, "dwconv emitted for another vector width");',
        "auto task = [&](int64_t t0, int64_t t1) {",
        f"  float* xs = kgen::scratch({SCRATCH_SLOT}, {rows * sw * row_len});",
        "  for (int64_t t = t0; t < t1; ++t) {",
        f"    const int64_t n = t / {s.channels}, c = t % {s.channels};",
        f"    const float* wc = {s.weights} + c * {taps};",
        f"    const float* xc = {x.ptr} + {x.offset} + n * {x.strides[0]} + c * {x.strides[1]};",
    ]
    L += ["    " + line for line in _fill(s, rows, row_len)]
    bias = f"kv::splat({s.weights}[{s.channels * taps} + c])" if s.has_bias else "kv::splat(0.0f)"
    L.append(f"    const kv::V bias = {bias};")
    L.append(f"    for (int64_t oh = 0; oh < {oh}; ++oh) {{")
    n_vec = -(-ow // lanes)
    full_blocks = (n_vec - 1) // BLOCK
    last = n_vec - full_blocks * BLOCK
    tail = ow - (n_vec - 1) * lanes
    if full_blocks:
        L.append(
            f"      for (int64_t j0 = 0; j0 < {full_blocks * BLOCK * lanes}; j0 += kv::W * {BLOCK}) {{"
        )
        L += ["        " + line for line in _block(s, BLOCK, None, row_len)]
        L.append("      }")
    L.append("      {")
    L.append(f"        const int64_t j0 = {full_blocks * BLOCK * lanes};")
    L += ["        " + line for line in _block(s, last, tail if tail < lanes else None, row_len)]
    L.append("      }")
    L += ["    }", "  }", "};", f"kiln::parallel(rt, {tasks}, {grain}, task);"]
    return L


def _fill(s: DwSpec, rows: int, row_len: int) -> list[str]:
    """Copy the (n, c) input plane into ``xs``: zero-padded, one row per (row, phase)."""
    (ih, iw), (sw, ph, pw) = s.in_hw, (s.stride[1], s.padding[0], s.padding[1])
    sx_h, sx_w = s.x.strides[2], s.x.strides[3]
    L = [f"for (int64_t r = 0; r < {rows}; ++r) {{", f"  const int64_t ir = r - {ph};"]
    L.append(f"  float* xr = xs + r * {sw * row_len};")
    L.append(f"  if (ir < 0 || ir >= {ih}) {{ std::memset(xr, 0, {sw * row_len * 4}); continue; }}")
    L.append(f"  const float* src = xc + ir * {sx_h};")
    for p in range(sw):
        # padded column j * sw + p is input column j * sw + p - pw
        lo = min(row_len, max(0, -(-(pw - p) // sw)))
        hi = min(row_len, max(lo, -(-(iw + pw - p) // sw)))
        d = f"xr + {p * row_len}"
        if lo:
            L.append(f"  std::memset({d}, 0, {lo * 4});")
        if hi > lo:
            first = lo * sw + p - pw
            if sw == 1 and sx_w == 1:
                L.append(f"  std::memcpy({d} + {lo}, src + {first}, {(hi - lo) * 4});")
            else:
                L.append(f"  for (int64_t j = {lo}; j < {hi}; ++j)")
                L.append(f"    ({d})[j] = src[(j * {sw} + {p - pw}) * {sx_w}];")
        if hi < row_len:
            L.append(f"  std::memset({d} + {hi}, 0, {(row_len - hi) * 4});")
    L.append("}")
    return L


def _block(s: DwSpec, nb: int, tail: int | None, row_len: int) -> list[str]:
    """``nb`` output vectors of row ``oh`` from column ``j0``; the last one has ``tail``
    valid lanes (None: all)."""
    (kh, kw), (sh, sw), (dh, dw) = s.kernel, s.stride, s.dilation
    L = [f"kv::V acc[{nb}];"]
    L.append(f"for (int b = 0; b < {nb}; ++b) acc[b] = bias;")
    L.append(f"for (int64_t u = 0; u < {kh}; ++u) {{")
    L.append(f"  const float* xr = xs + (oh * {sh} + u * {dh}) * {sw * row_len} + j0;")
    L.append(f"  #pragma GCC unroll {min(kw, 64)}")
    L.append(f"  for (int64_t v = 0; v < {kw}; ++v) {{")
    L.append(f"    const kv::V w = kv::splat(wc[u * {kw} + v]);")
    L.append(f"    const float* xp = xr + (v * {dw}) % {sw} * {row_len} + (v * {dw}) / {sw};")
    L.append(f"    #pragma GCC unroll {nb}")
    L.append(
        f"    for (int b = 0; b < {nb}; ++b) acc[b] = kv::fma(kv::load(xp + b * kv::W), w, acc[b]);"
    )
    L.append("  }")
    L.append("}")
    for b in range(nb):
        L.append("{")
        L += ["  " + line for line in _epilogue(s, b, tail if b == nb - 1 else None)]
        L.append("}")
    return L


def _epilogue(s: DwSpec, b: int, tail: int | None) -> list[str]:
    names: dict[str, str] = {s.acc_value: f"acc[{b}]"}
    n = None if tail is None else str(tail)
    out = [f"const int64_t ow = j0 + {b} * kv::W;"]
    for v, lit in s.consts.items():
        names[v] = f"kv::splat({lit})"

    def index(op: Operand) -> tuple[str, int]:
        terms = [str(op.offset)]
        for var, st in zip(("n", "c", "oh", "ow"), op.strides):
            if st:
                terms.append(var if st == 1 else f"{var} * {st}")
        return " + ".join(terms), op.strides[3]

    for k, (v, op) in enumerate(s.ext.items()):
        idx, sw = index(op)
        expr = splat_load(op, idx) if sw == 0 else load(op, idx, sw, n)
        out.append(f"const kv::V e{k} = {expr};")
        names[v] = f"e{k}"
    for m, node in enumerate(s.epilogue):
        args = [names[i] for i in node.inputs]
        expr = pointwise_expr(node, args, [s.dtypes[i] for i in node.inputs])
        out.append(f"const kv::V y{m} = {expr};")
        names[node.output] = f"y{m}"
    for v, op in s.outs.items():
        idx, sw = index(op)
        out.append(store(op, idx, sw, names[v], n))
    return out


class KernelState(Protocol):
    """What the lowering needs of the program being generated (``codegen._Gen``)."""

    g: Graph
    nr: int  # GEMM panel width: two vectors
    threads: int

    def prepared_param(self, key: tuple[object, ...], make: Callable[[], torch.Tensor]) -> str: ...
    def operand(self, value: str, shape: tuple[int, ...]) -> Operand: ...
    def out_operand(self, value: str, strides: tuple[int, ...] | None = None) -> Operand: ...
    def consts(self, values: list[str]) -> dict[str, str]: ...
    def local_ref(self, ref: str) -> int: ...
    def external_inputs(self, nodes: list[Node]) -> list[str]: ...
    def dtypes(self) -> dict[str, torch.dtype]: ...


def dwconv_kernel(gen: KernelState, k: Kernel, nodes: list[Node]) -> list[str]:
    """Lower a ``dwconv`` kernel (the conv first, then its epilogue) to C++ lines;
    ValueError when it is not of that form."""
    g, conv = gen.g, nodes[0]
    if not is_depthwise_conv(g, conv):
        raise ValueError("a dwconv kernel must start with a depthwise conv")
    out_shape = g.meta(conv.output).shape
    for e in nodes[1:]:
        if not supports_pointwise(e) or g.meta(e.output).shape != out_shape:
            raise ValueError(f"epilogue op {e.op} {g.meta(e.output).shape}")
    if is_channels_last(conv):
        return dwconv_nhwc_kernel(gen, k, nodes)
    has_bias = len(conv.inputs) > 2

    def filters() -> torch.Tensor:  # the filter taps, then the biases
        return torch.cat([g.constants[v].float().reshape(-1) for v in conv.inputs[1:]]).contiguous()

    weights = gen.prepared_param(("dwconv", *conv.inputs[1:]), filters)
    ext = [v for v in gen.external_inputs(nodes[1:]) if v != conv.output]
    consts = gen.consts(ext)
    a = conv.attrs
    x_shape = g.meta(conv.inputs[0]).shape
    spec = DwSpec(
        batch=out_shape[0],
        channels=out_shape[1],
        in_hw=as_2d(x_shape[2:], 1),
        out_hw=as_2d(out_shape[2:], 1),
        kernel=as_2d(g.meta(conv.inputs[1]).shape[2:], 1),
        stride=as_2d(a["stride"], 1),
        padding=as_2d(a["padding"], 0),
        dilation=as_2d(a["dilation"], 1),
        x=operand_4d(gen.operand(conv.inputs[0], x_shape)),
        weights=weights,
        has_bias=has_bias,
        acc_value=conv.output,
        epilogue=tuple(nodes[1:]),
        ext={v: operand_4d(gen.operand(v, out_shape)) for v in ext if v not in consts},
        consts=consts,
        outs={v: operand_4d(gen.out_operand(v)) for v in k.outputs},
        dtypes=gen.dtypes(),
    )
    return emit_dwconv(spec, gen.nr // 2, gen.threads)


def nhwc_4d(op: Operand) -> Operand:
    """Strides over (n, w, c) as strides over (n, 1, w, c)."""
    if len(op.strides) == 4:
        return op
    n, w, c = op.strides
    return Operand(op.ptr, op.dtype, op.offset, (n, 0, w, c))


def dwconv_nhwc_kernel(gen: KernelState, k: Kernel, nodes: list[Node]) -> list[str]:
    """Lower a channels-last ``dwconv`` kernel (``dwconv_nhwc.py``)."""
    g, conv = gen.g, nodes[0]
    out_shape = g.meta(conv.output).shape  # (N, *spatial', C)
    x_shape = g.meta(conv.inputs[0]).shape  # (N, *spatial, C)
    lanes = gen.nr // 2
    x = nhwc_4d(gen.operand(conv.inputs[0], x_shape))
    if x.strides[3] != 1:
        raise ValueError("channels of a channels-last depthwise conv input are not contiguous")
    w_name, b_name = conv.inputs[1], conv.inputs[2] if len(conv.inputs) > 2 else None

    def filters() -> torch.Tensor:
        bias = g.constants[b_name] if b_name is not None else None
        return pack_filters(g.constants[w_name], bias, lanes)

    weights = gen.prepared_param(("dwconv_nhwc", w_name, b_name, lanes), filters)
    a = conv.attrs
    spec = DwNhwcSpec(
        batch=out_shape[0],
        channels=out_shape[-1],
        in_hw=as_2d(x_shape[1:-1], 1),
        out_hw=as_2d(out_shape[1:-1], 1),
        kernel=as_2d(g.meta(w_name).shape[2:], 1),
        stride=as_2d(a["stride"], 1),
        padding=as_2d(a["padding"], 0),
        dilation=as_2d(a["dilation"], 1),
        x=x,
        weights=weights,
        epi=nhwc_epilogue(gen, k, nodes),
    )
    return emit_dwconv_nhwc(spec, lanes, gen.threads)


def nhwc_epilogue(gen: KernelState, k: Kernel, nodes: list[Node]) -> NhwcEpilogue:
    """The epilogue of a channels-last conv kernel (the conv first, then pointwise ops
    of its output shape; ValueError for anything else)."""
    g, conv = gen.g, nodes[0]
    out_shape = g.meta(conv.output).shape
    for e in nodes[1:]:
        if not supports_pointwise(e) or g.meta(e.output).shape != out_shape:
            raise ValueError(f"epilogue op {e.op} {g.meta(e.output).shape}")
    ext = [v for v in gen.external_inputs(nodes[1:]) if v != conv.output]
    consts = gen.consts(ext)
    return NhwcEpilogue(
        acc_value=conv.output,
        nodes=tuple(nodes[1:]),
        ext={v: nhwc_4d(gen.operand(v, out_shape)) for v in ext if v not in consts},
        consts=consts,
        outs={v: nhwc_4d(gen.out_operand(v)) for v in k.outputs},
        dtypes=gen.dtypes(),
    )
