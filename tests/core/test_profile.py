"""Hardware profiles: calibration on this machine, JSON round trip, the on-disk cache."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch

from kiln.core import calibrate as profile_mod
from kiln.core.calibrate import calibrate, load_profile
from kiln.core.hardware import HardwareProfile, gemm_shape_class, reference_cpu_profile


def test_calibrate_is_fast_and_sane() -> None:
    threads = torch.get_num_threads()
    t0 = time.perf_counter()
    p = calibrate(threads=2)
    elapsed = time.perf_counter() - t0
    assert elapsed < 5.0, f"calibration took {elapsed:.1f} s"
    assert torch.get_num_threads() == threads  # restored
    assert p.threads == 2 and p.isa
    # wide bounds: any CPU from a laptop to a server, shared or not
    assert 1.0 < p.peak_gflops < 20000.0
    assert 0.5 < p.mem_bw_gbs < 2000.0
    assert 0.0 < p.extern_call_us < 100.0 and 0.0 < p.kernel_fixed_us <= 50.0
    assert set(p.gemm_efficiency) == {"tiny", "small", "large"}
    assert all(0.0 < e <= 1.0 for e in p.gemm_efficiency.values())
    assert p.gemm_efficiency["large"] == 1.0  # peak is defined by the large GEMM


def test_json_round_trip() -> None:
    p = reference_cpu_profile()
    q = HardwareProfile.from_json(p.to_json())
    assert q == p and isinstance(q.cache_bytes, tuple)
    hash(q)  # frozen and hashable despite the efficiency dict


def test_load_profile_caches_per_cpu_and_threads(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("KILN_CACHE_DIR", str(tmp_path))
    calls: list[int] = []

    def fake_calibrate(threads: int = 2) -> HardwareProfile:
        calls.append(threads)
        return reference_cpu_profile(threads)

    monkeypatch.setattr("kiln.core.calibrate.calibrate", fake_calibrate)
    a = load_profile(threads=2)
    b = load_profile(threads=2)
    assert a == b and calls == [2]  # second call read the JSON
    assert profile_mod.profile_path(2).parent == tmp_path
    assert profile_mod.profile_path(2).exists()
    load_profile(threads=1)
    assert calls == [2, 1]  # keyed by thread count
    profile_mod.profile_path(1).write_text("{not json")
    load_profile(threads=1)
    assert calls == [2, 1, 1]  # a corrupt entry is recalibrated
    load_profile(threads=2, refresh=True)
    assert calls == [2, 1, 1, 2]


def test_invalid_profiles_are_rejected() -> None:
    with pytest.raises(ValueError):
        HardwareProfile("x", "avx2", 0, 1.0, 1.0, (0, 0, 0), 1.0, 1.0, {})
    with pytest.raises(ValueError):
        HardwareProfile("x", "avx2", 1, 1.0, 1.0, (0, 0, 0), -1.0, 1.0, {})


def test_gemm_shape_classes() -> None:
    assert gemm_shape_class(2 * 8 * 64 * 64) == "tiny"
    assert gemm_shape_class(2 * 8 * 512 * 512) == "small"
    assert gemm_shape_class(2 * 512**3) == "large"
    p = reference_cpu_profile()
    assert p.efficiency(2 * 512**3) == p.gemm_efficiency["large"]
