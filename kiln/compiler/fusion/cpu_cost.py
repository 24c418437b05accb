"""The calibrated CPU cost of one native kernel, from rates fitted on kiln's own kernels.

``time = fixed + max(compute, memory) + unhidden * min(compute, memory) + pack + gather``
(µs), with ``KernelRates`` fields (``unhidden``: the part of the smaller of compute and
memory time the larger does not hide, fitted between 0 and 1):

* fixed: ``parallel_us`` when the kernel opens a parallel region, else ``serial_us``,
  plus ``gemm_us`` for a GEMM. A
  kernel goes parallel as its generated code decides (the thresholds of ``codegen/cpu``,
  mirrored below): pointwise, row and copy kernels from 32768 elements, a GEMM when its
  (row block, panel) units outweigh ``kg::gemm``'s grain, a batched GEMM / depthwise
  conv when there are more tasks than its grain; never with one thread.
* memory: each value's bytes (reads of in(k) and parameters, writes of out(k)) at the
  bandwidth of the cache level they live in — ``read_gbs`` on all threads,
  ``serial_read_gbs`` on one. Activations live in the nearest level that holds all the
  kernel's activations (each was written by a recent kernel, into an arena reused call
  after call, and the kernel's reads and writes share the cache); parameters
  in the nearest level that holds the model's *total* parameter bytes (the program runs
  again and again, so weights stay where all of them fit). L2 is per core: a parallel
  kernel has ``threads`` of them.
* compute, for the busiest thread (``at::parallel_for`` makes ``min(threads,
  ceil(tasks / grain))`` chunks of equal task counts):
  - GEMM: every register block of R rows and one panel (NR columns) costs
    ``2 R NR (K + gemm_step_extra)`` FLOPs at the per-thread rate for R, interpolated
    between ``gemm_gflops`` at R = 1, 2, 4 and MR (rows are split into blocks of at
    most MR, near-equal heights, as ``kiln_gemm.h`` does); a GEMM chain runs its rows in
    blocks (``chains.chain_row_blocks``), each block through every stage's panels, and
    every thread streams every weight (at the one-thread bandwidth of where they live;
    when they fit one L2, hidden behind the compute where it is shorter);
  - pointwise work (epilogues, pointwise and row kernels; an exp counts 10 FLOPs) at
    ``pointwise_gflops`` per thread; a row kernel's reductions are not counted there but
    as ``row_ns`` per row and pass (softmax and layer norm make 3 passes over a row, a
    plain sum 1: loop, accumulate, horizontal reduce);
  - depthwise conv: its vector-padded taps at ``dwconv_gflops`` per thread, and the copy
    of each zero-padded input plane into scratch as pointwise work (1 FLOP an element);
  - pooling (``pool2d``, a ``single`` kernel whose window reads hit the cache): a max or
    add per window tap and output as pointwise work, plus on NCHW values the padded copy
    of each plane into scratch (``pool_flops``); it goes parallel from
    ``PARALLEL_MIN_ELEMS`` *input* elements;
* gather: bytes copied element by element — the rows an ``index_select`` (embedding
  lookup) picks, and values a pointwise or copy kernel reads through a strided view (a
  transpose it materialises) — move at ``gather_gbs``, as a strided operand's packing;
* pack: a GEMM whose right operand is computed at run time packs it into panels per
  call: the panels' bytes at ``pack_gbs`` (rows contiguous) or ``gather_gbs`` (strided),
  on the thread that runs each batch item.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from kiln.compiler.fusion.candidates import Candidate
from kiln.compiler.fusion.chains import chain_row_blocks
from kiln.compiler.ir.graph import Graph, Node, OpClass, ValueKind, conv_padding
from kiln.compiler.ir.layout import Access, access, is_view
from kiln.core.hardware import HardwareProfile, KernelRates

# Parallel thresholds of the generated code (codegen/cpu/pointwise.py, kiln_gemm.h,
# gemm.py, dwconv.py): the cost model cannot import codegen, so they are mirrored here.
PARALLEL_MIN_ELEMS = 32768
GEMM_MIN_CHUNK_FLOPS = 1 << 19
GEMM_FLOPS_PER_BYTE = 6
BMM_GRAIN_FLOPS = 1 << 16
DWCONV_MIN_TASK_FMAS = 1 << 12
LANES = {"avx512": 16, "avx2": 8}
NATIVE_TEMPLATES = frozenset(
    {"pointwise", "reduction", "gemm", "chain", "dwconv", "single", "copy"}
)
# The pool2d kernels, measured on Zen 5 with 2 threads (3x3/2, 3x3/1 and 2x2/2 pools over
# 16-64 channels of 56x56 and 64x64 images): channels-last ones run their taps at about the
# pointwise rate; NCHW ones 1.5x slower per tap (vector loads from the phase-split plane
# straddle cache lines) plus 2 FLOPs' worth per element of the plane's scratch copy.
POOL_NCHW_TAP, POOL_NCHW_FILL = 1.5, 2.0


def pool_flops(node: Node, graph: Graph, lanes: int) -> float:
    """Pointwise work of a ``pool2d`` kernel (``codegen/cpu/pool.py``): a max / add per
    window tap of every output, channels (NHWC) or output columns (NCHW) rounded up to
    whole vectors; NCHW taps cost ``POOL_NCHW_TAP`` times more, and each element its
    scratch plane holds (padding and column phases included) ``POOL_NCHW_FILL``."""
    (kh, kw), (sh, sw) = node.attrs["kernel"], node.attrs["stride"]
    if node.attrs["channels_last"]:
        n, oh, ow, c = graph.meta(node.output).shape
        return float(kh * kw * n * oh * ow * -(-c // lanes) * lanes)
    n, c, oh, ow = graph.meta(node.output).shape
    padded = -(-ow // lanes) * lanes
    rows, row_len = (oh - 1) * sh + kh, -(-(padded + (kw - 1) // sw) // 16) * 16
    taps = POOL_NCHW_TAP * kh * kw * oh * padded
    return n * c * (taps + POOL_NCHW_FILL * rows * sw * row_len)


def register_rows(isa: str) -> int:
    """MR: rows of one GEMM register block (``kiln_gemm.h``)."""
    return 12 if isa == "avx512" else 6


@dataclass(frozen=True)
class GemmWork:
    """One GEMM of a kernel: ``batch`` products of (m, k) x (k, n)."""

    batch: int
    m: int
    k: int
    n: int
    runtime_b: bool  # the right operand is packed per call
    strided_b: bool  # ... element by element (its rows are not contiguous)


@dataclass(frozen=True)
class NativeWork:
    """What a native kernel's time depends on, read off the graph once (see module doc).

    ``values``: (bytes, is a parameter, is written) of every value read or written;
    ``elems``: the size the codegen's pointwise/row parallel threshold looks at."""

    template: str
    values: tuple[tuple[float, bool, bool], ...]
    param_total: float
    elems: int
    pointwise_flops: float
    row_passes: int  # rows x passes of a row kernel
    gathered_bytes: float  # bytes copied element by element (gathers, strided reads)
    gemm: GemmWork | None = None
    dw_tasks: int = 0  # depthwise conv: planes, vector FMAs and padded inputs per plane
    dw_plane_fmas: int = 0
    dw_plane_copy: int = 0
    chain: tuple[GemmWork, ...] = ()  # a GEMM chain's stages, in order


