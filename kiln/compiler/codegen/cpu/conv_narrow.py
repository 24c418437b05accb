"""Dense channels-last convs with few output channels (``dconv`` when C_out <= 4, such
as the layer that turns features back into an RGB image): vectorised along the *input*
channels. The ``conv_nhwc`` kernel puts output channels in the vector lanes, so a
3-channel output uses 3 of 16 lanes and runs at a fifth of its rate (style transfer's
9x9 32 -> 3 conv over 72x72: 2.1 ms, and oneDNN's call 2.0-2.8 ms).

Here each (pixel, output channel) pair accumulates a vector over the input channels,
which are contiguous in an NHWC image: per tap and per vector of C_in, ``C_out`` weight
loads, one input load per pixel, ``PX * C_out`` FMAs; at the end each accumulator is
summed across its lanes (``kv::hsum``), the bias added, and the pixel's C_out values
go through the fused epilogue as one partial vector. The weight is packed once as
(C_out, KH, KW, C_in). Pixels are walked row by row in blocks of ``PX`` on one row, as
in ``conv_nhwc``: a block whose taps all lie inside the image reads at fixed offsets,
a border block with a pointer per pixel and tap (a zero row in zero padding, the mirrored
pixel in reflect padding; a kernel row wholly in zero padding is skipped).
x (N, IH, IW, C_in) with C_in a whole number of vectors, out (N, OH, OW, C_out).
"""

from __future__ import annotations

import torch

from kiln.compiler.codegen.cpu.conv_spec import ConvNhwcSpec, interior, mirror, pixel_chunks
from kiln.compiler.codegen.cpu.dwconv_nhwc import epilogue
from kiln.compiler.fusion.convs import is_narrow_conv

ACCUMULATORS = 12  # PX * C_out sums held in vector registers


def is_narrow(c_in: int, c_out: int, lanes: int, channel_stride: int) -> bool:
    """Whether the narrow kernel runs this conv: ``is_narrow_conv`` (the rule the cost
    model prices by), over contiguous input channels."""
    return is_narrow_conv(c_in, c_out, lanes) and channel_stride == 1


def pack_narrow(w: torch.Tensor, bias: torch.Tensor | None, lanes: int) -> torch.Tensor:
    """w (C_out, C_in, KH, KW) [+ bias] -> (C_out, KH, KW, C_in) flat, then the bias
    padded to one vector."""
    b = torch.zeros(lanes)
    if bias is not None:
        b[: w.shape[0]] = bias.float().reshape(-1)
    return torch.cat([w.float().permute(0, 2, 3, 1).reshape(-1), b]).contiguous()


