"""Channels-last depthwise convolutions (groups == channels, multiplier 1), 1-D and 2-D,
with a fused pointwise epilogue: values (N, H, W, C) (1-D: (N, L, C), run as H = 1).

Vectorised along channels: a vector holds ``kv::W`` neighbouring channels of one pixel,
so no lanes are wasted on narrow planes (a 7x7 NCHW plane fills 7 of 16 lanes per row)
and every load is contiguous. One task computes one output row of one block of up to
``CB`` channel vectors, so tasks run in parallel over (image, output row, channel
block). Within a row, interior pixels go in register blocks of ``PX`` pixels x ``CB``
vectors: per kernel row, each input column of the block's window is loaded once and
feeds every (pixel, tap) pair that reads it (unrolled at generation time, so a 3-wide
stride-1 window loads 6 columns for 12 FMAs per vector). Pixels whose window crosses
the left or right padding run one at a time with per-tap bounds checks; kernel rows
in the top/bottom padding are skipped. The filter is stored tap-major with the
channels padded to whole vectors (zeros), then the bias; the last channel vector of a
ragged channel count is loaded and stored masked. The epilogue (activations, residual
adds, gating) runs on the accumulators before the store.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kiln.compiler.codegen.cpu.emit import Operand, load, pointwise_expr, splat_load, store
from kiln.compiler.ir.graph import Node

PX = 4  # output pixels per register block
MIN_TASK_FMAS = 1 << 12  # vector FMAs a parallel chunk holds at least


@dataclass(frozen=True)
class NhwcEpilogue:
    """What runs on an accumulator of a channels-last conv before it is stored."""

    acc_value: str  # the conv's output value
    nodes: tuple[Node, ...]  # the fused pointwise ops, topological
    ext: dict[str, Operand]  # their operands, strides (n, oh, ow, c)
    consts: dict[str, str]  # 0-d constants -> C++ literals
    outs: dict[str, Operand]  # written values, strides (n, oh, ow, c)
    dtypes: dict[str, torch.dtype]


@dataclass(frozen=True)
class DwNhwcSpec:
    batch: int
    channels: int
    in_hw: tuple[int, int]  # (1, L) for 1-D
    out_hw: tuple[int, int]
    kernel: tuple[int, int]
    stride: tuple[int, int]
    padding: tuple[int, int]
    dilation: tuple[int, int]
    x: Operand  # strides (n, h, w, c); c must be 1
    weights: str  # C++ pointer: (KH * KW, Cp) taps, then Cp biases (zeros without a bias)
    epi: NhwcEpilogue


def padded_channels(channels: int, lanes: int) -> int:
    return -(-channels // lanes) * lanes


def pack_filters(w: torch.Tensor, bias: torch.Tensor | None, lanes: int) -> torch.Tensor:
    """w (C, 1, *kernel) [+ bias (C,)] -> flat (taps, Cp) filter then (Cp,) bias, zero
    padded to whole vectors of ``lanes`` channels."""
    c = w.shape[0]
    cp = padded_channels(c, lanes)
    taps = w.float().reshape(c, -1).t()  # (taps, C)
    out = torch.zeros(taps.shape[0] + 1, cp)
    out[:-1, :c] = taps
    if bias is not None:
        out[-1, :c] = bias.float().reshape(-1)
    return out.reshape(-1).contiguous()


def channel_blocks(channels: int, lanes: int, max_vectors: int) -> tuple[int, int, int]:
    """(blocks, vectors per block, vectors of the last block): blocks as even as whole
    vectors allow, at most ``max_vectors`` each."""
    vecs = -(-channels // lanes)
    blocks = -(-vecs // max_vectors)
    per = -(-vecs // blocks)
    return blocks, per, vecs - (blocks - 1) * per


def vector_tail(channels: int, lanes: int) -> int | None:
    """Valid lanes of the last vector of ``channels`` (None: a whole vector)."""
    tail = channels - (-(-channels // lanes) - 1) * lanes
    return None if tail == lanes else tail


def interior(s: DwNhwcSpec) -> tuple[int, int]:
    """Output columns [lo, hi) whose whole window lies inside the input row."""
    (_, iw), (_, ow) = s.in_hw, s.out_hw
    kw, sw, pw, dw = s.kernel[1], s.stride[1], s.padding[1], s.dilation[1]
    lo = min(ow, -(-pw // sw))
    last = iw - 1 + pw - (kw - 1) * dw  # ow * sw <= last
    hi = max(lo, min(ow, last // sw + 1)) if last >= 0 else lo
    return lo, hi


def emit_dwconv_nhwc(s: DwNhwcSpec, lanes: int, threads: int) -> list[str]:
    """The kernel body for ``lanes`` floats per vector (``kv::W``, checked at compile time)."""
    oh_n, ow_n = s.out_hw
    kh, kw = s.kernel
    max_vectors = 4 if lanes == 16 else 2
    blocks, per, last = channel_blocks(s.channels, lanes, max_vectors)
    tail_n = vector_tail(s.channels, lanes)
    tasks = s.batch * oh_n * blocks
    task_fmas = ow_n * kh * kw * per
    grain = tasks if threads <= 1 else max(1, -(-MIN_TASK_FMAS // task_fmas))
    x = s.x
    L = [
        f'static_assert(kv::W == {lanes}, "dwconv_nhwc emitted for another vector width");',
        f"const float* wt = {s.weights};",
        f"const float* bias = wt + {kh * kw * padded_channels(s.channels, lanes)};",
        "auto task = [&](int64_t t0, int64_t t1) {",
        "  for (int64_t t = t0; t < t1; ++t) {",
        f"    const int64_t cb = t % {blocks}, r = t / {blocks};",
        f"    const int64_t oh = r % {oh_n}, n = r / {oh_n};",
        f"    const int64_t c0 = cb * {per * lanes};",
        f"    const float* xn = {x.ptr} + {x.offset} + n * {x.strides[0]};",
    ]
    if last == per and tail_n is None:
        L += ["    " + line for line in _row(s, per, None, lanes)]
    else:
        L.append(f"    if (cb < {blocks - 1}) {{")
        L += ["      " + line for line in _row(s, per, None, lanes)]
        L.append("    } else {")
        L += ["      " + line for line in _row(s, last, tail_n, lanes)]
        L.append("    }")
    L += ["  }", "};", f"kiln::parallel(rt, {tasks}, {grain}, task);"]
    return L


def _row(s: DwNhwcSpec, nb: int, tail: int | None, lanes: int) -> list[str]:
    """One output row ``oh`` of the ``nb`` channel vectors from ``c0``."""
    lo, hi = interior(s)
    ow_n = s.out_hw[1]
    L = [f"for (int64_t ow = 0; ow < {ow_n};) {{"]
    if hi - lo >= PX:
        L.append(f"  if (ow >= {lo} && ow + {PX} <= {hi}) {{")
        L += ["    " + line for line in _block(s, nb, tail, lanes)]
        L.append(f"    ow += {PX};")
        L.append("    continue;")
        L.append("  }")
    L.append("  {")
    L += ["    " + line for line in _single(s, nb, tail, lanes)]
    L.append("  }")
    L.append("  ow += 1;")
    L.append("}")
    return L


def _vec(j: int, nb: int, tail: int | None) -> str | None:
    """Valid lanes of vector ``j`` of ``nb`` (None: all)."""
    return str(tail) if tail is not None and j == nb - 1 else None


def _xload(ptr: str, n: str | None) -> str:
    return f"kv::loadn({ptr}, {n}, 0.0f)" if n else f"kv::load({ptr})"


def _row_check(s: DwNhwcSpec) -> list[str]:
    (ih_n, _), (sh, ph, dh) = s.in_hw, (s.stride[0], s.padding[0], s.dilation[0])
    return [
        f"const int64_t ih = oh * {sh} - {ph} + u * {dh};",
        f"if (ih < 0 || ih >= {ih_n}) continue;",
    ]


def _block(s: DwNhwcSpec, nb: int, tail: int | None, lanes: int) -> list[str]:
    """``PX`` interior pixels from ``ow``: per kernel row, each window column loaded once."""
    kh, kw = s.kernel
    sw, pw, dw = s.stride[1], s.padding[1], s.dilation[1]
    cp = padded_channels(s.channels, lanes)
    sx_h, sx_w = s.x.strides[1], s.x.strides[2]
    L = []
    for p in range(PX):
        for j in range(nb):
            L.append(f"kv::V a{p}_{j} = kv::load(bias + c0 + {j * lanes});")
    L.append(f"for (int64_t u = 0; u < {kh}; ++u) {{")
    L += ["  " + line for line in _row_check(s)]
    L.append(f"  const float* xr = xn + ih * {sx_h} + (ow * {sw} - {pw}) * {sx_w} + c0;")
    L.append(f"  const float* wr = wt + u * {kw * cp} + c0;")
    for q in range((PX - 1) * sw + (kw - 1) * dw + 1):
        users = [(p, v) for p in range(PX) for v in range(kw) if p * sw + v * dw == q]
        if not users:
            continue
        L.append("  {")
        for j in range(nb):
            L.append(
                f"    const kv::V x{j} = {_xload(f'xr + {q * sx_w + j * lanes}', _vec(j, nb, tail))};"
            )
        for p, v in users:
            for j in range(nb):
                w = f"kv::load(wr + {v * cp + j * lanes})"
                L.append(f"    a{p}_{j} = kv::fma(x{j}, {w}, a{p}_{j});")
        L.append("  }")
    L.append("}")
    for p in range(PX):
        for j in range(nb):
            L.append("{")
            L += [
                "  " + x
                for x in epilogue(
                    s.epi, f"a{p}_{j}", "oh", f"(ow + {p})", j, _vec(j, nb, tail), lanes
                )
            ]
            L.append("}")
    return L


def _single(s: DwNhwcSpec, nb: int, tail: int | None, lanes: int) -> list[str]:
    """Pixel ``ow`` alone, every tap's column checked against the padding."""
    kh, kw = s.kernel
    iw_n = s.in_hw[1]
    sw, pw, dw = s.stride[1], s.padding[1], s.dilation[1]
    cp = padded_channels(s.channels, lanes)
    sx_h, sx_w = s.x.strides[1], s.x.strides[2]
    L = [f"kv::V a0_{j} = kv::load(bias + c0 + {j * lanes});" for j in range(nb)]
    L.append(f"for (int64_t u = 0; u < {kh}; ++u) {{")
    L += ["  " + line for line in _row_check(s)]
    L.append(f"  for (int64_t v = 0; v < {kw}; ++v) {{")
    L.append(f"    const int64_t iw = ow * {sw} - {pw} + v * {dw};")
    L.append(f"    if (iw < 0 || iw >= {iw_n}) continue;")
    L.append(f"    const float* xp = xn + ih * {sx_h} + iw * {sx_w} + c0;")
    L.append(f"    const float* wp = wt + (u * {kw} + v) * {cp} + c0;")
    for j in range(nb):
        x = _xload(f"xp + {j * lanes}", _vec(j, nb, tail))
        L.append(f"    a0_{j} = kv::fma({x}, kv::load(wp + {j * lanes}), a0_{j});")
    L += ["  }", "}"]
    for j in range(nb):
        L.append("{")
        L += ["  " + x for x in epilogue(s.epi, f"a0_{j}", "oh", "ow", j, _vec(j, nb, tail), lanes)]
        L.append("}")
    return L


