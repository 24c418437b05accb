"""Helpers for tests of kiln's hand-written C++ extensions."""

from __future__ import annotations

import re
from collections.abc import Sequence
from pathlib import Path


def quoted_includes(source: Path, dirs: Sequence[Path]) -> set[Path]:
    """Every file that ``source`` includes with ``#include "..."``, transitively, found as
    the compiler would: next to the including file, then in ``dirs``."""
    found: set[Path] = set()
    todo = [source]
    while todo:
        path = todo.pop()
        for name in re.findall(r'^\s*#\s*include\s+"([^"]+)"', path.read_text(), re.M):
            hits = [d / name for d in (path.parent, *dirs) if (d / name).exists()]
            assert hits, f"{path.name} includes {name}, found nowhere on the include path"
            if hits[0].resolve() not in found:
                found.add(hits[0].resolve())
                todo.append(hits[0])
    return found
