"""A small MLP and a task over it, for the compression tests (no data files needed).

The task's search and confirmation "texts" are two disjoint draws of correlated inputs
(seeds 3 and 5); its margins are those of ``kiln.quality.spread`` over per-sample losses.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
from torch import Tensor, nn

from kiln.quality.spread import PairedDifference, paired_difference


def toy_mlp(seed: int = 0) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(
        nn.Linear(64, 128), nn.GELU(), nn.Linear(128, 128), nn.GELU(), nn.Linear(128, 32)
    ).eval()


def correlated_inputs(rows: int, k: int = 64, seed: int = 1) -> Tensor:
    gen = torch.Generator().manual_seed(seed)
    mix = torch.randn(k, k, generator=gen) / k**0.5 + torch.eye(k)
    return torch.randn(rows, k, generator=gen) @ mix  # (rows, K)


@dataclass
class ToyTask:
    """Loss = 1/2 |y' - y|^2 per sample against the original model's outputs y."""

    model: nn.Module
    calib_rows: int = 2048
    eval_rows: int = 2048
    confirm_rows: int = 2048
    z: float = 0.0  # no margin by default: the search tests predate it
    _reference: Tensor | None = field(default=None, init=False)
    _confirm_reference: Tensor | None = field(default=None, init=False)

    kind = "toy"
    search_text = "toy search inputs"
    confirm_text = "toy confirmation inputs"

    def calibration(self) -> list[Tensor]:
        return list(correlated_inputs(self.calib_rows, seed=2).split(256))

    def loss_fn(self, model: nn.Module, batch: Tensor) -> Tensor:
        out = model(batch)  # (B, 32)
        gen = torch.Generator().manual_seed(int(batch.shape[0]))
        return (torch.randn(out.shape, generator=gen) * out).sum()

    def budget(self, max_increase: float) -> float:
        return max_increase * self.scale()

    def describe(self, loss_increase: float) -> float:
        return loss_increase / self.scale()

    def scale(self) -> float:
        """Mean 1/2 |y|^2: budgets are relative to the outputs' own size."""
        self.baseline()
        assert self._reference is not None
        return float(0.5 * self._reference.pow(2).sum(1).mean())

    def eval_inputs(self) -> Tensor:
        return correlated_inputs(self.eval_rows, seed=3)

    def confirm_inputs(self) -> Tensor:
        return correlated_inputs(self.confirm_rows, seed=5)

    def baseline(self) -> float:
        if self._reference is None:
            with torch.no_grad():
                self._reference = self.model(self.eval_inputs())
                self._confirm_reference = self.model(self.confirm_inputs())
        return 1.0

    def confirm_baseline(self) -> float:
        return self.baseline()

    def _paired(self, model: nn.Module, x: Tensor, ref: Tensor | None) -> PairedDifference:
        if ref is None:
            raise RuntimeError("call baseline() on the original model before measure()")
        with torch.no_grad():
            diff = model(x) - ref  # (rows, 32)
        return paired_difference(0.5 * diff.pow(2).sum(1), z=self.z)

    def measure_search(self, model: nn.Module) -> PairedDifference:
        return self._paired(model, self.eval_inputs(), self._reference)

    def measure_confirmation(self, model: nn.Module) -> PairedDifference:
        return self._paired(model, self.confirm_inputs(), self._confirm_reference)

    def measure(self, model: nn.Module) -> float:
        return self.measure_search(model).mean


def log_ratio(a: float, b: float) -> float:
    return abs(math.log(a / b))
