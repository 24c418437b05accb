"""Dense channels-last 1-D/2-D convolutions (one group) as direct implicit GEMMs, with
a fused pointwise epilogue (the ``dconv`` template): x (N, IH, IW, C_in), out (N, OH, OW,
C_out) (1-D: IH = OH = KH = 1).

Each output pixel is a row of a GEMM whose K runs over the taps and, within a tap,
over the input channels, which are contiguous in an NHWC image: the row's "A" data is
KH * KW contiguous runs of C_in floats, read in place (no im2col buffer). The weight
is packed once at compile time into one panel per block of ``CB`` output-channel
vectors, tap-major, (KH, KW, C_in, CB * W) contiguous, so a K step is one row of ``CB``
weight vectors and a task streams its panel linearly. A register block holds
``PX`` pixels of one output row x ``CB`` output-channel vectors (``row_pixels``: 4 to 8
pixels, the size that divides the row best): per K step, ``CB`` weight loads, ``PX``
broadcasts of input channels, ``PX * CB`` FMAs. A block whose every tap lies inside the
image reads pixel p's channels at a fixed offset from one pointer per tap; a border block
(on one output row too) skips kernel rows in zero padding and reads a tap whose columns
all lie inside at fixed offsets as well, the others through one pointer per pixel: a zero
row in the padding (or, padded by reflection, the mirrored pixel). Tasks are (image,
whole output rows, output-channel block), run in parallel; a row's pixels past its last
full block run one at a time. This is what the stem of a CNN wants (3 input channels,
read in place from the NCHW image, where oneDNN's NHWC call runs at a fraction of its
usual rate); oneDNN stays the other choice for every dense conv, and the cost model picks.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from kiln.compiler.codegen.cpu.conv_narrow import emit_conv_narrow, is_narrow, pack_narrow
from kiln.compiler.codegen.cpu.conv_spec import (
    ConvNhwcSpec,
    interior,
    mirror,
    panel_width,
    pixel_chunks,
    with_bias,
)
from kiln.compiler.codegen.cpu.conv_winograd import emit_conv_winograd, pack_winograd
from kiln.compiler.codegen.cpu.dwconv import KernelState, as_2d, nhwc_4d, nhwc_epilogue
from kiln.compiler.codegen.cpu.dwconv_nhwc import (
    channel_blocks,
    epilogue,
    vector_tail,
)
from kiln.compiler.fusion.convs import is_dense_nhwc_conv, winograd_ok, zero_padded
from kiln.compiler.fusion.program import Kernel
from kiln.compiler.ir.graph import Node

MIN_TASK_FMAS = 1 << 12  # vector FMAs a parallel chunk holds at least
PREFETCH_ROWS = 16  # weight rows (K steps) fetched ahead


def pack_weights(w: torch.Tensor, bias: torch.Tensor | None, lanes: int) -> torch.Tensor:
    """w (C_out, C_in, KH, KW) [+ bias] -> flat panels (blocks, KH * KW * C_in, PW), one per
    block of PW output channels (zero padded), then the bias (blocks * PW,): a task streams
    one contiguous panel."""
    c_out = w.shape[0]
    pw = panel_width(c_out, lanes)
    blocks = -(-c_out // pw)
    rows = w.float().permute(2, 3, 1, 0).reshape(-1, c_out)  # (KH * KW * C_in, C_out)
    padded = torch.zeros(rows.shape[0], blocks * pw)
    padded[:, :c_out] = rows
    panels = padded.reshape(-1, blocks, pw).permute(1, 0, 2).reshape(-1)
    return with_bias(panels, bias, blocks * pw)


def emit_conv_nhwc(s: ConvNhwcSpec, lanes: int, threads: int) -> list[str]:
    """The kernel body for ``lanes`` floats per vector (``kv::W``, checked at compile time)."""
    oh_n, ow_n = s.out_hw
    kh, kw = s.kernel
    blocks, per, last = channel_blocks(s.c_out, lanes, 2)
    tail_n = vector_tail(s.c_out, lanes)
    granule = ow_n  # tasks hold whole output rows (``_pixels`` runs row by row)
    pixels = oh_n * ow_n
    chunk = pixel_chunks(pixels, granule, s.batch * blocks, threads)
    chunks = -(-pixels // chunk)
    tasks = s.batch * blocks * chunks
    task_fmas = chunk * kh * kw * s.c_in * per
    grain = tasks if threads <= 1 else max(1, -(-MIN_TASK_FMAS // task_fmas))
    x = s.x
    L = [
        f'static_assert(kv::W == {lanes}, "conv_nhwc emitted for another vector width");',
        f"static const float zrow[{s.c_in}] = {{}};  // the padding",
        f"const float* wt = {s.weights};",
        f"const float* bias = wt + {kh * kw * s.c_in * blocks * per * lanes};",
        "auto task = [&](int64_t t0, int64_t t1) {",
        "  for (int64_t t = t0; t < t1; ++t) {",
        f"    const int64_t q = t % {chunks}, r = t / {chunks};",  # chunk fastest: shares weights
        f"    const int64_t cb = r % {blocks}, n = r / {blocks};",
        f"    const int64_t c0 = cb * {per * lanes};",
        f"    const int64_t m0 = q * {chunk}, m1 = std::min<int64_t>(m0 + {chunk}, {pixels});",
        f"    const float* xn = {x.ptr} + {x.offset} + n * {x.strides[0]};",
    ]
    if last == per and tail_n is None:
        L += ["    " + line for line in _pixels(s, per, None, lanes)]
    else:
        L.append(f"    if (cb < {blocks - 1}) {{")
        L += ["      " + line for line in _pixels(s, per, None, lanes)]
        L.append("    } else {")
        L += ["      " + line for line in _pixels(s, last, tail_n, lanes)]
        L.append("    }")
    L += ["  }", "};", f"kiln::parallel(rt, {tasks}, {grain}, task);"]
    return L


def row_pixels(out_w: int, lanes: int, vectors: int) -> int:
    """Pixels of a block that stays on one output row: the size (4 .. 8 on AVX-512, fewer
    on AVX2 with two channel vectors, within the accumulator registers) that leaves the
    fewest pixels of a row over, the larger on a tie."""
    most = min(8, (16 if lanes == 16 else 8) // vectors)
    sizes = [n for n in range(min(4, most), most + 1) if n <= out_w] or [1]
    return min(sizes, key=lambda n: (out_w % n, -n))


def _pixels(s: ConvNhwcSpec, nb: int, tail: int | None, lanes: int) -> list[str]:
    """Output pixels [m0, m1) (flat over the image), row by row in blocks that stay on one
    row: a block whose every tap lies inside the image (``interior``) reads its inputs at
    fixed offsets from one pointer per tap, a border block takes a pointer per pixel and
    tap, a row's last pixels run one at a time."""
    px, ow_n = row_pixels(s.out_hw[1], lanes, nb), s.out_hw[1]
    L = [
        "int64_t m = m0;",
        "while (m < m1) {",
        f"  const int64_t row_end = std::min<int64_t>(m1, (m / {ow_n} + 1) * {ow_n});",
        f"  for (; m + {px} <= row_end; m += {px}) {{",
        f"    if ({interior(s, px)}) {{",
    ]
    L += ["      " + line for line in _interior_block(s, px, nb, tail, lanes)]
    L += ["    } else {"] + ["      " + line for line in _block(s, px, nb, tail, lanes)]
    L += ["    }", "  }", "  for (; m < row_end; ++m) {"]
    L += ["    " + line for line in _block(s, 1, nb, tail, lanes)]
    L += ["  }", "}"]
    return L


