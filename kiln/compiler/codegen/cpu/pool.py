"""2-D max / average pooling (the ``pool2d`` primitive): one kernel per pool, either layout.

Channels-last (N, H, W, C): vectorised along channels, as ``dwconv_nhwc.py`` is. One
task computes one output row of one block of up to ``CB`` channel vectors (tasks run in
parallel over image, row and block); per output pixel the window is clamped to the
input and each of its pixels' channel vectors is one contiguous load combined into
registers. Clamping is exact for both modes: padding never wins a max (PyTorch pads
with -inf, and every window holds an input pixel), and an average counts the padding
as zeros (``count_include_pad``: the divisor is always KH * KW in floor mode).

NCHW (N, C, H, W): one task per (image, channel) plane, as ``dwconv.py`` runs its
planes: the plane is copied into per-thread scratch, padded with the mode's identity
(-inf or 0) and split by the column stride into phases (phase p holds padded columns
p, p + s, p + 2s, ...), so every tap of a vector of output columns is one contiguous
load with no bounds tests; output rows go in blocks of up to ``BLOCK`` vectors.

Either kernel runs in parallel from ``PARALLEL_MIN_ELEMS`` input elements (mirrored by
the cost model, ``fusion/cpu_cost.py``), one chunk per thread.
"""

from __future__ import annotations

from dataclasses import dataclass

from kiln.compiler.codegen.cpu.colreduce import ColumnState
from kiln.compiler.codegen.cpu.emit import Operand
from kiln.compiler.ir.graph import Node

CB = 4  # channel vectors per channels-last task (registers: one accumulator each)
BLOCK = 4  # output vectors per NCHW register block
PARALLEL_MIN_ELEMS = 32768  # input elements from which a pool runs in parallel
SCRATCH_SLOT = 4  # kgen::scratch slot (row kernels 0, gemm 1-2, dwconv 3, rnn 5)
_INIT = {"max": "-__builtin_inff()", "avg": "0.0f"}


@dataclass(frozen=True)
class PoolSpec:
    mode: str  # "max" | "avg"
    batch: int
    channels: int
    in_hw: tuple[int, int]
    out_hw: tuple[int, int]
    kernel: tuple[int, int]
    stride: tuple[int, int]
    padding: tuple[int, int]
    x: Operand  # strides (n, c, h, w) or, channels-last, (n, h, w, c)
    y: Operand  # contiguous, same order as x

    def combine(self, acc: str, x: str) -> str:
        return f"kv::max({acc}, {x})" if self.mode == "max" else f"{acc} + {x}"

    def finish(self, acc: str) -> str:
        """The output from an accumulator (an average divides by the whole window)."""
        taps = self.kernel[0] * self.kernel[1]
        return acc if self.mode == "max" else f"{acc} / kv::splat({taps}.0f)"


def pool_kernel(gen: ColumnState, node: Node, lanes: int) -> list[str]:
    """C++ lines of a kernel holding one ``pool2d`` node; ValueError when it cannot run
    natively (it then runs as its PyTorch reference)."""
    g, a = gen.g, node.attrs
    x, out = node.inputs[0], node.output
    shape, out_shape = g.meta(x).shape, g.meta(out).shape
    if g.meta(x).dtype != g.meta(out).dtype or gen.operand(x, shape).ctype != "float":
        raise ValueError("pool2d: not float32")
    cl = bool(a["channels_last"])
    n, c, h, w = (shape[0], shape[3], shape[1], shape[2]) if cl else shape
    oh, ow = (out_shape[1], out_shape[2]) if cl else (out_shape[2], out_shape[3])

    def pair(key: str) -> tuple[int, int]:
        return int(a[key][0]), int(a[key][1])

    spec = PoolSpec(
        a["mode"], n, c, (h, w), (oh, ow), pair("kernel"), pair("stride"), pair("padding"),
        gen.operand(x, shape), gen.out_operand(out),
    )  # fmt: skip
    parallel = gen.threads > 1 and n * c * h * w >= PARALLEL_MIN_ELEMS
    if cl:
        if spec.x.strides[3] != 1:
            raise ValueError("pool2d: channels are not contiguous")
        return emit_pool_nhwc(spec, lanes, parallel)
    return emit_pool_nchw(spec, lanes, parallel)


def _parallel(tasks: int, parallel: bool) -> list[str]:
    return ["};", f"kiln::parallel(rt, {tasks}, {1 if parallel else tasks}, task);"]


