"""Per-kernel timing of a compiled program: the "measured" column of the report.

A profiling build of the same program times every kernel call with a steady clock
(the counters live in the program; ``kiln_profile()`` exposes them) — the production
build carries no timing code. The whole program runs again and again, so each kernel
is timed in the steady state a served model runs in (weights and small activations
warm in the caches the program leaves them in).
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable, Sequence

import torch

from kiln.compiler.codegen.cpu import build
from kiln.compiler.codegen.cpu.codegen import generate
from kiln.compiler.codegen.cpu.pack import nr as panel_width
from kiln.compiler.exec.compiled import CompiledModule
from kiln.compiler.exec.executors import NativeExecutor
from kiln.compiler.fusion.program import Program


def profile_program(
    prog: Program,
    inputs: Sequence[torch.Tensor],
    iters: int = 50,
    warmup: int = 5,
    rounds: int = 1,
    threads: int | None = None,
    before_round: Callable[[], object] | None = None,
) -> list[float]:
    """µs per call of each kernel of ``prog`` (last entry: final output copies): the
    mean over ``iters`` calls, the smallest such mean over ``rounds`` rounds (noise on a
    shared machine only ever adds time). ``threads``: the thread count the program is
    generated for (default: torch's); ``before_round`` runs before each round (e.g. wait
    for co-tenants to go quiet)."""
    cpp = generate(prog, panel_width(build.isa()), threads=threads, profile=True)
    so = build.compile_program(cpp.source)
    native = NativeExecutor(prog, cpp, str(so), build.load_runtime())
    lib = ctypes.CDLL(str(so))
    lib.kiln_profile.restype = ctypes.POINTER(ctypes.c_double)
    counters = lib.kiln_profile()
    flat = [t.contiguous() for t in inputs]
    n = len(prog.kernels) + 1
    best = [float("inf")] * n
    with torch.no_grad():
        for _ in range(warmup):
            native(flat)
        for _ in range(rounds):
            if before_round is not None:
                before_round()
            for i in range(n):
                counters[i] = 0.0
            for _ in range(iters):
                native(flat)
            best = [min(b, counters[i] / iters) for i, b in enumerate(best)]
    return best


def profile_kernels(
    compiled: CompiledModule,
    inputs: Sequence[torch.Tensor],
    iters: int = 50,
    warmup: int = 5,
    rounds: int = 1,
) -> list[float]:
    """Mean µs per call of each kernel (last entry: final output copies; with ``rounds``,
    the best round's); also fills ``compiled.report.kernels[i].measured_us``."""
    prog = compiled.program
    if prog is None:
        raise ValueError("this module has no orchestrated program to profile")
    times = profile_program(prog, inputs, iters, warmup, rounds)
    for k in compiled.report.kernels:
        k.measured_us = times[k.index]
    return times
