"""GEMM chains on and off: ``python -m kiln.bench.chain_ab`` is
``python -m kiln.bench.feature_ab --feature chains`` (see there)."""

from __future__ import annotations

import sys

from kiln.bench.feature_ab import main

if __name__ == "__main__":
    raise SystemExit(main(["--feature", "chains", *sys.argv[1:]]))
