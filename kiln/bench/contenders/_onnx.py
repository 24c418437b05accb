"""ONNX export shared by the ONNX Runtime and OpenVINO contenders (torch only).

The file is written once per model into the model's work folder; a second
contender reuses it (and a recorded export failure), so each model is
exported once per run. The dynamo exporter is tried first, then the
TorchScript one.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import torch


def ensure_onnx(
    model: torch.nn.Module, inputs: tuple[Any, ...], workdir: Path
) -> tuple[Path, dict[str, Any]]:
    """Return ``(path to model.onnx, facts)``; facts hold ``export_s`` and the
    exporter used when this call exported, or ``onnx_reused`` when it did not.
    Raises ``RuntimeError`` with the exporter errors if export fails."""
    path = workdir / "model.onnx"
    meta = workdir / "model.onnx.json"
    if meta.exists():
        info = json.loads(meta.read_text())
        if info.get("error"):
            raise RuntimeError(f"onnx export failed: {info['error']}")
        return path, {"onnx_reused": True, "onnx_exporter": info.get("exporter")}
    errors: list[str] = []
    t0 = time.perf_counter()
    for dynamo in (True, False):
        try:
            with torch.no_grad():
                torch.onnx.export(
                    model, inputs, str(path), dynamo=dynamo, external_data=False, verbose=False
                )
        except Exception as e:  # noqa: BLE001 - any exporter failure falls through to the next
            errors.append(f"{'dynamo' if dynamo else 'torchscript'}: {type(e).__name__}: {e}"[:500])
            continue
        exporter = "dynamo" if dynamo else "torchscript"
        facts = {"export_s": time.perf_counter() - t0, "onnx_exporter": exporter}
        meta.write_text(json.dumps({"exporter": exporter}))
        return path, facts
    meta.write_text(json.dumps({"error": " | ".join(errors)}))
    raise RuntimeError("onnx export failed: " + " | ".join(errors))


def numpy_inputs(inputs: tuple[Any, ...]) -> list[Any]:
    """Contiguous numpy copies of the tensor inputs, in order."""
    return [t.detach().contiguous().numpy().copy() for t in inputs]
