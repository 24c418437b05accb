"""The chains-on/off A/B really compiles two different programs and reports both."""

from __future__ import annotations

import torch
from torch import nn

from kiln.bench import chain_ab


def test_chain_ab_compares_programs_with_and_without_chains() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(),
                          nn.Linear(32, 8)).eval()  # fmt: skip
    row = {"model": "mlp", **chain_ab.compare(model, (torch.randn(64, 16),), rounds=1)}
    assert row["chain_kernels"] >= 1 or row["kernels_on"] == row["kernels_off"]
    assert row["kernels_on"] <= row["kernels_off"]
    assert len(row["on_ms"]) == len(row["off_ms"]) == 1
    assert row["ratio_median"] == row["off_median_ms"] / row["on_median_ms"]
    result = {"date": "d", "cpu": {"name": "cpu", "avx512f": False}, "threads": 2,
              "rounds": 1, "fitted_rates": False, "models": [row]}  # fmt: skip
    assert "| mlp |" in chain_ab.markdown(result)
