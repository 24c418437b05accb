"""INT8 / INT4 weights repacked for kiln's CPU kernels, made once and shared.

kiln's weight-only kernels (``woq.h``) read weights in panels of W output channels (W: the
SIMD lanes): INT8 as int8 (P, K, W) with the scales padded to P * W; INT4 as one record per
panel and group (fp16 scales, fp16 offsets, then the nibbles). Two users run them: the
eager layer's kernel (``woq.cpu_int8_kernel``: prefill and eager decode) and the C++ decode
step (``kiln.llm.native.step``). Each repacking its own copy held the weights three times
(the layer's, the kernel's, the step's: 7.2 GB for a 1.5B INT8 model that stores 2.2), so
``int8_panels`` / ``int4_panels`` return one shared copy per source tensor while anyone
holds it (weak references: the copy goes with its last user), and make it in huge pages
(``kiln.core.huge_pages``), where a step streams it with fewer TLB misses.

A source modified in place (its version counter moved) is repacked again.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable

import torch
from torch import Tensor

from kiln.core.huge_pages import huge_page_empty

# (kind, id(source)) -> (source, its version, what else keys the copy, weak copies)
_SHARED: dict[tuple[str, int], tuple[weakref.ref[Tensor], int, tuple[int, ...], tuple]] = {}


def _pad_rows(t: Tensor, rows: int) -> Tensor:
    out = torch.zeros((rows, *t.shape[1:]), dtype=t.dtype)
    out[: t.shape[0]] = t
    return out


def _in_huge_pages(t: Tensor) -> Tensor:
    out = huge_page_empty(t.shape, t.dtype)
    out.copy_(t)
    return out


def panels_int8(qweight: Tensor, lanes: int) -> Tensor:
    """qweight int8 (N, K) -> panels int8 (ceil(N / lanes), K, lanes), zero-padded."""
    n, k = qweight.shape
    panels = -(-n // lanes)
    q = _pad_rows(qweight, panels * lanes).view(panels, lanes, k)
    return q.transpose(1, 2).contiguous()  # (P, K, W)


def panels_int4(
    packed: Tensor, scale: Tensor, offset: Tensor, group_size: int, lanes: int
) -> Tensor:
    """The INT4 format -> per-panel group records uint8 (P, G, 4W + gW/2) (see woq.h)."""
    n, k = packed.shape[0], 2 * packed.shape[1]
    panels, groups, half = -(-n // lanes), k // group_size, group_size // 2
    nib = _pad_rows(packed, panels * lanes).view(panels, lanes, groups, half)
    nib = nib.permute(0, 2, 3, 1).reshape(panels, groups, half * lanes)  # (P, G, g/2 * W)

    def halves(t: Tensor) -> Tensor:  # (N, G) fp16 -> (P, G, 2W) bytes
        t = _pad_rows(t, panels * lanes).view(panels, lanes, groups).transpose(1, 2)
        return t.contiguous().view(torch.uint8)

    return torch.cat((halves(scale), halves(offset), nib), dim=2).contiguous()


def _shared(
    kind: str, source: Tensor, extra: tuple[int, ...], make: Callable[[], tuple[Tensor, ...]]
) -> tuple[Tensor, ...]:
    """The live copy made from ``source`` (same version, same ``extra``), else a new one."""
    key = (kind, id(source))
    entry = _SHARED.get(key)
    if entry is not None:
        src, version, was, refs = entry
        copies = tuple(r() for r in refs)
        fresh = src() is source and version == source._version and was == extra
        if fresh and all(c is not None for c in copies):
            return copies  # type: ignore[return-value]
    made = make()
    _SHARED[key] = (weakref.ref(source), source._version, extra,
                    tuple(weakref.ref(t) for t in made))  # fmt: skip
    for stale in [k for k, e in _SHARED.items() if e[0]() is None or e[3][0]() is None]:
        del _SHARED[stale]
    return made


def int8_panels(qweight: Tensor, scale: Tensor, lanes: int) -> tuple[Tensor, Tensor]:
    """INT8 weights (N, K) and scales (N,) as the kernels read them: panels int8
    (P, K, lanes) and scales fp32 (P * lanes,), zero-padded, shared, in huge pages."""

    def make() -> tuple[Tensor, Tensor]:
        w = _in_huge_pages(panels_int8(qweight.contiguous(), lanes))
        return w, _pad_rows(scale.float(), w.shape[0] * lanes)

    w, s = _shared("int8", qweight, (lanes, scale.data_ptr(), scale._version), make)
    return w, s


def int4_panels(
    packed: Tensor, scale: Tensor, offset: Tensor, group_size: int, lanes: int
) -> Tensor:
    """INT4 weights as the kernels read them: per-panel group records (see ``panels_int4``),
    shared, in huge pages."""

    def make() -> tuple[Tensor]:
        args = (packed.contiguous(), scale.contiguous(), offset.contiguous())
        return (_in_huge_pages(panels_int4(*args, group_size, lanes)),)

    extra = (lanes, group_size, scale.data_ptr(), scale._version, offset.data_ptr(),
             offset._version)  # fmt: skip
    return _shared("int4", packed, extra, make)[0]
