"""Contenders: one module per runtime, each importing only its own runtime.

A contender module defines ``make() -> Contender`` (or a registry entry names another
factory: ``"module:factory"``). The worker process calls ``prepare`` once (timed as compile
time), then ``run`` many times (timed), then ``outputs`` once to hand the results back for
the error check. This package's ``__init__`` imports no runtime, so the parent runner can
list names freely.

Two registries: ``MODULES`` for the CPU suite, ``GPU_MODULES`` for the GPU suite
(``suite_worker --device cuda``), where the model and inputs are already on the GPU when
``prepare`` is called. Eager is the same contender on both; torch.compile runs in three
modes; ``kiln`` on the GPU also records what its compile report says (executor, fallbacks,
CUDA graph capture).
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

# The GPU side-by-side (kiln/bench/gpu_suite.py): contender name -> "module[:factory]".
GPU_MODULES: dict[str, str] = {
    "eager": "kiln.bench.contenders.eager",
    "inductor-default": "kiln.bench.contenders.inductor_modes:make_default",
    "inductor-reduce-overhead": "kiln.bench.contenders.inductor_modes:make_reduce_overhead",
    "inductor-max-autotune": "kiln.bench.contenders.inductor_modes:make_max_autotune",
    "kiln": "kiln.bench.contenders.kiln_gpu",
}
GPU_ALIASES: dict[str, str] = {
    "torch": "eager",
    "inductor": "inductor-default",
    "torch.compile": "inductor-default",
    "reduce-overhead": "inductor-reduce-overhead",
    "max-autotune": "inductor-max-autotune",
}
GPU_NAMES: list[str] = list(GPU_MODULES)


class Contender(Protocol):
    """What the worker drives. ``prepare`` returns extra facts to record
    (e.g. ``{"export_s": 2.1, "onnx_exporter": "dynamo"}``)."""

    def prepare(
        self, model: torch.nn.Module, inputs: tuple[Any, ...], workdir: Path
    ) -> dict[str, Any]: ...

    def run(self) -> None: ...

    def outputs(self) -> list[torch.Tensor]: ...


def _registry(device: str) -> tuple[dict[str, str], dict[str, str]]:
    if device == "cpu":
        return MODULES, ALIASES
    if device == "cuda":
        return GPU_MODULES, GPU_ALIASES
    raise ValueError(f"device must be 'cpu' or 'cuda', not {device!r}")


def canonical(name: str, device: str = "cpu") -> str:
    """Map a user-facing name or alias to the canonical contender name (of ``device``'s
    registry)."""
    modules, aliases = _registry(device)
    key = aliases.get(name.strip().lower(), name.strip().lower())
    if key not in modules:
        raise KeyError(f"unknown contender {name!r}; known: {', '.join(modules)}")
    return key


def factory_path(name: str, device: str = "cpu") -> tuple[str, str]:
    """``(module, factory function)`` that builds contender ``name`` on ``device``."""
    modules, _ = _registry(device)
    module, _, fn = modules[canonical(name, device)].partition(":")
    return module, fn or "make"


def load(name: str, device: str = "cpu") -> Contender:
    """Import the contender's module (and with it its runtime) and build one."""
    module, fn = factory_path(name, device)
    contender: Contender = getattr(importlib.import_module(module), fn)()
    return contender


def flatten_outputs(out: Any) -> list[torch.Tensor]:
    """All tensors in a (possibly nested) model output, in pytree order."""
    leaves = torch.utils._pytree.tree_leaves(out)
    return [t.detach().clone() for t in leaves if isinstance(t, torch.Tensor)]
