"""Memory in transparent huge pages: one TLB entry per 2 MB for weights a step streams whole.

Linux backs an anonymous mapping with huge pages when
``/sys/kernel/mm/transparent_hugepage/enabled`` says ``always``, or ``madvise`` and the
range was marked with ``madvise(MADV_HUGEPAGE)``; torch's allocator does neither.
``huge_page_arena`` returns such a marked, 2 MB-aligned range (pages untouched, so not yet
resident); ``huge_page_empty`` hands out tensors carved from shared arenas, so weights
made at run time (the INT8 / INT4 kernels' repacked panels) are born in huge pages instead
of being copied there afterwards (a copy doubles their memory while it runs).

Where huge pages cannot be had (THP ``never``, not Linux, madvise refused) the arena is
None with the reason, and ``huge_page_empty`` is a plain ``torch.empty``.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import math
from collections.abc import Callable, Sequence
from pathlib import Path

import torch
from torch import Tensor

HUGE_PAGE = 2 << 20
ALIGN = 64  # each tensor's first byte: a cache line
MADV_HUGEPAGE = 14  # linux/mman.h
THP_ENABLED = Path("/sys/kernel/mm/transparent_hugepage/enabled")
CHUNK = 64 << 20  # arena size huge_page_empty carves small tensors from


def thp_mode() -> str:
    """The kernel's THP policy: ``always``, ``madvise``, ``never``, or ``unavailable``."""
    try:
        text = THP_ENABLED.read_text()
    except OSError:
        return "unavailable"
    chosen = [w[1:-1] for w in text.split() if w.startswith("[")]
    return chosen[0] if chosen else "unavailable"


@functools.cache
def _madvise() -> Callable[[int, int, int], int] | None:
    name = ctypes.util.find_library("c")
    if name is None:
        return None
    fn = ctypes.CDLL(name, use_errno=True).madvise
    fn.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    fn.restype = ctypes.c_int
    return fn  # type: ignore[no-any-return]


def huge_page_arena(nbytes: int) -> tuple[Tensor | None, str]:
    """``nbytes`` of uint8 CPU memory starting on a 2 MB boundary, marked for huge pages;
    (None, why) when they cannot be had. The pages are not touched (not yet resident)."""
    mode = thp_mode()
    if mode not in ("always", "madvise"):
        return None, f"transparent huge pages are {mode}"
    madvise = _madvise()
    if madvise is None:
        return None, "no C library to call madvise"
    span = -(-nbytes // HUGE_PAGE) * HUGE_PAGE
    raw = torch.empty(span + HUGE_PAGE, dtype=torch.uint8)
    start = -raw.data_ptr() % HUGE_PAGE
    arena = raw[start : start + span]
    if madvise(arena.data_ptr(), span, MADV_HUGEPAGE) != 0:
        return None, f"madvise(MADV_HUGEPAGE) failed: errno {ctypes.get_errno()}"
    return arena, ""


def aligned(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


class _Pool:
    """The arena ``huge_page_empty`` is carving now; a tensor keeps its arena alive, and
    an arena no tensor uses any more is freed."""

    arena: Tensor | None = None
    offset = 0


def huge_page_empty(shape: Sequence[int], dtype: torch.dtype) -> Tensor:
    """An uninitialised contiguous CPU tensor in huge pages (cache-line aligned), carved
    from a shared ``CHUNK`` arena (or its own, when over a quarter of one); a plain
    ``torch.empty`` where huge pages cannot be had."""
    nbytes = math.prod(shape) * torch.empty(0, dtype=dtype).element_size()
    if nbytes > CHUNK // 4:
        arena, _ = huge_page_arena(nbytes)
    else:
        if _Pool.arena is None or _Pool.offset + nbytes > _Pool.arena.numel():
            _Pool.arena, _ = huge_page_arena(CHUNK)
            _Pool.offset = 0
        arena = None if _Pool.arena is None else _Pool.arena[_Pool.offset :]
        _Pool.offset += aligned(nbytes)
    if arena is None:
        return torch.empty(tuple(shape), dtype=dtype)
    return arena[:nbytes].view(dtype).view(tuple(shape))