def _interior_block(s: ConvNhwcSpec, npx: int, nb: int, tail: int | None, lanes: int) -> list[str]:
    """Pixels m .. m + npx - 1 of one output row, every tap inside the image: pixel p of
    tap (u, v) reads channel ci at ``xr + p * stride_w * sx_w + ci * sx_c`` (an NCHW
    image read in place has strided channels)."""
    (kh, kw), ow_n = s.kernel, s.out_hw[1]
    (sh, sw), (ph, pw), (dh, dw) = s.stride, s.padding, s.dilation
    sx_h, sx_w, sx_c = s.x.strides[1], s.x.strides[2], s.x.strides[3]
    at = "ci" if sx_c == 1 else f"ci * {sx_c}"
    L = [f"const int64_t oh = m / {ow_n}, ow = m % {ow_n};"]
    L += [f"const int64_t oh{p} = oh, ow{p} = ow + {p};" for p in range(npx)]
    L.append(f"const float* xb = xn + (oh * {sh} - {ph}) * {sx_h} + (ow * {sw} - {pw}) * {sx_w};")
    L += _accumulators(npx, nb, lanes)
    L.append(f"for (int64_t u = 0; u < {kh}; ++u) {{")
    L.append(f"  for (int64_t v = 0; v < {kw}; ++v) {{")
    L.append(f"    const float* xr = xb + u * {dh * sx_h} + v * {dw * sx_w};")
    L += _k_steps(s, npx, nb, lanes, lambda p: f"xr[{p * sw * sx_w} + {at}]")
    L += ["  }", "}"]
    return L + _stores(s, npx, nb, tail, lanes)


