"""``HardwareProfile``: the few device numbers the cost model needs, and their cache.

A profile is device-neutral on purpose: the cost model only ever asks for peak
compute, memory bandwidth, caches, the fixed cost of one native kernel (a
parallel region on a CPU, a launch on a GPU) and of one library/PyTorch call,
and how efficient GEMMs are per shape class. ``calibrate.py`` measures them on
this machine; ``load_profile`` caches the result as JSON under
``$KILN_CACHE_DIR`` (default ``~/.cache/kiln``), keyed by CPU model, ISA and thread
count, so calibration runs once per machine and thread count.

A CPU profile also carries ``KernelRates``: the rates of kiln's own generated kernels
(fixed costs, read bandwidth per cache level, GEMM micro-kernel rates, ...), fitted by
``kiln calibrate`` on programs of kiln's kernels, or derived from the quick profile
(``derive_kernel_rates``) until then. The CPU cost model (``fusion/cpu_cost.py``) uses
them; a profile without them is priced by the plain roofline.
"""

from __future__ import annotations

import json
import platform
from dataclasses import asdict, dataclass, field, replace
from typing import Any

# GEMM shape classes by FLOP count (2*M*N*K, times batch): below ~0.5 MFLOP a GEMM is
# dominated by call/loop overhead, from ~16 MFLOP it runs near peak (library territory).
GEMM_CLASSES = ("tiny", "small", "large")
_TINY_FLOPS = 2.0**19
_LARGE_FLOPS = 2.0**24


def gemm_shape_class(flops: float) -> str:
    """Shape class of a GEMM/conv with ``flops`` floating-point operations."""
    if flops < _TINY_FLOPS:
        return "tiny"
    return "small" if flops < _LARGE_FLOPS else "large"


LEVELS = ("l2", "l3", "dram")  # where a kernel's bytes come from, nearest first


@dataclass(frozen=True)
class KernelRates:
    """Rates of kiln's generated CPU kernels at one thread count (``threads`` of the
    profile). "Per thread" rates are multiplied by the threads a kernel runs on.

    serial_us         fixed cost of a native kernel that runs on one thread, µs
    parallel_us       fixed cost of one that opens a parallel region on all threads, µs
    gemm_us           fixed cost a GEMM kernel adds (dispatch, grain, panel set-up), µs
    read_gbs          (L2, L3, DRAM) bandwidth of a kernel on all threads, GB/s
    serial_read_gbs   the same for a kernel on one thread
    gemm_gflops       per-thread GEMM micro-kernel rate with R = 1, 2, 4 and MR (the
                      register block height: 12 on AVX-512, 6 on AVX2) rows per block
    gemm_step_extra   extra k steps each register block pays (accumulator set-up,
                      epilogue, stores), in units of one k step
    pack_gbs          per-thread rate of packing a runtime right operand with contiguous
                      rows into panels (bytes of the packed panels per second, /1e9)
    gather_gbs        per-thread rate of element-by-element copies: packing a strided
                      (transposed) right operand, a gather's rows, strided reads
    pointwise_gflops  per-thread rate of pointwise work (an exp counts 10, a divide 4)
    row_ns            per-thread cost of one row of a row (reduction) kernel and one pass
                      over it: loop set-up, accumulation, horizontal reduce
    unhidden          fraction (0..1) of the smaller of a kernel's compute and memory
                      time that is not hidden behind the larger
    dwconv_gflops     per-thread rate of the native depthwise conv's vector-padded work
    fitted            True when fitted on this machine, False when derived
    """

    serial_us: float
    parallel_us: float
    gemm_us: float
    read_gbs: tuple[float, float, float]
    serial_read_gbs: tuple[float, float, float]
    gemm_gflops: tuple[float, float, float, float]
    gemm_step_extra: float
    pack_gbs: float
    gather_gbs: float
    pointwise_gflops: float
    row_ns: float
    dwconv_gflops: float
    unhidden: float = 0.0
    fitted: bool = False

    def __post_init__(self) -> None:
        rates = [*self.read_gbs, *self.serial_read_gbs, *self.gemm_gflops, self.pack_gbs]
        rates += [self.gather_gbs, self.pointwise_gflops, self.dwconv_gflops]
        fixed = [self.serial_us, self.parallel_us, self.gemm_us, self.row_ns]
        fixed += [self.gemm_step_extra, self.unhidden]
        if min(rates) <= 0 or min(fixed) < 0 or self.unhidden > 1:
            raise ValueError(f"invalid kernel rates {self}")

    def scaled(self, compute: float, memory: float) -> KernelRates:
        """These rates with every compute rate times ``compute`` and every bandwidth
        times ``memory`` (another machine of the same kind, roughly)."""
        return replace(
            self,
            read_gbs=_times(self.read_gbs, memory),
            serial_read_gbs=_times(self.serial_read_gbs, memory),
            gemm_gflops=_times(self.gemm_gflops, compute),
            pack_gbs=self.pack_gbs * memory,
            gather_gbs=self.gather_gbs * compute,
            pointwise_gflops=self.pointwise_gflops * compute,
            row_ns=self.row_ns / compute,
            dwconv_gflops=self.dwconv_gflops * compute,
            fitted=False,
        )

    @staticmethod
    def from_dict(d: dict[str, Any]) -> KernelRates:
        tuples = ("read_gbs", "serial_read_gbs", "gemm_gflops")
        fields: dict[str, Any] = {
            k: tuple(float(x) for x in v) if k in tuples else v for k, v in d.items()
        }
        return KernelRates(**fields)


