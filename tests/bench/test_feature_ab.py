"""The feature on/off A/B really compiles two different programs and reports both."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import kiln
from kiln.bench import feature_ab
from kiln.compiler import api


def _mlp() -> tuple[nn.Module, tuple[torch.Tensor, ...]]:
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(),
                          nn.Linear(32, 8))  # fmt: skip
    return model.eval(), (torch.randn(64, 16),)


def _convs() -> tuple[nn.Module, tuple[torch.Tensor, ...]]:
    model = nn.Sequential(nn.Conv2d(16, 32, 3, padding=1), nn.ReLU(),
                          nn.Conv2d(32, 32, 3, padding=1), nn.ReLU())  # fmt: skip
    return model.eval(), (torch.randn(1, 16, 24, 24),)


@pytest.mark.parametrize(
    ("feature", "make", "always"), [("chains", _mlp, False), ("winograd", _convs, True)]
)
def test_feature_ab_compares_programs_with_and_without(
    feature: str, make: object, always: bool
) -> None:
    """A 32-channel 3x3 conv over 24x24 pixels is priced about 1.6x cheaper by Winograd on
    any profile (both templates at the same efficiency), so it is always chosen; whether a
    small MLP's chain pays depends on the host's fitted rates (none on a fresh machine),
    so either its chains are chosen or the two programs are the same."""
    torch.manual_seed(0)
    model, inputs = make()  # type: ignore[operator]
    row = {"model": "m", **feature_ab.compare(model, inputs, feature, rounds=1)}
    chosen = row["feature_kernels"] >= 1
    assert chosen if always else chosen or row["kernels_on"] == row["kernels_off"], row
    assert row["kernels_on"] <= row["kernels_off"]
    assert len(row["on_ms"]) == len(row["off_ms"]) == 1
    assert row["ratio_median"] == row["off_median_ms"] / row["on_median_ms"]
    result = {"date": "d", "feature": feature, "cpu": {"name": "cpu", "avx512f": False},
              "threads": 2, "rounds": 1, "fitted_rates": False, "models": [row]}  # fmt: skip
    assert "| m |" in feature_ab.markdown(result)


def test_withheld_feature_is_not_chosen() -> None:
    """... and never when withheld (the 'off' program of the A/B)."""
    model, inputs = _convs()
    target = api.CPU_TARGET
    api.CPU_TARGET = feature_ab.without(target, "winograd")
    try:
        off = kiln.compile(model, inputs)
    finally:
        api.CPU_TARGET = target
    assert not any(k.template == "wconv" for k in off.report.kernels)
