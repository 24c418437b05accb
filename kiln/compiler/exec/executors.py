"""Executors of an orchestrated program.

* ``NativeExecutor``: the generated C++ program, one call per inference.
* ``ReferenceExecutor``: the same kernels in the same order, each node an ATen call —
  the correctness oracle and the fallback when the native path does not apply.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from kiln.compiler.codegen.cpu.codegen import CppProgram
from kiln.compiler.fusion.program import Program
from kiln.compiler.ir.graph import OpClass
from kiln.compiler.ir.semantics import eval_node

Tensor = torch.Tensor


class ShapeMismatch(ValueError):
    """Inputs whose shapes or dtypes differ from the ones the program was compiled for."""


def check_inputs(prog: Program, inputs: Sequence[Tensor]) -> None:
    g = prog.graph
    if len(inputs) != len(g.inputs):
        raise ShapeMismatch(f"expected {len(g.inputs)} tensor inputs, got {len(inputs)}")
    for i, (name, t) in enumerate(zip(g.inputs, inputs)):
        meta = g.meta(name)
        if tuple(t.shape) != meta.shape or t.dtype != meta.dtype:
            raise ShapeMismatch(
                f"input {i} ({name}): compiled for {meta.dtype} {list(meta.shape)}, got "
                f"{t.dtype} {list(t.shape)}; kiln programs have static shapes — compile again "
                "for this shape"
            )


def index_error(prog: Program, inputs: Sequence[Tensor]) -> IndexError:
    """The error eager raises for an out-of-range embedding / gather index, naming the
    program input that holds it (followed back through reshapes and views) and the value;
    an index computed inside the program is named by its node."""
    g = prog.graph
    for node in g.nodes:
        if node.op != "index_select":
            continue
        size = g.meta(node.inputs[0]).shape[node.attrs["dim"]]
        root = node.inputs[1]
        while root not in g.inputs:
            p = g.producer(root)
            if p is None or p.cls != OpClass.LAYOUT or len(p.inputs) != 1:
                break
            root = p.inputs[0]
        if root not in g.inputs:
            continue
        i = g.inputs.index(root)
        t = inputs[i]
        bad = t[(t < -size) | (t >= size)]
        if bad.numel():
            return IndexError(
                f"index out of range: input {i} ({root}) holds {int(bad[0])}, but the table "
                f"it indexes ({node.name}, an embedding lookup or gather) has {size} rows "
                f"(valid indices: {-size}..{size - 1})"
            )
    selects = ", ".join(n.name for n in g.nodes if n.op == "index_select")
    return IndexError(
        f"index out of range in a gather the program computes its index for ({selects})"
    )


class ReferenceExecutor:
    """Runs each chosen kernel's nodes through ATen, kernel by kernel."""

    def __init__(self, prog: Program) -> None:
        self.prog = prog

    def __call__(self, inputs: Sequence[Tensor]) -> list[Tensor]:
        check_inputs(self.prog, inputs)
        return self.run_all(inputs)[0]

    def run_all(self, inputs: Sequence[Tensor]) -> tuple[list[Tensor], dict[str, Tensor]]:
        """Outputs plus every value any kernel wrote (for locating a divergence)."""
        g = self.prog.graph
        env: dict[str, Tensor] = dict(g.constants)
        env.update(zip(g.inputs, inputs))
        view_cache: dict[str, Tensor] = {}

        def get(v: str) -> Tensor:
            if v in env:
                return env[v]
            if v not in view_cache:  # a layout view: derive it from its producer's input
                p = g.producer(v)
                assert p is not None
                view_cache[v] = eval_node(p, [get(i) for i in p.inputs])
            return view_cache[v]

        for k in self.prog.kernels:
            for n in k.nodes:
                node = g.node(n)
                env[node.output] = eval_node(node, [get(i) for i in node.inputs])
            for o in k.outputs:  # copy kernels materialise views
                if o not in env:
                    env[o] = get(o).contiguous()
        outs = [get(o).contiguous() for o in g.outputs]
        return outs, env


class NativeExecutor:
    """The generated program, loaded into the runtime extension."""

    def __init__(self, prog: Program, cpp: CppProgram, so_path: str, runtime: Any) -> None:
        g = prog.graph
        self.prog, self.cpp = prog, cpp
        externs = [(e.fn, [[n] for n in e.root_numels], e.root_dtypes) for e in cpp.externs]
        self.native = runtime.Program(
            so_path,
            cpp.params,
            max(64, cpp.arena_bytes),
            [list(g.meta(i).shape) for i in g.inputs],
            [g.meta(i).dtype for i in g.inputs],
            [list(g.meta(o).shape) for o in g.outputs],
            [g.meta(o).dtype for o in g.outputs],
            externs,
        )

    def __call__(self, inputs: Sequence[Tensor]) -> list[Tensor]:
        try:
            return self.native.run(list(inputs))
        except RuntimeError as err:
            if "kiln_entry returned 2" in str(err):  # a gather's index out of range
                raise index_error(self.prog, inputs) from None
            raise
