"""What the dense channels-last conv kernels (``conv_nhwc``, ``conv_narrow``) share: the
conv's shape and operands, how output pixels are split into parallel tasks, when a
block of pixels on one output row reads no padding, and how a padded coordinate is
mirrored (reflect padding)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kiln.compiler.codegen.cpu.dwconv_nhwc import NhwcEpilogue, channel_blocks
from kiln.compiler.codegen.cpu.emit import Operand

TASK_PIXELS = 48  # output pixels a task holds at least (each task streams its weights)


@dataclass(frozen=True)
class ConvNhwcSpec:
    """A dense channels-last conv as a kernel sees it (1-D: height 1)."""

    batch: int
    c_in: int
    c_out: int
    in_hw: tuple[int, int]
    out_hw: tuple[int, int]
    kernel: tuple[int, int]
    stride: tuple[int, int]
    padding: tuple[int, int]
    dilation: tuple[int, int]
    x: Operand  # strides (n, h, w, c)
    weights: str  # C++ pointer to the packed weight, then the biases
    epi: NhwcEpilogue
    reflect: bool = False  # the padding mirrors the border (F.pad's "reflect"), not zeros


def panel_width(c_out: int, lanes: int) -> int:
    """Output channels per block (a whole number of vectors, at most two)."""
    return channel_blocks(c_out, lanes, 2)[1] * lanes


def with_bias(panels: torch.Tensor, bias: torch.Tensor | None, padded_out: int) -> torch.Tensor:
    """Packed weight panels (flat), then the bias zero padded to ``padded_out`` channels
    (zeros without one): the layout the conv kernels read ``bias`` from."""
    b = torch.zeros(padded_out)
    if bias is not None:
        b[: bias.numel()] = bias.float().reshape(-1)
    return torch.cat([panels.reshape(-1).float(), b]).contiguous()


def pixel_chunks(pixels: int, px: int, tasks: int, threads: int) -> int:
    """Pixels per task (a multiple of ``px``: a row): the image's pixels split so that
    there are about 4 tasks per thread when the ``tasks`` (image, channel block) pairs are
    fewer, each at least ``TASK_PIXELS``."""
    want = -(-4 * threads // tasks) if threads > 1 else 1
    chunk = max(-(-pixels // want), TASK_PIXELS)
    return min(-(-chunk // px) * px, -(-pixels // px) * px)


def interior(s: ConvNhwcSpec, px: int) -> str:
    """C++ condition: pixels m .. m + px - 1 (on one output row) read no padding."""
    (ih_n, iw_n), (kh, kw), ow_n = s.in_hw, s.kernel, s.out_hw[1]
    (sh, sw), (ph, pw), (dh, dw) = s.stride, s.padding, s.dilation
    oh, ow = f"(m / {ow_n})", f"(m % {ow_n})"
    return (
        f"{oh} * {sh} >= {ph} && "
        f"{oh} * {sh} - {ph} + {(kh - 1) * dh} < {ih_n} && {ow} * {sw} >= {pw} && "
        f"({ow} + {px - 1}) * {sw} - {pw} + {(kw - 1) * dw} < {iw_n}"
    )


def mirror(i: str, n: int) -> str:
    """C++: padded coordinate ``i`` (an expression) of a dim of ``n`` mirrored into [0, n)."""
    i = f"({i})"
    return f"({i} < 0 ? -{i} : ({i} >= {n} ? {2 * (n - 1)} - {i} : {i}))"
