"""Control flow on tensor values cannot be captured by torch.export: kiln says so in a few
lines naming the user's file and line and the remedies, without torch's graph dump."""

from __future__ import annotations

import inspect
import re

import pytest
import torch
from torch import Tensor, nn

from kiln.compiler.capture import CaptureError, capture


class Branch(nn.Module):
    def forward(self, x: Tensor) -> Tensor:
        if x.sum() > 0:
            return x * 2
        return x - 1


class LoopCount(nn.Module):
    def forward(self, x: Tensor) -> Tensor:
        for _ in range(int(x.abs().sum().item()) % 3):
            x = x + 1
        return x


def _line_of(method: object, text: str) -> int:
    lines, first = inspect.getsourcelines(method)  # type: ignore[arg-type]
    return first + next(i for i, line in enumerate(lines) if text in line)


@pytest.mark.parametrize(
    ("model", "code"),
    [(Branch(), "if x.sum() > 0:"), (LoopCount(), "for _ in range(int(x.abs().sum().item())")],
    ids=["branch", "loop_count"],
)
def test_data_dependent_control_flow_says_where_and_what_to_do(
    model: nn.Module, code: str, capfd: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(CaptureError) as info:
        capture(model, (torch.randn(4, 8),))
    msg = str(info.value)
    line = _line_of(type(model).forward, code)
    assert f"{__file__}:{line} in forward: {code}" in msg, msg
    assert f"kiln cannot capture {type(model).__name__}" in msg
    assert 'torch.compile(model, backend="kiln")' in msg and "torch.where" in msg
    assert len(msg.splitlines()) <= 4  # a few lines, not a page
    assert info.value.__suppress_context__  # torch's exception is not chained on
    err = capfd.readouterr().err
    assert "def forward" not in err and "Unable to find user code" not in err, err


def test_other_export_failures_pass_through() -> None:
    class Raises(nn.Module):
        def forward(self, x: Tensor) -> Tensor:
            raise ValueError("the model's own error")

    with pytest.raises(ValueError, match=re.escape("the model's own error")):
        capture(Raises(), (torch.randn(2),))
