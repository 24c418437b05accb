"""This process's memory: its resident high-water mark, and freed heap handed back.

``peak_rss_bytes`` reads ``VmHWM`` (the kernel's high-water mark of resident memory) from
``/proc/self/status``; not getrusage's ``ru_maxrss``, which on Linux carries a parent's
peak over fork + exec, so a child of a large process would report the parent's.

``trim_heap`` calls glibc's ``malloc_trim``. glibc's allocator keeps freed chunks for reuse, and its mmap threshold grows with the
largest chunk freed so far, so after a few MB-sized tensors are freed the next ones come
from the heap too. A streaming load that reads a block, stores or quantizes it and frees
it, block after block, then fragments the heap: resident memory grew by about a third of
a block per block on SmolLM2 although nothing was kept. ``trim_heap`` after each block
returns the free pages, keeping resident memory at what is really held.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
from collections.abc import Callable
from pathlib import Path


def peak_rss_bytes() -> int | None:
    """This process's resident-memory high-water mark in bytes (None without Linux /proc)."""
    try:
        text = Path("/proc/self/status").read_text(encoding="ascii")
    except OSError:
        return None
    for line in text.splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024  # kB
    return None


@functools.cache
def _malloc_trim() -> Callable[[int], int] | None:
    name = ctypes.util.find_library("c")
    if name is None:
        return None
    fn = getattr(ctypes.CDLL(name), "malloc_trim", None)  # glibc only
    if fn is None:
        return None
    fn.argtypes, fn.restype = [ctypes.c_size_t], ctypes.c_int
    return fn  # type: ignore[no-any-return]


def trim_heap() -> bool:
    """Return the heap's free pages to the OS; False where the C library cannot (not
    glibc), which only means resident memory may stay higher than what is held."""
    fn = _malloc_trim()
    if fn is None:
        return False
    fn(0)  # 1 if pages were returned, 0 if there were none to return
    return True
