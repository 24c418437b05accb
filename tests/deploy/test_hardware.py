"""The hardware catalog and the ``--hardware`` spec parser: examples, aliases, errors,
overrides, JSON files, and ``this_machine`` with a fake profile (never calibrating)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

import kiln.core.calibrate
from kiln.core.hardware import HardwareProfile, reference_cpu_profile
from kiln.deploy.hardware import (
    DEVICES,
    DTYPES,
    GIB,
    LINKS,
    Device,
    Hardware,
    HardwareSpecError,
    parse_hardware,
    this_machine,
)

CPU = Device("cpu", "cpu", 64 * GIB, 68.0, {"fp32": 0.46}, "shared-memory", 0.0)


def test_count_and_device() -> None:
    hw = parse_hardware("4xRTX3090")
    assert (hw.device.name, hw.count, hw.spec) == ("RTX3090", 4, "4xRTX3090")
    assert hw.link.name == "pcie4" and hw.host_link.name == "pcie4"
    assert hw.host_memory_bytes == 256 * GIB and hw.disk_read_gbs == 2.0
    single = parse_hardware("A100-80GB")
    assert single.count == 1 and single.device.memory_bytes == 80 * GIB
    assert single.link.name == "nvlink3" and single.spec == "A100-80GB"


def test_options() -> None:
    hw = parse_hardware("8 x a100-40gb, host=256GB, nvme=3GB/s")
    assert (hw.device.name, hw.count) == ("A100-40GB", 8)
    assert hw.host_memory_bytes == 256 * GIB and hw.disk_read_gbs == 3.0
    assert hw.spec == "8xA100-40GB,host=256gb,nvme=3gb/s"
    h100 = parse_hardware("2xH100,link=pcie5")
    assert h100.link == LINKS["pcie5"] and h100.host_link.name == "pcie5"
    assert parse_hardware("H100").link.name == "nvlink4"


def test_cpu() -> None:
    hw = parse_hardware("cpu", cpu=CPU)
    assert hw.device == CPU and hw.count == 1 and hw.host_memory_bytes == 64 * GIB
    assert hw.link.name == hw.host_link.name == "shared-memory" and hw.price_per_hour == 0.0
    small = parse_hardware("CPU,ram=2GB", cpu=CPU)
    assert small.device.memory_bytes == small.host_memory_bytes == 2 * GIB


@pytest.mark.parametrize(
    "alias,name",
    [("3090", "RTX3090"), ("RTX-3090", "RTX3090"), ("rtx 3090", "RTX3090"),
     ("h100", "H100"), ("2080ti", "RTX2080Ti"), ("RTX-A6000", "A6000"), ("V100", "V100-32GB")],
)  # fmt: skip
def test_aliases(alias: str, name: str) -> None:
    assert parse_hardware(f"2x{alias}").device.name == name


@pytest.mark.parametrize(
    "spec,words",
    [
        ("A100", ["ambiguous", "A100-40GB", "A100-80GB"]),
        ("2xB200", ["'B200'", "RTX3090", "H100", "cpu"]),
        ("0xH100", ["count", "0"]),
        ("H100,host=lots", ["'lots'", "size"]),
        ("H100,mem=-1GB", ["'-1gb'"]),
        ("H100,speed=9", ["'speed=9'", "host", "nvme", "link"]),
        ("H100,host", ["'host'"]),
        ("H100,link=infiniband", ["'infiniband'", "nvlink4", "pcie4"]),
        ("H100,nvme=fast", ["'fast'", "GB/s"]),
        ("H100,price=cheap", ["'cheap'"]),
        ("H100,host=1GB,host=2GB", ["twice"]),
    ],
)
def test_errors_name_the_bad_part(spec: str, words: list[str]) -> None:
    with pytest.raises(HardwareSpecError) as err:
        parse_hardware(spec, cpu=CPU)
    assert isinstance(err.value, ValueError)
    for word in words:
        assert word in str(err.value)


def test_overrides() -> None:
    hw = parse_hardware("2xRTX4090,mem=20GiB,bw=900,price=1.5,disk=500MB/s,host=64GB")
    assert hw.device.memory_bytes == 20 * GIB and hw.device.bandwidth_gbs == 900.0
    assert hw.device.price_per_hour == 1.5 and hw.price_per_hour == 3.0
    assert hw.disk_read_gbs == 0.5 and hw.host_memory_bytes == 64 * GIB
    assert hw.device.tflops == DEVICES["RTX4090"].tflops  # the rest is the catalog's
    assert DEVICES["RTX4090"].memory_bytes == 24 * GIB  # the catalog is untouched
    sizes = {"512MB": 512 * 2**20, "1.5TiB": int(1.5 * 2**40), "1024KB": 2**20, "4096": 4096}
    for text, size in sizes.items():
        assert parse_hardware(f"L4,host={text}").host_memory_bytes == size


def test_with_count_and_price() -> None:
    hw = parse_hardware("A100-80GB")
    eight = hw.with_count(8)
    assert eight.count == 8 and eight.device == hw.device and eight.spec == "8xA100-80GB"
    assert eight.price_per_hour == pytest.approx(8 * hw.price_per_hour)
    assert parse_hardware(eight.spec) == eight
    assert eight.with_count(1) == hw
    with pytest.raises(HardwareSpecError, match="count"):
        hw.with_count(0)


def test_json_round_trip(tmp_path: Path) -> None:
    hw = parse_hardware("4xH200,host=1TB,nvme=7GB/s,link=pcie5,price=9")
    path = tmp_path / "hw.json"
    path.write_text(hw.to_json(), encoding="utf-8")
    back = parse_hardware(str(path))
    assert back == dataclasses.replace(hw, spec=str(path))
    assert parse_hardware(f"2x{path}").count == 2
    other = tmp_path / "hw.txt"  # any name holding a "/" is a file
    other.write_text(hw.to_json(), encoding="utf-8")
    assert parse_hardware(str(other)).device == hw.device


def test_json_custom_device(tmp_path: Path) -> None:
    path = tmp_path / "mi250.json"
    path.write_text(
        '{"device": {"name": "MI250X", "kind": "gpu", "memory_bytes": 68719476736,'
        ' "bandwidth_gbs": 1638, "tflops": {"fp32": 47.9, "fp16": 383}}, "count": 2}'
    )
    hw = parse_hardware(str(path))
    assert hw.device.name == "MI250X" and hw.count == 2 and hw.device.tflops["fp16"] == 383
    assert hw.link.name == "pcie4" and hw.host_memory_bytes == 256 * GIB
    path.write_text('{"device": "T4", "disk_read_gbs": 1}')
    assert parse_hardware(str(path)).device == DEVICES["T4"]
    path.write_text('{"device": {"name": "X"}}')
    with pytest.raises(HardwareSpecError, match="mi250.json"):
        parse_hardware(str(path))
    with pytest.raises(HardwareSpecError, match="cannot read"):
        parse_hardware(str(tmp_path / "missing.json"))


def test_catalog_is_sane() -> None:
    required = {"V100-32GB", "A100-40GB", "A100-80GB", "H100", "H200", "L4", "T4", "A6000",
                "RTX2080Ti", "RTX3090", "RTX4090"}  # fmt: skip
    assert required <= set(DEVICES)
    for name, d in DEVICES.items():
        assert d.name == name and d.kind == "gpu" and d.link in LINKS
        assert d.memory_bytes > 0 and d.bandwidth_gbs > 0 and d.price_per_hour > 0
        assert max(d.tflops.get("fp16", 0), d.tflops.get("fp32", 0)) > 0
        assert set(d.tflops) <= set(DTYPES)
        if "fp16-2:4" in d.tflops:  # sparse rates exist exactly where bf16 does (Ampere on)
            assert d.tflops["fp16-2:4"] == 2 * d.tflops["fp16"] and "bf16" in d.tflops
        else:
            assert "bf16" not in d.tflops
    for name, link in LINKS.items():
        assert link.name == name and link.bandwidth_gbs > 0 and link.latency_us > 0
    assert isinstance(parse_hardware("T4"), Hardware)


def test_this_machine(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    calls: list[int] = []

    def fake_profile(threads: int = 2, refresh: bool = False) -> HardwareProfile:
        calls.append(threads)
        return reference_cpu_profile(threads)

    monkeypatch.setattr(kiln.core.calibrate, "load_profile", fake_profile)
    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal:       16384000 kB\nMemFree:  100 kB\n")
    dev = this_machine(4, meminfo=meminfo)
    assert calls == [4]
    assert dev.name == "cpu" and dev.kind == "cpu" and dev.link == "shared-memory"
    assert dev.memory_bytes == 16384000 * 1024 and dev.price_per_hour == 0.0
    assert dev.bandwidth_gbs == 68.0 and dev.tflops == {"fp32": pytest.approx(0.92)}
    meminfo.write_text("MemFree: 1 kB\n")
    with pytest.raises(OSError):
        this_machine(meminfo=meminfo)
