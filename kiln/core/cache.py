"""kiln's one on-disk cache folder: ``$KILN_CACHE_DIR``, else ``~/.cache/kiln``.

Everything kiln keeps between runs lives under it, each kind in its own sub-folder:
``programs/`` and ``runtime/`` (native builds), ``captures/`` (``torch.export`` results),
``measured/`` (timed candidate kernels), ``data/`` (the Austen novels), hardware profiles.
"""

from __future__ import annotations

import os
from pathlib import Path


def cache_dir(sub: str = "") -> Path:
    """The cache folder (or its sub-folder ``sub``), created if missing."""
    env = os.environ.get("KILN_CACHE_DIR")
    root = Path(env) if env else Path.home() / ".cache" / "kiln"
    path = root / sub if sub else root
    path.mkdir(parents=True, exist_ok=True)
    return path
