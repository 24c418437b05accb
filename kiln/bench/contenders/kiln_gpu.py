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


class KilnGpu(Kiln):
    def prepare(
        self, model: torch.nn.Module, inputs: tuple[Any, ...], workdir: Path
    ) -> dict[str, Any]:
        facts = super().prepare(model, inputs, workdir)
        facts["output_devices"] = sorted({str(t.device) for t in self.outputs()})
        return facts


def make() -> KilnGpu:
    return KilnGpu()
