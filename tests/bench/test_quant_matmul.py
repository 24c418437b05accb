"""kiln.bench.quant_matmul: every (format, rows) pair timed once per round in a rotated
order (interleaved, not one format after another), medians per pair, GGUF formats through
their kernels, and the speed-up table against fp32."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from kiln.bench import quant_matmul as qm
from kiln.kernels.cpu.gguf_blocks import TYPE_IDS, reference_dequantize


def test_rounds_are_interleaved_and_rotated(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[int] = []  # per timed step: id of its first linear (one per format)
    real = qm._one_step

    def spy(step: list[tuple[str, Any, torch.Tensor]], flush: torch.Tensor) -> Any:
        calls.append(id(step[0][1]))
        return real(step, flush)

    monkeypatch.setattr(qm, "_one_step", spy)
    monkeypatch.setattr(qm.torch, "ones", lambda n: torch.zeros(1024))  # a small "flush"
    formats, rows, reps = ["fp32", "int8", "gguf-q4_0"], [1, 2], 3
    results = qm.run(rows, formats, reps, layers=1)
    pairs = len(formats) * len(rows)
    assert len(calls) == pairs * (reps + 1)  # a warm-up round, then reps rounds
    rounds = [calls[i * pairs : (i + 1) * pairs] for i in range(reps + 1)]
    firsts = [r[0] for r in rounds]
    assert len(set(firsts[:3])) == 3  # each round starts one pair later: no fixed order
    assert {(r["format"], r["rows"]) for r in results} == {(f, m) for f in formats for m in rows}
    gguf = next(r for r in results if r["format"] == "gguf-q4_0")
    assert gguf["backend"] == "kiln" and set(gguf["class_ms"]) == {c for _, c, _, _ in qm.LINEARS}
    ups = qm.speedups(results)
    assert {(u["format"], u["rows"]) for u in ups} == {(f, m) for f in formats[1:] for m in rows}
    table = qm.render(results, ups)
    assert table.count("\n") == 1 + len(results) and "gguf-q4_0" in table


def test_gguf_linears_compute_the_product() -> None:
    """The benchmark's GGUF linear is a real kernel on valid blocks: it matches the reference
    dequantization times x up to the 8-bit activations' error."""
    gen = torch.Generator().manual_seed(0)
    fn = qm._make_linear("gguf-q8_0", 64, 96, gen)
    x = torch.randn(3, 96)
    w = reference_dequantize(fn._blocks, TYPE_IDS["Q8_0"], 96)  # type: ignore[attr-defined]
    want = x @ w.T
    assert torch.allclose(fn(x), want, atol=0.02 * float(want.abs().max()))