def _accumulators(npx: int, nb: int, lanes: int) -> list[str]:
    """a{p}_{j}: pixel p's sums for channel vector j, started at the bias."""
    return [
        f"kv::V a{p}_{j} = kv::load(bias + c0 + {j * lanes});"
        for p in range(npx)
        for j in range(nb)
    ]


def _k_steps(
    s: ConvNhwcSpec, npx: int, nb: int, lanes: int, x_at: Callable[[int], str]
) -> list[str]:
    """One tap (u, v): its C_in steps, each a row of ``nb`` weight vectors times pixel p's
    input channel ``x_at(p)`` (a C++ float expression of ``ci``)."""
    (kh, kw), pw_ = s.kernel, panel_width(s.c_out, lanes)
    L = [
        f"    const float* wr = wt + cb * {kh * kw * s.c_in * pw_} + (u * {kw} + v) * {s.c_in * pw_};"
    ]
    L.append(f"    for (int64_t ci = 0; ci < {s.c_in}; ++ci) {{")
    for line in range(0, nb * lanes * 4, 64):  # the panel streams: fetch ahead of use
        L.append(
            f"      __builtin_prefetch(wr + (ci + {PREFETCH_ROWS}) * {pw_} + {line // 4}, 0, 3);"
        )
    for j in range(nb):
        L.append(f"      const kv::V w{j} = kv::load(wr + ci * {pw_} + {j * lanes});")
    for p in range(npx):
        L.append(f"      {{ const kv::V b = kv::splat({x_at(p)});")
        for j in range(nb):
            L.append(f"        a{p}_{j} = kv::fma(b, w{j}, a{p}_{j});")
        L.append("      }")
    return L + ["    }"]


def _block(s: ConvNhwcSpec, npx: int, nb: int, tail: int | None, lanes: int) -> list[str]:
    """Pixels m .. m + npx - 1 of one output row x ``nb`` output-channel vectors from
    ``c0``, some tap reading the padding. A kernel row wholly in zero padding adds nothing
    and is skipped (with reflect padding the mirrored row is read); per tap, the pixels
    read at fixed offsets when their columns all lie inside the image (as interior blocks
    do), else through a pointer each: the zero row, or the mirrored pixel."""
    (ih_n, iw_n), (kh, kw), ow_n = s.in_hw, s.kernel, s.out_hw[1]
    (sh, sw), (ph, pw), (dh, dw) = s.stride, s.padding, s.dilation
    sx_h, sx_w, sx_c = s.x.strides[1], s.x.strides[2], s.x.strides[3]
    at = "ci" if sx_c == 1 else f"ci * {sx_c}"
    L = [f"const int64_t oh = m / {ow_n}, ow = m % {ow_n};"]
    L += [f"const int64_t oh{p} = oh, ow{p} = ow + {p};" for p in range(npx)]
    L += _accumulators(npx, nb, lanes)
    L.append(f"for (int64_t u = 0; u < {kh}; ++u) {{")
    L.append(f"  int64_t ih = oh * {sh} - {ph} + u * {dh};")
    if s.reflect:
        L.append(f"  ih = {mirror('ih', ih_n)};")
    else:
        L.append(f"  if (ih < 0 || ih >= {ih_n}) continue;  // a row of zeros adds nothing")
    L.append(f"  const float* xh = xn + ih * {sx_h};")
    L.append(f"  for (int64_t v = 0; v < {kw}; ++v) {{")
    L.append(f"    const int64_t iw = ow * {sw} - {pw} + v * {dw};")
    L.append(f"    if (iw >= 0 && iw + {(npx - 1) * sw} < {iw_n}) {{")
    L.append(f"      const float* xr = xh + iw * {sx_w};")
    L += ["  " + x for x in _k_steps(s, npx, nb, lanes, lambda p: f"xr[{p * sw * sx_w} + {at}]")]
    L.append("    } else {")
    for p in range(npx):
        col = f"iw + {p * sw}"
        if s.reflect:
            L.append(f"      const float* x{p} = xh + {mirror(col, iw_n)} * {sx_w};")
        else:
            L.append(f"      const bool in{p} = {col} >= 0 && {col} < {iw_n};")
            L.append(f"      const float* x{p} = in{p} ? xh + ({col}) * {sx_w} : zrow;")
            if sx_c != 1:  # strided channels (an NCHW image read in place): not the zero row
                L.append(f"      const int64_t s{p} = in{p} ? {sx_c} : 0;")

    def channel(p: int) -> str:  # pixel p's input channel ci
        if sx_c == 1:
            return f"x{p}[ci]"
        return f"x{p}[ci * {sx_c}]" if s.reflect else f"x{p}[ci * s{p}]"

    L += ["  " + x for x in _k_steps(s, npx, nb, lanes, channel)]
    L += ["    }", "  }", "}"]
    return L + _stores(s, npx, nb, tail, lanes)


