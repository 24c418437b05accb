"""Micro-benchmarks that fill a ``HardwareProfile`` for this CPU (about 1.5 s).

Each figure is the minimum over many short batches within a fixed time budget
(the machine may be shared, and noise only ever adds time):

* memory bandwidth: ``sum`` over a 128 MB float32 tensor (4x a typical L3);
* peak GFLOP/s: ``mm`` at 512x512x512; GEMM efficiency per shape class from
  ``mm`` at 8x64x64 (tiny) and 8x512x512 (small) on one thread against the
  one-thread peak, per-call overhead removed;
* library/PyTorch call cost: a 1-element ``add`` with ``out=``;
* native kernel fixed cost: the fork/join of one parallel region, from an
  ``add`` over 128K floats at ``threads`` threads against 1 thread
  (t_T = call + fork + work / T, t_1 = call + work).

Peak and bandwidth are measured at 1 and at ``threads`` threads and the better
is kept: on a shared machine a thread pool can wait for a descheduled thread.

The rates of kiln's own kernels (``KernelRates``) are derived from these figures
(``derive_kernel_rates``) until ``kiln calibrate`` fits them on programs of kiln's kernels
(``kiln.compiler.exec.calibrate_kernels``, which stores them with ``store_profile``).
"""

from __future__ import annotations

import os
import re
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import torch

from kiln.core.cache import cache_dir
from kiln.core.hardware import HardwareProfile, cpu_model, derive_kernel_rates, gemm_shape_class
from kiln.core.native import isa


def _best_us(fn: Callable[[], object], inner: int, budget_s: float) -> float:
    """Fastest mean time of ``inner`` back-to-back calls (µs), over as many batches as fit
    in ``budget_s`` (at least 3). Short batches catch the moments a shared machine is
    quiet; the minimum is the figure for an idle machine."""
    fn()  # warm-up: allocation, dispatch caches, thread pool start
    best = float("inf")
    stop = time.perf_counter() + budget_s
    batches = 0
    while batches < 3 or (time.perf_counter() < stop and batches < 200):
        t0 = time.perf_counter_ns()
        for _ in range(inner):
            fn()
        best = min(best, (time.perf_counter_ns() - t0) / inner / 1e3)
        batches += 1
    return best


def _mm_us(m: int, k: int, n: int, inner: int, budget_s: float) -> float:
    a, b, c = torch.randn(m, k), torch.randn(k, n), torch.empty(m, n)
    return _best_us(lambda: torch.mm(a, b, out=c), inner, budget_s)


def _bandwidth_gbs(numel: int) -> float:
    """Read bandwidth of ``sum`` over a float32 tensor of ``numel`` elements (GB/s)."""
    big = torch.ones(numel)
    return big.nbytes / (_best_us(lambda: big.sum(), inner=1, budget_s=0.3) * 1e3)


def cache_bytes() -> tuple[int, int, int]:
    """(L1d, L2, L3) from sysfs, falling back to sysconf, 0 where unknown."""
    sizes = {1: 0, 2: 0, 3: 0}
    base = "/sys/devices/system/cpu/cpu0/cache"
    try:
        for entry in sorted(os.listdir(base)):
            if not entry.startswith("index"):
                continue
            with open(f"{base}/{entry}/level") as f:
                level = int(f.read())
            with open(f"{base}/{entry}/type") as f:
                kind = f.read().strip()
            with open(f"{base}/{entry}/size") as f:
                text = f.read().strip().upper()
            mult = {"K": 1024, "M": 1024**2, "G": 1024**3}.get(text[-1:], 1)
            if kind != "Instruction" and level in sizes:
                sizes[level] = int(text.rstrip("KMG")) * mult
    except (OSError, ValueError):
        names = {1: "SC_LEVEL1_DCACHE_SIZE", 2: "SC_LEVEL2_CACHE_SIZE", 3: "SC_LEVEL3_CACHE_SIZE"}
        for level, name in names.items():
            try:
                sizes[level] = max(0, os.sysconf(name))
            except (ValueError, OSError):
                sizes[level] = 0
    return sizes[1], sizes[2], sizes[3]


def _isa() -> str:
    """The vector ISA torch dispatches to here (avx512, avx2, default, ...)."""
    try:
        return str(torch.backends.cpu.get_cpu_capability()).lower()
    except (AttributeError, RuntimeError):
        return "default"


def calibrate(threads: int = 2) -> HardwareProfile:
    """Measure this CPU for ``threads`` torch threads. Restores the thread count after."""
    saved = torch.get_num_threads()
    try:
        with torch.no_grad():
            return _measure(threads)
    finally:
        torch.set_num_threads(saved)


