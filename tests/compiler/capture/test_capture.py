"""End-to-end capture: eager model vs ``run_graph`` on the captured graph, plus
the primitive structure each lowering must produce."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from torch import Tensor, nn

from kiln.compiler.capture import CaptureResult, capture, fallback_report
from kiln.compiler.capture.passes import for_cpu_backend
from kiln.compiler.ir.graph import Graph, Node, ValueKind
from kiln.compiler.ir.semantics import run_graph
from tests.compiler.capture import models as M
from tests.support.compare import assert_close_to_reference

Case = Callable[[], tuple[nn.Module, tuple[Tensor, ...]]]

CASES: dict[str, Case] = {
    "mlp": lambda: (M.MLP(), (torch.randn(4, 12),)),
    "layernorm": lambda: (nn.LayerNorm(16), (torch.randn(2, 3, 16),)),
    "rmsnorm": lambda: (M.RMSNorm(16), (torch.randn(2, 3, 16),)),
    "attention": lambda: (M.Attention(), (torch.randn(2, 5, 32),)),
    "conv_bn_relu": lambda: (M.ConvBNReLU(), (torch.randn(2, 3, 8, 8),)),
    "conv1d": lambda: (
        nn.Sequential(nn.Conv1d(4, 6, 3, stride=2, padding=1), nn.Tanh(), nn.Conv1d(6, 6, 1)),
        (torch.randn(2, 4, 16),),
    ),
    "instance_group_norm": lambda: (M.Norms(), (torch.randn(2, 8, 6, 6),)),
    "lstm1": lambda: (M.LSTMModel(1), (torch.randn(2, 5, 8),)),
    "lstm2": lambda: (M.LSTMModel(2), (torch.randn(3, 4, 8),)),
    "embed_mean": lambda: (M.EmbedMean(), (torch.randint(0, 20, (3, 7)),)),
    "log_softmax": lambda: (nn.LogSoftmax(dim=1), (torch.randn(4, 10) * 5,)),
    "structured": lambda: (M.Structured(), (torch.randn(3, 6), torch.randn(3, 6))),
    "pooling": lambda: (M.CNNHead(), (torch.randn(2, 4, 10, 10),)),
    "pointwise": lambda: (M.Pointwise(), (torch.randn(4, 6), torch.randn(4, 6))),
    "layouts": lambda: (M.Layouts(), (torch.randn(2, 6, 8),)),
}

_cache: dict[str, tuple[nn.Module, tuple[Tensor, ...], CaptureResult]] = {}


def captured(name: str) -> tuple[nn.Module, tuple[Tensor, ...], CaptureResult]:
    """Capture each case once per session (torch.export dominates test time)."""
    if name not in _cache:
        torch.manual_seed(0)
        model, inputs = CASES[name]()
        _cache[name] = (model, inputs, capture(model, inputs))
    return _cache[name]


def ops(g: Graph) -> list[str]:
    return [n.op for n in g.nodes]


def users(g: Graph, value: str) -> list[Node]:
    return [n for n in g.nodes if value in n.inputs]


@pytest.mark.parametrize("name", list(CASES))
def test_matches_eager(name: str) -> None:
    model, inputs, result = captured(name)
    with torch.no_grad():
        expected = model(*inputs)
    actual = result.unflatten(run_graph(result.graph, list(inputs)))
    assert_close_to_reference(actual, expected, rtol_to_max=1e-5)


@pytest.mark.parametrize("name", list(CASES))
def test_graph_invariants(name: str) -> None:
    """Valid graph; every reduction keepdim=True; every opaque node reported;
    constants contiguous; inputs in call order."""
    _, inputs, result = captured(name)
    g = result.graph
    g.validate()
    assert [g.meta(i).shape for i in g.inputs] == [tuple(x.shape) for x in inputs]
    for n in g.nodes:
        if n.op in ("sum", "max", "min"):
            assert n.attrs["keepdim"] is True, n
    assert {f.node_name for f in result.fallbacks} == {n.name for n in g if n.op == "opaque"}
    for name_, data in g.constants.items():
        assert data.is_contiguous(), name_
        assert tuple(data.shape) == g.meta(name_).shape
        kind = g.values[name_].kind
        assert kind == (ValueKind.CONST if data.dim() == 0 else ValueKind.PARAM)


def test_mlp_primitives() -> None:
    """linear -> mm on a contiguous (K, N) PARAM + bias add; gelu exact -> erf,
    gelu tanh -> tanh; silu -> sigmoid * x; nothing opaque."""
    model, _, result = captured("mlp")
    assert isinstance(model, M.MLP)
    g = result.graph
    mms = [n for n in g.nodes if n.op == "mm"]
    assert len(mms) == 3
    for n, fc in zip(mms, (model.fc1, model.fc2, model.fc3), strict=True):
        w = n.inputs[1]
        assert g.values[w].kind == ValueKind.PARAM
        assert torch.equal(g.constants[w], fc.weight.detach().t())  # (K, N)
        assert [u.op for u in users(g, n.output)] == ["add"]
    assert {"erf", "tanh", "sigmoid"} <= set(ops(g))
    assert not result.fallbacks


def _check_softmax(g: Graph, max_node: Node) -> None:
    """max -> sub -> exp -> sum -> div, reductions keepdim=True."""
    (sub,) = users(g, max_node.output)
    assert sub.op == "sub"
    (exp,) = users(g, sub.output)
    assert exp.op == "exp"
    assert sorted(u.op for u in users(g, exp.output)) == ["div", "sum"]
    (s,) = [u for u in users(g, exp.output) if u.op == "sum"]
    assert s.attrs["dims"] == max_node.attrs["dims"] and s.attrs["keepdim"]


def test_attention_softmax_and_layernorm() -> None:
    _, _, result = captured("attention")
    g = result.graph
    (mx,) = [n for n in g.nodes if n.op == "max"]
    _check_softmax(g, mx)
    assert mx.attrs["dims"] == (3,) and mx.attrs["keepdim"] is True
    assert ops(g).count("bmm") == 2
    assert ops(g).count("rsqrt") == 1  # layer norm: rsqrt(var + eps)
    assert "opaque" not in ops(g)


def test_log_softmax_primitives() -> None:
    _, _, result = captured("log_softmax")
    assert ops(result.graph) == ["max", "sub", "exp", "sum", "log", "sub"]


def test_batchnorm_folds_into_the_conv_weights() -> None:
    """Eval batch norm becomes a per-channel scale and shift, which capture then
    folds into the preceding convolution's weight and bias: only the convs and
    their activations are left."""
    _, _, result = captured("conv_bn_relu")
    g = result.graph
    assert ops(g) == ["conv", "relu", "conv", "maximum", "minimum"]
    convs = [n for n in g.nodes if n.op == "conv"]
    assert [c.attrs["groups"] for c in convs] == [1, 8]  # depthwise second
    for c in convs:
        assert all(g.values[v].kind == ValueKind.PARAM for v in c.inputs[1:])
        assert g.meta(c.inputs[2]).shape == (8,)


def test_conv1d_attrs() -> None:
    g = captured("conv1d")[2].graph
    assert [n.op for n in g.nodes] == ["conv", "tanh", "conv"]
    first = g.nodes[0]
    assert first.attrs == {"stride": (2,), "padding": (1,), "dilation": (1,), "groups": 1}
    assert len(first.inputs) == 3  # x, weight, bias


def test_instance_and_group_norm_are_primitive() -> None:
    g = captured("instance_group_norm")[2].graph
    assert "opaque" not in ops(g)
    assert ops(g).count("rsqrt") == 2


def test_lstm_layers_are_rnn_primitives() -> None:
    """A plain LSTM stack is one ``rnn`` primitive per layer (capture/rnn.py), not opaque."""
    for name in ("lstm1", "lstm2"):
        g = captured(name)[2].graph
        assert "opaque" not in ops(g)
        assert "rnn" in ops(g) and "sigmoid" not in ops(g)


def test_embedding_is_a_row_gather_and_mean_is_sum_times_scale() -> None:
    _, _, result = captured("embed_mean")
    g = result.graph
    assert not result.fallbacks
    (gather,) = [n for n in g.nodes if n.op == "index_select"]
    assert gather.attrs == {"dim": 0} and g.values[gather.inputs[0]].kind == ValueKind.PARAM
    (emb,) = users(g, gather.output)  # the view back to (B, T, D)
    (s,) = users(g, emb.output)
    assert s.op == "sum" and s.attrs == {"dims": (1,), "keepdim": True}
    (scale,) = users(g, s.output)
    assert scale.op == "mul" and g.constants[scale.inputs[1]].item() == pytest.approx(1 / 7)


def test_structured_outputs() -> None:
    model, inputs, result = captured("structured")
    out = result.unflatten(run_graph(result.graph, list(inputs)))
    assert list(out) == ["sum", "pair", "max"] and isinstance(out["pair"], tuple)


def test_pooling() -> None:
    """Max and average pools of 4-D values, tiling or overlapping, are ``pool2d`` nodes;
    adaptive (1, 1) is a reduction over (H, W); constant padding is a cat."""
    _, _, result = captured("pooling")
    g = result.graph
    assert not result.fallbacks
    assert "cat" in ops(g)
    pools = [(n.attrs, g.meta(n.output).shape) for n in g.nodes if n.op == "pool2d"]
    common = {"padding": (0, 0), "channels_last": False}
    assert pools == [
        ({"mode": "max", "kernel": (2, 2), "stride": (2, 2), **common}, (2, 4, 5, 5)),
        ({"mode": "max", "kernel": (3, 3), "stride": (1, 1), **common}, (2, 4, 8, 8)),
        ({"mode": "avg", "kernel": (2, 2), "stride": (2, 2), **common}, (2, 4, 5, 5)),
    ]
    assert any(n.op == "sum" and n.attrs["dims"] == (2, 3) for n in g.nodes)


def test_pointwise_scalars_and_powers() -> None:
    g = captured("pointwise")[2].graph
    assert "opaque" not in ops(g)
    for n in g.nodes:  # pow(x, 3) and pow(x, 0.5) are not pow nodes
        if n.op == "pow" and n.inputs[1] in g.constants:
            assert g.constants[n.inputs[1]].item() not in (0.5, 2, 3)
    for v in g.values.values():  # python scalars are float32/bool 0-d constants
        if v.kind == ValueKind.CONST:
            assert v.meta.dtype in (torch.float32, torch.bool)


def test_layout_chains_collapse() -> None:
    """x.view(a).view(b).view(x.shape) * 2 reads x directly; the permute pair
    cancels; split/select become slices."""
    g = captured("layouts")[2].graph
    first = g.producer(g.outputs[0])
    assert first is not None and first.op == "mul" and first.inputs[0] == "x"
    assert "opaque" not in ops(g)
    assert "slice" in ops(g) and "cat" in ops(g)


def test_integer_math_becomes_opaque() -> None:
    """The C++ backend's kernels take float32/bool only: for it int64 arithmetic runs in
    torch, while the cast and the view of the int input stay primitive."""

    class IntOps(nn.Module):
        def forward(self, idx: Tensor) -> Tensor:
            shifted = (idx.view(-1) + 1) * 2  # int64 math
            return shifted.float().view(2, 3) * 0.5

    idx = torch.arange(6).view(2, 3)
    g = for_cpu_backend(capture(IntOps(), (idx,)).graph)
    fallbacks = fallback_report(g)
    assert [f.aten_op for f in fallbacks] == ["aten.add.Tensor", "aten.mul.Tensor"]
    assert all("int64" in f.reason for f in fallbacks)
    assert "cast" in ops(g) and "view" in ops(g)
    assert_close_to_reference(run_graph(g, [idx])[0], IntOps()(idx))


def test_multi_output_indices_fall_back_per_output() -> None:
    """max(dim) values are a reduction; only the used indices output is opaque."""

    class ArgMax(nn.Module):
        def forward(self, x: Tensor) -> tuple[Tensor, Tensor]:
            v, i = x.max(dim=-1)
            return v * 2, i

    x = torch.randn(3, 5)
    result = capture(ArgMax(), (x,))
    (op,) = [n for n in result.graph.nodes if n.op == "opaque"]
    assert op.attrs["output_index"] == 1
    assert "max" in ops(result.graph)
    assert_close_to_reference(result.unflatten(run_graph(result.graph, [x])), ArgMax()(x))


def test_buffer_mutation_is_reported() -> None:
    class Counter(nn.Module):
        calls: Tensor

        def __init__(self) -> None:
            super().__init__()
            self.register_buffer("calls", torch.zeros(()))

        def forward(self, x: Tensor) -> Tensor:
            self.calls.add_(1)
            return x * 2

    with pytest.warns(UserWarning, match="in-place"):
        result = capture(Counter(), (torch.randn(3),))
    assert result.mutations == ["calls"]
    assert [n.op for n in result.graph.nodes] == ["mul"]
