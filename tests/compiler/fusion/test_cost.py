"""Roofline cost estimates (checked by hand) and the measured-cost cache."""

from __future__ import annotations

from pathlib import Path

import pytest

from kiln.compiler.fusion.candidates import Candidate, enumerate_candidates, make_candidate
from kiln.compiler.fusion.cost import CostModel, candidate_bytes, estimate, structure_key
from kiln.compiler.ir.graph import Graph
from kiln.core.hardware import HardwareProfile
from tests.compiler.fusion.orch_graphs import (
    meta,
    mm_bias_relu_graph,
    op,
    opaque_gelu,
    softmax_graph,
    vit_like,
)

# round numbers: 100 GFLOP/s = 1e5 flop/µs, 10 GB/s = 1e4 B/µs
PROFILE = HardwareProfile(
    name="test",
    isa="avx2",
    threads=2,
    peak_gflops=100.0,
    mem_bw_gbs=10.0,
    cache_bytes=(32768, 1 << 20, 1 << 25),
    kernel_fixed_us=1.0,
    extern_call_us=5.0,
    gemm_efficiency={"tiny": 0.1, "small": 0.5, "large": 1.0},
)


def whole(g: Graph) -> Candidate:
    return make_candidate(g, [n.name for n in g.nodes])


def test_pointwise_roofline_by_hand() -> None:
    g = Graph()
    x = g.add_input("x", meta(64, 128))
    g.outputs = [op(g, "exp", (x,), (64, 128))]
    c = whole(g)
    assert candidate_bytes(c, g) == 2 * 64 * 128 * 4  # read x, write exp(x)
    # memory-bound: 65536 B / 1e4 B/µs; compute 10 flop/elem * 8192 / 1e5 = 0.82 µs
    assert estimate(c, g, PROFILE) == pytest.approx(65536 / 1e4 + 1.0)


def test_gemm_roofline_by_hand() -> None:
    g = mm_bias_relu_graph(m=8, k=64, n=32)
    c = whole(g)
    assert c.template == "gemm"
    # x 8x64, w 64x32, bias 32, out 8x32 (float32)
    assert candidate_bytes(c, g) == 4 * (8 * 64 + 64 * 32 + 32 + 8 * 32)
    flops = 2 * 8 * 32 * 64  # tiny class: 10% of peak
    compute = flops / (100.0 * 0.1 * 1e3) + 2 * 8 * 32 / 1e5  # + bias add and relu
    assert estimate(c, g, PROFILE) == pytest.approx(compute + 1.0)


def test_views_read_what_they_touch() -> None:
    g = Graph()
    x = g.add_input("x", meta(64, 128))
    s = op(g, "slice", (x,), (64, 32), dim=1, start=0, end=32, step=1)
    y = op(g, "relu", (s,), (64, 32))
    b = g.add_input("b", meta(1, 128))
    e = op(g, "expand", (b,), (64, 128), shape=(64, 128))
    z = op(g, "add", (x, e), (64, 128))
    g.outputs = [y, z]
    relu = make_candidate(g, [g.nodes[1].name])
    assert relu.inputs == ("x",)
    assert candidate_bytes(relu, g) == 4 * (64 * 32 + 64 * 32)  # a quarter of x, once
    add = make_candidate(g, [g.nodes[3].name])
    assert candidate_bytes(add, g) == 4 * (64 * 128 + 128 + 64 * 128)  # b read once


def test_pool_roofline_by_hand() -> None:
    """A ``pool2d`` is a native kernel: bytes of its input and output, a max per window
    tap and output."""
    for channels_last in (True, False):
        g = Graph()
        x = g.add_input("x", meta(1, 56, 56, 64) if channels_last else meta(1, 64, 56, 56))
        attrs = {"mode": "max", "kernel": (3, 3), "stride": (2, 2), "padding": (1, 1)}
        out = (1, 28, 28, 64) if channels_last else (1, 64, 28, 28)
        g.outputs = [op(g, "pool2d", (x,), out, **attrs, channels_last=channels_last)]
        c = whole(g)
        assert c.template == "single"
        memory = 4 * 64 * (56 * 56 + 28 * 28) / 1e4
        assert estimate(c, g, PROFILE) == pytest.approx(max(memory, 9 * 64 * 28 * 28 / 1e5) + 1.0)


def test_extern_kernels_pay_a_call() -> None:
    g = Graph()
    x = g.add_input("x", meta(4, 4))
    g.outputs = [opaque_gelu(g, x, (4, 4))]
    c = whole(g)
    assert c.template == "single"
    assert estimate(c, g, PROFILE) == pytest.approx(5.0 + 2 * 64 / 1e4)


def test_a_oneDNN_conv_pays_its_weight_reorder() -> None:
    """A conv through oneDNN reads and rewrites its plain weight every call
    (``ONEDNN_WEIGHT_PASSES``) before the conv reads it: a late ResNet layer's 9.4 MB
    filter makes it memory-bound, where the roofline of its FLOPs alone was not."""
    import torch

    from kiln.compiler.fusion.cost import ONEDNN_CONV_US, ONEDNN_WEIGHT_PASSES

    g = Graph()
    x = g.add_input("x", meta(1, 512, 4, 4))
    w = g.add_constant("w", torch.zeros(512, 512, 3, 3))
    attrs = {"stride": (1, 1), "padding": (1, 1), "dilation": (1, 1), "groups": 1}
    g.outputs = [op(g, "conv", (x, w), (1, 512, 4, 4), **attrs)]
    c = whole(g)
    assert c.template == "conv"
    weight = 4 * 512 * 512 * 9
    moved = 4 * 512 * 16 * 2 + (1 + ONEDNN_WEIGHT_PASSES) * weight  # in, out, weight x 3
    flops = 2 * 16 * 512 * 512 * 9
    compute = flops / (100.0 * PROFILE.efficiency(flops) * 1e3)
    assert moved / 1e4 > compute  # memory-bound by the reorder
    assert estimate(c, g, PROFILE) == pytest.approx(moved / 1e4 + 5.0 + ONEDNN_CONV_US)


