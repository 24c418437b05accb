"""LSTM and GRU layers as one native kernel each (capture/rnn.py, codegen/cpu/rnn.py,
kiln_rnn.h), against PyTorch's own nn.LSTM / nn.GRU."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import kiln
from tests.support.compare import assert_close_to_reference


def _rnn_kernels(compiled: kiln.CompiledModule) -> list[str]:
    return [k.executor for k in compiled.report.kernels if k.primitives == ["rnn"]]


@pytest.mark.parametrize("cell", ["lstm", "gru"])
@pytest.mark.parametrize(
    "hidden,layers,batch_first,bias,shape",
    [
        (64, 2, True, True, (3, 7, 20)),  # a whole number of GEMM panels
        (37, 1, False, True, (5, 2, 20)),  # ragged: a partial panel, time-major input
        (48, 2, True, False, (1, 11, 20)),  # no biases, batch 1
    ],
)
@pytest.mark.parametrize("threads", [1, 2])
def test_layers_run_as_one_native_kernel_each(
    cell: str,
    hidden: int,
    layers: int,
    batch_first: bool,
    bias: bool,
    shape: tuple[int, int, int],
    threads: int,
    vector_isa: str,
) -> None:
    torch.manual_seed(0)
    cls = nn.LSTM if cell == "lstm" else nn.GRU
    model = cls(20, hidden, num_layers=layers, bias=bias, batch_first=batch_first).eval()
    x = torch.randn(shape)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)  # 2: the time loop's threads meet at a barrier each step
    try:
        compiled = kiln.compile(model, (x,), cache=False)
        assert compiled.report.isa == vector_isa
        kinds = _rnn_kernels(compiled)
        # every layer's outputs; an LSTM's final cell states are one more call per layer
        assert kinds == ["native"] * (layers * (2 if cell == "lstm" else 1))
        fresh = torch.randn(shape)
        with torch.no_grad():
            assert_close_to_reference(compiled(fresh), model(fresh), rtol_to_max=1e-5)
    finally:
        torch.set_num_threads(before)


def test_a_stack_the_layer_kernel_does_not_cover_still_compiles() -> None:
    """Bidirectional LSTMs keep ATen's unrolled decomposition (no rnn kernel) and match."""
    torch.manual_seed(0)
    model = nn.LSTM(10, 16, bidirectional=True, batch_first=True).eval()
    x = torch.randn(2, 5, 10)
    compiled = kiln.compile(model, (x,), cache=False)
    assert _rnn_kernels(compiled) == []
    with torch.no_grad():
        assert_close_to_reference(compiled(x), model(x), rtol_to_max=1e-5)


def test_only_the_outputs_used_are_computed() -> None:
    """The LSTM's final cell state is a second call, dropped when nothing reads it."""

    class LastOutput(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lstm = nn.LSTM(8, 32, batch_first=True)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            out, _ = self.lstm(x)
            return out[:, -1]

    model = LastOutput().eval()
    x = torch.randn(2, 6, 8)
    compiled = kiln.compile(model, (x,), cache=False)
    assert _rnn_kernels(compiled) == ["native"]
    with torch.no_grad():
        assert_close_to_reference(compiled(x), model(x), rtol_to_max=1e-5)
