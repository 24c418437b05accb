"""Program -> Triton launches and ATen calls, in program order.

Each kernel of the orchestrated program becomes one launch of a generated Triton
kernel when a template covers it (``pointwise``, ``rows``, ``gemm``, ``chain``,
``copy``, ``cat``), an ``AttentionCall`` of the fused attention kernel; otherwise it becomes an ``AtenCall`` that evaluates its nodes with the
reference semantics on the device (cuDNN for convolutions and pooling, ATen for opaque
ops and gathers) and writes the results into their planned storage. Every such fallback is
listed with its reason, as on the CPU.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kiln.compiler.codegen.gpu.attention import AttentionCall, attention_call
from kiln.compiler.codegen.gpu.expr import Unsupported
from kiln.compiler.codegen.gpu.gemm import chain, gemm
from kiln.compiler.codegen.gpu.pointwise import cat, copy, pointwise
from kiln.compiler.codegen.gpu.rows import rows
from kiln.compiler.codegen.gpu.source import Launch
from kiln.compiler.fusion.program import Kernel, Program, is_extern
from kiln.compiler.ir.graph import OpClass


@dataclass(frozen=True)
class AtenCall:
    """Kernel ``kernel`` run node by node through ATen on the device."""

    kernel: int
    reason: str


Step = Launch | AtenCall | AttentionCall


@dataclass
class TritonProgram:
    steps: list[Step]
    native_kernels: list[int] = field(default_factory=list)
    fallbacks: list[tuple[int, str]] = field(default_factory=list)  # (kernel, reason)


def generate(prog: Program) -> TritonProgram:
    out = TritonProgram([])
    for i, k in enumerate(prog.kernels):
        if is_extern(prog.graph, k) or _library_pool(prog, k):
            out.steps.append(AtenCall(i, "library call"))
            continue
        try:
            step = _launch(prog, i, k)
        except Unsupported as why:
            out.steps.append(AtenCall(i, str(why)))
            out.fallbacks.append((i, str(why)))
            continue
        out.steps.append(step)
        out.native_kernels.append(i)
    return out


def _library_pool(prog: Program, k: Kernel) -> bool:
    """A lone ``pool2d``: ATen's (cuDNN's) pooling on the device, a library call like a
    conv, not a fallback (there is no Triton pooling template)."""
    return len(k.nodes) == 1 and prog.graph.node(k.nodes[0]).op == "pool2d"


def _launch(prog: Program, i: int, k: Kernel) -> Launch | AttentionCall:
    g = prog.graph
    if k.template == "attention":
        return attention_call(prog, i, k)
    nodes = [g.node(n) for n in k.nodes]
    if k.template == "copy":
        return copy(prog, i, k)
    classes = {n.cls for n in nodes}
    if k.template == "chain":
        return chain(prog, i, k, nodes)
    if classes == {OpClass.POINTWISE}:
        return pointwise(prog, i, k, nodes)
    if OpClass.REDUCTION in classes and classes <= {OpClass.REDUCTION, OpClass.POINTWISE}:
        return rows(prog, i, k, nodes)
    if len(nodes) == 1 and nodes[0].op == "cat":
        return cat(prog, i, k, nodes[0])
    if nodes[0].op in ("mm", "bmm") and classes <= {OpClass.GEMM, OpClass.POINTWISE}:
        return gemm(prog, i, k, nodes)
    raise Unsupported(f"no Triton template for {'+'.join(n.op for n in nodes)}")
