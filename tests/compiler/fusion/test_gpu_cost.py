"""The GPU cost model's decisions, checked against arithmetic done by hand."""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator
from pathlib import Path

import pytest
import torch

from kiln.compiler.fusion.aliases import GraphIndex
from kiln.compiler.fusion.candidates import Candidate, kernel_io, make_candidate
from kiln.compiler.fusion.cost import candidate_bytes
from kiln.compiler.fusion.gpu_cost import GpuCostModel, gpu_estimate
from kiln.compiler.ir.graph import Graph
from kiln.core.gpu_profile import gpu_profile
from tests.compiler.fusion.orch_graphs import meta, op, opaque_gelu, softmax_rows

F16, F32 = torch.float16, torch.float32
H100 = gpu_profile("H100")
LAUNCH = H100.graph_launch_us
BYTES_PER_US = H100.hbm_gbs * H100.bandwidth_efficiency * 1e3
FLOP_PER_US = 1e6  # per TFLOP/s


@pytest.fixture
def no_tf32() -> Iterator[None]:
    saved = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32 = saved


def cand(g: Graph, template: str, names: Iterable[str]) -> Candidate:
    """A candidate built directly (templates the CPU enumerator does not know)."""
    ix = GraphIndex(g)
    outs, ins = kernel_io(ix, ix.mask(names))
    return Candidate(template=template, nodes=frozenset(names), outputs=outs, inputs=ins)


def gemm_graph(m: int, k: int, n: int, dtype: torch.dtype) -> Graph:
    g = Graph()
    x, w = g.add_input("x", meta(m, k, dtype=dtype)), g.add_input("w", meta(k, n, dtype=dtype))
    g.outputs = [g.add_node("mm", (x, w), meta(m, n, dtype=dtype))]
    return g


def whole(g: Graph, template: str) -> Candidate:
    return cand(g, template, [n.name for n in g.nodes])


def test_large_gemm_is_compute_bound_at_the_dtype_peak(no_tf32: None) -> None:
    s = 8192
    flops = 2.0 * s**3
    fp16 = gemm_graph(s, s, s, F16)
    t16 = gpu_estimate(whole(fp16, "gemm"), fp16, H100)
    hand = flops / (989.5 * FLOP_PER_US * 0.75)  # dense fp16 peak x large-GEMM efficiency
    assert t16 == pytest.approx(hand, rel=0.01)
    assert 3 * s * s * 2 / BYTES_PER_US < 0.2 * hand  # memory is not the limit
    fp32 = gemm_graph(s, s, s, F32)
    t32 = gpu_estimate(whole(fp32, "gemm"), fp32, H100)
    assert t32 == pytest.approx(flops / (67.0 * FLOP_PER_US * 0.75), rel=0.01)  # CUDA cores
    assert t16 < t32 / 10
    torch.backends.cuda.matmul.allow_tf32 = True  # the fixture restores it
    tf32 = gpu_estimate(whole(fp32, "gemm"), fp32, H100)
    assert tf32 == pytest.approx(flops / (494.5 * FLOP_PER_US * 0.75), rel=0.01)


def test_a_gemm_with_few_tiles_leaves_sms_idle() -> None:
    g = gemm_graph(128, 4096, 128, F16)  # 2 x 2 tiles of 64 x 64 on 132 SMs
    flops = 2.0 * 128 * 4096 * 128  # tiny class
    compute = flops / (989.5 * FLOP_PER_US * H100.gemm_efficiency["tiny"])
    memory = 2 * (128 * 4096 * 2 + 128 * 128) / BYTES_PER_US
    expect = max(compute, memory) * 132 / 4 + LAUNCH
    assert gpu_estimate(whole(g, "gemm"), g, H100) == pytest.approx(expect, rel=1e-6)


def test_pointwise_is_bandwidth_bound() -> None:
    g = Graph()
    x = g.add_input("x", meta(4096, 4096))
    g.outputs = [op(g, "exp", (x,), (4096, 4096))]
    c = make_candidate(g, [g.nodes[0].name])
    nbytes = 2 * 4096 * 4096 * 4
    assert candidate_bytes(c, g) == nbytes
    compute = 10 * 4096 * 4096 / (67.0 * FLOP_PER_US)  # exp: 10 flop per element
    memory = nbytes / BYTES_PER_US
    assert compute < memory / 10
    assert gpu_estimate(c, g, H100) == pytest.approx(memory + LAUNCH, rel=1e-9)
    plain = GpuCostModel(H100, cuda_graph=False).estimate(c, g)
    assert plain == pytest.approx(memory + H100.launch_us, rel=1e-9)


