"""``GpuProfile``: the numbers a GPU kernel cost model needs, built in or measured.

Built-in profiles come from NVIDIA's datasheets and architecture whitepapers (dense
tensor-core rates: the sheets print 2:4-sparse figures, twice the dense ones) and from
the CUDA C++ Programming Guide's per-compute-capability limits. Launch overheads and
achievable fractions are no datasheet's: they are planning estimates, replaced by
``calibrate_gpu_profile`` on a real device, which caches its result as JSON under
``kiln.core.cache.cache_dir()`` keyed by the device's name. ``load_gpu_profile``
returns that calibration if there is one, else ``detect_gpu_profile``: the nearest
built-in (by name, SM count and memory) with the device's own SM count and memory.

Only the table, the lookups and the JSON round trip run without CUDA.
"""

from __future__ import annotations

import json
import os
import re
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import torch

from kiln.core.cache import cache_dir

GIB = 2**30
MIB = 2**20
KIB = 2**10
TENSOR_DTYPES = ("float16", "bfloat16", "tf32")
# GEMM size classes by FLOPs (2*M*N*K, times batch). On a GPU a 256^3 GEMM is tiny (short
# K loop, pipeline never full), 2048^3 large. Too few tiles to fill the SMs is priced
# separately (wave quantization in the cost model), so the classes only carry the rest.
GPU_GEMM_CLASSES = ("tiny", "small", "large")
_TINY_FLOPS = 2.0**27
_LARGE_FLOPS = 2.0**33


def gpu_gemm_class(flops: float) -> str:
    """Size class of a GPU GEMM of ``flops`` floating-point operations."""
    if flops < _TINY_FLOPS:
        return "tiny"
    return "small" if flops < _LARGE_FLOPS else "large"


@dataclass(frozen=True)
class GpuProfile:
    """One GPU model. Rates: TFLOP/s = 1e12 FLOP/s, GB/s = 1e9 B/s; sizes in bytes.

    fp32_tflops           CUDA-core fp32 FMA peak (non-tensor work, fp32 GEMMs without TF32)
    tensor_tflops         dense tensor-core peak per input dtype: float16, bfloat16, tf32
    hbm_gbs               device-memory bandwidth
    graph_launch_us       fixed cost of one kernel node in a CUDA-graph replay
    launch_us             fixed cost of one plain kernel launch from Python
    bandwidth_efficiency  fraction of ``hbm_gbs`` a streaming kernel reaches
    gemm_efficiency       fraction of the peak a GEMM reaches, by ``gpu_gemm_class``
    """

    name: str
    sm_count: int
    memory_bytes: int
    compute_capability: tuple[int, int]
    fp32_tflops: float
    tensor_tflops: dict[str, float] = field(hash=False)
    hbm_gbs: float
    l2_bytes: int
    smem_per_sm: int
    smem_per_block: int
    max_threads_per_sm: int
    max_blocks_per_sm: int
    graph_launch_us: float
    launch_us: float
    bandwidth_efficiency: float
    gemm_efficiency: dict[str, float] = field(hash=False)
    regs_per_sm: int = 65536  # 32-bit registers: 256 KB register file per SM (sm_70 on)
    regs_per_thread: int = 255

    def __post_init__(self) -> None:
        sizes = (self.sm_count, self.memory_bytes, self.l2_bytes, self.smem_per_sm)
        rates = (self.fp32_tflops, self.hbm_gbs, *self.tensor_tflops.values())
        fracs = (self.bandwidth_efficiency, *self.gemm_efficiency.values())
        if min(sizes) <= 0 or min(rates) <= 0 or not all(0 < f <= 1 for f in fracs):
            raise ValueError(f"invalid GPU profile {self.name!r}")
        if not set(self.tensor_tflops) <= set(TENSOR_DTYPES):
            raise ValueError(f"tensor_tflops keys must be among {TENSOR_DTYPES}")
        if self.smem_per_block > self.smem_per_sm or min(self.graph_launch_us, self.launch_us) < 0:
            raise ValueError(f"invalid GPU profile {self.name!r}")

    def matmul_tflops(self, dtype: torch.dtype, allow_tf32: bool | None = None) -> float:
        """Peak of a GEMM whose inputs are ``dtype``: the tensor cores for fp16/bf16, for
        fp32 too when TF32 is allowed (default: ``torch.backends.cuda.matmul.allow_tf32``,
        the rule the generated kernels follow), else the CUDA cores."""
        key = {torch.float16: "float16", torch.bfloat16: "bfloat16"}.get(dtype)
        if dtype == torch.float32:
            tf32 = torch.backends.cuda.matmul.allow_tf32 if allow_tf32 is None else allow_tf32
            key = "tf32" if tf32 else None
        return self.tensor_tflops.get(key or "", self.fp32_tflops)

    def efficiency(self, flops: float) -> float:
        """Fraction of the peak a GEMM of ``flops`` reaches (1.0 if not given)."""
        return self.gemm_efficiency.get(gpu_gemm_class(flops), 1.0)

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=2, sort_keys=True)

    @staticmethod
    def from_json(text: str) -> GpuProfile:
        d = json.loads(text)
        d["compute_capability"] = tuple(int(x) for x in d["compute_capability"])
        for k in ("tensor_tflops", "gemm_efficiency"):
            d[k] = {str(a): float(b) for a, b in d[k].items()}
        return GpuProfile(**d)