def test_a_oneDNN_conv_runs_below_the_gemm_rate() -> None:
    """A compute-bound dense conv through oneDNN is priced at ``ONEDNN_CONV_EFFICIENCY``
    of the GEMM efficiency of its size (what the suite's extern convs measured)."""
    import torch

    from kiln.compiler.fusion.cost import ONEDNN_CONV_EFFICIENCY, ONEDNN_CONV_US

    g = Graph()
    x = g.add_input("x", meta(1, 64, 28, 28))
    w = g.add_constant("w", torch.zeros(64, 64, 3, 3))
    attrs = {"stride": (1, 1), "padding": (1, 1), "dilation": (1, 1), "groups": 1}
    g.outputs = [op(g, "conv", (x, w), (1, 64, 28, 28), **attrs)]
    flops = 2 * 784 * 64 * 64 * 9
    compute = flops / (100.0 * PROFILE.efficiency(flops) * ONEDNN_CONV_EFFICIENCY * 1e3)
    assert compute > 4 * (2 * 64 * 784 + 3 * 64 * 64 * 9) / 1e4  # not memory-bound
    assert estimate(whole(g), g, PROFILE) == pytest.approx(compute + 5.0 + ONEDNN_CONV_US)


def test_fusing_softmax_is_cheaper_than_five_kernels() -> None:
    g = softmax_graph()
    cands = enumerate_candidates(g)
    fused = next(c for c in cands if len(c.nodes) == 5)
    singles = [c for c in cands if len(c.nodes) == 1]
    assert estimate(fused, g, PROFILE) < 0.5 * sum(estimate(c, g, PROFILE) for c in singles)


def test_structure_key_ignores_names_but_not_shapes() -> None:
    g = vit_like(layers=2)
    cands = enumerate_candidates(g, max_nodes=4)
    keys: dict[str, list[Candidate]] = {}
    for c in cands:
        keys.setdefault(structure_key(c, g, "p"), []).append(c)
    assert max(len(v) for v in keys.values()) >= 2  # the two layers share measurements
    a = softmax_graph(64, 128)
    b = softmax_graph(64, 256)
    assert structure_key(whole(a), a, "p") != structure_key(whole(b), b, "p")
    assert structure_key(whole(a), a, "p") != structure_key(whole(a), a, "q")


def test_measured_costs_are_cached_on_disk(tmp_path: Path) -> None:
    g = softmax_graph()
    cands = enumerate_candidates(g)
    calls: list[Candidate] = []

    def measure(c: Candidate) -> float:
        calls.append(c)
        return 1.0 + len(c.nodes)

    path = tmp_path / "measured.json"
    model = CostModel(PROFILE, measure=measure, cache_path=path)
    first = model.costs(cands, g)
    assert len(calls) == len(cands) and path.exists()
    assert first[cands[0]] == 1.0 + len(cands[0].nodes)
    again = CostModel(PROFILE, measure=measure, cache_path=path).costs(cands, g)
    assert again == first and len(calls) == len(cands)  # all from the file
    assert CostModel(PROFILE).cost(cands[0], g) == estimate(cands[0], g, PROFILE)


def test_cost_is_device_neutral() -> None:
    """A GPU-like profile (high bandwidth, launch cost) changes numbers, not code paths."""
    gpu = HardwareProfile("gpu", "sm90", 1, 50000.0, 3000.0, (0, 50 << 20, 0), 3.0, 8.0, {})
    g = softmax_graph()
    c = whole(g)
    nbytes = candidate_bytes(c, g)
    assert nbytes == 2 * 64 * 128 * 4
    # memory-bound: 17 flop/elem * 8192 elem at 5e7 flop/µs is below 65536 B at 3e6 B/µs
    assert estimate(c, g, gpu) == pytest.approx(3.0 + nbytes / 3e6)


def test_dconv_work_rounds_outputs_to_vectors_unless_narrow() -> None:
    """The ``dconv`` kernel puts output channels in the lanes (20 outputs: 32 lanes of
    work on AVX-512); with at most 4 outputs over whole vectors of inputs it runs
    vectorised along C_in (``conv_narrow``), its exact FLOPs."""
    import torch

    from kiln.compiler.fusion.cost import dconv_flops, gemm_flops

    for c_out, want_lanes in ((20, 32), (3, 3)):
        g = Graph()
        x = g.add_input("x", meta(1, 6, 6, 32))
        w = g.add_constant("w", torch.zeros(c_out, 32, 3, 3))
        attrs = {"stride": (1, 1), "padding": (1, 1), "dilation": (1, 1), "groups": 1}
        y = op(g, "conv", (x, w), (1, 6, 6, c_out), **attrs, channels_last=True)
        node = g.nodes[-1]
        assert node.output == y
        exact = gemm_flops(node, g)
        assert exact == 2 * 36 * c_out * 32 * 9
        assert dconv_flops(node, g, 16) == pytest.approx(exact / c_out * want_lanes)