def epilogue(
    s: NhwcEpilogue, acc: str, oh: str, ow: str, j: int, n: str | None, lanes: int
) -> list[str]:
    """Epilogue and stores of accumulator ``acc``: pixel (``oh``, ``ow``) (C++ expressions)
    of image ``n``, channel vector ``j`` from ``c0`` (``n`` valid lanes; None: all)."""
    names: dict[str, str] = {s.acc_value: acc}
    for v, lit in s.consts.items():
        names[v] = f"kv::splat({lit})"

    def index(op: Operand) -> tuple[str, int]:
        sn, sh, sw, sc = op.strides
        terms = [str(op.offset)]
        terms += [f"{var} * {st}" for var, st in (("n", sn), (oh, sh), (ow, sw)) if st]
        if sc:
            terms.append(f"(c0 + {j * lanes}) * {sc}")
        return " + ".join(terms), sc

    out = []
    for k, (v, op) in enumerate(s.ext.items()):
        idx, sc = index(op)
        expr = splat_load(op, idx) if sc == 0 else load(op, idx, sc, n)
        out.append(f"const kv::V e{k} = {expr};")
        names[v] = f"e{k}"
    for m, node in enumerate(s.nodes):
        expr = pointwise_expr(
            node, [names[i] for i in node.inputs], [s.dtypes[i] for i in node.inputs]
        )
        out.append(f"const kv::V y{m} = {expr};")
        names[node.output] = f"y{m}"
    for v, op in s.outs.items():
        idx, sc = index(op)
        out.append(store(op, idx, sc, names[v], n))
    return out
