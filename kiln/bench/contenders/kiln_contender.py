"""kiln: ``fn = kiln.compile(model, example_inputs)``; ``fn(*inputs)`` returns
the same outputs as the model. ``prepare`` also records what the compile report says
(executor, fallbacks, kernel count, kiln's phase timings), so a result shows whether kiln
ran its own program; ``profile`` (called by the worker after the compile was timed) adds
each kernel's measured time and the share of the program spent in extern kernels
(PyTorch or library calls)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from kiln.bench.contenders import flatten_outputs


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


def extern_share(kernels: list[Any]) -> dict[str, Any]:
    """Measured µs per kernel (``measured_us`` filled) -> the share of the total spent in
    kernels that are not native loops (extern: PyTorch or library calls), and the rows."""
    total = sum(k.measured_us or 0.0 for k in kernels)
    extern = sum(k.measured_us or 0.0 for k in kernels if k.executor != "native")
    return {
        "kernel_us_total": total,
        "extern_share": extern / total if total > 0 else 0.0,
        "kernels": [
            {
                "template": k.template,
                "executor": k.executor,
                "predicted_us": k.predicted_us,
                "measured_us": k.measured_us,
                "ops": " ".join(k.primitives),
            }
            for k in kernels
        ],  # fmt: skip
    }


class Kiln:
    def __init__(self) -> None:
        self._fn: Any = None
        self._inputs: tuple[Any, ...] = ()
        self._last: Any = None

    def prepare(
        self, model: torch.nn.Module, inputs: tuple[Any, ...], workdir: Path
    ) -> dict[str, Any]:
        try:
            import kiln

            compile_fn = kiln.compile  # type: ignore[attr-defined]
        except (ImportError, AttributeError) as e:
            raise RuntimeError(f"unavailable: {type(e).__name__}: {e}") from e
        self._fn = compile_fn(model, inputs)
        self._inputs = inputs
        self.run()  # a first call, so lazy work is counted as compile time
        return report_facts(getattr(self._fn, "report", None))

    def profile(self) -> dict[str, Any]:
        """Per-kernel times of kiln's C++ program (a profiling build of it) and the share
        in extern kernels; {} for a program without one (another backend)."""
        from kiln.compiler.exec.profile import profile_kernels

        if getattr(self._fn, "program", None) is None or self._fn.report.executor != "native":
            return {}
        profile_kernels(self._fn, self._inputs)
        return extern_share(self._fn.report.kernels)

    def run(self) -> None:
        with torch.inference_mode():
            self._last = self._fn(*self._inputs)

    def outputs(self) -> list[torch.Tensor]:
        return flatten_outputs(self._last)


def make() -> Kiln:
    return Kiln()
