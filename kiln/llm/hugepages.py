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
one process): 8% faster (median 23.2 -> 21.2 ms). A GGUF layer's blocks (a buffer the step
streams in place, ``GgufLinear.blocks``) move too: the Q8_0 SmolLM2 step 10.4 -> 9.3 ms.

Where huge pages cannot be had (THP ``never``, not Linux, madvise refused) nothing moves and
the reason is returned: the weights are then exactly where they were, only slower to stream.
"""

from __future__ import annotations

import weakref

import torch
from torch import Tensor, nn

from kiln.compress.gguf_linear import GgufLinear
from kiln.core.huge_pages import ALIGN, HUGE_PAGE, huge_page_arena, thp_mode
from kiln.core.huge_pages import aligned as _aligned
from kiln.core.memory import trim_heap

__all__ = ["ALIGN", "HUGE_PAGE", "move_to_huge_pages_", "thp_mode"]
TRIM_EVERY = 16 << 20  # bytes moved between handing freed heap back to the OS


def move_to_huge_pages_(module: nn.Module) -> tuple[int, str]:
    """Move ``module``'s CPU parameters (and its GGUF layers' blocks) into one huge-page
    arena, in place.

    Returns (bytes moved, "") or (0, why nothing moved). Parameters already in huge pages
    (a second call) stay; one shared by two modules (a tied head) moves once."""
    blocks = [m.blocks for m in module.modules() if isinstance(m, GgufLinear)]
    tensors = {id(t): t for t in (*module.parameters(), *blocks)}.values()  # each once
    params = [p for p in tensors if p.device.type == "cpu" and p.numel() > 0]
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