def test_a_row_kernel_with_few_rows_runs_on_few_sms() -> None:
    g = Graph()
    x = g.add_input("x", meta(16, 65536))
    g.outputs = [softmax_rows(g, x, (16, 65536))]
    c = make_candidate(g, [n.name for n in g.nodes])
    assert c.template == "reduction"
    memory = 2 * 16 * 65536 * 4 / BYTES_PER_US
    assert gpu_estimate(c, g, H100) == pytest.approx(memory * 132 / 16 + LAUNCH, rel=1e-6)


def test_an_aten_call_pays_two_graph_nodes() -> None:
    g = Graph()
    x = g.add_input("x", meta(4, 4))
    g.outputs = [opaque_gelu(g, x, (4, 4))]
    c = make_candidate(g, [g.nodes[0].name])
    assert c.template == "single"
    assert gpu_estimate(c, g, H100) == pytest.approx(2 * LAUNCH, abs=0.01)


def mlp(batch: int, widths: list[int], dtype: torch.dtype) -> tuple[Graph, list[list[str]]]:
    """mm -> bias add -> relu per layer (no relu after the last); the node names per layer."""
    g = Graph()
    h = g.add_input("x", meta(batch, widths[0], dtype=dtype))
    layers: list[list[str]] = []
    for i, (k, n) in enumerate(zip(widths, widths[1:], strict=False)):
        w = g.add_constant(f"w{i}", torch.zeros(k, n, dtype=dtype))
        b = g.add_constant(f"b{i}", torch.zeros(n, dtype=dtype))
        out = meta(batch, n, dtype=dtype)
        h = g.add_node("add", (g.add_node("mm", (h, w), out), b), out)
        if i < len(widths) - 2:
            h = g.add_node("relu", (h,), out)
        layers.append([nd.name for nd in g.nodes[len(sum(layers, [])) :]])
    g.outputs = [h]
    return g, layers


def test_fusing_a_memory_bound_mlp_chain_beats_its_gemm_kernels() -> None:
    batch = 65536
    g, layers = mlp(batch, [64] * 5, F16)
    chain = whole(g, "chain")
    assert chain.inputs == ("x",) and len(chain.outputs) == 1
    # HBM traffic: x in, y out (fp16), four 64x64 weights and biases; nothing in between
    nbytes = 2 * (2 * batch * 64 + 4 * (64 * 64 + 64))
    assert candidate_bytes(chain, g) == nbytes
    # 20 resident warps (5 blocks: 96 registers x 128 threads) cover HBM latency (15)
    memory = nbytes / BYTES_PER_US
    fused = gpu_estimate(chain, g, H100)
    assert fused == pytest.approx(memory + LAUNCH, rel=1e-9)  # memory-bound
    gemms = [cand(g, "gemm", names) for names in layers]
    each = (2 * batch * 64 * 2 + 2 * (64 * 64 + 64)) / BYTES_PER_US + LAUNCH
    separate = sum(gpu_estimate(c, g, H100) for c in gemms)
    assert separate == pytest.approx(4 * each, rel=1e-9)
    assert fused < separate / 3


def test_register_and_shared_memory_pressure_cost_parallelism() -> None:
    batch = 65536
    g, _ = mlp(batch, [64, 256, 256, 64], F16)
    nbytes = candidate_bytes(whole(g, "chain"), g)
    # layer 2 keeps 256 + 256 fp32 columns: BM = 64 needs 288 registers > 255, so BM = 32
    # (160 registers); its 256 x 256 fp16 weight tile (128 KiB) leaves room for one block of
    # 4 warps per SM, against the 15 HBM latency needs
    expect = nbytes / BYTES_PER_US * 15 / 4 + LAUNCH
    assert gpu_estimate(whole(g, "chain"), g, H100) == pytest.approx(expect, rel=1e-9)
    wide32, _ = mlp(batch, [64, 256, 256, 64], F32)  # a 256 KiB fp32 tile fits no SM
    assert gpu_estimate(whole(wide32, "chain"), wide32, H100) == math.inf


