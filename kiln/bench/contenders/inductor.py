"""torch.compile with the default inductor backend and default mode."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from kiln.bench.contenders import flatten_outputs


class Inductor:
    """``prepare`` compiles and runs once, so compile time covers tracing,
    inductor code generation and the C++ build (cache dir set by the runner)."""

    def __init__(self) -> None:
        self._fn: Any = None
        self._inputs: tuple[Any, ...] = ()
        self._last: Any = None

    def prepare(
        self, model: torch.nn.Module, inputs: tuple[Any, ...], workdir: Path
    ) -> dict[str, Any]:
        self._fn = torch.compile(model)
        self._inputs = inputs
        self.run()  # the first call triggers compilation
        return {}

    def run(self) -> None:
        with torch.inference_mode():
            self._last = self._fn(*self._inputs)

    def outputs(self) -> list[torch.Tensor]:
        return flatten_outputs(self._last)


def make() -> Inductor:
    return Inductor()