def _stores(s: ConvNhwcSpec, npx: int, nb: int, tail: int | None, lanes: int) -> list[str]:
    """The epilogue of each accumulator a{p}_{j} (pixel p at oh{p}, ow{p})."""
    L = []
    for p in range(npx):
        for j in range(nb):
            n = str(tail) if tail is not None and j == nb - 1 else None
            L.append("{")
            L += ["  " + x for x in epilogue(s.epi, f"a{p}_{j}", f"oh{p}", f"ow{p}", j, n, lanes)]
            L.append("}")
    return L


def conv_nhwc_kernel(gen: KernelState, k: Kernel, nodes: list[Node]) -> list[str]:
    """Lower a ``dconv`` kernel (a dense channels-last conv, then its epilogue), or a
    ``wconv`` one (the same by Winograd's F(2x2, 3x3))."""
    g, conv = gen.g, nodes[0]
    if not is_dense_nhwc_conv(g, conv):
        raise ValueError("a dconv kernel must start with a dense channels-last conv")
    out_shape = g.meta(conv.output).shape  # (N, *spatial', C_out)
    x_shape = g.meta(conv.inputs[0]).shape  # (N, *spatial, C_in)
    lanes = gen.nr // 2
    x = nhwc_4d(gen.operand(conv.inputs[0], x_shape))  # any channel stride: read as scalars
    w_name, b_name = conv.inputs[1], conv.inputs[2] if len(conv.inputs) > 2 else None

    narrow = is_narrow(x_shape[-1], out_shape[-1], lanes, x.strides[3])
    a = conv.attrs
    winograd = k.template == "wconv"
    if winograd and not winograd_ok(g, conv):
        raise ValueError("a wconv kernel must be a conv fusion.convs.winograd_ok accepts")
    form, pack = (
        ("conv_narrow", pack_narrow)
        if narrow
        else ("conv_winograd", pack_winograd)
        if winograd
        else ("conv_nhwc", pack_weights)
    )

    def packed() -> torch.Tensor:
        w = g.constants[w_name]
        bias = g.constants[b_name] if b_name is not None else None
        return pack(w if w.dim() == 4 else w.unsqueeze(2), bias, lanes)

    spec = ConvNhwcSpec(
        batch=out_shape[0],
        c_in=x_shape[-1],
        c_out=out_shape[-1],
        in_hw=as_2d(x_shape[1:-1], 1),
        out_hw=as_2d(out_shape[1:-1], 1),
        kernel=as_2d(g.meta(w_name).shape[2:], 1),
        stride=as_2d(a["stride"], 1),
        padding=as_2d(a["padding"], 0),
        dilation=as_2d(a["dilation"], 1),
        x=x,
        weights=gen.prepared_param((form, w_name, b_name, lanes), packed),
        epi=nhwc_epilogue(gen, k, nodes),
        reflect=not zero_padded(conv),
    )
    if narrow:  # few output channels: vectorised along the input channels
        return emit_conv_narrow(spec, lanes, gen.threads)
    if winograd:
        return emit_conv_winograd(spec, lanes, gen.threads)
    return emit_conv_nhwc(spec, lanes, gen.threads)
