"""The calibrated CPU cost model: fitting ``KernelRates`` recovers known rates, cache-level
bandwidth choice, and hand-checked native kernel times."""

from __future__ import annotations

import math
import random
from dataclasses import fields, replace

import pytest
import torch

from kiln.compiler.fusion.cost import estimate
from kiln.compiler.fusion.cost_fit import Sample, fit_kernel_rates, log_errors, probe_samples
from kiln.compiler.fusion.cpu_cost import busiest, gemm_rate, level, native_time
from kiln.compiler.fusion.probes import probe_programs
from kiln.compiler.ir.graph import Graph
from kiln.core.hardware import HardwareProfile, KernelRates, reference_cpu_profile
from tests.compiler.fusion.orch_graphs import meta, op
from tests.compiler.fusion.test_cost import whole

# small caches keep the probe programs' weights small (L2 256 KB per core, L3 4 MB)
PROFILE = replace(reference_cpu_profile(2), cache_bytes=(32768, 256 * 1024, 4 << 20))
TRUE = PROFILE.kernels
assert TRUE is not None


def synthetic(rates: KernelRates, noise: float = 0.0, seed: int = 0) -> list[Sample]:
    """Every probe kernel at 1 and 2 threads, "measured" as the model predicts under
    ``rates``, times lognormal noise of relative size ``noise``."""
    rng = random.Random(seed)
    samples = []
    for program in probe_programs(PROFILE.cache_bytes):
        for threads in (1, 2):
            at = replace(PROFILE, threads=threads)
            for s in probe_samples(program, PROFILE, threads, [1.0] * len(program.kernels)):
                t = native_time(s.work, at, rates) * math.exp(rng.gauss(0.0, noise))
                samples.append(Sample(s.work, threads, t))
    return samples


def far_start() -> KernelRates:
    """A start well away from ``TRUE``: rates 1.5x / 0.7x, overheads 2-5x off."""
    assert TRUE is not None
    return replace(
        TRUE.scaled(1.5, 0.7), serial_us=0.1, parallel_us=2.0, gemm_us=0.5,
        gemm_step_extra=1.0, row_ns=5.0, unhidden=0.6,
    )  # fmt: skip


def values(r: KernelRates) -> dict[str, float]:
    out: dict[str, float] = {}
    for f in fields(r):
        v = getattr(r, f.name)
        if isinstance(v, tuple):
            out.update({f"{f.name}[{i}]": x for i, x in enumerate(v)})
        elif not isinstance(v, bool):
            out[f.name] = v
    return out


def test_fit_recovers_the_rates_that_generated_the_measurements() -> None:
    samples = synthetic(TRUE)
    fit = fit_kernel_rates(samples, PROFILE, far_start())
    assert fit.fitted
    for name, want in values(TRUE).items():
        assert values(fit)[name] == pytest.approx(want, rel=1e-4), name
    assert max(abs(log_errors(samples, PROFILE, fit))) < 1e-3  # reproduces what it was fit on


def test_fit_is_robust_to_noise_and_contended_outliers() -> None:
    samples = synthetic(TRUE, noise=0.05, seed=1)
    # a co-tenant held a core while a few parallel kernels ran: 20x slower
    for i in range(0, len(samples), 25):
        samples[i] = replace(samples[i], measured_us=samples[i].measured_us * 20)
    fit = fit_kernel_rates(samples, PROFILE, far_start())
    for name in ("parallel_us", "read_gbs[0]", "serial_read_gbs[1]", "gemm_gflops[3]",
                 "pointwise_gflops", "dwconv_gflops"):  # fmt: skip
        assert values(fit)[name] == pytest.approx(values(TRUE)[name], rel=0.15), name


def test_single_thread_profiles_tie_parallel_to_serial_rates() -> None:
    one = replace(PROFILE, threads=1)
    samples = [s for s in synthetic(TRUE) if s.threads == 1]
    fit = fit_kernel_rates(samples, one, far_start())
    assert fit.parallel_us == fit.serial_us and fit.read_gbs == fit.serial_read_gbs
    assert fit.serial_read_gbs[0] == pytest.approx(TRUE.serial_read_gbs[0], rel=1e-3)


def gemv(k: int, n: int, m: int = 1) -> Graph:
    g = Graph()
    x = g.add_input("x", meta(m, k))
    w = g.add_constant("w", torch.randn(k, n))
    g.outputs = [op(g, "mm", (x, w), (m, n))]
    return g


