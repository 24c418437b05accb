"""The Triton backend of ``kiln.compile``: generate, build the executor, report."""

from __future__ import annotations

import time

import torch

from kiln.compiler.codegen.gpu.codegen import AtenCall, generate
from kiln.compiler.codegen.gpu.source import interpreting
from kiln.compiler.exec.compiled import CompiledModule
from kiln.compiler.exec.gpu import TritonExecutor
from kiln.compiler.exec.report import CompileReport, Fallback, KernelReport
from kiln.compiler.fusion.program import Program


def build(prog: Program, device: str, graphs: bool, report: CompileReport) -> CompiledModule:
    """A ``CompiledModule`` running ``prog`` as Triton kernels on ``device`` (a CUDA
    device, or the CPU under ``TRITON_INTERPRET=1``)."""
    dev = torch.device(device)
    if dev.type != "cuda" and not interpreting():
        raise RuntimeError(
            "the triton backend needs a CUDA device, or TRITON_INTERPRET=1 to run its "
            "kernels through Triton's interpreter on the CPU (for testing)"
        )
    t0 = time.perf_counter()
    tprog = generate(prog)
    report.timings_s["codegen"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    ex = TritonExecutor(prog, tprog, dev, graphs=graphs)
    report.timings_s["build"] = time.perf_counter() - t0
    report.graph_captured = ex.graph is not None
    report.arena_bytes = prog.arena_bytes
    if ex.tuned:
        report.timings_s["tuned kernels"] = float(ex.tuned)
    if dev.type != "cuda":
        report.executor = "triton (interpreter)"
    elif ex.graph is not None:
        report.executor = "triton + CUDA graph"
    else:
        report.executor = "triton"
        if graphs:
            report.fallbacks.append(Fallback("CUDA graph", ex.graph_error))
    g = prog.graph
    fallback = dict(tprog.fallbacks)
    for step in tprog.steps:
        i = step.kernel
        k = prog.kernels[i]
        ops = [g.node(n).op for n in k.nodes] or ["copy"]
        if isinstance(step, AtenCall):
            ex_name = "fallback" if i in fallback else "extern"
            if i in fallback:
                report.fallbacks.append(Fallback("+".join(ops), fallback[i]))
        else:
            ex_name = "native"
        report.kernels.append(
            KernelReport(i, k.template, ops, ex_name, k.cost_us, note=fallback.get(i, ""))
        )
    compiled = CompiledModule(ex, g, prog, report, out_spec=None)
    compiled.native_program = tprog
    return compiled
