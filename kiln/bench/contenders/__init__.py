"""Contenders: one module per runtime, each importing only its own runtime.

A contender module defines ``make() -> Contender``. The worker process calls
``prepare`` once (timed as compile time), then ``run`` many times (timed), then
``outputs`` once to hand the results back for the error check. This package's
``__init__`` imports no runtime, so the parent runner can list names freely.
"""

from __future__ import annotations

import importlib
from pathlib import Path
from typing import Any, Protocol

import torch

# contender name -> module implementing it
MODULES: dict[str, str] = {
    "eager": "kiln.bench.contenders.eager",
    "inductor": "kiln.bench.contenders.inductor",
    "ort": "kiln.bench.contenders.ort",
    "openvino": "kiln.bench.contenders.ov",
    "kiln": "kiln.bench.contenders.kiln_contender",
}
ALIASES: dict[str, str] = {
    "torch": "eager",
    "torch.compile": "inductor",
    "compile": "inductor",
    "onnxruntime": "ort",
    "ov": "openvino",
}
NAMES: list[str] = list(MODULES)


class Contender(Protocol):
    """What the worker drives. ``prepare`` returns extra facts to record
    (e.g. ``{"export_s": 2.1, "onnx_exporter": "dynamo"}``)."""

    def prepare(
        self, model: torch.nn.Module, inputs: tuple[Any, ...], workdir: Path
    ) -> dict[str, Any]: ...

    def run(self) -> None: ...

    def outputs(self) -> list[torch.Tensor]: ...


def canonical(name: str) -> str:
    """Map a user-facing name or alias to the canonical contender name."""
    key = ALIASES.get(name.strip().lower(), name.strip().lower())
    if key not in MODULES:
        raise KeyError(f"unknown contender {name!r}; known: {', '.join(NAMES)}")
    return key


def load(name: str) -> Contender:
    """Import the contender's module (and with it its runtime) and build one."""
    module = importlib.import_module(MODULES[canonical(name)])
    contender: Contender = module.make()
    return contender


def flatten_outputs(out: Any) -> list[torch.Tensor]:
    """All tensors in a (possibly nested) model output, in pytree order."""
    leaves = torch.utils._pytree.tree_leaves(out)
    return [t.detach().clone() for t in leaves if isinstance(t, torch.Tensor)]
