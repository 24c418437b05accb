"""What a candidate kernel costs on a GPU, in µs: a roofline with occupancy, or a measurement.

``time = max(compute / c_par, memory / m_par) + fixed`` where

* compute = each mm/bmm's ``gemm_flops`` / (peak of its input dtype x efficiency of its
  size class) + other nodes' ``node_flops`` / the fp32 CUDA-core peak. The peak of a GEMM
  is the tensor cores' for fp16/bf16, for fp32 too when TF32 is allowed
  (``torch.backends.cuda.matmul.allow_tf32``, cuDNN's flag for conv; the generated
  kernels follow the same rule), else the CUDA cores'. Tensor-core and CUDA-core work
  are summed, not overlapped;
* memory = ``candidate_bytes`` / (HBM bandwidth x its achievable fraction): only in(k),
  parameters and out(k) touch HBM, so a ``chain``'s intermediates and an ``attention``'s
  (M, N) scores (online softmax) cost no memory time. L2 traffic is not modelled;
* fixed = one CUDA-graph kernel node (programs are replayed as one graph; with
  ``cuda_graph=False`` a plain launch), two for an ATen/cuDNN call (``conv``, and a
  ``single`` opaque op or conv).

Parallelism (c_par, m_par <= 1). ``fill = min(1, programs / SMs)``: a kernel with fewer
programs than SMs leaves SMs idle (wave quantization). Programs: ``pointwise`` one per
1024 elements, ``reduction`` one per row, ``gemm`` (and an mm as ``single``) one per
64x64 output tile, ``conv`` one per 4096 outputs, ``chain``/``attention`` one per BM
rows. Library-tuned kernels run at full occupancy, so c_par = m_par = fill; the fused
kernels keep a wide tile in registers, which costs parallelism:

* ``chain`` (mm -> pointwise -> mm ...): 4 warps own BM rows; layer i holds its input
  (K_i wide when produced in-kernel, else streamed 32 at a time) and its fp32 accumulator
  (N_i wide; the last layer's output is stored 64 columns at a time) in registers:
  ``BM x (K_i + N_i) / 128 + 32`` per thread; the weight tile K_i x N_i sits in shared
  memory. ``attention``: BM query rows hold q (D), a BN=64 score tile and the output
  (Dv): ``BM x (D + 64 + Dv) / 128 + 32``; K and V tiles (64 x (D + Dv)) in shared memory.
* BM starts at 64 and halves (down to 16) while the registers exceed the per-thread limit;
  resident blocks per SM = min over threads, registers, shared memory and block limits.
* With W resident warps per SM, ``m_par = fill x min(1, W / W_mem)``, where W_mem warps
  keep enough bytes in flight to cover HBM latency (Little's law: bandwidth x 600 ns per
  SM, 1 KiB in flight per warp), and ``c_par = fill x min(1, W / 4)`` (a warp per
  sub-partition keeps the tensor cores busy).
* Infeasible (``math.inf``, so the BLP never picks it): a chain intermediate wider than
  256 or a head dimension over 256, a weight/KV tile over the per-block shared memory,
  or registers over the limit even at BM = 16.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from pathlib import Path

import torch

from kiln.compiler.fusion.candidates import Candidate
from kiln.compiler.fusion.cost import (
    CostModelBase,
    GraphLookup,
    candidate_bytes,
    gemm_flops,
    is_extern_kernel,
    node_flops,
)
from kiln.compiler.ir.graph import Graph, Node, OpClass
from kiln.core.gpu_profile import GpuProfile

TILE = 64  # GEMM output tile edge (M and N), and the last chain layer's column tile
POINTWISE_BLOCK = 1024  # elements per pointwise program
CONV_BLOCK = 4096  # outputs per conv program (an implicit-GEMM tile)
THREADS = 128  # 4 warps per chain/attention program
ROW_BLOCKS = (64, 32, 16)  # BM candidates, largest first (tensor-core mma needs M >= 16)
STREAM_K = 32  # width of an input slice streamed from HBM into registers
ATTN_BN = 64  # key/value rows per attention step
REG_OVERHEAD = 32  # registers per thread for addresses, indices, loop state
MAX_FUSED_WIDTH = 256  # widest chain intermediate / attention head dimension
HBM_LATENCY_S = 600e-9  # loaded device-memory latency (Ampere/Hopper order)
BYTES_IN_FLIGHT_PER_WARP = 1024  # two 16-byte vector loads per thread outstanding
EXTERN_NODES = 2  # an ATen/cuDNN call: its kernel(s) plus setup (a workspace, a bias)


def _gemm_us(n: Node, graph: Graph, profile: GpuProfile) -> float:
    flops = gemm_flops(n, graph)
    dtype = graph.meta(n.inputs[0]).dtype
    tf32 = torch.backends.cudnn.allow_tf32 if n.op == "conv" else None
    return flops / (profile.matmul_tflops(dtype, tf32) * profile.efficiency(flops) * 1e6)


def _tiles(n: Node, graph: Graph, rows: int = TILE, cols: int = TILE) -> int:
    """Programs of a kernel tiling an mm/bmm output in rows x cols blocks."""
    shape = graph.meta(n.output).shape
    batch = math.prod(shape[:-2])
    return batch * math.ceil(shape[-2] / rows) * math.ceil(shape[-1] / cols)


def resident_warps(profile: GpuProfile, regs: int, smem: int) -> int:
    """Warps per SM of a THREADS-thread program using ``regs`` registers per thread and
    ``smem`` bytes of shared memory; 0 if one program does not fit."""
    if regs > profile.regs_per_thread or smem > profile.smem_per_block:
        return 0
    blocks = min(
        profile.max_threads_per_sm // THREADS,
        profile.regs_per_sm // (regs * THREADS),
        profile.smem_per_sm // max(smem, 1),
        profile.max_blocks_per_sm,
    )
    return blocks * THREADS // 32


def _fit(profile: GpuProfile, regs_of: Callable[[int], int], smem: int) -> tuple[int, int] | None:
    """(BM, resident warps) for the largest row block that fits, else None."""
    for bm in ROW_BLOCKS:
        warps = resident_warps(profile, regs_of(bm), smem)
        if warps:
            return bm, warps
    return None


def _regs(bm: int, width: int) -> int:
    return math.ceil(bm * width / THREADS) + REG_OVERHEAD


def _chain_shape(nodes: list[Node], graph: Graph, profile: GpuProfile) -> tuple[int, int] | None:
    """(programs, resident warps) of a chain kernel, None if it cannot be built."""
    gemms = [n for n in nodes if n.cls == OpClass.GEMM]
    produced = {n.output for n in nodes}
    widths, smem = [], 0
    for i, n in enumerate(gemms):
        k, cols = graph.meta(n.inputs[0]).shape[-1], graph.meta(n.output).shape[-1]
        if i < len(gemms) - 1 and cols > MAX_FUSED_WIDTH:
            return None
        cols = min(cols, TILE) if i == len(gemms) - 1 else cols
        widths.append((k if n.inputs[0] in produced else STREAM_K) + cols)
        smem = max(smem, k * cols * graph.meta(n.inputs[1]).dtype.itemsize)
    fit = _fit(profile, lambda bm: _regs(bm, max(widths)), smem)
    if fit is None:
        return None
    bm, warps = fit
    return _tiles(gemms[0], graph, bm, graph.meta(gemms[0].output).shape[-1]), warps


def _attention_shape(
    nodes: list[Node], graph: Graph, profile: GpuProfile
) -> tuple[int, int] | None:
    """(programs, resident warps) of a fused attention kernel, None if it cannot be built."""
    gemms = [n for n in nodes if n.cls == OpClass.GEMM]
    if len(gemms) != 2:
        return None
    qk, pv = gemms
    d, dv = graph.meta(qk.inputs[0]).shape[-1], graph.meta(pv.output).shape[-1]
    if max(d, dv) > MAX_FUSED_WIDTH:
        return None
    smem = ATTN_BN * (d + dv) * graph.meta(qk.inputs[1]).dtype.itemsize
    fit = _fit(profile, lambda bm: _regs(bm, d + ATTN_BN + dv), smem)
    if fit is None:
        return None
    bm, warps = fit
    return _tiles(pv, graph, bm, dv), warps


def _programs(candidate: Candidate, nodes: list[Node], graph: Graph) -> int:
    """Programs of a library-tuned (full-occupancy) kernel."""
    gemms = [n for n in nodes if n.cls == OpClass.GEMM]
    if candidate.template == "conv" or (gemms and gemms[0].op == "conv"):
        return math.ceil(graph.meta(gemms[0].output).numel / CONV_BLOCK)
    if gemms:
        return _tiles(gemms[0], graph)
    reductions = [n for n in nodes if n.cls == OpClass.REDUCTION]
    if reductions:
        return graph.meta(reductions[0].output).numel
    numel = max(graph.meta(n.output).numel for n in nodes)
    return math.ceil(numel / POINTWISE_BLOCK)


def memory_warps(profile: GpuProfile) -> int:
    """Resident warps per SM needed to keep HBM busy (bytes in flight over its latency)."""
    per_sm = profile.hbm_gbs * 1e9 * HBM_LATENCY_S / profile.sm_count
    return max(1, math.ceil(per_sm / BYTES_IN_FLIGHT_PER_WARP))


def gpu_estimate(
    candidate: Candidate,
    graph: Graph,
    profile: GpuProfile,
    lookup: GraphLookup | None = None,
    cuda_graph: bool = True,
) -> float:
    """Estimate of one kernel's time on a GPU in µs (see the module docstring);
    ``math.inf`` for a fused kernel that cannot be built."""
    lk = lookup or GraphLookup(graph)
    nodes = lk.ordered(candidate)
    compute_us = 0.0
    for n in nodes:
        if n.cls == OpClass.GEMM:
            compute_us += _gemm_us(n, graph, profile)
        else:
            compute_us += node_flops(n, graph) / (profile.fp32_tflops * 1e6)
    bandwidth = profile.hbm_gbs * profile.bandwidth_efficiency * 1e3  # bytes per µs
    memory_us = candidate_bytes(candidate, graph, lk) / bandwidth

    if candidate.template in ("chain", "attention"):
        shape_of = _chain_shape if candidate.template == "chain" else _attention_shape
        shape = shape_of(nodes, graph, profile)
        if shape is None:
            return math.inf
        programs, warps = shape
        c_occ, m_occ = min(1.0, warps / 4), min(1.0, warps / memory_warps(profile))
    else:
        programs, c_occ, m_occ = _programs(candidate, nodes, graph), 1.0, 1.0
    fill = min(1.0, max(programs, 1) / profile.sm_count)

    launch = profile.graph_launch_us if cuda_graph else profile.launch_us
    fixed = launch * (EXTERN_NODES if is_extern_kernel(candidate, nodes) else 1)
    return max(compute_us / (fill * c_occ), memory_us / (fill * m_occ)) + fixed


class GpuCostModel(CostModelBase):
    """Costs of candidates on one GPU: ``gpu_estimate``, or measurements cached on disk
    keyed by ``structure_key(candidate, graph, profile.name)`` (see ``CostModelBase``).
    ``cuda_graph=False`` prices kernels launched one by one from Python."""

    def __init__(
        self,
        profile: GpuProfile,
        measure: Callable[[Candidate], float] | None = None,
        cache_path: Path | None = None,
        cuda_graph: bool = True,
    ) -> None:
        super().__init__(profile.name, measure, cache_path)
        self.profile = profile
        self.cuda_graph = cuda_graph

    def estimate(self, candidate: Candidate, graph: Graph) -> float:
        """Roofline-with-occupancy estimate (µs)."""
        return gpu_estimate(candidate, graph, self.profile, self.lookup(graph), self.cuda_graph)
