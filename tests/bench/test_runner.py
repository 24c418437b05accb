"""The side-by-side runner on one tiny model: eager + ONNX Runtime (+ kiln, which
records an error until kiln.compile works), 2 rounds, few reps."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from kiln.bench import output_errors as errors
from kiln.bench import system
from kiln.bench.roofline import Peak, count_flops, model_roofline
from kiln.bench.suite import MODELS
from kiln.bench.suite_runner import run_suite


def test_run_suite_writes_result_with_ratios(tmp_path: Path) -> None:
    events: list[str] = []
    result = run_suite(
        ["tcnn_mlp"], ["ort", "kiln"], rounds=2, reps=3, out_dir=tmp_path,
        warmup_s=0.05, rep_ms=1.0, quiet_wait_s=0.2, on_event=lambda kind, info: events.append(kind),
        tag="unit",
    )  # fmt: skip
    path = Path(result["path"])
    assert path.parent == tmp_path and path.name.endswith("-unit.json")
    saved = json.loads(path.read_text())
    assert saved["contenders"] == ["eager", "ort", "kiln"]
    m = saved["models"]["tcnn_mlp"]
    eager, ort = m["results"]["eager"], m["results"]["ort"]
    assert len(eager["round_medians_ms"]) == 2 and eager["ms"] == min(eager["round_medians_ms"])
    assert len(eager["round_busy_before"]) == len(eager["round_cotenant_busy"]) == 2
    assert 0 <= eager["best_round_cotenant_busy"] <= 1
    assert ort["ms"] > 0 and ort["compile_s"] > 0 and "export_s" in ort
    assert m["speedup_vs_eager"]["ort"] == eager["ms"] / ort["ms"]
    assert ort["max_rel_err"] < 1e-4  # fp32 MLP, different GEMM kernels
    kiln = m["results"]["kiln"]
    assert "error" not in kiln and kiln["ms"] > 0  # kiln compiled, verified and was timed
    assert kiln["max_rel_err"] < 1e-4
    assert kiln["executor"] == "native" and kiln["fallbacks"] == []
    assert 0 <= kiln["extern_share"] <= 1 and kiln["kernel_us_total"] > 0
    assert len(kiln["kernels"]) == kiln["n_kernels"]
    assert m["flops"] == 2 * 64 * (32 * 64 + 64 * 64 * 2 + 64 * 16)
    assert m["input_shapes"] == [[64, 32]] and m["output_shapes"] == [[64, 16]]
    assert saved["device"]["slug"] and saved["versions"]["torch"]
    assert "loadavg" in saved["load_before"] and "loadavg" in saved["load_after"]
    assert saved["summary"]["geomean_speedup_vs_eager"]["ort"] > 0
    assert {"prepare", "prepared", "round", "model_done"} <= set(events)


def test_lstm_flops_counted() -> None:
    model, inputs = MODELS["lstm"].build()
    # 16 tokens through W_ih (1024x80), W_hh (1024x256), then (1024x256) x2, + head 32x256
    expected = 2 * 16 * (1024 * 80 + 1024 * 256 * 3) + 2 * 16 * 32 * 256
    assert count_flops(model, inputs) == expected


def test_roofline_floor() -> None:
    model, inputs = MODELS["swiglu_tower"].build()
    r = model_roofline(model, inputs, Peak(gflops=100.0, bw_gbs=10.0, source="test"))
    assert r["flops"] == 4 * 3 * 2 * 8 * 320 * 864
    params = 4 * 3 * 320 * 864 * 4
    assert r["bytes"] == params + 2 * 8 * 320 * 4
    assert r["floor_ms"] == max(r["flops"] / 100e9, r["bytes"] / 10e9) * 1e3


def test_compare_errors() -> None:
    ref = [torch.tensor([1.0, -2.0, 4.0]), torch.tensor([3, 4])]
    got = [torch.tensor([1.0, -2.5, 4.0]), torch.tensor([3, 4])]
    assert errors.compare(got, ref) == {"max_abs_err": 0.5, "max_rel_err": 0.125}
    assert "check_error" in errors.compare(got[:1], ref)
    assert "check_error" in errors.compare([torch.zeros(2), ref[1]], ref)


def test_device_slug() -> None:
    cpu = {"name": "AMD EPYC 9R45 96-Core Processor", "avx512f": True, "avx2": True}
    assert system.device_slug(cpu) == "amd-epyc-9r45-96-core-avx512"


def test_a_result_never_overwrites_an_earlier_one(tmp_path: Path) -> None:
    # Two runs on one day get the same name: the second becomes name-2, the first stays.
    first = system.write_result({"run": 1}, tmp_path, "host-20260101.json", markdown="one")
    second = system.write_result({"run": 2}, tmp_path, "host-20260101.json", markdown="two")
    assert Path(first["path"]).name == "host-20260101.json"
    assert Path(second["path"]).name == "host-20260101-2.json"
    assert json.loads((tmp_path / "host-20260101.json").read_text())["run"] == 1
    assert (tmp_path / "host-20260101-2.md").read_text() == "two"
