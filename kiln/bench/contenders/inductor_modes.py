"""torch.compile (inductor) in one of its modes, for the GPU suite.

* ``default``          -- Triton kernels, launched one by one from Python;
* ``reduce-overhead``  -- the same kernels replayed through CUDA graphs (cudagraph trees);
* ``max-autotune``     -- matmul/conv templates autotuned against cuBLAS, plus CUDA graphs.

Compile time is cold only if the process has fresh ``TORCHINDUCTOR_CACHE_DIR`` and
``TRITON_CACHE_DIR`` folders: the GPU runner (kiln/bench/gpu_suite.py) gives each worker
its own. ``prepare`` calls the compiled function three times, so tracing, code generation,
autotuning and CUDA-graph recording (warm-up run, then record) all count as compile time.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from kiln.bench.contenders import flatten_outputs

MODES = ("default", "reduce-overhead", "max-autotune")


class InductorMode:
    """``torch.compile(model, mode=mode)``; each call marks a new CUDA-graph step, so the
    previous call's outputs (kept only for ``outputs``) may be overwritten by the replay."""

    def __init__(self, mode: str) -> None:
        if mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, not {mode!r}")
        self.mode = mode
        self._fn: Any = None
        self._inputs: tuple[Any, ...] = ()
        self._last: Any = None

    def prepare(
        self, model: torch.nn.Module, inputs: tuple[Any, ...], workdir: Path
    ) -> dict[str, Any]:
        self._fn = torch.compile(model, mode=None if self.mode == "default" else self.mode)
        self._inputs = inputs
        for _ in range(3):  # compile; then cudagraph trees warm up and record
            self.run()
        facts: dict[str, Any] = {"mode": self.mode}
        try:
            from torch._dynamo.utils import counters

            facts["dynamo_graphs"] = int(counters["stats"]["unique_graphs"])
        except (ImportError, KeyError, TypeError):
            pass
        return facts

    def run(self) -> None:
        torch.compiler.cudagraph_mark_step_begin()
        with torch.inference_mode():
            self._last = self._fn(*self._inputs)

    def outputs(self) -> list[torch.Tensor]:
        return flatten_outputs(self._last)


def make_default() -> InductorMode:
    return InductorMode("default")


def make_reduce_overhead() -> InductorMode:
    return InductorMode("reduce-overhead")


def make_max_autotune() -> InductorMode:
    return InductorMode("max-autotune")