# Planning estimates (host and driver dependent, measured by calibrate_gpu_profile): a small
# kernel's node in a replayed CUDA graph, and a PyTorch / Triton launch from Python.
PLANNING_GRAPH_LAUNCH_US = 2.0
PLANNING_LAUNCH_US = 6.0


def _gpu(name: str, sms: int, gib: int, cc: tuple[int, int], fp32: float, tc16: float,
         tf32: float, bw: float, l2_mib: int, bw_eff: float, eff: tuple[float, float, float],
         ) -> GpuProfile:  # fmt: skip
    """A built-in profile; shared memory and thread limits follow from the compute
    capability (CUDA C++ Programming Guide, "Technical Specifications per Compute
    Capability": 8.0: 164/163 KB, 2048 threads, 32 blocks; 8.9: 100/99 KB, 1536 threads,
    24 blocks; 9.0: 228/227 KB, 2048 threads, 32 blocks per SM / per block)."""
    smem_kb, threads, blocks = {(8, 0): (164, 2048, 32), (8, 9): (100, 1536, 24),
                                (9, 0): (228, 2048, 32)}[cc]  # fmt: skip
    return GpuProfile(
        name=name,
        sm_count=sms,
        memory_bytes=gib * GIB,
        compute_capability=cc,
        fp32_tflops=fp32,
        tensor_tflops={"float16": tc16, "bfloat16": tc16, "tf32": tf32},
        hbm_gbs=bw,
        l2_bytes=l2_mib * MIB,
        smem_per_sm=smem_kb * KIB,
        smem_per_block=(smem_kb - 1) * KIB,
        max_threads_per_sm=threads,
        max_blocks_per_sm=blocks,
        graph_launch_us=PLANNING_GRAPH_LAUNCH_US,
        launch_us=PLANNING_LAUNCH_US,
        bandwidth_efficiency=bw_eff,
        gemm_efficiency=dict(zip(GPU_GEMM_CLASSES, eff, strict=True)),
    )


# Achievable fractions (bandwidth; GEMM tiny/small/large) are planning estimates: a copy
# kernel reaches ~85-90% of HBM peak, cuBLAS-class GEMMs ~75% (H100, power-bound) to ~85%
# (A100) of the dense tensor peak at large shapes; the L4 (72 W) throttles under GEMMs.
# fmt: off
GPU_PROFILES: dict[str, GpuProfile] = {
    p.name: p
    for p in (
        # NVIDIA H100 Tensor Core GPU datasheet, SXM5 column (132 SMs per the Hopper
        # whitepaper): FP32 67, TF32 989 / FP16 & BF16 1,979 sparse -> 494.5 / 989.5 dense,
        # 80 GB HBM3 at 3.35 TB/s, 50 MB L2.
        _gpu("H100", 132, 80, (9, 0), 67.0, 989.5, 494.5, 3350.0, 50, 0.85, (0.35, 0.6, 0.75)),
        # Same datasheet, PCIe column (114 SMs): FP32 51, TF32 756 / FP16 1,513 sparse ->
        # 378 / 756.5 dense, 80 GB HBM2e at 2.0 TB/s, 50 MB L2; 350 W board.
        _gpu("H100-PCIe", 114, 80, (9, 0), 51.0, 756.5, 378.0, 2000.0, 50, 0.85, (0.35, 0.55, 0.7)),
        # NVIDIA H200 Tensor Core GPU datasheet (SXM): H100 SXM compute, 141 GB HBM3e at
        # 4.8 TB/s, 50 MB L2.
        _gpu("H200", 132, 141, (9, 0), 67.0, 989.5, 494.5, 4800.0, 50, 0.85, (0.35, 0.6, 0.75)),
        # NVIDIA A100 Tensor Core GPU datasheet, 40GB SXM column (108 SMs per the Ampere
        # GA100 whitepaper): FP32 19.5, TF32 156, FP16/BF16 312 dense, HBM2 1,555 GB/s, L2 40 MB.
        _gpu("A100-40GB", 108, 40, (8, 0), 19.5, 312.0, 156.0, 1555.0, 40, 0.9, (0.4, 0.65, 0.85)),
        # Same datasheet, 80GB SXM column: HBM2e 2,039 GB/s, same compute.
        _gpu("A100-80GB", 108, 80, (8, 0), 19.5, 312.0, 156.0, 2039.0, 40, 0.9, (0.4, 0.65, 0.85)),
        # NVIDIA L4 Tensor Core GPU datasheet: FP32 30.3, TF32 120 / FP16 & BF16 242 sparse ->
        # 60 / 121 dense, 24 GB GDDR6 at 300 GB/s; 58 SMs (7,424 CUDA cores / 128 per SM) and
        # 48 MB L2 per the Ada Lovelace (AD104) whitepaper.
        _gpu("L4", 58, 24, (8, 9), 30.3, 121.0, 60.0, 300.0, 48, 0.85, (0.3, 0.5, 0.6)),
    )
}
# fmt: on


