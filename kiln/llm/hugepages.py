"""Model weights in transparent huge pages: fewer TLB misses for a step that streams them all.

A decode step reads every weight once. With 4 KB pages that is one page-table walk per 4 KB
(SmolLM2-135M in fp32: 132,000 per token); with 2 MB pages, one per 2 MB. Linux backs an
anonymous mapping with huge pages when ``/sys/kernel/mm/transparent_hugepage/enabled`` says
``always``, or ``madvise`` and the range was marked with ``madvise(MADV_HUGEPAGE)``; torch's
allocator does neither. ``move_to_huge_pages_`` copies a module's CPU parameters into one
2 MB-aligned arena so marked and rebinds each parameter to its view there: the values,
dtypes, shapes and tied parameters stay as they were, the old copies are freed — one
parameter at a time, the freed heap handed back to the OS as it goes, so the move needs
little more memory than the model (copying all, then freeing all, needed twice as much). Measured on
the fp32 SmolLM2 decode step here (AMD EPYC, 2 threads, steps of both layouts alternated in
one process): 8% faster (median 23.2 -> 21.2 ms).

Where huge pages cannot be had (THP ``never``, not Linux, madvise refused) nothing moves and
the reason is returned: the weights are then exactly where they were, only slower to stream.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import weakref
from collections.abc import Callable, Sequence
from pathlib import Path

import torch
from torch import Tensor, nn

from kiln.core.memory import trim_heap

HUGE_PAGE = 2 << 20
ALIGN = 64  # each tensor's first byte: a cache line
TRIM_EVERY = 16 << 20  # bytes moved between handing freed heap back to the OS
MADV_HUGEPAGE = 14  # linux/mman.h
THP_ENABLED = Path("/sys/kernel/mm/transparent_hugepage/enabled")


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


def _aligned(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


def copy_to_huge_pages(tensors: Sequence[Tensor]) -> tuple[list[Tensor], str]:
    """Copies of the CPU ``tensors`` (same values, dtypes and shapes, contiguous), together
    in one huge-page arena; ([], why) when huge pages cannot be had."""
    sizes = [t.numel() * t.element_size() for t in tensors]
    arena, why = huge_page_arena(sum(_aligned(n) for n in sizes))
    if arena is None:
        return [], why
    copies, offset = [], 0
    with torch.no_grad():
        for t, size in zip(tensors, sizes, strict=True):
            view = arena[offset : offset + size].view(t.dtype).view(t.shape)
            view.copy_(t)
            copies.append(view)
            offset += _aligned(size)
    return copies, ""


def move_to_huge_pages_(module: nn.Module) -> tuple[int, str]:
    """Move ``module``'s CPU parameters into one huge-page arena, in place.

    Returns (bytes moved, "") or (0, why nothing moved). Parameters already in huge pages
    (a second call) stay; one shared by two modules (a tied head) moves once."""
    params = [p for p in module.parameters() if p.device.type == "cpu" and p.numel() > 0]
    params = [p for p in params if not _moved(p)]
    if not params:
        return 0, "no CPU parameters outside huge pages"
    sizes = [p.numel() * p.element_size() for p in params]
    arena, why = huge_page_arena(sum(_aligned(n) for n in sizes))
    if arena is None:
        return 0, why
    offset, unreturned = 0, 0
    with torch.no_grad():
        for p, size in zip(params, sizes, strict=True):
            view = arena[offset : offset + size].view(p.dtype).view(p.shape)
            view.copy_(p.data)
            p.data = view  # the old copy is freed now (unless something else holds it)
            _MOVED[id(p)] = weakref.ref(p)
            offset, unreturned = offset + _aligned(size), unreturned + size
            if unreturned >= TRIM_EVERY:
                trim_heap()
                unreturned = 0
    trim_heap()
    return offset, ""


# The parameters moved so far, by id (a parameter whose .data is later replaced is not
# re-checked). Weak references: a tensor's == is elementwise, so no WeakSet.
_MOVED: dict[int, weakref.ref[Tensor]] = {}


def _moved(p: Tensor) -> bool:
    ref = _MOVED.get(id(p))
    return ref is not None and ref() is p
