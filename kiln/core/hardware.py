"""``HardwareProfile``: the few device numbers the cost model needs, and their cache.

A profile is device-neutral on purpose: the cost model only ever asks for peak
compute, memory bandwidth, caches, the fixed cost of one native kernel (a
parallel region on a CPU, a launch on a GPU) and of one library/PyTorch call,
and how efficient GEMMs are per shape class. ``calibrate.py`` measures them on
this machine; ``load_profile`` caches the result as JSON under
``$KILN_CACHE_DIR`` (default ``~/.cache/kiln``), keyed by CPU model and thread
count, so calibration runs once per machine and thread count.
"""

from __future__ import annotations

import json
import platform
from dataclasses import asdict, dataclass, field

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


@dataclass(frozen=True)
class HardwareProfile:
    """What one device (at one thread count) costs.

    peak_gflops      best sustained GEMM rate (GFLOP/s) at a large shape
    mem_bw_gbs       streaming read bandwidth from main memory (GB/s)
    cache_bytes      (L1d, L2, L3) per-core/shared sizes in bytes (0 = unknown)
    kernel_fixed_us  fixed cost of one native kernel (parallel region / launch), µs
    extern_call_us   fixed cost of one library or PyTorch call, µs
    gemm_efficiency  fraction of peak a GEMM reaches, by ``gemm_shape_class``
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
        return HardwareProfile(**d)


def reference_cpu_profile(threads: int = 2) -> HardwareProfile:
    """A fixed profile for tests and offline planning: the Zen 5 host in docs/benchmarks.md
    (AVX-512, 255 GFLOP/s per core, 68 GB/s, torch op ≈ 1 µs). Not this machine."""
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
