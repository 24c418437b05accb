"""CPU GEMM chains (``codegen/cpu/chain.py``): MLPs run row block by row block in one
parallel region, against the reference semantics and plain PyTorch; their legality and
their price against separate GEMM kernels."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from kiln.compiler.api import compile_graph
from kiln.compiler.fusion.candidates import (
    CPU_TARGET,
    GPU_TARGET,
    legal_template,
    make_candidate,
)
from kiln.compiler.fusion.chains import chain_candidates, chain_row_blocks
from kiln.compiler.fusion.cost import GraphLookup, calibrated_work
from kiln.compiler.fusion.cpu_cost import native_time
from kiln.compiler.fusion.program import Kernel
from kiln.compiler.ir.graph import Graph, TensorMeta
from kiln.compiler.ir.semantics import run_graph
from kiln.core.calibrate import load_profile
from tests.support.compare import assert_close_to_reference

F32 = torch.float32


def _meta(*shape: int) -> TensorMeta:
    return TensorMeta(tuple(shape), F32)


def _mlp(m: int, widths: list[int], transposed_input: bool = False) -> Graph:
    """x (m, widths[0]) -> [mm, + bias, relu] per layer; the second layer's result is
    also an output, the last layer adds a residual input instead of the relu."""
    g = Graph()
    if transposed_input:  # read through a permute: strided along K
        xt = g.add_input("xt", _meta(widths[0], m))
        h = g.add_node("permute", (xt,), _meta(m, widths[0]), {"dims": (1, 0)})
    else:
        h = g.add_input("x", _meta(m, widths[0]))
    res = g.add_input("res", _meta(m, widths[-1]))
    outs = []
    for i, (k, n) in enumerate(zip(widths, widths[1:])):
        w = g.add_constant(f"w{i}", torch.randn(k, n) / k**0.5)
        b = g.add_constant(f"b{i}", torch.randn(n))
        h = g.add_node("add", (g.add_node("mm", (h, w), _meta(m, n)), b), _meta(m, n))
        last = i == len(widths) - 2
        h = g.add_node("add" if last else "relu", (h, res) if last else (h,), _meta(m, n))
        if i == 1:
            outs.append(h)
    g.outputs = [h, *outs]
    return g


def _one_chain(g: Graph) -> list[Kernel]:
    nodes = [n for n in g.nodes if n.op != "permute"]
    outputs = tuple(v for v in g.outputs)
    return [Kernel("chain", tuple(n.name for n in nodes), outputs, tuple(g.inputs))]


@pytest.mark.parametrize(
    "m,widths,transposed",
    [(1, [8, 40, 33, 5], False), (13, [63, 256, 256, 100], True), (64, [32, 64, 64, 16], False),
     (250, [20, 100, 36, 40], False)],
)  # fmt: skip
def test_chain_matches_reference(m: int, widths: list[int], transposed: bool) -> None:
    g = _mlp(m, widths, transposed)
    x = torch.randn(widths[0], m) if transposed else torch.randn(m, widths[0])
    inputs = [x, torch.randn(m, widths[-1])]
    compiled = compile_graph(g, kernels=_one_chain(g))
    assert [k.template for k in compiled.report.kernels] == ["chain"]
    assert [k.executor for k in compiled.report.kernels] == ["native"]
    got = compiled.run_flat(inputs)
    assert_close_to_reference(got, run_graph(g, inputs), rtol_to_max=1e-5)
    h = x.T if transposed else x  # plain PyTorch, independently of the graph
    for i in range(len(widths) - 1):
        h = h @ g.constants[f"w{i}"] + g.constants[f"b{i}"]
        h = h + inputs[1] if i == len(widths) - 2 else torch.relu(h)
    assert_close_to_reference(got[0], h, rtol_to_max=1e-5)


def test_solver_chains_an_mlp_where_rows_split_between_threads() -> None:
    """64 rows on two threads: the chain saves a region per layer and is chosen; on one
    row there is nothing to split and the chain's single thread would lose."""
    profile = load_profile()
    if profile.threads < 2 or profile.kernels is None:
        pytest.skip("needs a calibrated profile of two or more threads")
    g = _mlp(64, [64, 256, 256, 256, 64])
    lk = GraphLookup(g)
    names = [n.name for n in g.nodes]
    chain = make_candidate(g, names)
    assert chain.template == "chain"
    work = calibrated_work(chain, g, profile, lk)
    assert work is not None and len(work.chain) == 4
    rates = profile.kernels
    chained = native_time(work, profile, rates)
    layers = []
    for i in range(4):
        c = make_candidate(g, names[3 * i : 3 * i + 3])
        assert c.template == "gemm"
        w = calibrated_work(c, g, profile, lk)
        assert w is not None
        layers.append(native_time(w, profile, rates))
    assert chained < sum(layers)
    compiled = compile_graph(g)
    assert "chain" in [k.template for k in compiled.report.kernels]