def _times(values: tuple[float, ...], factor: float) -> Any:
    return tuple(v * factor for v in values)


@dataclass(frozen=True)
class HardwareProfile:
    """What one device (at one thread count) costs.

    peak_gflops      best sustained GEMM rate (GFLOP/s) at a large shape
    mem_bw_gbs       streaming read bandwidth from main memory (GB/s)
    cache_bytes      (L1d, L2, L3) per-core/shared sizes in bytes (0 = unknown)
    kernel_fixed_us  fixed cost of one native kernel (parallel region / launch), µs
    extern_call_us   fixed cost of one library or PyTorch call, µs
    gemm_efficiency  fraction of peak a GEMM reaches, by ``gemm_shape_class``
    kernels          rates of kiln's generated CPU kernels (None: not a CPU profile,
                     or one priced by the plain roofline)
    """

    name: str
    isa: str
    threads: int
    peak_gflops: float
    mem_bw_gbs: float
    cache_bytes: tuple[int, int, int]
    kernel_fixed_us: float
    extern_call_us: float
    gemm_efficiency: dict[str, float] = field(default_factory=dict, hash=False)
    kernels: KernelRates | None = None

    def __post_init__(self) -> None:
        if self.threads < 1 or self.peak_gflops <= 0 or self.mem_bw_gbs <= 0:
            raise ValueError(f"invalid hardware profile {self}")
        if self.kernel_fixed_us < 0 or self.extern_call_us < 0:
            raise ValueError("fixed costs must be >= 0")

    def efficiency(self, flops: float) -> float:
        """Fraction of ``peak_gflops`` a GEMM of ``flops`` reaches (1.0 if not measured)."""
        return self.gemm_efficiency.get(gemm_shape_class(flops), 1.0)

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=2, sort_keys=True)

    @staticmethod
    def from_json(text: str) -> HardwareProfile:
        d = json.loads(text)
        d["cache_bytes"] = tuple(int(x) for x in d["cache_bytes"])
        d["gemm_efficiency"] = {str(k): float(v) for k, v in d["gemm_efficiency"].items()}
        if d.get("kernels") is not None:  # absent from profiles written before them
            d["kernels"] = KernelRates.from_dict(d["kernels"])
        return HardwareProfile(**d)


# kiln's kernels on the host the suite's results come from (AMD EPYC, Zen 4, AVX-512, 1 MB L2
# per core, 32 MB L3), fitted by ``kiln calibrate`` at 2 threads; the 1-thread entry is its
# serial half.
def _reference(parallel_us: float, read_gbs: tuple[float, float, float]) -> KernelRates:
    return KernelRates(
        serial_us=0.017, parallel_us=parallel_us, gemm_us=0.13, read_gbs=read_gbs,
        serial_read_gbs=(120.0, 60.0, 28.0), gemm_gflops=(30.0, 113.0, 113.0, 113.0),
        gemm_step_extra=3.2, pack_gbs=70.0, gather_gbs=15.0, pointwise_gflops=24.5,
        row_ns=2.2, dwconv_gflops=49.0, unhidden=0.18,
    )  # fmt: skip


_REFERENCE_RATES = {
    1: _reference(0.017, (120.0, 60.0, 28.0)),
    2: _reference(1.22, (211.0, 123.0, 48.0)),
}
# that host's quick profile (torch.mm at 512^3, torch sum over 128 MB): what other hosts'
# quick figures are compared with to scale the reference rates
_REFERENCE_QUICK_PEAK = 105.0
_REFERENCE_QUICK_DRAM_GBS = 25.0


def derive_kernel_rates(profile: HardwareProfile) -> KernelRates:
    """Kernel rates for a profile not fitted on kiln's kernels: the reference host's,
    compute rates scaled by this machine's quick GEMM peak and bandwidths by its quick
    main-memory bandwidth against that host's, the parallel-region cost from the quick
    profile."""
    ref = _REFERENCE_RATES[min(profile.threads, 2)]
    compute = profile.peak_gflops / _REFERENCE_QUICK_PEAK
    rates = ref.scaled(compute, profile.mem_bw_gbs / _REFERENCE_QUICK_DRAM_GBS)
    parallel = profile.kernel_fixed_us if profile.threads > 1 else ref.serial_us
    return replace(rates, parallel_us=parallel)


def reference_cpu_profile(threads: int = 2) -> HardwareProfile:
    """A fixed profile for tests and offline planning: the Zen 5 host in docs/benchmarks.md
    (AVX-512, 255 GFLOP/s per core, 68 GB/s, torch op ≈ 1 µs) with kiln's kernel rates
    fitted on a host of its kind. Not this machine."""
    return HardwareProfile(
        name=f"reference-zen5-{threads}t",
        isa="avx512",
        threads=threads,
        peak_gflops=230.0 * threads,
        mem_bw_gbs=68.0,
        cache_bytes=(48 * 1024, 1024 * 1024, 32 * 1024 * 1024),
        kernel_fixed_us=0.5 if threads > 1 else 0.1,
        extern_call_us=1.0,
        gemm_efficiency={"tiny": 0.15, "small": 0.5, "large": 0.9},
        kernels=_REFERENCE_RATES[min(threads, 2)],
    )


def cpu_model() -> str:
    """The CPU's marketing name (``model name`` in /proc/cpuinfo where there is one)."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.lower().startswith(("model name", "hardware", "cpu model")):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown-cpu"
