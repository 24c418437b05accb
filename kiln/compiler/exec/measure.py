"""Measured candidate costs: each candidate kernel built alone and timed on this machine.

Used by ``kiln.compile(..., measure=True)`` through ``CostModel(measure=...)``, which
caches every timing on disk by the kernel's structure and shapes — the first compile
of a model builds one small program per distinct candidate (slow: about a second
each), later compiles of any model sharing those kernels read the cache.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch

from kiln.compiler.exec.compiled import CompiledModule
from kiln.compiler.fusion.candidates import Candidate
from kiln.compiler.fusion.program import Kernel
from kiln.compiler.ir.graph import Graph, ValueKind


def subgraph(graph: Graph, cand: Candidate) -> Graph:
    """The candidate's nodes as a graph of their own: external values become inputs
    (constants stay constants), the candidate's outputs become outputs."""
    sub = Graph()
    order = [n for n in graph.nodes if n.name in cand.nodes]
    inside = {n.output for n in order}
    for n in order:
        for v in n.inputs:
            if v in inside or v in sub.values:
                continue
            if graph.values[v].kind in (ValueKind.PARAM, ValueKind.CONST):
                sub.add_constant(v, graph.constants[v])
            else:
                sub.add_input(v, graph.meta(v))
        sub.add_node(n.op, n.inputs, graph.meta(n.output), n.attrs, name=n.name)
    sub.outputs = list(cand.outputs)
    return sub


def _random(meta: object) -> torch.Tensor:
    shape, dtype = meta.shape, meta.dtype  # type: ignore[attr-defined]
    if dtype.is_floating_point:
        return torch.randn(shape, dtype=dtype)
    if dtype == torch.bool:
        return torch.rand(shape) > 0.5
    return torch.zeros(shape, dtype=dtype)


# Builds one program from a graph and the kernels to run it with (the compiler's entry
# point, passed in by ``kiln.compiler.api`` so that this module does not import it).
BuildFn = Callable[[Graph, list[Kernel]], CompiledModule]


def measurer(graph: Graph, build: BuildFn, reps: int = 20) -> Callable[[Candidate], float]:
    """``measure(candidate) -> µs`` for candidates of ``graph``, each built alone by ``build``."""

    def measure(cand: Candidate) -> float:
        sub = subgraph(graph, cand)
        order = tuple(n.name for n in sub.nodes)
        kernel = Kernel(cand.template, order, tuple(cand.outputs), tuple(sub.inputs))
        compiled = build(sub, [kernel])
        inputs = [_random(sub.meta(v)) for v in sub.inputs]
        for _ in range(3):
            compiled.run_flat(inputs)
        best = float("inf")
        for _ in range(3):
            t0 = time.perf_counter()
            for _ in range(reps):
                compiled.run_flat(inputs)
            best = min(best, (time.perf_counter() - t0) / reps * 1e6)
        return best

    return measure
