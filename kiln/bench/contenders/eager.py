"""Eager PyTorch: the reference contender (``module(*inputs)`` under inference mode)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from kiln.bench.contenders import flatten_outputs


class Eager:
    """Calls the module directly; nothing to prepare."""

    def __init__(self) -> None:
        self._model: torch.nn.Module | None = None
        self._inputs: tuple[Any, ...] = ()
        self._last: Any = None

    def prepare(
        self, model: torch.nn.Module, inputs: tuple[Any, ...], workdir: Path
    ) -> dict[str, Any]:
        self._model, self._inputs = model, inputs
        return {}

    def run(self) -> None:
        assert self._model is not None
        with torch.inference_mode():
            self._last = self._model(*self._inputs)

    def outputs(self) -> list[torch.Tensor]:
        return flatten_outputs(self._last)


def make() -> Eager:
    return Eager()