def test_weights_are_read_from_the_level_holding_all_of_them() -> None:
    """A GEMV's weight comes at L2, L3 or DRAM bandwidth by the model's total weight bytes
    (the same 1 MB weight in a model of 1 MB, 8 MB and 64 MB of weights)."""
    assert TRUE is not None
    fast = replace(TRUE, gemm_gflops=(1e4,) * 4)  # memory-bound whatever the bandwidth
    p = replace(PROFILE, cache_bytes=(32768, 1 << 20, 32 << 20), kernels=fast)
    times = []
    for extra in (0, 7 << 20, 63 << 20):
        g = gemv(512, 512)
        if extra:
            g.add_constant("other", torch.empty(extra // 4))
        times.append(estimate(whole(g), g, p))
    # 1 MB over two threads' L2 (2 MB), then L3, then DRAM: slower each time
    assert times[0] < times[1] < times[2]
    w = 512 * 512 * 4
    for t, bw in zip(times, TRUE.read_gbs):
        assert t == pytest.approx(TRUE.parallel_us + TRUE.gemm_us + w / (bw * 1e3), rel=0.02)


def test_level_and_parallel_split_by_hand() -> None:
    p = replace(PROFILE, cache_bytes=(32768, 1 << 20, 32 << 20))
    assert level(1 << 20, 1, p) == 0 and level(2 << 20, 1, p) == 1 and level(2 << 20, 2, p) == 0
    assert level(32 << 20, 2, p) == 1 and level((32 << 20) + 1, 2, p) == 2
    assert busiest(8, 3, 2) == (4, 2)  # two chunks of 4
    assert busiest(3, 3, 2) == (3, 1)  # within one grain: inline
    assert busiest(100, 1, 1) == (100, 1)
    assert busiest(5, 2, 2) == (3, 2)  # imbalance: the busiest thread has 3


def overlapped(a: float, b: float) -> float:
    assert TRUE is not None
    return max(a, b) + TRUE.unhidden * min(a, b)


def test_pointwise_and_gemm_by_hand() -> None:
    assert TRUE is not None
    g = Graph()
    x = g.add_input("x", meta(64, 128))
    g.outputs = [op(g, "exp", (x,), (64, 128))]
    # 8192 elements: one thread; 64 KB of activations in L2; exp = 10 FLOPs an element
    memory = 2 * 64 * 128 * 4 / (TRUE.serial_read_gbs[0] * 1e3)
    compute = 10 * 64 * 128 / (TRUE.pointwise_gflops * 1e3)
    want = TRUE.serial_us + overlapped(memory, compute)
    assert estimate(whole(g), g, PROFILE) == pytest.approx(want)
    # 12 x 64 @ 64 x 32: one panel, one register block of MR = 12 rows, serial, all in L2
    g = gemv(64, 32, m=12)
    flops = 2 * 12 * 32 * (64 + TRUE.gemm_step_extra)
    compute = flops / (TRUE.gemm_gflops[3] * 1e3)
    memory = 4 * (12 * 64 + 64 * 32 + 12 * 32) / (TRUE.serial_read_gbs[0] * 1e3)
    fixed = TRUE.serial_us + TRUE.gemm_us
    assert estimate(whole(g), g, PROFILE) == pytest.approx(fixed + overlapped(compute, memory))
    assert gemm_rate(3.0, TRUE, "avx512") == pytest.approx(
        (TRUE.gemm_gflops[1] + TRUE.gemm_gflops[2]) / 2
    )


def test_pool_by_hand() -> None:
    """A ``pool2d`` on both threads (>= 32768 input elements): input and output bytes from
    L2, its taps (channels rounded up to whole vectors) as pointwise work; on NCHW values
    the taps (output columns rounded up) cost 1.5x, and the scratch plane's copy 2 each."""
    assert TRUE is not None
    attrs = {"mode": "max", "kernel": (3, 3), "stride": (2, 2), "padding": (1, 1)}
    g = Graph()
    x = g.add_input("x", meta(1, 56, 56, 20))
    g.outputs = [op(g, "pool2d", (x,), (1, 28, 28, 20), **attrs, channels_last=True)]
    memory = 4 * 20 * (56 * 56 + 28 * 28) / (TRUE.read_gbs[0] * 1e3)
    compute = 9 * 28 * 28 * 32 / (TRUE.pointwise_gflops * 1e3) / 2  # avx512: 2 vectors
    want = TRUE.parallel_us + overlapped(memory, compute)
    assert estimate(whole(g), g, PROFILE) == pytest.approx(want)
    g = Graph()
    x = g.add_input("x", meta(1, 20, 56, 56))
    g.outputs = [op(g, "pool2d", (x,), (1, 20, 28, 28), **attrs, channels_last=False)]
    scratch = 57 * 2 * 48  # rows (27 * 2 + 3) x phases x 32 + 1 columns, to whole lines
    compute = 20 * (1.5 * 9 * 28 * 32 + 2 * scratch) / (TRUE.pointwise_gflops * 1e3) / 2
    want = TRUE.parallel_us + overlapped(memory, compute)
    assert estimate(whole(g), g, PROFILE) == pytest.approx(want)


def test_profiles_without_kernel_rates_keep_the_roofline() -> None:
    """A device-neutral profile (no ``KernelRates``) is priced as before."""
    bare = HardwareProfile("x", "avx2", 2, 100.0, 10.0, (0, 1 << 20, 0), 1.0, 5.0, {})
    g = Graph()
    x = g.add_input("x", meta(64, 128))
    g.outputs = [op(g, "exp", (x,), (64, 128))]
    assert estimate(whole(g), g, bare) == pytest.approx(65536 / 1e4 + 1.0)
