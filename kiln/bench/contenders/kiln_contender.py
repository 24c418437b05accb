"""kiln: ``fn = kiln.compile(model, example_inputs)``; ``fn(*inputs)`` returns
the same outputs as the model. Until ``kiln.compile`` exists, ``prepare`` fails
with ``unavailable: <error>`` and the runner records that."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from kiln.bench.contenders import flatten_outputs


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
        return {}

    def run(self) -> None:
        with torch.inference_mode():
            self._last = self._fn(*self._inputs)

    def outputs(self) -> list[torch.Tensor]:
        return flatten_outputs(self._last)


def make() -> Kiln:
    return Kiln()