def gpu_profile(name: str) -> GpuProfile:
    """The built-in profile called ``name`` (case-insensitive)."""
    for key, prof in GPU_PROFILES.items():
        if key.lower() == name.lower():
            return prof
    raise KeyError(f"no GPU profile {name!r}; built-in: {', '.join(GPU_PROFILES)}")


def family(name: str) -> str:
    """'h100', 'a100', 'l4', ... from a device or profile name ("NVIDIA H200" -> 'h200')."""
    m = re.search(r"\b([a-z]+\d+)", name.lower().removeprefix("nvidia").strip())
    return m.group(1) if m else ""


def _properties(device: Any) -> Any:
    if not torch.cuda.is_available():
        raise RuntimeError("no CUDA device: use gpu_profile(name) for a built-in profile")
    return torch.cuda.get_device_properties(device)


def nearest_gpu_profile(
    name: str, sm_count: int, memory_bytes: int, capability: tuple[int, int] | None = None
) -> GpuProfile:
    """The built-in closest to a device: same family name if any (else same compute
    capability, else all), then nearest SM count, then nearest memory size; a "PCIe" in
    the name prefers PCIe variants."""
    pool = [p for p in GPU_PROFILES.values() if family(p.name) == family(name)]
    pool = pool or [p for p in GPU_PROFILES.values() if p.compute_capability == capability]
    pool = pool or list(GPU_PROFILES.values())
    pcie = "pcie" in name.lower()
    return min(
        pool,
        key=lambda p: (
            ("pcie" in p.name.lower()) != pcie,
            abs(p.sm_count - sm_count) / sm_count,
            abs(p.memory_bytes - memory_bytes) / memory_bytes,
        ),
    )


def detect_gpu_profile(device: Any = None) -> GpuProfile:
    """The nearest built-in profile to a CUDA device, with its SM count and memory
    overridden from ``torch.cuda.get_device_properties`` (the name records a change)."""
    props = _properties(device)
    sms, mem = int(props.multi_processor_count), int(props.total_memory)
    cap = (int(props.major), int(props.minor))
    base = nearest_gpu_profile(str(props.name), sms, mem, cap)
    name = base.name
    if sms != base.sm_count or abs(mem - base.memory_bytes) > 0.1 * base.memory_bytes:
        name = f"{base.name}[{sms}SM,{mem / GIB:.0f}GiB]"
    return replace(base, name=name, sm_count=sms, memory_bytes=mem, compute_capability=cap)


def gpu_profile_path(device_name: str) -> Path:
    """Where the calibration of a device called ``device_name`` is cached."""
    slug = re.sub(r"[^a-z0-9]+", "-", device_name.lower()).strip("-") or "gpu"
    return cache_dir() / f"gpu-{slug}.json"


def load_gpu_profile(device: Any = None) -> GpuProfile:
    """The cached calibration of ``device``, else ``detect_gpu_profile(device)``."""
    path = gpu_profile_path(str(_properties(device).name))
    try:
        return GpuProfile.from_json(path.read_text(encoding="utf-8"))
    except (OSError, ValueError, KeyError, TypeError):
        return detect_gpu_profile(device)


