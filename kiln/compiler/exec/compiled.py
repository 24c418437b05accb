"""``CompiledModule``: the callable ``kiln.compile`` returns."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch.utils._pytree import TreeSpec, tree_unflatten

from kiln.compiler.exec.report import CompileReport
from kiln.compiler.fusion.program import Program
from kiln.compiler.ir.graph import Graph

Tensor = torch.Tensor
Run = Callable[[Sequence[Tensor]], list[Tensor]]


class CompiledModule:
    """A model compiled by kiln: call it like the model (same positional tensor
    inputs at the compiled shapes, same output structure).

    ``report`` says which kernels were chosen and why; ``program`` and ``graph`` hold
    the orchestrated program and the primitive graph for inspection.
    """

    def __init__(
        self,
        run: Run,
        graph: Graph,
        program: Program | None,
        report: CompileReport,
        out_spec: TreeSpec | None,
        eager: Callable[..., Any] | None = None,
    ) -> None:
        self._run = run
        self.graph = graph
        self.program = program
        self.report = report
        self._out_spec = out_spec
        self._eager = eager
        self._single = out_spec is None
        self.native_program: Any = None  # the generated C++ program (CppProgram), if native

    def __call__(self, *args: Tensor) -> Any:
        flat = [a if a.is_contiguous() else a.contiguous() for a in args]
        outs = self._run(flat)
        if self._single:
            return outs[0]
        return tree_unflatten(outs, self._out_spec)  # type: ignore[arg-type]

    def set_output_spec(self, spec: TreeSpec | None) -> None:
        """How flat outputs rebuild the model's output structure (None: one tensor)."""
        self._out_spec = spec
        self._single = spec is None

    def run_flat(self, inputs: Sequence[Tensor]) -> list[Tensor]:
        """Flat tensors in, flat tensors out (the torch.compile backend's calling form)."""
        return self._run([a if a.is_contiguous() else a.contiguous() for a in inputs])

    def __repr__(self) -> str:
        return f"CompiledModule({self.report.summary()})"
