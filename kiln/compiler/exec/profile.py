"""Per-kernel timing of a compiled program: the "measured" column of the report.

A profiling build of the same program times every kernel call with a steady clock
(the counters live in the program; ``kiln_profile()`` exposes them) — the production
build carries no timing code.
"""

from __future__ import annotations

import ctypes
from collections.abc import Sequence

import torch

from kiln.compiler.codegen.cpu import build
from kiln.compiler.codegen.cpu.codegen import generate
from kiln.compiler.codegen.cpu.pack import nr as panel_width
from kiln.compiler.exec.compiled import CompiledModule
from kiln.compiler.exec.executors import NativeExecutor


def profile_kernels(
    compiled: CompiledModule, inputs: Sequence[torch.Tensor], iters: int = 50, warmup: int = 5
) -> list[float]:
    """Mean µs per call of each kernel (last entry: final output copies); also fills
    ``compiled.report.kernels[i].measured_us``."""
    prog = compiled.program
    if prog is None:
        raise ValueError("this module has no orchestrated program to profile")
    cpp = generate(prog, panel_width(build.isa()), profile=True)
    so = build.compile_program(cpp.source)
    native = NativeExecutor(prog, cpp, str(so), build.load_runtime())
    lib = ctypes.CDLL(str(so))
    lib.kiln_profile.restype = ctypes.POINTER(ctypes.c_double)
    counters = lib.kiln_profile()
    flat = [t.contiguous() for t in inputs]
    n = len(prog.kernels) + 1
    with torch.no_grad():
        for _ in range(warmup):
            native(flat)
        for i in range(n):
            counters[i] = 0.0
        for _ in range(iters):
            native(flat)
    times = [counters[i] / iters for i in range(n)]
    for k in compiled.report.kernels:
        k.measured_us = times[k.index]
    return times
