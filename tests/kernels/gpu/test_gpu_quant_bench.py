"""kiln/bench/gpu_quant.py end to end on tiny shapes (the interpreter without a GPU)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

pytest.importorskip("triton")
from kiln.bench import gpu_quant  # noqa: E402  (after the importorskip)


def test_smoke_run_writes_checked_cases(tmp_path: Path) -> None:
    out = tmp_path / "r" / "gpu_quant.json"
    assert gpu_quant.main(["--smoke", "--out", str(out), "--warmup-ms", "1", "--rep-ms", "5"]) == 0
    result = json.loads(out.read_text())
    assert result["all_ok"] and result["smoke"]
    assert {"device", "torch", "triton", "cases"} <= result.keys()
    cases = result["cases"]
    assert {c["method"] for c in cases} == set(gpu_quant.METHODS)
    assert len(cases) == len(gpu_quant.SMOKE_SHAPES) * len(gpu_quant.SMOKE_ROWS) * len(
        gpu_quant.METHODS
    )
    for c in cases:
        assert c["ms"] > 0 and c["speedup_vs_fp16"] > 0
        assert c["method"] == "fp16" or c["rel_err"] < gpu_quant.MAX_REL_ERR


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU exit")
def test_full_run_needs_a_gpu(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert gpu_quant.main(["--out", str(tmp_path / "x.json")]) == 2
    assert "no CUDA GPU" in capsys.readouterr().err
    assert not (tmp_path / "x.json").exists()


def test_quantizers_round_trip() -> None:
    w = torch.randn(8, 128)
    q, s = gpu_quant.quantize_int8(w)
    assert (q.float() * s[:, None] - w).abs().max() <= s.max() / 2 + 1e-6
    packed, scale, offset = gpu_quant.quantize_int4(w, 32)
    assert packed.shape == (8, 64) and scale.shape == offset.shape == (8, 4)
    kept = gpu_quant.prune_24(w)
    assert ((kept != 0).reshape(8, 32, 4).sum(-1) == 2).all()
