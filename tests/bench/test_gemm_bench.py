"""The GEMM shape-class benchmark on one tiny shape: kiln + the torch contenders
(oneDNN pre-packed, torch MKL), 1 round, few reps; then the pure helpers."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kiln.bench.gemm.gemm_runner import TARGET, run_gemm, summarise_classes
from kiln.bench.gemm.gemm_table import render_table
from kiln.bench.gemm.shapes import CLASSES, case_from_name, make_cases, parse_shapes


def test_run_gemm_one_tiny_shape(tmp_path: Path) -> None:
    result = run_gemm(
        [(8, 64, 64)], ["kiln", "onednn", "mkl"], ["gelu"], rounds=1, reps=3, out_dir=tmp_path,
        warmup_s=0.05, rep_ms=1.0, quiet_wait_s=0.2,
    )  # fmt: skip
    path = Path(result["path"])
    assert path.parent == tmp_path
    assert path.name.startswith("gemm-") and path.name.endswith(".json")
    saved = json.loads(path.read_text())
    assert saved["contenders"] == ["kiln", "onednn", "mkl"]
    assert saved["libraries"] == ["onednn", "mkl"] and saved["threads"] == 2
    assert "loadavg" in saved["load_before"] and "loadavg" in saved["load_after"]
    e = saved["cases"]["8x64x64-gelu"]
    assert (e["m"], e["k"], e["n"], e["shape_class"], e["epilogue"]) == (8, 64, 64, "tiny", "gelu")
    for c in ("kiln", "onednn", "mkl"):
        assert e["us"][c] > 0, e["facts"][c]
        assert e["round_us"][c] == [e["us"][c]] and len(e["round_cotenant_busy"][c]) == 1
        assert e["round_inner"][c][0] >= 1 and 1 <= e["round_attempts"][c][0] <= 2
    libs = {c: e["us"][c] for c in ("onednn", "mkl")}
    assert e["fastest_library"] == min(libs, key=lambda c: libs[c])
    assert e["fastest_library_us"] == min(libs.values())
    assert e["kiln_ratio"] == pytest.approx(e["us"]["kiln"] / e["fastest_library_us"])
    # fp32 against the float64 reference: a 64-term dot product plus erf stays ~1e-7
    assert e["accuracy"]["kiln"]["max_rel_err"] <= 1e-4
    assert e["accuracy"]["onednn"]["max_rel_err"] <= 1e-4
    assert "gemm" in e["kiln_kernels"] and e["facts"]["kiln"]["kernels"]
    tiny = saved["classes"]["tiny"]
    assert tiny["cases"] == ["8x64x64-gelu"] and tiny["measured"] == 1
    assert tiny["worst_ratio"] == e["kiln_ratio"]
    assert tiny["within_1_2x"] == (e["kiln_ratio"] <= TARGET)
    table = render_table(saved)
    assert "| tiny | 8×64×64 | gelu |" in table and "within 1.2x" in table


def test_parse_shapes_and_cases() -> None:
    assert parse_shapes("tiny") == CLASSES["tiny"]
    assert parse_shapes("small,8x256x688, 4×32×16") == [*CLASSES["small"], (4, 32, 16)]
    assert len(parse_shapes(None)) == sum(len(v) for v in CLASSES.values())
    with pytest.raises(ValueError):
        parse_shapes("8x0x4")
    with pytest.raises(ValueError):
        parse_shapes("huge")
    cases = make_cases([(64, 512, 2048), (4, 32, 16)])
    assert [c.name for c in cases] == [
        "64x512x2048-gelu", "64x512x2048-bias", "4x32x16-gelu", "4x32x16-bias",
    ]  # fmt: skip
    assert [c.shape_class for c in cases] == ["large", "large", "tiny", "tiny"]
    assert case_from_name("8x320x864-bias") == make_cases([(8, 320, 864)], ["bias"])[0]
    with pytest.raises(ValueError):
        make_cases([(1, 1, 1)], ["relu"])


def _entry(cls: str, epi: str, ratio: float | None) -> dict[str, object]:
    return {"shape_class": cls, "epilogue": epi, "kiln_ratio": ratio}


def test_class_verdicts() -> None:
    cases = {
        "a-gelu": _entry("tiny", "gelu", 0.5),
        "a-bias": _entry("tiny", "bias", 1.1),
        "b-gelu": _entry("small", "gelu", 1.3),  # one case over the target fails the class
        "b-bias": _entry("small", "bias", 0.8),
        "c-gelu": _entry("large", "gelu", 1.0),
        "c-bias": _entry("large", "bias", None),  # kiln failed: no verdict
    }
    s = summarise_classes(cases)
    assert s["tiny"]["within_1_2x"] is True and s["tiny"]["worst_case"] == "a-bias"
    assert s["tiny"]["geomean_ratio"] == pytest.approx((0.5 * 1.1) ** 0.5)
    assert s["small"]["within_1_2x"] is False and s["small"]["within_1_2x_geomean"] is True
    assert s["small"]["by_epilogue"]["gelu"]["worst_ratio"] == 1.3
    assert s["large"]["within_1_2x"] is None and s["large"]["measured"] == 1
