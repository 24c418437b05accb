"""What a candidate kernel costs, in µs: a roofline estimate, or a cached measurement.

Roofline: ``max(compute, memory) + fixed`` where

* compute = GEMM/conv FLOPs / (peak x efficiency of the GEMM's shape class, times
  ``ONEDNN_CONV_EFFICIENCY`` for a dense conv through oneDNN, or
  ``ONEDNN_DEPTHWISE_EFFICIENCY`` for a depthwise one)
  + other FLOPs / peak (about 1 per pointwise element, more for transcendentals);
  a native depthwise conv (``dwconv``) counts 2 x taps per output with every output
  row rounded up to whole vectors, at ``DWCONV_EFFICIENCY`` of peak; a native dense
  channels-last conv (``dconv``) its GEMM FLOPs with C_out rounded up to whole vectors
  (a 3x3 one run by Winograd's algorithm, ``wconv``: its transformed work, ``dconv_flops``),
  at ``DCONV_EFFICIENCY`` times the GEMM efficiency of its size;
* memory = bytes / bandwidth, bytes = reads of in(k) and of parameters (each read
  capped at its storage's size: a slice reads part of it, an expand no more than
  it) + writes of out(k);
* fixed = one library/PyTorch call for kernels that run as one (conv through
  oneDNN, opaque ops), else one native kernel (a parallel region / a launch); a
  conv through oneDNN adds ``ONEDNN_CONV_US``, and its memory the reorder of its weight
  (``ONEDNN_WEIGHT_PASSES``).

With a profile that carries ``KernelRates`` (a CPU profile: fitted on kiln's own kernels
by ``kiln calibrate``, or derived from the quick profile), native ``pointwise``,
``reduction``, ``gemm``, ``dwconv``, ``single`` and ``copy`` kernels are priced by the
calibrated model of ``cpu_cost.py`` instead: fixed cost by whether the kernel opens a
parallel region, memory at the bandwidth of the cache level each value lives in, GEMMs
at the fitted rate of their register-block height.

Recomputation needs no special case: a node inside two chosen kernels is paid twice.
Only ``HardwareProfile`` fields are used, so the same model serves any device.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
from collections.abc import Callable, Iterable
from pathlib import Path

from kiln.compiler.fusion.candidates import Candidate
from kiln.compiler.fusion.convs import is_depthwise_conv, is_narrow_conv
from kiln.compiler.fusion.cpu_cost import (
    NATIVE_TEMPLATES,
    NativeWork,
    native_time,
    native_work,
    traffic,
)
from kiln.compiler.ir.graph import Graph, Node, OpClass, ValueKind
from kiln.compiler.ir.layout import storage_root
from kiln.core.cache import cache_dir
from kiln.core.hardware import HardwareProfile

_TRANSCENDENTAL = frozenset(
    {"exp", "log", "tanh", "sigmoid", "erf", "sin", "cos", "log1p", "expm1", "pow"}
)
_DIVISION_LIKE = frozenset({"div", "sqrt", "rsqrt", "reciprocal"})
FLOPS_TRANSCENDENTAL = 10.0  # a vectorised polynomial evaluation per element
FLOPS_DIVISION = 4.0  # divide/sqrt throughput is a few FMAs
EXTERN_OPS = frozenset({"opaque", "conv"})
# The native depthwise kernel (codegen/cpu/dwconv.py), measured on Zen 5 with 2 threads
# over 1-D and 2-D shapes (3x3 to 7x7 and 31-tap kernels, 7x7 to 112x112 planes): 60-127
# GFLOP/s of vector-padded work where GEMMs reach about 210. Its memory is costed like
# every other kernel's (max with compute): the sum over-predicted it 2-4x, its planes
# being cache-resident.
DWCONV_EFFICIENCY = 0.5
# One conv through oneDNN on NCHW tensors (reorders to its blocked layout and back,
# every call) costs far more than a torch op: measured 27-45 µs for 16-channel 8x8
# convs (1x1, 3x3 dense, depthwise; 1 and 2 threads). 25 µs, below every measurement,
# is added to every conv extern; depthwise convs ran 2.6-47x faster natively and 1x1
# convs 1.3-3.7x faster as native GEMMs over the shapes measured (suite models' layers).
ONEDNN_CONV_US = 25.0
# PyTorch keeps no packed copy of a conv's weight: oneDNN reorders the plain tensor into
# its blocked layout on every call, one more read and one write of it before the conv
# reads the copy. Negligible for small filters, it is most of a late ResNet layer's time:
# a 512-channel 3x3 conv over a 4x4 map (9.4 MB of weights) took 1.4-3.5 ms through
# PyTorch on an Intel Xeon at 2 threads (a clone of the weight alone 0.6 ms), 0.5 ms as
# kiln's dconv over a pre-packed weight.
ONEDNN_WEIGHT_PASSES = 2
# oneDNN's NCHW depthwise convs run far below GEMM rates: measured 6-20 GFLOP/s (3x3,
# 28x28 to 112x112 planes, batch 1 and 8), where its GEMMs reach about 210.
ONEDNN_DEPTHWISE_EFFICIENCY = 0.1
# oneDNN's dense convs called through PyTorch run below the GEMM rate of their size: the
# extern convs of the suite measured 0.6x the roofline's time-rate on an AMD EPYC (Zen 4,
# median of 10), and 3x3 NHWC convs of 16-512 channels ran at 18-126 GFLOP/s on an Intel
# Xeon where kiln's GEMMs reach 291 (a 1x1 16 -> 96 conv over 56x56 took 309 µs, priced
# 62). Half the GEMM efficiency of its size.
ONEDNN_CONV_EFFICIENCY = 0.5
# The native dense channels-last conv (codegen/cpu/conv_nhwc.py, a direct implicit GEMM),
# measured on Zen 5 with 2 threads against oneDNN on ResNet-18 and style-transfer layers
# (3x3, 7..28 px, 32-256 channels): 0.9-1.2x oneDNN's rate (136-228 GFLOP/s), and 2-5x
# on 3-channel stems, where oneDNN falls to 37-100 GFLOP/s (not modelled: the BLP
# already prefers the native kernel there, as it has no oneDNN call to pay).
DCONV_EFFICIENCY = 1.0
# ... but on images of few pixels (ResNet-18's 4x4 stage, 512 channels) each pass over the
# weights serves few pixels: 0.7x oneDNN's rate measured at 16 pixels.
DCONV_FEW_PIXELS, DCONV_FEW_PIXELS_EFFICIENCY = 24, 0.6
# A 3x3 conv the wconv template runs by Winograd's F(2x2, 3x3) (codegen/cpu/conv_winograd.py)
# is priced by the vector work it does: 16 multiplies per 2x2 tile and channel pair, and
# per tile and channel the input transform (16 loads, 32 additions, 16 stores) and the
# output transform (16 loads, 24 additions); at this share of the direct kernel's rate.
# Measured against the direct kernel side by side (Intel Xeon AVX-512, 2 threads, 3x3
# convs of 10x10 to 56x56 pixels and 32-256 channels): 1.3-1.8x faster where this work
# predicts 2.0-2.2x; 0.65-0.83 of the rate, 0.75 the median.
WINOGRAD_INPUT_OPS, WINOGRAD_OUTPUT_OPS, WINOGRAD_EFFICIENCY = 64, 40, 0.75
_LANES = {"avx512": 16, "avx2": 8}


class GraphLookup:
    """Node name -> Node and -> position for one graph, built once and reused."""

    def __init__(self, graph: Graph) -> None:
        self.graph = graph
        self.by_name = {n.name: n for n in graph.nodes}
        self.pos = {n.name: i for i, n in enumerate(graph.nodes)}

    def ordered(self, candidate: Candidate) -> list[Node]:
        """The candidate's nodes in graph (topological) order."""
        return [self.by_name[n] for n in sorted(candidate.nodes, key=self.pos.__getitem__)]

    def root(self, value: str) -> str:
        return storage_root(self.graph, value)

    @functools.cached_property
    def param_bytes(self) -> float:
        """Bytes of all the graph's parameters (where they live depends on it)."""
        g = self.graph
        return float(sum(_nbytes(g, v) for v, x in g.values.items() if x.kind == ValueKind.PARAM))