def traffic(
    candidate: Candidate, graph: Graph, nodes: Sequence[Node], root: Callable[[str], str]
) -> tuple[dict[str, float], dict[str, float]]:
    """(bytes read per storage root, bytes written per value) of a kernel: reads of in(k)
    and parameters, each capped at its storage's size (a slice reads part of it, an
    expand no more than it, a gather no more rows than it writes); writes of out(k)."""
    produced = {n.output for n in nodes}
    read: dict[str, float] = {}
    seen: set[str] = set()
    for n in nodes:
        for v in n.inputs:
            if v in produced or v in seen:
                continue
            seen.add(v)
            r = root(v)
            if r in produced or graph.values[r].kind == ValueKind.CONST:
                continue
            b = min(nbytes(graph, v), nbytes(graph, r))
            if n.op == "index_select" and v == n.inputs[0]:
                b = min(b, nbytes(graph, n.output))
            read[r] = read.get(r, 0.0) + b
    reads = {r: min(b, float(nbytes(graph, r))) for r, b in read.items()}
    return reads, {v: float(nbytes(graph, v)) for v in candidate.outputs}


def nbytes(graph: Graph, value: str) -> int:
    """Size of a value in bytes."""
    meta = graph.meta(value)
    return meta.numel * meta.dtype.itemsize