def save_gpu_profile(profile: GpuProfile, device_name: str) -> Path:
    """Write ``profile`` as the cached calibration of ``device_name`` (atomically)."""
    path = gpu_profile_path(device_name)
    tmp = path.with_suffix(f".{os.getpid()}.tmp")
    tmp.write_text(profile.to_json(), encoding="utf-8")
    tmp.replace(path)
    return path


# -- calibration (needs CUDA) ---------------------------------------------------------
def gpu_time_us(fn: Any, reps: int, trials: int = 5) -> float:
    """Fastest mean GPU time (µs) of ``reps`` back-to-back ``fn()`` over ``trials``."""
    fn()
    torch.cuda.synchronize()
    best = float("inf")
    for _ in range(trials):
        start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(reps):
            fn()
        stop.record()
        stop.synchronize()
        best = min(best, start.elapsed_time(stop) * 1e3 / reps)
    return best


def _gemm_tflops(n: int, dtype: torch.dtype, dev: torch.device, tf32: bool = False) -> float:
    saved = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = tf32
    try:
        a, b = (torch.randn(n, n, device=dev, dtype=dtype) for _ in range(2))
        c = torch.empty(n, n, device=dev, dtype=dtype)
        return 2.0 * n**3 / (gpu_time_us(lambda: torch.mm(a, b, out=c), reps=3) * 1e6)
    finally:
        torch.backends.cuda.matmul.allow_tf32 = saved


def _copy_gbs(dev: torch.device) -> float:
    """Copy bandwidth (bytes read + written per second, GB/s) over 512 MiB of float32."""
    src = torch.empty(128 * MIB, device=dev)
    dst = torch.empty_like(src)
    return 2 * src.nbytes / (gpu_time_us(lambda: dst.copy_(src), reps=5) * 1e3)


def _launch_us(nodes: int = 200) -> tuple[float, float]:
    """(µs per kernel node in a replayed CUDA graph, µs per plain launch from Python),
    with a 1-element in-place add as the near-empty kernel."""
    x = torch.zeros(1, device="cuda")
    x.add_(1.0)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(nodes):
            x.add_(1.0)
    graph_us = gpu_time_us(graph.replay, reps=5) / nodes
    plain = float("inf")
    for _ in range(5):
        torch.cuda.synchronize()
        t0 = time.perf_counter_ns()
        for _ in range(nodes):
            x.add_(1.0)
        torch.cuda.synchronize()
        plain = min(plain, (time.perf_counter_ns() - t0) / nodes / 1e3)
    return graph_us, plain


def calibrate_gpu_profile(device: Any = None) -> GpuProfile:
    """Measure a CUDA device (about 10 s), starting from ``detect_gpu_profile``, and cache
    the result (see ``gpu_profile_path``). Measured rates replace the datasheet peaks, so
    the large-GEMM and bandwidth efficiencies become 1.0 (the small classes keep their
    ratio to the large one): copy bandwidth over 2 x 512 MiB, launch overheads, and mm
    rates at 8192^3 (fp16, bf16), 4096^3 (fp32 with and without TF32)."""
    props = _properties(device)
    base = detect_gpu_profile(device)
    dev = torch.device("cuda", torch.cuda.current_device())
    if device is not None:
        dev = torch.device("cuda", device) if isinstance(device, int) else torch.device(device)
    with torch.no_grad(), torch.cuda.device(dev):
        bw = _copy_gbs(dev)
        graph_us, plain_us = _launch_us()
        tensor = {
            "float16": _gemm_tflops(8192, torch.float16, dev),
            "bfloat16": _gemm_tflops(8192, torch.bfloat16, dev),
            "tf32": _gemm_tflops(4096, torch.float32, dev, tf32=True),
        }
        fp32 = _gemm_tflops(4096, torch.float32, dev)
    large = base.gemm_efficiency.get("large", 1.0)
    eff = {k: round(min(1.0, v / large), 4) for k, v in base.gemm_efficiency.items()}
    prof = replace(
        base,
        fp32_tflops=round(fp32, 2),
        tensor_tflops={k: round(v, 2) for k, v in tensor.items()},
        hbm_gbs=round(bw, 1),
        bandwidth_efficiency=1.0,
        gemm_efficiency=eff,
        graph_launch_us=round(graph_us, 3),
        launch_us=round(plain_us, 3),
    )
    save_gpu_profile(prof, str(props.name))
    return prof