def _rates(threads: int) -> tuple[float, float, float]:
    """(GEMM GFLOP/s at 512^3, read GB/s, µs of a 128K-float add) at ``threads``."""
    torch.set_num_threads(threads)
    m = 512
    peak = 2.0 * m**3 / (_mm_us(m, m, m, inner=1, budget_s=0.3) * 1e3)
    bw = _bandwidth_gbs(32 * 1024 * 1024)  # 128 MB
    n = 128 * 1024  # above at::parallel_for's grain size: a real parallel region
    xa, xb, xc = torch.ones(n), torch.ones(n), torch.empty(n)
    add_us = _best_us(lambda: torch.add(xa, xb, out=xc), inner=10, budget_s=0.2)
    return peak, bw, add_us


def _measure(threads: int) -> HardwareProfile:
    torch.set_num_threads(1)
    one_a, one_b, one_c = torch.ones(1), torch.ones(1), torch.empty(1)
    call_us = _best_us(lambda: torch.add(one_a, one_b, out=one_c), inner=100, budget_s=0.1)
    # small GEMMs against the 1-thread peak: at these sizes threads barely help
    peak_1, bw_1, add_1 = _rates(1)
    eff = {gemm_shape_class(2.0 * 512**3): 1.0}
    for mm, kk, nn in ((8, 64, 64), (8, 512, 512)):
        flops = 2.0 * mm * kk * nn
        t_mm = _mm_us(mm, kk, nn, inner=20, budget_s=0.1)
        t = max(t_mm - call_us, 0.25 * t_mm)  # the call overhead estimate is noisy
        eff[gemm_shape_class(flops)] = min(1.0, flops / (t * 1e3) / peak_1)
    peak, bw, fork = peak_1, bw_1, 0.0
    if threads > 1:
        # a thread pool on a busy machine can run slower than one thread: never report
        # less than the 1-thread figures, and clamp the fork/join cost
        peak_t, bw_t, add_t = _rates(threads)
        peak, bw = max(peak_t, peak_1), max(bw_t, bw_1)
        work = max(add_1 - call_us, 0.0)
        fork = add_t - call_us - work / threads
    kernel_fixed = min(max(fork, 0.05), 10.0)

    prof = HardwareProfile(
        name=f"{cpu_model()} ({threads}t)",
        isa=_isa(),
        threads=threads,
        peak_gflops=round(peak, 2),
        mem_bw_gbs=round(bw, 2),
        cache_bytes=cache_bytes(),
        kernel_fixed_us=round(kernel_fixed, 3),
        extern_call_us=round(call_us, 3),
        gemm_efficiency={k: round(v, 4) for k, v in eff.items()},
    )
    return replace(prof, kernels=derive_kernel_rates(prof))


def profile_path(threads: int) -> Path:
    """Where this machine's profile at ``threads`` threads is cached: keyed by the CPU's
    name, its instruction set and the thread count (hosts sharing a marketing name, such as
    Zen 3 and Zen 5 "AMD EPYC", differ in ISA and speed)."""
    slug = re.sub(r"[^a-z0-9]+", "-", cpu_model().lower()).strip("-") or "cpu"
    return cache_dir() / f"hardware-{slug}-{isa()}-{threads}t.json"


def load_profile(threads: int = 2, refresh: bool = False) -> HardwareProfile:
    """This machine's profile at ``threads`` threads: cached JSON, else calibrated now
    (about a second) and cached. ``refresh=True`` recalibrates (the quick figures; the
    kernel rates are then derived again until ``kiln calibrate`` fits them). A profile
    cached before kernel rates existed gets derived ones."""
    path = profile_path(threads)
    if not refresh and path.exists():
        try:
            prof = HardwareProfile.from_json(path.read_text(encoding="utf-8"))
            if prof.kernels is None:
                prof = replace(prof, kernels=derive_kernel_rates(prof))
            return prof
        except (ValueError, KeyError, TypeError):
            pass  # stale or corrupt cache entry: recalibrate below
    return store_profile(calibrate(threads))


def store_profile(prof: HardwareProfile) -> HardwareProfile:
    """Cache ``prof`` as this machine's profile at its thread count; returns it."""
    path = profile_path(prof.threads)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".{os.getpid()}.tmp")
    tmp.write_text(prof.to_json(), encoding="utf-8")
    tmp.replace(path)  # atomic: concurrent processes never read half a file
    return prof
