"""``torch.compile(model, backend="kiln")``: kiln's program runs (not the FX graph), one
program per input signature up to the cap, and every fallback warns and is recorded."""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import pytest
import torch
from torch import Tensor, nn

import kiln.compiler.api
from kiln.compiler.backend import KilnFallbackWarning, KilnGraph, kiln_backend
from tests.support.compare import assert_close_to_reference


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(16, 16)

    def forward(self, x: Tensor) -> Tensor:
        return torch.nn.functional.gelu(self.fc(x)).softmax(-1)


class Branchy(Net):
    def forward(self, x: Tensor) -> Tensor:
        h = torch.relu(self.fc(x))
        if h.sum() > 0:  # dynamo splits the graph here
            return h * 2
        return -h


@pytest.fixture(autouse=True)
def fresh_dynamo() -> None:
    torch._dynamo.reset()


@contextlib.contextmanager
def warnings_as_errors() -> Iterator[None]:
    with warnings.catch_warnings():
        warnings.simplefilter("error", KilnFallbackWarning)
        yield


def recording(graphs: list[KilnGraph]) -> Callable[..., KilnGraph]:
    """kiln's backend, keeping the ``KilnGraph`` it returns for each dynamo graph."""

    def backend(gm: torch.fx.GraphModule, example_inputs: Sequence[Any], **kw: Any) -> KilnGraph:
        graph = kiln_backend(gm, example_inputs, **kw)
        graphs.append(graph)
        return graph

    return backend


def test_kilns_program_runs_not_the_graph() -> None:
    model, graphs = Net().eval(), list[KilnGraph]()
    compiled = torch.compile(model, backend=recording(graphs))
    x = torch.randn(4, 16)
    with torch.no_grad():
        assert_close_to_reference(compiled(x), model(x))
        (graph,) = graphs
        (program,) = graph.kiln_programs.values()
        assert program.report.verification.startswith("ok")
        assert all(k.executor == "native" for k in program.report.kernels)
        calls: list[int] = []
        run = program._run

        def counted(flat: Sequence[Tensor]) -> list[Tensor]:
            calls.append(len(flat))
            return run(flat)

        program._run = counted
        assert_close_to_reference(compiled(x), model(x))
    assert calls == [3]  # weight, bias, x: dynamo passes the parameters as inputs
    assert (graph.kiln_calls, graph.graph_calls, graph.kiln_fallbacks) == (2, 0, [])


def test_new_shapes_compile_new_programs_up_to_the_cap() -> None:
    model, graphs = Net().eval(), list[KilnGraph]()
    compiled = torch.compile(
        model, backend=recording(graphs), dynamic=True, options={"max_shapes": 2}
    )
    with torch.no_grad():
        for rows in (3, 5, 3):
            x = torch.randn(rows, 16)
            assert_close_to_reference(compiled(x), model(x))
        (graph,) = graphs
        assert sorted(k[-1][0][0] for k in graph.kiln_programs) == [3, 5]
        assert (graph.kiln_calls, graph.graph_calls) == (3, 0)
        x = torch.randn(7, 16)
        with pytest.warns(KilnFallbackWarning, match=r"max_shapes=2\); new ones, first"):
            assert_close_to_reference(compiled(x), model(x))
        with warnings_as_errors():  # warned once: a further new shape runs quietly
            compiled(torch.randn(9, 16))
    assert (graph.kiln_calls, graph.graph_calls, len(graph.kiln_programs)) == (3, 2, 2)
    assert len(graph.kiln_fallbacks) == 1 and "max_shapes=2" in graph.kiln_fallbacks[0]


def test_a_graph_kiln_cannot_compile_warns_why_and_is_recorded(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    attempts = []

    def broken(*args: Any, **kwargs: Any) -> Any:
        attempts.append(1)
        raise RuntimeError("no lowering for frobnicate\nand a second line")

    monkeypatch.setattr(kiln.compiler.api, "compile", broken)
    model, graphs = Net().eval(), list[KilnGraph]()
    compiled = torch.compile(model, backend=recording(graphs))
    x = torch.randn(4, 16)
    with torch.no_grad():
        with pytest.warns(KilnFallbackWarning, match="RuntimeError: no lowering for frobnicate"):
            assert_close_to_reference(compiled(x), model(x))
        with warnings_as_errors():
            compiled(x)  # the same inputs: not tried again, not warned again
    (graph,) = graphs
    assert attempts == [1] and graph.kiln_programs == {}
    assert graph.kiln_fallbacks == [
        "could not compile the graph for inputs [[16, 16], [16], [4, 16]]: "
        "RuntimeError: no lowering for frobnicate"
    ]
    assert (graph.kiln_calls, graph.graph_calls) == (0, 2)


class Counts(Net):
    calls: Tensor

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("calls", torch.zeros(()))

    def forward(self, x: Tensor) -> Tensor:
        self.calls.add_(1)
        return self.fc(x) + self.calls


@pytest.mark.filterwarnings("ignore:kiln capture ignores in-place updates")
def test_a_graph_that_updates_a_buffer_in_place_runs_as_the_graph() -> None:
    model, graphs = Counts().eval(), list[KilnGraph]()
    compiled = torch.compile(model, backend=recording(graphs))
    x = torch.randn(4, 16)
    with torch.no_grad():
        with pytest.warns(KilnFallbackWarning, match=r"updates inputs \[0\] in place"):
            compiled(x)
        y = compiled(x)
    assert float(model.calls) == 2  # updated once per call, not by kiln's verification too
    assert_close_to_reference(y, model.fc(x) + 2)
    assert graphs[0].kiln_programs == {} and graphs[0].graph_calls == 2


def test_calls_that_need_gradients_run_the_graph_and_say_so() -> None:
    model, graphs = Net().eval(), list[KilnGraph]()
    compiled = torch.compile(model, backend=recording(graphs))
    x = torch.randn(4, 16)
    with pytest.warns(KilnFallbackWarning, match="compute no gradients"):
        y = compiled(x)
    y.sum().backward()  # autograd still works
    assert model.fc.weight.grad is not None
    assert graphs[0].kiln_programs == {} and graphs[0].graph_calls == 1


def test_data_dependent_branches_compile_around_the_split() -> None:
    model, graphs = Branchy().eval(), list[KilnGraph]()
    compiled = torch.compile(model, backend=recording(graphs))
    x = torch.randn(4, 16)
    with torch.no_grad():
        assert_close_to_reference(compiled(x), model(x))
    assert len(graphs) == 2  # before the branch, and the branch taken
    assert all(len(g.kiln_programs) == 1 and g.kiln_calls == 1 for g in graphs)


def test_unknown_options_are_refused() -> None:
    with pytest.raises(ValueError, match="unknown options"):
        kiln_backend(torch.fx.symbolic_trace(Net()), [], options={"max_shape": 3})
