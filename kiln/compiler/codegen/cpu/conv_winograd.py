"""Dense channels-last 3x3 stride-1 convolutions by Winograd's minimal filtering F(2x2, 3x3)
(Lavin & Gray, "Fast Algorithms for Convolutional Neural Networks", 2016), with the
``dconv`` template's fused epilogue: x (N, IH, IW, C_in), out (N, OH, OW, C_out).

Each 2x2 block of output pixels (a *tile*) is computed from the 4x4 input patch around it
as ``Y = A^T [U (.) V] A``, where ``V = B^T d B`` is the patch transformed and ``U = G g G^T``
the 3x3 filter transformed (once, at compile time). The elementwise product over the 16
transformed positions, summed over input channels, is 16 independent GEMMs
(tiles x C_in) @ (C_in x C_out): 16 multiplies per tile and channel pair where direct
convolution spends 36 (2.25x fewer), for a transform of each input patch and output tile
(additions only) and weights 16/9 the size.

A task takes a block of tiles (flat over images and tile rows) and a group of output-channel
blocks (``split``): it transforms its tiles' input patches into a per-thread scratch
``V`` (16, tiles, C_in rounded to whole vectors), then per channel block of ``PW`` columns
and per transformed position runs the register-blocked micro-kernel (``R`` tiles x the
block's vectors, as ``conv_nhwc`` does with pixels) into a scratch ``M`` (16, tiles, PW),
and transforms each tile's 16 results into its 2x2 pixels, adding the bias and running the
epilogue on each before the store. The padding is read as a zero row (or mirrored: reflect
padding); a tile past an odd output edge computes and drops its extra pixels.

The transforms use additions only (B and A hold 0 and +-1; G's halves are applied at
compile time in float64), so results differ from direct convolution by rounding alone.
Where this pays is ``fusion.convs.winograd_pays``, the rule the cost model prices with.
"""

from __future__ import annotations

import torch

from kiln.compiler.codegen.cpu.conv_spec import ConvNhwcSpec, mirror, panel_width, with_bias
from kiln.compiler.codegen.cpu.dwconv_nhwc import channel_blocks, epilogue, vector_tail

SCRATCH_SLOTS = (6, 7)  # kgen::scratch slots of V and M (row kernels 0, gemm 1-2, ...)
SCRATCH_FLOATS = 1 << 17  # V of a task at most (512 KB: within a core's L2)
FEW_TILES = 16  # tiles a thread has at most when the channels, not the tiles, are split
PREFETCH_ROWS = 16  # transformed-weight rows fetched ahead

# F(2x2, 3x3): the filter transform G (4x3); B^T and A^T are written out as additions.
_G = ((1.0, 0.0, 0.0), (0.5, 0.5, 0.5), (0.5, -0.5, 0.5), (0.0, 0.0, 1.0))


def micro_rows(lanes: int, vectors: int) -> int:
    """Tiles of a register block: accumulators within the vector registers (32 on
    AVX-512, 16 on AVX2), leaving room for the weight vectors and a broadcast."""
    if lanes == 16:
        return 12 if vectors == 2 else 16
    return 6 if vectors == 2 else 8


