"""GPU profiles: the datasheet table, lookups, JSON round trip, device detection, cache."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from kiln.core import gpu_profile as gp
from kiln.core.gpu_profile import (
    GIB,
    GPU_PROFILES,
    GpuProfile,
    detect_gpu_profile,
    gpu_gemm_class,
    gpu_profile,
    load_gpu_profile,
    save_gpu_profile,
)


def test_every_profile_is_sane() -> None:
    assert {"H100", "H100-PCIe", "A100-40GB", "A100-80GB", "L4"} <= set(GPU_PROFILES)
    for name, p in GPU_PROFILES.items():
        assert p.name == name
        numbers = (p.sm_count, p.memory_bytes, p.fp32_tflops, p.hbm_gbs, p.l2_bytes,
                   p.smem_per_sm, p.smem_per_block, p.max_threads_per_sm, p.max_blocks_per_sm,
                   p.graph_launch_us, p.launch_us)  # fmt: skip
        assert all(x > 0 for x in numbers), name
        assert set(p.tensor_tflops) == {"float16", "bfloat16", "tf32"}
        assert p.tensor_tflops["bfloat16"] >= p.tensor_tflops["tf32"] >= p.fp32_tflops
        assert p.tensor_tflops["float16"] == p.tensor_tflops["bfloat16"]  # dense, fp32 accum
        assert p.smem_per_block < p.smem_per_sm
        assert p.regs_per_sm == 65536 and p.regs_per_thread == 255
        assert p.graph_launch_us < p.launch_us  # a graph replay skips the host
        eff = p.gemm_efficiency
        assert 0 < eff["tiny"] <= eff["small"] <= eff["large"] <= 1
        assert 0 < p.bandwidth_efficiency <= 1
    # spot checks against the datasheets (dense tensor-core figures)
    h100, a100 = gpu_profile("H100"), gpu_profile("A100-80GB")
    assert (h100.sm_count, h100.hbm_gbs, h100.tensor_tflops["bfloat16"]) == (132, 3350, 989.5)
    assert (a100.sm_count, a100.hbm_gbs, a100.tensor_tflops["float16"]) == (108, 2039, 312)
    assert gpu_profile("A100-40GB").hbm_gbs == 1555
    assert gpu_profile("L4").tensor_tflops["tf32"] == 60


def test_lookup_is_case_insensitive_and_names_the_choices() -> None:
    assert gpu_profile("h100-pcie") is GPU_PROFILES["H100-PCIe"]
    with pytest.raises(KeyError, match="A100-40GB") as err:
        gpu_profile("V100")
    assert "V100" in str(err.value) and "L4" in str(err.value)


def test_matmul_peak_follows_dtype_and_tf32_flag() -> None:
    p = gpu_profile("A100-40GB")
    assert p.matmul_tflops(torch.float16) == p.matmul_tflops(torch.bfloat16) == 312
    assert p.matmul_tflops(torch.float32, allow_tf32=True) == 156
    assert p.matmul_tflops(torch.float32, allow_tf32=False) == 19.5
    assert p.matmul_tflops(torch.float64) == 19.5
    saved = torch.backends.cuda.matmul.allow_tf32
    try:
        for flag, peak in ((True, 156), (False, 19.5)):
            torch.backends.cuda.matmul.allow_tf32 = flag
            assert p.matmul_tflops(torch.float32) == peak
    finally:
        torch.backends.cuda.matmul.allow_tf32 = saved


def test_gemm_classes() -> None:
    assert gpu_gemm_class(2.0 * 256**3) == "tiny"
    assert gpu_gemm_class(2.0 * 1024**3) == "small"
    assert gpu_gemm_class(2.0 * 2048**3) == "large"
    p = gpu_profile("H100")
    assert p.efficiency(2.0 * 8192**3) == p.gemm_efficiency["large"]


def test_json_round_trip() -> None:
    for p in GPU_PROFILES.values():
        q = GpuProfile.from_json(p.to_json())
        assert q == p and isinstance(q.compute_capability, tuple)
        assert hash(q) == hash(p)


def test_invalid_profiles_are_refused() -> None:
    p = gpu_profile("L4")
    with pytest.raises(ValueError):
        replace(p, hbm_gbs=0.0)
    with pytest.raises(ValueError):
        replace(p, tensor_tflops={"int8": 242.0})
    with pytest.raises(ValueError):
        replace(p, bandwidth_efficiency=1.5)


def _fake_device(
    monkeypatch: pytest.MonkeyPatch, name: str, sms: int, gib: float, cc: tuple[int, int]
) -> None:
    props = SimpleNamespace(
        name=name, multi_processor_count=sms, total_memory=int(gib * GIB), major=cc[0], minor=cc[1]
    )
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device=None: props)


@pytest.mark.parametrize(
    ("device", "sms", "gib", "cc", "expect"),
    [
        ("NVIDIA H100 80GB HBM3", 132, 79.2, (9, 0), "H100"),
        ("NVIDIA H100 PCIe", 114, 79.6, (9, 0), "H100-PCIe"),
        ("NVIDIA H100 NVL", 132, 93.1, (9, 0), "H100"),
        ("NVIDIA H200", 132, 139.8, (9, 0), "H200"),
        ("NVIDIA A100-SXM4-40GB", 108, 39.4, (8, 0), "A100-40GB"),
        ("NVIDIA A100-SXM4-80GB", 108, 79.2, (8, 0), "A100-80GB"),
        ("NVIDIA A100 80GB PCIe", 108, 79.2, (8, 0), "A100-80GB"),
        ("NVIDIA L4", 58, 22.5, (8, 9), "L4"),
        ("NVIDIA RTX 6000 Ada Generation", 142, 47.5, (8, 9), "L4"),  # by capability
    ],
)
def test_detect_maps_to_the_nearest_builtin(
    monkeypatch: pytest.MonkeyPatch,
    device: str,
    sms: int,
    gib: float,
    cc: tuple[int, int],
    expect: str,
) -> None:
    _fake_device(monkeypatch, device, sms, gib, cc)
    p = detect_gpu_profile(0)
    base = GPU_PROFILES[expect]
    assert p.name.split("[")[0] == expect
    assert (p.hbm_gbs, p.tensor_tflops) == (base.hbm_gbs, base.tensor_tflops)
    assert p.sm_count == sms and p.memory_bytes == int(gib * GIB)  # from the device


def test_detect_names_a_changed_device(monkeypatch: pytest.MonkeyPatch) -> None:
    _fake_device(monkeypatch, "NVIDIA H100 80GB HBM3 MIG 3g.40gb", 60, 39.5, (9, 0))
    p = detect_gpu_profile()
    assert p.name == "H100[60SM,40GiB]" and p.sm_count == 60
    _fake_device(monkeypatch, "NVIDIA H100 80GB HBM3", 132, 79.2, (9, 0))
    assert detect_gpu_profile().name == "H100"


def test_detect_needs_cuda(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(RuntimeError, match="no CUDA device"):
        detect_gpu_profile()


def test_load_prefers_the_cached_calibration(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv("KILN_CACHE_DIR", str(tmp_path))
    _fake_device(monkeypatch, "NVIDIA A100-SXM4-40GB", 108, 39.4, (8, 0))
    detected = load_gpu_profile(0)
    assert detected == detect_gpu_profile(0)  # nothing cached yet
    measured = replace(detected, hbm_gbs=1400.0, bandwidth_efficiency=1.0, graph_launch_us=1.1)
    path = save_gpu_profile(measured, "NVIDIA A100-SXM4-40GB")
    assert path == gp.gpu_profile_path("NVIDIA A100-SXM4-40GB") and path.parent == tmp_path
    assert load_gpu_profile(0) == measured
    path.write_text("{not json", encoding="utf-8")
    assert load_gpu_profile(0) == detected  # a corrupt cache falls back to detection


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_calibration_measures_and_caches(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("KILN_CACHE_DIR", str(tmp_path))
    base = detect_gpu_profile()
    p = gp.calibrate_gpu_profile()
    # measured rates: below the datasheet peaks, not absurdly so (any shared-host noise)
    assert 0.3 * base.hbm_gbs < p.hbm_gbs < 1.2 * base.hbm_gbs
    for key, peak in base.tensor_tflops.items():
        assert 0.2 * peak < p.tensor_tflops[key] < 1.1 * peak, key
    assert 0.2 * base.fp32_tflops < p.fp32_tflops < 1.1 * base.fp32_tflops
    assert 0 < p.graph_launch_us < p.launch_us < 100
    assert p.bandwidth_efficiency == 1.0 and p.gemm_efficiency["large"] == 1.0
    assert load_gpu_profile() == p  # cached by device name
