"""OpenVINO CPU plugin on the exported ONNX file.

2 inference threads, latency hint, f32 precision. Inputs are bound once as
shared-memory tensors on one infer request; a timed call is only ``infer()``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import openvino as ov
import torch

from kiln.bench.contenders._onnx import ensure_onnx, numpy_inputs

CONFIG = {
    "INFERENCE_NUM_THREADS": "2",
    "PERFORMANCE_HINT": "LATENCY",
    "INFERENCE_PRECISION_HINT": "f32",
}


class OpenVINO:
    def __init__(self) -> None:
        self._request: Any = None
        self._arrays: list[np.ndarray] = []
        self._n_out = 0

    def prepare(
        self, model: torch.nn.Module, inputs: tuple[Any, ...], workdir: Path
    ) -> dict[str, Any]:
        path, facts = ensure_onnx(model, inputs, workdir)
        core = ov.Core()
        compiled = core.compile_model(core.read_model(str(path)), "CPU", CONFIG)
        if len(compiled.inputs) != len(inputs):
            raise RuntimeError(
                f"OpenVINO model has {len(compiled.inputs)} inputs, model takes {len(inputs)}"
            )
        request = compiled.create_infer_request()
        self._arrays = numpy_inputs(inputs)  # kept alive: the tensors share their memory
        for i, arr in enumerate(self._arrays):
            request.set_input_tensor(i, ov.Tensor(arr, shared_memory=True))
        self._request, self._n_out = request, len(compiled.outputs)
        return facts

    def run(self) -> None:
        self._request.infer()

    def outputs(self) -> list[torch.Tensor]:
        return [
            torch.from_numpy(np.array(self._request.get_output_tensor(i).data, copy=True))
            for i in range(self._n_out)
        ]


def make() -> OpenVINO:
    return OpenVINO()
