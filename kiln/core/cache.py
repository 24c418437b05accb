"""kiln's one on-disk cache folder: ``$KILN_CACHE_DIR``, else ``~/.cache/kiln``.

Everything kiln keeps between runs lives under it, each kind in its own sub-folder:
``programs/`` and ``runtime/`` (native builds), ``captures/`` (``torch.export`` results),
``measured/`` (timed candidate kernels), ``data/`` (the Austen novels), hardware profiles.
"""

from __future__ import annotations

import os
from pathlib import Path


def cache_dir(sub: str = "") -> Path:
    """The cache folder (or its sub-folder ``sub``), created if missing. A sub-folder can
    be moved on its own with ``$KILN_<SUB>_DIR`` (e.g. ``KILN_PROGRAMS_DIR``): a benchmark
    gives each model fresh ``programs``/``captures`` folders, so kiln's compile is timed
    cold while the machine's hardware profile and runtime build stay where they are."""
    own = os.environ.get(f"KILN_{sub.upper()}_DIR") if sub else None
    env = os.environ.get("KILN_CACHE_DIR")
    root = Path(env) if env else Path.home() / ".cache" / "kiln"
    path = Path(own) if own else root / sub if sub else root
    path.mkdir(parents=True, exist_ok=True)
    return path