def test_a_chain_with_1024_wide_intermediates_is_infeasible() -> None:
    g, layers = mlp(4096, [64, 1024, 64], F16)
    assert gpu_estimate(whole(g, "chain"), g, H100) == math.inf
    assert all(gpu_estimate(cand(g, "gemm", n), g, H100) < math.inf for n in layers)
    costs = GpuCostModel(H100).costs([whole(g, "chain")], g)
    assert list(costs.values()) == [math.inf]


def attention_graph(heads: int, seq: int, d: int) -> Graph:
    """softmax(q @ k^T * d^-0.5) @ v per head, float32."""
    g = Graph()
    q, k, v = (g.add_input(n, meta(heads, seq, d)) for n in "qkv")
    kt = op(g, "permute", (k,), (heads, d, seq), dims=(0, 2, 1))
    scale = g.add_constant("scale", torch.tensor(d**-0.5))
    s = op(g, "mul", (op(g, "bmm", (q, kt), (heads, seq, seq)), scale), (heads, seq, seq))
    p = softmax_rows(g, s, (heads, seq, seq))
    g.outputs = [op(g, "bmm", (p, v), (heads, seq, d))]
    return g


def test_attention_is_cheaper_than_its_unfused_kernels_at_long_sequence(no_tf32: None) -> None:
    heads, seq, d = 16, 4096, 64
    g = attention_graph(heads, seq, d)
    names = [n.name for n in g.nodes if n.op != "permute"]
    fused = cand(g, "attention", names)
    assert fused.inputs == ("q", "k", "v")
    assert candidate_bytes(fused, g) == 4 * 4 * heads * seq * d  # q, k, v, out: no scores
    unfused = [
        make_candidate(g, names[:2]),  # bmm -> scale: a gemm with an epilogue
        make_candidate(g, names[2:7]),  # softmax: a row kernel
        make_candidate(g, names[7:]),  # bmm
    ]
    assert [c.template for c in unfused] == ["gemm", "reduction", "gemm"]
    # fused: compute-bound on the fp32 CUDA cores (no TF32); 16 resident warps per SM
    bmm = 2.0 * heads * seq * seq * d / (67.0 * FLOP_PER_US * 0.75)
    softmax = (1 + 1 + 1 + 10 + 1 + 4) * heads * seq * seq / (67.0 * FLOP_PER_US)
    t_fused = gpu_estimate(fused, g, H100)
    assert t_fused == pytest.approx(2 * bmm + softmax + LAUNCH, rel=1e-9)
    t_unfused = sum(gpu_estimate(c, g, H100) for c in unfused)
    scores = heads * seq * seq * 4 / BYTES_PER_US  # one pass over the fp32 scores
    assert t_unfused > 2 * bmm + 2 * scores  # the softmax alone reads and writes them
    assert t_fused < 0.75 * t_unfused


def test_attention_with_too_wide_heads_is_infeasible() -> None:
    g = attention_graph(2, 256, 512)
    names = [n.name for n in g.nodes if n.op != "permute"]
    assert gpu_estimate(cand(g, "attention", names), g, H100) == math.inf


def test_a_smaller_gpu_is_slower_on_the_same_kernel() -> None:
    g = gemm_graph(4096, 4096, 4096, F16)
    c = whole(g, "gemm")
    assert gpu_estimate(c, g, gpu_profile("L4")) > 5 * gpu_estimate(c, g, H100)


def test_measured_costs_are_cached_and_reused(tmp_path: Path) -> None:
    g, layers = mlp(1024, [64] * 5, F16)
    cands = [whole(g, "chain")] + [cand(g, "gemm", n) for n in layers]
    calls: list[Candidate] = []

    def measure(c: Candidate) -> float:
        calls.append(c)
        return 10.0 + len(c.nodes)

    path = tmp_path / "measured.json"
    first = GpuCostModel(H100, measure=measure, cache_path=path).costs(cands, g)
    # layers 1-3 share one structure (layer 4 has no relu): 3 distinct measurements
    assert len(calls) == 3 and path.exists()
    assert first[cands[0]] == 10.0 + len(cands[0].nodes)
    again = GpuCostModel(H100, measure=measure, cache_path=path).costs(cands, g)
    assert again == first and len(calls) == 3  # all from the file
    other = GpuCostModel(gpu_profile("A100-80GB"), measure=measure, cache_path=path)
    other.cost(cands[0], g)
    assert len(calls) == 4  # keyed by the profile name too
    assert GpuCostModel(H100).cost(cands[0], g) == gpu_estimate(cands[0], g, H100)