def emit_conv_narrow(s: ConvNhwcSpec, lanes: int, threads: int) -> list[str]:
    """The kernel body (``s.weights`` points at ``pack_narrow``'s tensor)."""
    oh_n, ow_n = s.out_hw
    kh, kw = s.kernel
    px = max(1, min(8, ACCUMULATORS // s.c_out))
    pixels = oh_n * ow_n
    chunk = pixel_chunks(pixels, ow_n, s.batch, threads)
    chunks = -(-pixels // chunk)
    tasks = s.batch * chunks
    x = s.x
    L = [
        f'static_assert(kv::W == {lanes}, "conv_narrow emitted for another vector width");',
        f"static const float zrow[{s.c_in}] = {{}};  // the padding",
        f"const float* wt = {s.weights};",
        f"const float* bias = wt + {s.c_out * kh * kw * s.c_in};",
        "auto task = [&](int64_t t0, int64_t t1) {",
        "  for (int64_t t = t0; t < t1; ++t) {",
        f"    const int64_t q = t % {chunks}, n = t / {chunks};",
        "    const int64_t c0 = 0;  // every output channel in one partial vector",
        f"    const int64_t m0 = q * {chunk}, m1 = std::min<int64_t>(m0 + {chunk}, {pixels});",
        f"    const float* xn = {x.ptr} + {x.offset} + n * {x.strides[0]};",
        "    int64_t m = m0;",
        "    while (m < m1) {",
        f"      const int64_t row_end = std::min<int64_t>(m1, (m / {ow_n} + 1) * {ow_n});",
        f"      for (; m + {px} <= row_end; m += {px}) {{",
        f"        if ({interior(s, px)}) {{",
    ]
    L += ["          " + line for line in _block(s, px, lanes, fast=True)]
    L += ["        } else {"]
    L += ["          " + line for line in _block(s, px, lanes, fast=False)]
    L += ["        }", "      }", "      for (; m < row_end; ++m) {"]
    L += ["        " + line for line in _block(s, 1, lanes, fast=False)]
    L += ["      }", "    }", "  }", "};", f"kiln::parallel(rt, {tasks}, 1, task);"]
    return L


def _block(s: ConvNhwcSpec, npx: int, lanes: int, fast: bool) -> list[str]:
    """Pixels m .. m + npx - 1 (on one output row when ``fast``), every output channel."""
    (ih_n, iw_n), (kh, kw), ow_n = s.in_hw, s.kernel, s.out_hw[1]
    (sh, sw), (ph, pw), (dh, dw) = s.stride, s.padding, s.dilation
    sx_h, sx_w = s.x.strides[1], s.x.strides[2]
    L = []
    for p in range(npx):
        L.append(f"const int64_t oh{p} = (m + {p}) / {ow_n}, ow{p} = (m + {p}) % {ow_n};")
    L += [f"kv::V a{p}_{o} = kv::splat(0.0f);" for p in range(npx) for o in range(s.c_out)]
    L.append(f"for (int64_t u = 0; u < {kh}; ++u) {{")
    L.append(f"  int64_t ih = oh0 * {sh} - {ph} + u * {dh};  // the block is on one row")
    if not fast and s.reflect:
        L.append(f"  ih = {mirror('ih', ih_n)};")
    elif not fast:
        L.append(f"  if (ih < 0 || ih >= {ih_n}) continue;  // a row of zeros adds nothing")
    L.append(f"  const float* xh = xn + ih * {sx_h};")
    L.append(f"  for (int64_t v = 0; v < {kw}; ++v) {{")
    L.append(f"    const int64_t iw = ow0 * {sw} - {pw} + v * {dw};")
    for p in range(npx):
        col = f"iw + {p * sw}"
        if fast:
            at = f"xh + ({col}) * {sx_w}"
        elif s.reflect:
            at = f"xh + {mirror(col, iw_n)} * {sx_w}"
        else:
            at = f"({col} >= 0 && {col} < {iw_n}) ? xh + ({col}) * {sx_w} : zrow"
        L.append(f"    const float* x{p} = {at};")
    L.append(f"    const float* wr = wt + (u * {kw} + v) * {s.c_in};")
    L.append(f"    for (int64_t c = 0; c < {s.c_in}; c += {lanes}) {{")
    for o in range(s.c_out):
        L.append(f"      const kv::V w{o} = kv::load(wr + {o * kh * kw * s.c_in} + c);")
    for p in range(npx):
        L.append(f"      {{ const kv::V b = kv::load(x{p} + c);")
        L += [f"        a{p}_{o} = kv::fma(b, w{o}, a{p}_{o});" for o in range(s.c_out)]
        L.append("      }")
    L += ["    }", "  }", "}"]
    for p in range(npx):
        L.append("{")
        L.append(f"  alignas(64) float o{p}[{lanes}] = {{}};")
        L += [f"  o{p}[{o}] = kv::hsum(a{p}_{o}) + bias[{o}];" for o in range(s.c_out)]
        L.append(f"  const kv::V r{p} = kv::load(o{p});")
        L += [
            "  " + x for x in epilogue(s.epi, f"r{p}", f"oh{p}", f"ow{p}", 0, str(s.c_out), lanes)
        ]
        L.append("}")
    return L