def block_sizes(rows: int) -> list[int]:
    """Register-block heights a task's tiles are cut into, largest first: ``rows``, then
    halves down to one (a 16-tile rest of 12-tile blocks runs as 12 + 3 + 1, not 12 ones)."""
    sizes = [rows]
    while sizes[-1] > 1:
        sizes.append(-(-sizes[-1] // 2) if sizes[-1] > 2 else 1)
    return sizes


def skewed(floats: int) -> int:
    """A stride of at least ``floats`` floats between the 16 transformed positions of a
    scratch: an odd number of cache lines, so that the 16 values of one tile (read or
    written together) lie in 16 different L1 sets; with a stride of a multiple of 4 KB
    (a power-of-two image) they would all share one set and evict each other."""
    lines = -(-floats // 16)
    return (lines + 1 - lines % 2) * 16


def split(tiles: int, padded_c_in: int, blocks: int, threads: int) -> tuple[int, int]:
    """(tile blocks, channel groups) of the parallel tasks, each task one of each, all of
    equal work: the tiles split between the threads, unless there are few of them
    (``FEW_TILES`` a thread) and the output-channel blocks divide evenly, when each
    thread takes its share of the channels over all the tiles (and streams only its part
    of the transformed weight); a tile block's ``V`` within ``SCRATCH_FLOATS``. Measured
    on this module's shapes (Intel Xeon, 2 threads): splitting the tiles ran 1.08-1.23x
    faster from 36 tiles (12x12 pixels) up, splitting the channels 1.18x at 25 tiles."""
    tblocks = max(1, -(-tiles * 16 * padded_c_in // SCRATCH_FLOATS))
    if threads <= 1:
        return tblocks, 1
    if tiles < threads * FEW_TILES and blocks % threads == 0:
        return tblocks, threads
    return -(-tblocks // threads) * threads, 1


def pack_winograd(w: torch.Tensor, bias: torch.Tensor | None, lanes: int) -> torch.Tensor:
    """w (C_out, C_in, 3, 3) [+ bias] -> flat panels (blocks, 16, C_in, PW) of ``G w G^T``,
    one per block of PW output channels (zero padded), then the bias (blocks * PW,)."""
    c_out, c_in = w.shape[:2]
    pw = panel_width(c_out, lanes)
    blocks = -(-c_out // pw)
    g = torch.tensor(_G, dtype=torch.float64)
    u = torch.einsum("ak,oikl,bl->abio", g, w.double(), g).reshape(16, c_in, c_out)
    padded = torch.zeros(16, c_in, blocks * pw, dtype=torch.float64)
    padded[..., :c_out] = u
    panels = padded.reshape(16, c_in, blocks, pw).permute(2, 0, 1, 3).reshape(-1).float()
    return with_bias(panels, bias, blocks * pw)


def emit_conv_winograd(s: ConvNhwcSpec, lanes: int, threads: int) -> list[str]:
    """The kernel body for ``lanes`` floats per vector (``kv::W``, checked at compile time)."""
    oh_n, ow_n = s.out_hw
    th, tw = -(-oh_n // 2), -(-ow_n // 2)
    tiles = s.batch * th * tw
    blocks, per, last = channel_blocks(s.c_out, lanes, 2)
    pw = per * lanes
    cp = -(-s.c_in // lanes) * lanes
    rows = micro_rows(lanes, per)
    tblocks, groups = split(tiles, cp, blocks, threads)
    tb = -(-tiles // tblocks)
    vs, ms = skewed(tb * cp), skewed(tb * pw)  # floats between positions e, e + 1
    per_group = blocks // groups
    tail_n = vector_tail(s.c_out, lanes)
    v_slot, m_slot = SCRATCH_SLOTS
    L = [
        f'static_assert(kv::W == {lanes}, "conv_winograd emitted for another vector width");',
        f"static const float zrow[{cp}] = {{}};  // the padding",
        f"const float* ut = {s.weights};",
        f"const float* bias = ut + {blocks * 16 * s.c_in * pw};",
        "auto task = [&](int64_t t0, int64_t t1) {",
        f"  float* const V = kgen::scratch({v_slot}, {16 * vs});",
        f"  float* const M = kgen::scratch({m_slot}, {16 * ms});",
        "  for (int64_t t = t0; t < t1; ++t) {",
        f"    const int64_t grp = t % {groups}, i0 = (t / {groups}) * {tb};",
        f"    const int64_t nt = std::min<int64_t>({tb}, {tiles} - i0);",
        "    for (int64_t i = 0; i < nt; ++i) {",
    ]
    L += ["      " + x for x in _input_transform(s, lanes, vs, cp, th, tw)]
    L += [
        "    }",
        f"    for (int64_t cb = grp * {per_group}; cb < (grp + 1) * {per_group}; ++cb) {{",
        f"      const int64_t c0 = cb * {pw};",
        "      for (int64_t e = 0; e < 16; ++e) {",
        f"        const float* u = ut + (cb * 16 + e) * {s.c_in * pw};",
        f"        const float* v = V + e * {vs};",
        f"        float* mo = M + e * {ms};",
        "        int64_t r = 0;",
    ]
    for size in block_sizes(rows):  # whole blocks, then the rest in smaller ones
        L.append(f"        for (; r + {size} <= nt; r += {size}) {{")
        L += ["          " + x for x in _micro(s.c_in, cp, pw, size, per, lanes)]
        L.append("        }")
    L += ["      }", "      for (int64_t i = 0; i < nt; ++i) {"]
    if last == per and tail_n is None:
        L += ["        " + x for x in _output_transform(s, lanes, ms, pw, th, tw, per, None)]
    else:
        L.append(f"        if (cb < {blocks - 1}) {{")
        L += ["          " + x for x in _output_transform(s, lanes, ms, pw, th, tw, per, None)]
        L.append("        } else {")
        L += ["          " + x for x in _output_transform(s, lanes, ms, pw, th, tw, last, tail_n)]
        L.append("        }")
    L += ["      }", "    }", "  }", "};", f"kiln::parallel(rt, {tblocks * groups}, 1, task);"]
    return L


def _tile_origin(th: int, tw: int) -> list[str]:
    """``n``, ``ty``, ``tx`` of tile ``i0 + i``."""
    return [
        f"const int64_t ii = i0 + i, n = ii / {th * tw}, ty = ii / {tw} % {th}, tx = ii % {tw};"
    ]


def _input_transform(s: ConvNhwcSpec, lanes: int, vs: int, cp: int, th: int, tw: int) -> list[str]:
    """``V[e][i][:] = (B^T d B)[e]`` of tile ``i``'s 4x4 input patch ``d``, a channel vector
    at a time: rows of the patch in the padding read the zero row (or the mirrored row)."""
    (ih_n, iw_n), (ph, pw) = s.in_hw, s.padding
    sx_n, sx_h, sx_w = s.x.strides[:3]
    L = _tile_origin(th, tw)
    L.append(f"const float* xn = {s.x.ptr} + {s.x.offset} + n * {sx_n};")
    for a in range(4):
        L.append(f"int64_t h{a} = ty * 2 - {ph} + {a};")
        if s.reflect:
            L.append(f"h{a} = {mirror(f'h{a}', ih_n)};")
    for b in range(4):
        L.append(f"int64_t w{b} = tx * 2 - {pw} + {b};")
        if s.reflect:
            L.append(f"w{b} = {mirror(f'w{b}', iw_n)};")
    for a in range(4):
        for b in range(4):
            inside = f"h{a} >= 0 && h{a} < {ih_n} && w{b} >= 0 && w{b} < {iw_n}"
            L.append(
                f"const float* p{a}{b} = {inside} ? xn + h{a} * {sx_h} + w{b} * {sx_w} : zrow;"
            )
    L.append(f"float* vo = V + i * {cp};")
    L.append(f"for (int64_t c = 0; c < {cp}; c += {lanes}) {{")
    ragged = s.c_in % lanes != 0
    if ragged:
        L.append(f"  const int nc = (int)std::min<int64_t>({lanes}, {s.c_in} - c);")
    for a in range(4):
        for b in range(4):
            load = f"kv::loadn(p{a}{b} + c, nc, 0.0f)" if ragged else f"kv::load(p{a}{b} + c)"
            L.append(f"  const kv::V d{a}{b} = {load};")
    for b in range(4):  # B^T d: along the patch's rows
        L += [
            f"  const kv::V t0{b} = d0{b} - d2{b}, t1{b} = d1{b} + d2{b};",
            f"  const kv::V t2{b} = d2{b} - d1{b}, t3{b} = d1{b} - d3{b};",
        ]
    for a in range(4):  # (B^T d) B: along its columns
        outs = (f"t{a}0 - t{a}2", f"t{a}1 + t{a}2", f"t{a}2 - t{a}1", f"t{a}1 - t{a}3")
        for b, expr in enumerate(outs):
            L.append(f"  kv::store(vo + {(4 * a + b) * vs} + c, {expr});")
    L.append("}")
    return L


def _micro(c_in: int, cp: int, pw: int, rows: int, vectors: int, lanes: int) -> list[str]:
    """``M[e][r + p][:]`` for ``rows`` tiles from ``r``: their transformed inputs (rows of
    ``v``) times the transformed weight panel ``u`` (C_in x PW), over every input channel."""
    L = [f"const float* vr = v + r * {cp};"]
    L += [f"kv::V a{p}_{j} = kv::splat(0.0f);" for p in range(rows) for j in range(vectors)]
    L.append(f"for (int64_t ci = 0; ci < {c_in}; ++ci) {{")
    for line in range(0, vectors * lanes * 4, 64):
        L.append(f"  __builtin_prefetch(u + (ci + {PREFETCH_ROWS}) * {pw} + {line // 4}, 0, 3);")
    L += [f"  const kv::V w{j} = kv::load(u + ci * {pw} + {j * lanes});" for j in range(vectors)]
    for p in range(rows):
        L.append(f"  {{ const kv::V b = kv::splat(vr[{p * cp} + ci]);")
        L += [f"    a{p}_{j} = kv::fma(b, w{j}, a{p}_{j});" for j in range(vectors)]
        L.append("  }")
    L.append("}")
    L += [
        f"kv::store(mo + (r + {p}) * {pw} + {j * lanes}, a{p}_{j});"
        for p in range(rows)
        for j in range(vectors)
    ]
    return L


def _output_transform(
    s: ConvNhwcSpec, lanes: int, ms: int, pw: int, th: int, tw: int, vectors: int,
    tail: int | None,
) -> list[str]:  # fmt: skip
    """Tile ``i``'s 2x2 pixels ``A^T m A + bias`` per channel vector, each through the
    epilogue (pixels past an odd output edge dropped)."""
    oh_n, ow_n = s.out_hw
    L = _tile_origin(th, tw)
    for j in range(vectors):
        L.append("{")
        for a in range(4):
            for b in range(4):
                at = f"M + {(4 * a + b) * ms} + i * {pw} + {j * lanes}"
                L.append(f"  const kv::V m{a}{b} = kv::load({at});")
        for b in range(4):  # A^T m: along rows
            L.append(f"  const kv::V s0{b} = m0{b} + m1{b} + m2{b}, s1{b} = m1{b} - m2{b} - m3{b};")
        L.append(f"  const kv::V bj = kv::load(bias + c0 + {j * lanes});")
        for dy in range(2):  # (A^T m) A: along columns
            L.append(f"  const kv::V q{dy}0 = s{dy}0 + s{dy}1 + s{dy}2 + bj;")
            L.append(f"  const kv::V q{dy}1 = s{dy}1 - s{dy}2 - s{dy}3 + bj;")
        n = str(tail) if tail is not None and j == vectors - 1 else None
        for dy in range(2):
            for dx in range(2):
                guard = []
                if dy and oh_n % 2:
                    guard.append(f"ty * 2 + 1 < {oh_n}")
                if dx and ow_n % 2:
                    guard.append(f"tx * 2 + 1 < {ow_n}")
                L.append(f"  if ({' && '.join(guard)}) {{" if guard else "  {")
                L.append(f"    const int64_t oh = ty * 2 + {dy}, ow = tx * 2 + {dx};")
                L += ["    " + x for x in epilogue(s.epi, f"q{dy}{dx}", "oh", "ow", j, n, lanes)]
                L.append("  }")
        L.append("}")
    return L