def _strided(graph: Graph, value: str) -> bool:
    """Whether ``value`` is a view whose innermost dim is not contiguous in its storage."""
    if not is_view(graph, value):
        return False
    acc = access(graph, value)
    return (
        isinstance(acc, Access)
        and bool(acc.shape)
        and acc.shape[-1] > 1
        and acc.strides[-1] not in (0, 1)
    )


def _gemm_work(node: Node, graph: Graph, root: Callable[[str], str]) -> GemmWork | None:
    """The GEMM a kernel's mm / bmm / 1x1 conv runs (None for any other conv)."""
    meta = graph.meta
    if node.op in ("mm", "bmm"):
        a, b = meta(node.inputs[0]).shape, meta(node.inputs[1]).shape
        batch = a[0] if node.op == "bmm" else 1
        runtime = graph.values[root(node.inputs[1])].kind != ValueKind.PARAM
        strided = False
        if runtime:
            acc = access(graph, node.inputs[1])
            strided = isinstance(acc, Access) and acc.strides[-1] != 1 and b[-1] > 1
        return GemmWork(batch, a[-2], a[-1], b[-1], runtime, strided)
    w, out = meta(node.inputs[1]).shape, meta(node.output).shape
    if node.op != "conv" or any(s != 1 for s in w[2:]) or node.attrs.get("groups", 1) != 1:
        return None
    spatial = math.prod(out[1:-1]) if node.attrs.get("channels_last") else math.prod(out[2:])
    if node.attrs.get("channels_last"):  # (N*HW, C_in) @ packed (C_in, C_out)
        return GemmWork(1, out[0] * spatial, w[1], w[0], False, False)
    # per image: W (C_out, C_in) @ X (C_in, HW), X packed per call (contiguous rows)
    return GemmWork(out[0], w[0], w[1], spatial, True, False)


