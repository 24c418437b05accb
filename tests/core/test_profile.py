"""Hardware profiles: calibration on this machine, JSON round trip, the on-disk cache."""

from __future__ import annotations

import json
import time
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from kiln.core import calibrate as profile_mod
from kiln.core.calibrate import calibrate, load_profile, store_profile
from kiln.core.hardware import (
    HardwareProfile,
    derive_kernel_rates,
    gemm_shape_class,
    reference_cpu_profile,
)


@pytest.mark.serial  # timed: alone on the machine
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


def test_kernel_rates_round_trip_and_old_profiles_load(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    p = reference_cpu_profile()
    assert p.kernels is not None and isinstance(p.kernels.read_gbs, tuple)
    q = HardwareProfile.from_json(p.to_json())
    assert q == p and q.kernels == p.kernels
    # a profile cached before kernel rates existed: no "kernels" key at all
    old = json.loads(p.to_json())
    del old["kernels"]
    bare = HardwareProfile.from_json(json.dumps(old))
    assert bare.kernels is None and bare.peak_gflops == p.peak_gflops
    # load_profile gives it rates derived from its quick figures, without recalibrating
    monkeypatch.setenv("KILN_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr("kiln.core.calibrate.calibrate", lambda threads=2: pytest.fail("ran"))
    profile_mod.profile_path(2).write_text(json.dumps(old))
    loaded = load_profile(threads=2)
    assert loaded.kernels == derive_kernel_rates(bare) and not loaded.kernels.fitted
    # a fitted profile stored and loaded again keeps its rates
    fitted = replace(p, kernels=replace(p.kernels, serial_us=0.07, fitted=True))
    store_profile(fitted)
    assert load_profile(threads=2) == fitted


def test_derived_kernel_rates_follow_the_quick_profile() -> None:
    p = reference_cpu_profile(2)
    fast = replace(p, peak_gflops=2 * p.peak_gflops, mem_bw_gbs=3 * p.mem_bw_gbs)
    a, b = derive_kernel_rates(p), derive_kernel_rates(fast)
    assert b.gemm_gflops[3] == pytest.approx(2 * a.gemm_gflops[3])
    assert b.read_gbs[2] == pytest.approx(3 * a.read_gbs[2])
    assert b.parallel_us == fast.kernel_fixed_us and not b.fitted
    with pytest.raises(ValueError):
        replace(a, pack_gbs=0.0)
