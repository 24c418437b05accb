"""A small MLP and a task over it, for the compression tests (no data files needed)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
from torch import Tensor, nn


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
    _reference: Tensor | None = field(default=None, init=False)

    kind = "toy"

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

    def baseline(self) -> float:
        if self._reference is None:
            with torch.no_grad():
                self._reference = self.model(self.eval_inputs())
        return 1.0

    def measure(self, model: nn.Module) -> float:
        if self._reference is None:
            raise RuntimeError("call baseline() on the original model before measure()")
        with torch.no_grad():
            diff = model(self.eval_inputs()) - self._reference
        return float(0.5 * diff.pow(2).sum(1).mean())


def log_ratio(a: float, b: float) -> float:
    return abs(math.log(a / b))