def native_work(
    candidate: Candidate,
    graph: Graph,
    nodes: Sequence[Node],
    root: Callable[[str], str],
    param_total: float,
    pointwise_flops: float,
    lanes: int,
) -> NativeWork:
    """The ``NativeWork`` of a native kernel (``nodes`` in order, ``pointwise_flops`` the
    FLOPs of its non-GEMM nodes)."""
    reads, writes = traffic(candidate, graph, nodes, root)
    params = {r for r in reads if graph.values[r].kind == ValueKind.PARAM}
    values = tuple((b, r in params, False) for r, b in reads.items()) + tuple(
        (b, False, True) for b in writes.values()
    )
    heavy = next((n for n in nodes if n.cls == OpClass.GEMM), None)
    elems = max((graph.meta(v).numel for v in candidate.outputs), default=0)
    rows, reductions = 0, {n.output for n in nodes if n.cls == OpClass.REDUCTION}
    for n in nodes:
        if n.cls == OpClass.REDUCTION or n.op == "pool2d":
            elems = max(elems, graph.meta(n.inputs[0]).numel)
        if n.cls == OpClass.REDUCTION:
            rows += graph.meta(n.output).numel
    if rows and any(n.cls != OpClass.REDUCTION and reductions & set(n.inputs) for n in nodes):
        rows += rows // len(reductions)  # a pass after the last reduction (normalise)
    pointwise_flops += sum(pool_flops(n, graph, lanes) for n in nodes if n.op == "pool2d")
    gathered = sum(float(nbytes(graph, n.output)) for n in nodes if n.op == "index_select")
    if candidate.template in ("pointwise", "single", "copy"):
        inside = {n.output for n in nodes}
        outside = {v for n in nodes for v in n.inputs if v not in inside}
        gathered += sum(nbytes(graph, v) for v in outside if _strided(graph, v))
    gemm, tasks, plane, copy = None, 0, 0, 0
    if heavy is not None and candidate.template == "dwconv":
        out, w = graph.meta(heavy.output).shape, graph.meta(heavy.inputs[1]).shape
        x = graph.meta(heavy.inputs[0]).shape
        tasks = math.prod(out[:2])
        plane = math.prod(out[2:-1]) * -(-out[-1] // lanes) * math.prod(w[2:])
        before, after = conv_padding(heavy.attrs)
        copy = math.prod(s + p + q for s, p, q in zip(x[2:], before, after))
    elif heavy is not None and candidate.template == "chain":
        stages = tuple(_gemm_work(n, graph, root) for n in nodes if n.cls == OpClass.GEMM)
        return NativeWork(
            "chain", values, param_total, elems, pointwise_flops, rows, gathered,
            chain=tuple(g for g in stages if g is not None),
        )  # fmt: skip
    elif heavy is not None:
        gemm = _gemm_work(heavy, graph, root)
    return NativeWork(
        candidate.template, values, param_total, elems, pointwise_flops, rows, gathered, gemm,
        tasks, plane, copy,
    )  # fmt: skip


def busiest(tasks: int, grain: int, threads: int) -> tuple[int, int]:
    """(tasks on the busiest thread, threads used) when ``at::parallel_for`` splits
    ``tasks`` with ``grain``: inline on one thread when ``tasks <= grain``."""
    if threads <= 1 or tasks <= max(grain, 1):
        return tasks, 1
    chunks = min(threads, -(-tasks // max(grain, 1)))
    return -(-tasks // chunks), threads


def level(nbytes_: float, threads: int, profile: HardwareProfile) -> int:
    """Index into ``LEVELS`` (0 L2, 1 L3, 2 DRAM) of where ``nbytes_`` of data live: the
    nearest level that holds them (L2 counts once per thread)."""
    _, l2, l3 = profile.cache_bytes
    if nbytes_ <= l2 * threads:
        return 0
    return 1 if nbytes_ <= l3 else 2


def gemm_rate(rows: float, rates: KernelRates, isa: str) -> float:
    """Per-thread GEMM rate (GFLOP/s) with ``rows`` rows per register block: linear
    between the fitted knots R = 1, 2, 4, MR."""
    knots = (1.0, 2.0, 4.0, float(register_rows(isa)))
    r = min(max(rows, 1.0), knots[-1])
    y = rates.gemm_gflops
    for i in range(len(knots) - 1):
        if r <= knots[i + 1]:
            return y[i] + (y[i + 1] - y[i]) * (r - knots[i]) / (knots[i + 1] - knots[i])
    return y[-1]


def _panel_us(rows: int, k: int, rates: KernelRates, isa: str) -> float:
    """One panel of ``rows`` rows: its register blocks' FLOPs at their rate."""
    mr = register_rows(isa)
    blocks = -(-rows // mr)
    r = rows / blocks
    nr = 2 * LANES.get(isa, 8)
    return blocks * 2.0 * r * nr * (k + rates.gemm_step_extra) / (gemm_rate(r, rates, isa) * 1e3)


def gemm_us(g: GemmWork, threads: int, rates: KernelRates, isa: str) -> tuple[float, float, int]:
    """(compute µs, pack µs, threads used) of a GEMM as ``kiln_gemm.h`` / ``gemm.py`` run it."""
    nr = 2 * LANES.get(isa, 8)
    panels = -(-g.n // nr)
    pack_rate = (rates.gather_gbs if g.strided_b else rates.pack_gbs) * 1e3
    pack_one = 4.0 * g.k * panels * nr / pack_rate if g.runtime_b else 0.0
    k = max(g.k, 1)
    if g.batch == 1:
        mb = min(g.m, 8 * register_rows(isa))
        blocks = -(-g.m // mb)
        work = max(2 * mb * k * nr, 4 * k * nr * GEMM_FLOPS_PER_BYTE)
        count, used = busiest(panels * blocks, -(-GEMM_MIN_CHUNK_FLOPS // work), threads)
        last = g.m - (blocks - 1) * mb  # the last row block may be short
        per_panel = (blocks - 1) * _panel_us(mb, g.k, rates, isa) + _panel_us(last, g.k, rates, isa)
        return count * per_panel / blocks, pack_one, used
    grain = max(1, BMM_GRAIN_FLOPS // max(1, g.m * g.n * g.k)) if threads > 1 else g.batch
    count, used = busiest(g.batch, grain, threads)
    return count * panels * _panel_us(g.m, g.k, rates, isa), count * pack_one, used


def chain_us(
    stages: Sequence[GemmWork], threads: int, rates: KernelRates, isa: str
) -> tuple[float, int]:
    """(compute µs, threads used) of a GEMM chain as ``codegen/cpu/chain.py`` runs it: the
    busiest thread's row blocks, each through every stage's panels. Every thread reads
    every weight, at the one-thread bandwidth of where the model's weights live; that
    stream runs panel by panel ahead of the micro-kernel (``KG_PREFETCH``). When the
    chain's weights fit one core's L2 it costs only where it outlasts the compute, not
    the ``unhidden`` share of other traffic; larger ones compete with the compute like
    any other traffic (``native_time``). Checked on 4-layer MLPs of 16-256 rows and
    128-1024 columns, two runs each: chains of up to 1 MB of weights ran 0.85-1.84x as
    fast as their separate GEMMs (1.0x or more in 11 of 12), 16 MB ones 0.74-1.47x."""
    m, mr, nr = stages[0].m, register_rows(isa), 2 * LANES.get(isa, 8)
    units = chain_row_blocks(m, threads, mr)
    used = min(threads, units)
    rows = -(-m // units)
    per_block = sum(-(-g.n // nr) * _panel_us(rows, g.k, rates, isa) for g in stages)
    return -(-units // used) * per_block, used


def native_time(work: NativeWork, profile: HardwareProfile, rates: KernelRates) -> float:
    """Predicted µs of a native kernel (the module docstring's formula)."""
    t, isa = profile.threads, profile.isa
    heavy_us, pack_us, used = 0.0, 0.0, 1
    if work.chain:
        heavy_us, used = chain_us(work.chain, t, rates, isa)
    elif work.gemm is not None:
        heavy_us, pack_us, used = gemm_us(work.gemm, t, rates, isa)
    elif work.dw_tasks:
        grain = -(-DWCONV_MIN_TASK_FMAS // max(work.dw_plane_fmas, 1))
        count, used = busiest(work.dw_tasks, grain, t)
        flops = 2.0 * count * work.dw_plane_fmas * LANES.get(isa, 8)
        heavy_us = flops / (rates.dwconv_gflops * 1e3)
        heavy_us += count * work.dw_plane_copy / (rates.pointwise_gflops * 1e3)
    elif t > 1 and work.elems >= PARALLEL_MIN_ELEMS:
        used = t
    bw = rates.read_gbs if used > 1 else rates.serial_read_gbs
    param_level = level(work.param_total, used, profile)
    act_level = level(sum(b for b, is_param, _ in work.values if not is_param), used, profile)
    memory_us = stream_us = 0.0
    # A chain: every thread streams every weight, hidden when they fit one L2 (chain_us).
    hidden = work.chain and sum(b for b, p, _ in work.values if p) <= profile.cache_bytes[1]
    for b, is_param, _ in work.values:
        if is_param and work.chain:
            weight_us = b / (rates.serial_read_gbs[level(work.param_total, 1, profile)] * 1e3)
            if hidden:
                stream_us += weight_us
            else:
                memory_us += weight_us
            continue
        memory_us += b / (bw[param_level if is_param else act_level] * 1e3)
    light_us = work.pointwise_flops / (rates.pointwise_gflops * 1e3)
    light_us += work.row_passes * rates.row_ns * 1e-3
    compute_us = heavy_us + light_us / used
    fixed = rates.parallel_us if used > 1 else rates.serial_us
    if work.gemm is not None or work.chain:
        fixed += rates.gemm_us
    gather_us = work.gathered_bytes / (rates.gather_gbs * 1e3) / used
    overlap = max(compute_us, memory_us + stream_us) + rates.unhidden * min(compute_us, memory_us)
    return fixed + overlap + pack_us + gather_us