def test_chain_row_blocks() -> None:
    assert chain_row_blocks(64, 2, 12) == 2  # one block per thread
    assert chain_row_blocks(11, 2, 12) == 1  # fewer rows than a register block
    assert chain_row_blocks(1000, 2, 12) == 12  # blocks of at most 96 rows, even count
    assert chain_row_blocks(1000, 1, 12) == 11
    assert chain_row_blocks(3, 4, 1) == 3  # never more blocks than rows
    for m in range(1, 300, 7):
        for t in (1, 2, 3, 4):
            u = chain_row_blocks(m, t, 6)
            assert 1 <= u <= m and -(-m // u) <= max(48, -(-m // t))


def test_cpu_chain_legality() -> None:
    """The CPU's chains need constant right operands and stages that read only their own
    values; a GPU chain does not."""
    g = Graph()
    x = g.add_input("x", _meta(8, 16))
    w2 = g.add_input("w2", _meta(16, 4))  # a runtime right operand
    w1 = g.add_constant("w1", torch.randn(16, 16))
    h = g.add_node("relu", (g.add_node("mm", (x, w1), _meta(8, 16)),), _meta(8, 16))
    g.outputs = [g.add_node("mm", (h, w2), _meta(8, 4))]
    nodes = [n.name for n in g.nodes]
    assert legal_template(g, nodes, target=CPU_TARGET) is None
    assert legal_template(g, nodes, target=GPU_TARGET) == "chain"
    g2 = Graph()
    x = g2.add_input("x", _meta(8, 16))
    w1, w2 = g2.add_constant("w1", torch.randn(16, 16)), g2.add_constant("w2", torch.randn(16, 16))
    h = g2.add_node("mm", (x, w1), _meta(8, 16))
    y = g2.add_node("mm", (h, w2), _meta(8, 16))
    g2.outputs = [g2.add_node("add", (y, h), _meta(8, 16))]  # stage 2 reads stage 1's value
    nodes = [n.name for n in g2.nodes]
    assert legal_template(g2, nodes[:2], target=CPU_TARGET) == "chain"
    assert legal_template(g2, nodes, target=CPU_TARGET) is None
    assert legal_template(g2, nodes, target=GPU_TARGET) == "chain"
    narrow = dataclasses.replace(CPU_TARGET, chain_width=8)
    assert legal_template(g2, nodes[:2], target=narrow) is None


def _skip_mlp(m: int, d_in: int, width: int, d_extra: int) -> Graph:
    """NeRF's skip: x -> 2 ReLU layers -> cat([h, x, e]) -> 2 more layers (DeepSDF too)."""
    g = Graph()
    x = g.add_input("x", _meta(m, d_in))
    e = g.add_input("e", _meta(m, d_extra))
    h, k = x, d_in
    for i in range(4):
        if i == 2:
            k = width + d_in + d_extra
            h = g.add_node("cat", (h, x, e), _meta(m, k), {"dim": -1})
        w = g.add_constant(f"w{i}", torch.randn(k, width) / k**0.5)
        h = g.add_node("relu", (g.add_node("mm", (h, w), _meta(m, width)),), _meta(m, width))
        k = width
    g.outputs = [h]
    return g


@pytest.mark.parametrize("m", [1, 29])
def test_chain_through_a_skip_cat(m: int, vector_isa: str) -> None:
    """On both vector ISAs (AVX2 built with -mno-avx512f on an AVX-512 host)."""
    g = _skip_mlp(m, 13, 40, 5)
    inputs = [torch.randn(m, 13), torch.randn(m, 5)]
    chains = [c for c in chain_candidates(g) if len(c.nodes) == len(g.nodes)]
    assert chains, "the whole skip MLP is one chain candidate"
    compiled = compile_graph(g, kernels=_one_chain(g))
    assert compiled.report.isa == vector_isa
    assert [k.template for k in compiled.report.kernels] == ["chain"]
    assert [k.executor for k in compiled.report.kernels] == ["native"]
    got = compiled.run_flat(inputs)
    assert_close_to_reference(got, run_graph(g, inputs), rtol_to_max=1e-5)
    x, e = inputs
    h = torch.relu(torch.relu(x @ g.constants["w0"]) @ g.constants["w1"])
    h = torch.relu(torch.cat([h, x, e], dim=-1) @ g.constants["w2"])
    assert_close_to_reference(got[0], torch.relu(h @ g.constants["w3"]), rtol_to_max=1e-5)


def test_a_cat_read_outside_the_chain_ends_it() -> None:
    g = _skip_mlp(8, 13, 40, 5)
    cat = next(n for n in g.nodes if n.op == "cat")
    g.outputs = [*g.outputs, cat.output]  # the cat's value is also a graph output
    nodes = [n.name for n in g.nodes]
    assert legal_template(g, nodes, target=CPU_TARGET) is None
    assert legal_template(g, nodes, target=GPU_TARGET) is None  # GPU chains take no cat
    before = [n.name for n in g.nodes if n.op != "cat"][:4]  # the two layers before it
    assert legal_template(g, before, target=CPU_TARGET) == "chain"
