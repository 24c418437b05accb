"""``CompiledModule``: the callable ``kiln.compile`` returns."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch.utils._pytree import TreeSpec, tree_unflatten

from kiln.compiler.exec.executors import ShapeMismatch, index_error
from kiln.compiler.exec.report import CompileReport
from kiln.compiler.fusion.program import Program
from kiln.compiler.ir.graph import Graph, TensorMeta

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
        self.native_program: Any = None  # the generated program (CppProgram / TritonProgram)
        # other input shapes: programs compiled on demand, up to ``max_shapes`` in all
        self._signature = _signature([graph.meta(v) for v in graph.inputs])
        self._recompile: Callable[[Sequence[Tensor]], CompiledModule] | None = None
        self._max_shapes = 1
        self.shapes: dict[tuple[Any, ...], CompiledModule] = {}

    def compile_new_shapes(
        self, recompile: Callable[[Sequence[Tensor]], CompiledModule], max_shapes: int
    ) -> None:
        """Let a call with other input shapes compile (and keep) a program for them, up to
        ``max_shapes`` programs in all; past that, a call with a new shape raises."""
        self._recompile, self._max_shapes = recompile, max_shapes

    def __call__(self, *args: Tensor) -> Any:
        flat = [a if a.is_contiguous() else a.contiguous() for a in args]
        if self._recompile is not None and _signature(flat) != self._signature:
            return self._for_shape(flat)(*flat)
        try:  # (free in CPython 3.11 until something raises)
            outs = self._run(flat)
        except RuntimeError as err:
            raise self._explained(err, flat) from None
        if self._single:
            return outs[0]
        return tree_unflatten(outs, self._out_spec)  # type: ignore[arg-type]

    def _for_shape(self, flat: Sequence[Tensor]) -> CompiledModule:
        key = _signature(flat)
        found = self.shapes.get(key)
        if found is not None:
            return found
        if 1 + len(self.shapes) >= self._max_shapes or self._recompile is None:
            raise ShapeMismatch(
                f"inputs of shapes {[list(t.shape) for t in flat]}: this model already has "
                f"programs for {1 + len(self.shapes)} input shapes (max_shapes="
                f"{self._max_shapes}); compile with a larger max_shapes, or pad inputs to a "
                "shape already compiled"
            )
        found = self.shapes[key] = self._recompile(flat)
        return found

    def set_output_spec(self, spec: TreeSpec | None) -> None:
        """How flat outputs rebuild the model's output structure (None: one tensor)."""
        self._out_spec = spec
        self._single = spec is None

    def run_flat(self, inputs: Sequence[Tensor]) -> list[Tensor]:
        """Flat tensors in, flat tensors out (the torch.compile backend's calling form)."""
        flat = [a if a.is_contiguous() else a.contiguous() for a in inputs]
        if self._recompile is not None and _signature(flat) != self._signature:
            return self._for_shape(flat).run_flat(flat)
        try:
            return self._run(flat)
        except RuntimeError as err:
            raise self._explained(err, flat) from None

    def _explained(self, err: RuntimeError, inputs: Sequence[Tensor]) -> Exception:
        """What eager would raise for a native program's failure: an out-of-range gather
        index (the program's error 2) as the IndexError naming the input; else ``err``."""
        if self.program is not None and "kiln_entry returned 2" in str(err):
            return index_error(self.program, inputs)
        return err

    def __repr__(self) -> str:
        return f"CompiledModule({self.report.summary()})"


def _signature(inputs: Sequence[Tensor] | Sequence[TensorMeta]) -> tuple[Any, ...]:
    return tuple((tuple(t.shape), t.dtype) for t in inputs)
