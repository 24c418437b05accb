"""Predicted decode latency of every (layer, option): each layer timed alone at batch 1.

The latency objective sums these per-layer times, which ignores that a real decode step
streams every weight from memory once (per-layer timings on a warm cache flatter the
larger options). It ranks options by what their kernels cost at decode size, which is
what the size objective cannot see (e.g. 2:4 on a CPU is smaller but not faster).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import torch
from torch import nn

from kiln.compress.sensitivity import SensitivityTable


@torch.inference_mode()
def time_module(module: nn.Module, in_features: int, rows: int = 1, reps: int = 25) -> float:
    """Median seconds of ``module(x)`` for x (rows, in_features), after warm-up."""
    x = torch.randn(rows, in_features)
    for _ in range(3):
        module(x)
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        module(x)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def measure_latency(
    table: SensitivityTable,
    layers: dict[str, nn.Linear],
    rows: int = 1,
    progress: Callable[[int, int], None] | None = None,
) -> dict[tuple[str, str], float]:
    """Seconds per call for every (layer, option) of ``table`` at ``rows`` activation rows."""
    out: dict[tuple[str, str], float] = {}
    for i, (name, opts) in enumerate(table.options.items()):
        for opt in opts:
            module = layers[name] if opt.module is None else opt.module
            out[(name, opt.name)] = time_module(module, layers[name].in_features, rows)
        if progress is not None:
            progress(i + 1, len(table.options))
    return out
