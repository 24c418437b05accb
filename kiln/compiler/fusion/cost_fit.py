"""Fitting ``KernelRates`` to measured kernel times: the calibrated CPU model's parameters.

A sample is one timed kernel: its ``NativeWork`` (what ``cost.calibrated_work`` reads off
its graph), the threads its program ran with and the measured µs. The fit minimises the
robust (soft-L1) sum of squared *log* errors ``log(pred / meas)`` of ``native_time`` over
every sample, all parameters at once, each searched in log space (positive, and relative
errors weigh a 1 µs kernel like a 1 ms one) within ``SEARCH_SPAN`` of its start (the rates
derived from the quick profile). Samples the first fit misses by more than 3x (a shared
machine's co-tenant woke up mid-measurement) are dropped and the fit repeated. A profile
of one thread has no parallel parameters: they are tied to the serial ones.

The parameters are those of ``KernelRates`` (see ``cpu_cost.py`` for the formula), so the
fit is the model reproducing its own measurements, and fitting samples generated from
known rates recovers them (``tests/compiler/fusion/test_cost_fit.py``).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, replace

import numpy as np
from scipy.optimize import least_squares

from kiln.compiler.fusion.cost import GraphLookup, calibrated_work
from kiln.compiler.fusion.cpu_cost import NativeWork, native_time
from kiln.compiler.fusion.probes import ProbeProgram
from kiln.core.hardware import HardwareProfile, KernelRates

# KernelRates fields searched, in vector order; tuples expand to their entries.
_SCALARS = ("serial_us", "parallel_us", "gemm_us", "gemm_step_extra", "pack_gbs", "gather_gbs",
            "pointwise_gflops", "row_ns", "dwconv_gflops",
            "unhidden")  # fmt: skip
_TUPLES = (("read_gbs", 3), ("serial_read_gbs", 3))  # then gemm_gflops, see to_vector
# fixed costs and step / row overheads may fit to ~0: searched as log(x + floor)
_FLOOR = dict.fromkeys(
    ("serial_us", "parallel_us", "gemm_us", "gemm_step_extra", "row_ns",
     "unhidden"), 1e-3,
)  # fmt: skip
N_GEMM_STEPS = 3
SEARCH_SPAN = math.log(30.0)  # each parameter within 30x of its starting value
OUTLIER_LOG_ERROR = math.log(3.0)  # a sample 3x off after the first fit is noise


@dataclass(frozen=True)
class Sample:
    """One measured kernel: its work, the threads its program ran with, its µs."""

    work: NativeWork
    threads: int
    measured_us: float


def probe_samples(
    program: ProbeProgram, profile: HardwareProfile, threads: int, times: Sequence[float]
) -> list[Sample]:
    """Samples of a timed probe program (``times`` per kernel; the warm-up and sink
    kernels and the final-copies entry are left out)."""
    lk = GraphLookup(program.graph)
    out = []
    for cand, probe, t in zip(program.kernels, program.fitted, times):
        work = calibrated_work(cand, program.graph, profile, lk) if probe else None
        if work is not None and t > 0:
            out.append(Sample(work, threads, float(t)))
    return out


def to_vector(rates: KernelRates) -> np.ndarray:
    """The searched parameters of ``rates`` (log space). The GEMM rates are searched as
    the rate at MR and three log-ratios >= 0 down to R = 4, 2, 1 (``N_GEMM_STEPS``): the
    micro-kernel is never faster with fewer rows (a rate no sample pins down stays
    monotone rather than wandering past peak)."""
    vals = [getattr(rates, f) + _FLOOR.get(f, 0.0) for f in _SCALARS]
    for f, _ in _TUPLES:
        vals += list(getattr(rates, f))
    x = list(np.log(np.asarray(vals, dtype=float)))
    g = np.log(np.asarray(rates.gemm_gflops, dtype=float))
    x += [g[3], *(max(0.0, g[i + 1] - g[i]) for i in (2, 1, 0))]
    return np.asarray(x)


def from_vector(x: np.ndarray, fitted: bool, single_thread: bool) -> KernelRates:
    """``KernelRates`` from a parameter vector (``to_vector``'s inverse)."""
    v = np.exp(x)
    d: dict[str, object] = {}
    for i, f in enumerate(_SCALARS):
        d[f] = max(float(v[i]) - _FLOOR.get(f, 0.0), 0.0)
    i = len(_SCALARS)
    for f, n in _TUPLES:
        d[f] = tuple(float(y) for y in v[i : i + n])
        i += n
    top, steps = x[i], x[i + 1 : i + 4]  # rate at MR; log-ratios MR/4, 4/2, 2/1
    d["gemm_gflops"] = tuple(float(np.exp(top - steps[: 3 - j].sum())) for j in (0, 1, 2)) + (
        float(np.exp(top)),
    )
    if single_thread:
        d["parallel_us"], d["read_gbs"] = d["serial_us"], d["serial_read_gbs"]
    return KernelRates(fitted=fitted, **d)  # type: ignore[arg-type]


def log_errors(
    samples: Sequence[Sample], profile: HardwareProfile, rates: KernelRates
) -> np.ndarray:
    """``log(pred / meas)`` of every sample under ``rates``."""
    profiles: dict[int, HardwareProfile] = {}
    out = np.empty(len(samples))
    for j, s in enumerate(samples):
        p = profiles.setdefault(s.threads, replace(profile, threads=s.threads))
        out[j] = math.log(native_time(s.work, p, rates) / s.measured_us)
    return out


def fit_kernel_rates(
    samples: Sequence[Sample], profile: HardwareProfile, start: KernelRates
) -> KernelRates:
    """The ``KernelRates`` that best reproduce ``samples`` (from ``start``); ``profile``
    gives the ISA, caches and the thread count the rates are for."""
    single = profile.threads == 1
    x0 = to_vector(start)
    lower, upper = x0 - SEARCH_SPAN, x0 + SEARCH_SPAN
    lower[-N_GEMM_STEPS:], upper[-N_GEMM_STEPS:] = 0.0, SEARCH_SPAN  # monotone GEMM rates
    i = _SCALARS.index("unhidden")  # a fraction: at most 1
    lower[i], upper[i] = math.log(_FLOOR["unhidden"]), math.log(1.0 + _FLOOR["unhidden"])
    x0[i] = min(max(x0[i], lower[i]), upper[i])
    bounds = (lower, upper)
    kept = list(samples)
    for _ in range(2):  # fit, drop the samples it cannot explain (noise), fit again

        def residuals(x: np.ndarray, kept: list[Sample] = kept) -> np.ndarray:
            return log_errors(kept, profile, from_vector(x, True, single))

        fit = least_squares(residuals, x0, bounds=bounds, loss="soft_l1", f_scale=0.2)
        x0 = fit.x
        errors = np.abs(log_errors(samples, profile, from_vector(x0, True, single)))
        kept = [s for s, e in zip(samples, errors) if e <= OUTLIER_LOG_ERROR]
    return from_vector(x0, True, single)