def emit_pool_nhwc(s: PoolSpec, lanes: int, parallel: bool) -> list[str]:
    (ih, iw), (oh_n, _) = s.in_hw, s.out_hw
    vecs = -(-s.channels // lanes)
    blocks = -(-vecs // CB)
    per = -(-vecs // blocks)
    last = vecs - (blocks - 1) * per
    tail = s.channels - (vecs - 1) * lanes
    x, y = s.x, s.y
    L = [
        f'static_assert(kv::W == {lanes}, "pool2d emitted for another vector width");',
        "auto task = [&](int64_t t0, int64_t t1) {",
        "  for (int64_t t = t0; t < t1; ++t) {",
        f"    const int64_t cb = t % {blocks}, r = t / {blocks};",
        f"    const int64_t oh = r % {oh_n}, n = r / {oh_n};",
        f"    const int64_t c0 = cb * {per * lanes}, h0 = oh * {s.stride[0]} - {s.padding[0]};",
        "    const int64_t u0 = h0 < 0 ? -h0 : 0;",
        f"    const int64_t u1 = h0 + {s.kernel[0]} > {ih} ? {ih} - h0 : {s.kernel[0]};",
        f"    const float* xn = {x.ptr} + {x.offset} + n * {x.strides[0]} + c0;",
        f"    float* yr = {y.ptr} + {y.offset} + n * {y.strides[0]} + oh * {y.strides[1]} + c0;",
    ]
    full = _pixels(s, per, None, lanes, iw)
    part = _pixels(s, last, tail if tail < lanes else None, lanes, iw)
    if blocks == 1 or full == part:
        L += ["    " + line for line in part]
    else:
        L.append(f"    if (cb < {blocks - 1}) {{")
        L += ["      " + line for line in full]
        L.append("    } else {")
        L += ["      " + line for line in part]
        L.append("    }")
    return L + ["  }", *_parallel(s.batch * oh_n * blocks, parallel)]


def _pixels(s: PoolSpec, nb: int, tail: int | None, lanes: int, iw: int) -> list[str]:
    """Output row ``oh``'s pixels, ``nb`` channel vectors from ``c0`` (the last one
    ``tail`` lanes wide; None: full)."""
    kw, sw, pw = s.kernel[1], s.stride[1], s.padding[1]
    sx_h, sx_w = s.x.strides[1], s.x.strides[2]
    init = _INIT[s.mode]
    L = [
        f"for (int64_t ow = 0; ow < {s.out_hw[1]}; ++ow) {{",
        f"  const int64_t w0 = ow * {sw} - {pw};",
        "  const int64_t v0 = w0 < 0 ? -w0 : 0;",
        f"  const int64_t v1 = w0 + {kw} > {iw} ? {iw} - w0 : {kw};",
    ]
    L += [f"  kv::V a{j} = kv::splat({init});" for j in range(nb)]
    L += [
        "  for (int64_t u = u0; u < u1; ++u) {",
        f"    const float* xr = xn + (h0 + u) * {sx_h} + w0 * {sx_w};",
        f"    #pragma GCC unroll {kw}",
        "    for (int64_t v = v0; v < v1; ++v) {",
        f"      const float* p = xr + v * {sx_w};",
    ]
    for j in range(nb):
        ptr = f"p + {j * lanes}"
        ld = f"kv::loadn({ptr}, {tail}, 0.0f)" if tail and j == nb - 1 else f"kv::load({ptr})"
        L.append(f"      a{j} = {s.combine(f'a{j}', ld)};")
    L += ["    }", "  }"]
    for j in range(nb):
        dst = f"yr + ow * {s.y.strides[2]} + {j * lanes}"
        if tail and j == nb - 1:
            L.append(f"  kv::storen({dst}, {s.finish(f'a{j}')}, {tail});")
        else:
            L.append(f"  kv::store({dst}, {s.finish(f'a{j}')});")
    return L + ["}"]


def scratch_layout(s: PoolSpec, lanes: int) -> tuple[int, int]:
    """(rows, phase row length) of an NCHW plane padded and split into column phases:
    enough for whole vectors of output columns at every tap."""
    (oh, ow), (kh, kw), (sh, sw) = s.out_hw, s.kernel, s.stride
    rows = (oh - 1) * sh + kh
    row_len = -(-(-(-ow // lanes) * lanes + (kw - 1) // sw) // 16) * 16
    return rows, row_len


def emit_pool_nchw(s: PoolSpec, lanes: int, parallel: bool) -> list[str]:
    oh, ow = s.out_hw
    sh, sw = s.stride
    rows, row_len = scratch_layout(s, lanes)
    x, y = s.x, s.y
    L = [
        f'static_assert(kv::W == {lanes}, "pool2d emitted for another vector width");',
        "auto task = [&](int64_t t0, int64_t t1) {",
        f"  float* xs = kgen::scratch({SCRATCH_SLOT}, {rows * sw * row_len});",
        "  for (int64_t t = t0; t < t1; ++t) {",
        f"    const int64_t n = t / {s.channels}, c = t % {s.channels};",
        f"    const float* xc = {x.ptr} + {x.offset} + n * {x.strides[0]} + c * {x.strides[1]};",
        f"    float* yc = {y.ptr} + {y.offset} + n * {y.strides[0]} + c * {y.strides[1]};",
    ]
    L += ["    " + line for line in _fill(s, rows, row_len)]
    L.append(f"    for (int64_t oh = 0; oh < {oh}; ++oh) {{")
    L.append(f"      const float* xr = xs + oh * {sh * sw * row_len};")
    L.append(f"      float* yr = yc + oh * {y.strides[2]};")
    n_vec = -(-ow // lanes)
    full = (n_vec - 1) // BLOCK
    if full:
        step = BLOCK * lanes
        L.append(f"      for (int64_t j0 = 0; j0 < {full * step}; j0 += {step}) {{")
        L += ["        " + line for line in _block(s, BLOCK, None, lanes, row_len)]
        L.append("      }")
    L.append("      {")
    L.append(f"        const int64_t j0 = {full * BLOCK * lanes};")
    tail = ow - (n_vec - 1) * lanes
    last = _block(s, n_vec - full * BLOCK, tail if tail < lanes else None, lanes, row_len)
    L += ["        " + line for line in last]
    L += ["      }", "    }", "  }", *_parallel(s.batch * s.channels, parallel)]
    return L


def _block(s: PoolSpec, nb: int, tail: int | None, lanes: int, row_len: int) -> list[str]:
    """``nb`` vectors of output row ``oh`` from column ``j0``, each tap one load from the
    scratch plane; the last vector ``tail`` lanes wide (None: full)."""
    (kh, kw), sw = s.kernel, s.stride[1]
    L = [f"kv::V a{b} = kv::splat({_INIT[s.mode]});" for b in range(nb)]
    for u in range(kh):
        for v in range(kw):
            off = (u * sw + v % sw) * row_len + v // sw
            for b in range(nb):
                ld = f"kv::load(xr + j0 + {off + b * lanes})"
                L.append(f"a{b} = {s.combine(f'a{b}', ld)};")
    for b in range(nb):
        dst, value = f"yr + j0 + {b * lanes}", s.finish(f"a{b}")
        if tail is not None and b == nb - 1:
            L.append(f"kv::storen({dst}, {value}, {tail});")
        else:
            L.append(f"kv::store({dst}, {value});")
    return L


def _fill(s: PoolSpec, rows: int, row_len: int) -> list[str]:
    """Copy plane ``xc`` into ``xs``: padded with the identity, one row per (row, phase)."""
    (ih, iw), (sw, ph, pw) = s.in_hw, (s.stride[1], s.padding[0], s.padding[1])
    sx_h, sx_w = s.x.strides[2], s.x.strides[3]
    pad = _INIT[s.mode]
    L = [f"for (int64_t r = 0; r < {rows}; ++r) {{", f"  const int64_t ir = r - {ph};"]
    L.append(f"  float* xr = xs + r * {sw * row_len};")
    L.append(f"  if (ir < 0 || ir >= {ih}) {{ std::fill_n(xr, {sw * row_len}, {pad}); continue; }}")
    L.append(f"  const float* src = xc + ir * {sx_h};")
    for p in range(sw):
        # padded column j * sw + p is input column j * sw + p - pw
        lo = min(row_len, max(0, -(-(pw - p) // sw)))
        hi = min(row_len, max(lo, -(-(iw + pw - p) // sw)))
        d = f"xr + {p * row_len}"
        if lo:
            L.append(f"  std::fill_n({d}, {lo}, {pad});")
        if hi > lo:
            if sw == 1 and sx_w == 1:
                L.append(f"  std::memcpy({d} + {lo}, src + {lo - pw}, {(hi - lo) * 4});")
            else:
                L.append(f"  for (int64_t j = {lo}; j < {hi}; ++j)")
                L.append(f"    ({d})[j] = src[(j * {sw} + {p - pw}) * {sx_w}];")
        if hi < row_len:
            L.append(f"  std::fill_n({d} + {hi}, {row_len - hi}, {pad});")
    L.append("}")
    return L
