"""The kernel part of ``kiln calibrate``: time kiln's own kernels, fit ``KernelRates``.

The probe programs (``fusion/probes.py``: GEMVs over weights in L2, L3 and DRAM, GEMMs of
1 to 512 rows, runtime-operand GEMMs, pointwise chains, softmax rows, depthwise convs)
are built with profiling counters and run at one thread and at the profile's thread
count, every kernel timed in the steady state (``profile_program``: the best of several
rounds, each started once co-tenants of a shared machine are quiet). ``fit_kernel_rates``
fits the CPU cost model's parameters to them; the profile is cached with them, so every
later ``kiln.compile`` on this machine prices kernels with the fitted rates. About a
minute the first time (mostly C++ builds, cached), seconds after.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import replace

import torch

from kiln.compiler.exec.profile import profile_program
from kiln.compiler.fusion.cost_fit import Sample, fit_kernel_rates, probe_samples
from kiln.compiler.fusion.probes import ProbeProgram, probe_programs
from kiln.compiler.fusion.program import Kernel, build_program
from kiln.core.calibrate import load_profile, store_profile
from kiln.core.hardware import HardwareProfile, derive_kernel_rates
from kiln.core.host_load import machine_busy_s

Note = Callable[[str], object]


def wait_quiet(max_wait_s: float = 0.3, threshold: float = 0.15) -> None:
    """Wait (at most ``max_wait_s``) until at most ``threshold`` of all CPUs were busy over
    the last 20 ms: timing starts in a quiet moment of a shared machine when there is one
    (niced work counts too: a parallel region still waits for a thread it delays)."""
    deadline = time.monotonic() + max_wait_s
    while time.monotonic() < deadline:
        before = machine_busy_s()
        time.sleep(0.02)
        after = machine_busy_s()
        if before is None or after is None:  # no /proc/stat: nothing to wait for
            return
        if after[0] - before[0] <= threshold * max(after[1] - before[1], 1e-9):
            return


def time_probe(program: ProbeProgram, threads: int, iters: int, rounds: int) -> list[float]:
    """µs per kernel of one probe program at ``threads`` threads (torch's thread count is
    set to it; the caller restores it)."""
    g = program.graph
    pos = {n.name: i for i, n in enumerate(g.nodes)}
    kernels = [
        Kernel(c.template, tuple(sorted(c.nodes, key=pos.__getitem__)), c.outputs, c.inputs)
        for c in program.kernels
    ]
    torch.set_num_threads(threads)
    prog = build_program(g, kernels)
    return profile_program(
        prog, program.inputs(), iters, warmup=3, rounds=rounds, threads=threads,
        before_round=wait_quiet,
    )  # fmt: skip


def slowed(parallel: float, serial: float) -> bool:
    """Whether a kernel timed on several threads ran while a co-tenant held a core: far
    slower than on one thread (a parallel region waits for a descheduled thread)."""
    return parallel > 1.5 * serial + 2.0


def contended(parallel: list[float], serial: list[float]) -> bool:
    """Whether any kernel of a program timed on several threads was ``slowed``."""
    return any(slowed(t, s) for t, s in zip(parallel, serial))


def measure_samples(
    profile: HardwareProfile, iters: int = 5, rounds: int = 20, note: Note | None = None
) -> list[Sample]:
    """Every probe kernel timed at one thread and at ``profile.threads``. Programs whose
    parallel run looks ``contended`` are timed again after all the others (three times at
    most, each after waiting for a quiet machine, the best time of each kernel kept): a
    co-tenant that held a core may be gone by then. Kernels still ``slowed`` are left out."""
    programs = probe_programs(profile.cache_bytes)
    counts = sorted({1, profile.threads})
    best: dict[tuple[str, int], list[float]] = {}
    saved = torch.get_num_threads()
    try:
        todo = [(p, t) for p in programs for t in counts]
        for attempt in range(4):
            if attempt:
                wait_quiet(max_wait_s=5.0)
            for p, threads in todo:
                if note:
                    note(f"timing kiln's {p.name} kernels at {threads} thread(s)")
                times = time_probe(p, threads, iters, rounds)
                old = best.get((p.name, threads), times)
                best[(p.name, threads)] = [min(a, b) for a, b in zip(old, times)]
            todo = [
                (p, t) for p, t in todo
                if t > 1 and contended(best[(p.name, t)], best[(p.name, 1)])
            ]  # fmt: skip
    finally:
        torch.set_num_threads(saved)
    samples: list[Sample] = []
    for p in programs:
        for threads in counts:
            times = best[(p.name, threads)]
            if threads > 1:
                times = [-1.0 if slowed(t, s) else t for t, s in zip(times, best[(p.name, 1)])]
            samples += probe_samples(p, profile, threads, times)
    return samples


def calibrate_kernels(profile: HardwareProfile, note: Note | None = None) -> HardwareProfile:
    """``profile`` with ``KernelRates`` fitted on this machine's kernels."""
    samples = measure_samples(profile, note=note)
    if note:
        note(f"fitting the cost model to {len(samples)} kernels")
    start = profile.kernels or derive_kernel_rates(profile)
    return replace(profile, kernels=fit_kernel_rates(samples, profile, start))


def load_fitted_profile(
    threads: int = 2, refresh: bool = False, note: Note | None = None
) -> HardwareProfile:
    """This machine's profile with fitted kernel rates: the cached one if they are fitted,
    else calibrated now and cached (``refresh``: recalibrate everything)."""
    profile = load_profile(threads, refresh=refresh)
    if profile.kernels is not None and profile.kernels.fitted and not refresh:
        return profile
    return store_profile(calibrate_kernels(profile, note))
