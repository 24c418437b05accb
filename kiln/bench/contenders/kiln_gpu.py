"""kiln on a CUDA GPU: ``kiln.compile(model, example_inputs)`` with the model and inputs
already on the device, which selects kiln's GPU backend (Triton kernels, the whole program
replayed as one CUDA graph).

Calling and timing are the CPU contender's (:class:`~kiln.bench.contenders.kiln_contender.Kiln`);
``prepare`` also records what the compile report says, so a result shows whether kiln really
ran its own program on the GPU: ``executor``, ``fallbacks``, ``graph_captured`` and
``arena_bytes`` (when the report carries them), kernel count, kiln's own phase timings and
the outputs' device. Compile time is cold only with a fresh ``KILN_CACHE_DIR`` (and Triton
cache), which the GPU runner gives each worker.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from kiln.bench.contenders.kiln_contender import Kiln


def report_facts(report: Any) -> dict[str, Any]:
    """The facts of a ``CompileReport`` a benchmark result keeps (missing ones left out)."""
    if report is None:
        return {"kiln_report": None}
    facts: dict[str, Any] = {
        "executor": getattr(report, "executor", None),
        "fallbacks": [f"{f.op}: {f.reason}" for f in getattr(report, "fallbacks", [])],
        "n_kernels": len(getattr(report, "kernels", []) or []),
        "kiln_timings_s": dict(getattr(report, "timings_s", {}) or {}),
        "verification": getattr(report, "verification", None),
    }
    for key in ("graph_captured", "arena_bytes", "cache_hit"):
        if hasattr(report, key):
            facts[key] = getattr(report, key)
    try:
        facts["kiln_summary"] = str(report.summary())[:2000]
    except Exception as e:  # noqa: BLE001 - a summary is a nicety, never a failure
        facts["kiln_summary"] = f"summary failed: {type(e).__name__}: {e}"
    return facts


class KilnGpu(Kiln):
    def prepare(
        self, model: torch.nn.Module, inputs: tuple[Any, ...], workdir: Path
    ) -> dict[str, Any]:
        facts = super().prepare(model, inputs, workdir)
        facts.update(report_facts(getattr(self._fn, "report", None)))
        facts["output_devices"] = sorted({str(t.device) for t in self.outputs()})
        return facts


def make() -> KilnGpu:
    return KilnGpu()