def gemm_flops(node: Node, graph: Graph) -> float:
    """2*M*N*K (times batch) for mm/bmm; 2 * out elements * (Cin/groups * kernel) for conv."""
    out = graph.meta(node.output).numel
    w = graph.meta(node.inputs[1]).shape
    if node.op == "conv":
        per_out = 1
        for s in w[1:]:  # (Cout, Cin/groups, *kernel)
            per_out *= s
        return 2.0 * out * per_out
    k = graph.meta(node.inputs[0]).shape[-1]
    return 2.0 * out * k


def dwconv_flops(node: Node, graph: Graph, lanes: int) -> float:
    """2 * taps per output of a depthwise conv, each output row (the innermost spatial
    dim) rounded up to whole vectors of ``lanes``: the native kernel's vector work."""
    out = graph.meta(node.output).shape
    rows = 1
    for s in out[:-1]:
        rows *= s
    taps = 1
    for s in graph.meta(node.inputs[1]).shape[2:]:
        taps *= s
    return 2.0 * rows * -(-out[-1] // lanes) * lanes * taps


def dconv_flops(node: Node, graph: Graph, lanes: int, winograd: bool = False) -> float:
    """GEMM FLOPs of a channels-last conv with C_out (the last dim of its output, the
    vectorised one) rounded up to whole vectors of ``lanes``; a narrow one (few outputs,
    whole vectors of C_in: vectorised along C_in) its exact FLOPs; with ``winograd`` (the
    ``wconv`` template) its transformed work (``WINOGRAD_*``), in FLOPs at the direct
    kernel's rate."""
    out = graph.meta(node.output).shape
    c_out, c_in = out[-1], graph.meta(node.inputs[0]).shape[-1]
    if is_narrow_conv(c_in, c_out, lanes):
        return gemm_flops(node, graph)
    padded_out = -(-c_out // lanes) * lanes
    if winograd:
        tiles = out[0] * -(-out[1] // 2) * -(-out[2] // 2)
        padded_in = -(-c_in // lanes) * lanes
        work = 2.0 * 16 * c_in * padded_out
        work += WINOGRAD_INPUT_OPS * padded_in + WINOGRAD_OUTPUT_OPS * padded_out
        return tiles * work / WINOGRAD_EFFICIENCY
    return gemm_flops(node, graph) / c_out * padded_out


def node_flops(node: Node, graph: Graph) -> float:
    """Floating-point work of one non-GEMM node (0 for layout and opaque nodes)."""
    if node.cls == OpClass.POINTWISE:
        per = 1.0
        if node.op in _TRANSCENDENTAL:
            per = FLOPS_TRANSCENDENTAL
        elif node.op in _DIVISION_LIKE:
            per = FLOPS_DIVISION
        return per * graph.meta(node.output).numel
    if node.cls == OpClass.REDUCTION:
        return float(graph.meta(node.inputs[0]).numel)
    if node.op == "pool2d":  # a max / add per window tap and output
        kh, kw = node.attrs["kernel"]
        return float(kh * kw * graph.meta(node.output).numel)
    return 0.0


def _nbytes(graph: Graph, value: str) -> int:
    """Size of a value (``TensorMeta.nbytes`` without allocating a tensor per call)."""
    meta = graph.meta(value)
    return meta.numel * meta.dtype.itemsize


def candidate_bytes(candidate: Candidate, graph: Graph, lookup: GraphLookup | None = None) -> float:
    """Bytes a kernel moves: reads of in(k) and parameters, writes of out(k) (``traffic``)."""
    lk = lookup or GraphLookup(graph)
    reads, writes = traffic(candidate, graph, lk.ordered(candidate), lk.root)
    return float(sum(reads.values()) + sum(writes.values()))


def is_extern_kernel(candidate: Candidate, nodes: list[Node]) -> bool:
    """Kernels run as a library/PyTorch call (oneDNN conv, opaque ops), not native loops.
    ``nodes`` are the candidate's nodes."""
    return candidate.template == "conv" or (
        candidate.template == "single" and nodes[0].op in EXTERN_OPS
    )


def calibrated_work(
    candidate: Candidate, graph: Graph, profile: HardwareProfile, lookup: GraphLookup
) -> NativeWork | None:
    """What the calibrated CPU model prices a native kernel on (None: a kernel it does
    not price, such as a library call)."""
    nodes = lookup.ordered(candidate)
    if candidate.template not in NATIVE_TEMPLATES or is_extern_kernel(candidate, nodes):
        return None
    light = sum(node_flops(n, graph) for n in nodes if n.cls == OpClass.POINTWISE)
    lanes = _LANES.get(profile.isa, 8)
    return native_work(candidate, graph, nodes, lookup.root, lookup.param_bytes, light, lanes)


def estimate(
    candidate: Candidate,
    graph: Graph,
    profile: HardwareProfile,
    lookup: GraphLookup | None = None,
) -> float:
    """Roofline estimate of one kernel's time in µs (see the module docstring).
    Pass a ``GraphLookup`` when estimating many candidates of one graph."""
    lk = lookup or GraphLookup(graph)
    if profile.kernels is not None and (work := calibrated_work(candidate, graph, profile, lk)):
        return native_time(work, profile, profile.kernels)
    nodes = lk.ordered(candidate)
    compute_us = 0.0
    fixed = profile.kernel_fixed_us
    if is_extern_kernel(candidate, nodes):
        fixed = profile.extern_call_us
        if candidate.template == "conv":
            fixed += ONEDNN_CONV_US
    for n in nodes:
        if n.cls == OpClass.GEMM and candidate.template == "dwconv":
            lanes = _LANES.get(profile.isa, 8)
            compute_us += dwconv_flops(n, graph, lanes) / (
                profile.peak_gflops * DWCONV_EFFICIENCY * 1e3
            )
        elif n.cls == OpClass.GEMM and candidate.template in ("dconv", "wconv"):
            lanes = _LANES.get(profile.isa, 8)
            f = dconv_flops(n, graph, lanes, winograd=candidate.template == "wconv")
            eff = profile.efficiency(gemm_flops(n, graph)) * DCONV_EFFICIENCY
            pixels = graph.meta(n.output).numel // graph.meta(n.output).shape[-1]
            if pixels < DCONV_FEW_PIXELS * graph.meta(n.output).shape[0]:
                eff *= DCONV_FEW_PIXELS_EFFICIENCY
            compute_us += f / (profile.peak_gflops * eff * 1e3)
        elif n.cls == OpClass.GEMM:
            f = gemm_flops(n, graph)
            eff = profile.efficiency(f)
            if n.op == "conv" and is_depthwise_conv(graph, n):
                eff = ONEDNN_DEPTHWISE_EFFICIENCY
            elif n.op == "conv" and candidate.template == "conv":
                eff *= ONEDNN_CONV_EFFICIENCY
            compute_us += f / (profile.peak_gflops * eff * 1e3)
        else:
            compute_us += node_flops(n, graph) / (profile.peak_gflops * 1e3)
    moved = candidate_bytes(candidate, graph, lk)
    if candidate.template == "conv":  # the weight's reorder, every call
        moved += ONEDNN_WEIGHT_PASSES * sum(
            _nbytes(graph, n.inputs[1]) for n in nodes if n.op == "conv"
        )
    memory_us = moved / (profile.mem_bw_gbs * 1e3)
    return max(compute_us, memory_us) + fixed


def structure_key(candidate: Candidate, graph: Graph, profile_name: str) -> str:
    """Hash of what a kernel's time depends on: template, ops, attributes, how operands
    are wired and viewed, shapes and dtypes, and the device profile. Names and weight
    values do not enter, so equal layers share one measurement."""
    lk = GraphLookup(graph)
    nodes, by_name = lk.ordered(candidate), lk.by_name
    local = {n.output: i for i, n in enumerate(nodes)}
    ins = {r: j for j, r in enumerate(candidate.inputs)}
    entries = []
    for n in nodes:
        args: list[tuple[object, ...]] = []
        for v in n.inputs:
            if v in local:
                args.append(("k", local[v]))
                continue
            chain, u = [], v
            while u != (root := lk.root(u)):
                p = by_name[graph.values[u].producer or ""]
                chain.append((p.op, sorted(p.attrs.items())))
                u = p.inputs[0]
            where = ("in", ins[root]) if root in ins else ("const",)
            meta, rmeta = graph.meta(v), graph.meta(root)
            args.append((where, tuple(chain), meta.shape, str(meta.dtype), rmeta.shape))
        attrs = sorted((k, str(a)) for k, a in n.attrs.items())
        out = graph.meta(n.output)
        entries.append(
            (n.op, attrs, args, out.shape, str(out.dtype), n.output in candidate.outputs)
        )
    text = repr((candidate.template, entries, profile_name))
    return hashlib.sha256(text.encode()).hexdigest()[:32]


class CostModelBase:
    """What every device's cost model shares: ``cost``/``costs`` from the subclass's
    ``estimate``, or, when a ``measure(candidate) -> µs`` callable is given, measurements
    cached on disk in a JSON file keyed by ``structure_key`` (default
    ``<cache dir>/measured_costs.json``); and the lookup of the graph last asked about.
    """

    def __init__(
        self,
        profile_name: str,
        measure: Callable[[Candidate], float] | None = None,
        cache_path: Path | None = None,
    ) -> None:
        self.profile_name = profile_name
        self.measure = measure
        self.cache_path = cache_path or cache_dir() / "measured_costs.json"
        self._measured: dict[str, float] | None = None
        self._lookup: GraphLookup | None = None

    def lookup(self, graph: Graph) -> GraphLookup:
        """The (cached) lookup of the graph most recently asked about."""
        if self._lookup is None or self._lookup.graph is not graph:
            self._lookup = GraphLookup(graph)
        return self._lookup

    def estimate(self, candidate: Candidate, graph: Graph) -> float:
        """The device model's estimate (µs)."""
        raise NotImplementedError

    def cost(self, candidate: Candidate, graph: Graph) -> float:
        """Measured cost if a ``measure`` callable was given (cached), else the estimate."""
        if self.measure is None:
            return self.estimate(candidate, graph)
        key = structure_key(candidate, graph, self.profile_name)
        table = self._table()
        if key not in table:
            table[key] = float(self.measure(candidate))
            self._store(key, table[key])
        return table[key]

    def costs(self, candidates: Iterable[Candidate], graph: Graph) -> dict[Candidate, float]:
        """``cost`` of each candidate, as the mapping ``orchestrate`` takes."""
        return {c: self.cost(c, graph) for c in candidates}

    def _table(self) -> dict[str, float]:
        if self._measured is None:
            self._measured = self._read()
        return self._measured

    def _read(self) -> dict[str, float]:
        try:
            data = json.loads(self.cache_path.read_text(encoding="utf-8"))
            return {str(k): float(v) for k, v in data.items()}
        except (OSError, ValueError, AttributeError):
            return {}

    def _store(self, key: str, value: float) -> None:
        """Merge one entry into the file (re-read first: other processes may write too)."""
        data = self._read()
        data[key] = value
        self.cache_path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.cache_path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(data, sort_keys=True), encoding="utf-8")
        tmp.replace(self.cache_path)


class CostModel(CostModelBase):
    """Costs of candidates on one device: the roofline ``estimate``, or cached
    measurements (see ``CostModelBase``)."""

    def __init__(
        self,
        profile: HardwareProfile,
        measure: Callable[[Candidate], float] | None = None,
        cache_path: Path | None = None,
    ) -> None:
        super().__init__(profile.name, measure, cache_path)
        self.profile = profile

    def estimate(self, candidate: Candidate, graph: Graph) -> float:
        """Roofline estimate (µs)."""
        return estimate(candidate, graph, self.profile, self.lookup(graph))
