"""Probe programs: small primitive graphs of many independent kernels of each family kiln
emits, timed by ``kiln calibrate`` to fit the CPU cost model's ``KernelRates``.

One program per family and working-set size (sizes follow this machine's caches), so a
profiling build times every kernel in the steady state real programs run in:

* ``gemv-l2`` / ``gemv-l3`` / ``gemv-dram``: GEMVs (and 2- and 4-row GEMMs) over packed
  weights whose total fits L2, fits L3, or does not: read bandwidth per level;
* ``gemm``: packed-weight GEMMs from 2 to 512 rows, K and N from 16 to 1024: the
  micro-kernel rate per register-block height and the per-block overhead;
* ``gemm-runtime``: batched and plain GEMMs whose right operand is computed at run time,
  with contiguous and transposed rows (attention's products): packing rates;
* ``pointwise`` / ``-l3`` / ``-dram``: chains of elementwise kernels (cheap and
  transcendental) from 256 elements to twice L3: fixed costs serial and parallel,
  bandwidth, pointwise rate;
* ``rows``: softmax and sum rows of 64 to 4096 elements: the per-row cost; and gathers
  (embedding lookups) from tables in L2 and in DRAM: the per-row cost of a gather;
* ``dwconv``: native depthwise convs, 1-D and 2-D.

Every program starts with a warm-up kernel that is not fitted (the first parallel kernel
of a call pays for waking the thread pool). Probes read and write intermediates, as
kernels of real programs do: each activation a probe reads is produced just before it by
a *feed* kernel (a negation of a graph input), and each result is read by a *sink* kernel
that copies one row of it to a graph output (a large graph output is fresh memory every
call: its page faults are no kernel's cost). Feeds and sinks are not fitted.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from kiln.compiler.fusion.candidates import Candidate, make_candidate
from kiln.compiler.ir.graph import Graph, TensorMeta

F32 = torch.float32


WARMUP_ELEMS = 1 << 16  # above the pointwise parallel threshold: wakes the thread pool


@dataclass
class ProbeProgram:
    """A graph and the kernels to run it with, in order; ``fitted`` flags the probes
    (not the warm-up and sink kernels)."""

    name: str
    graph: Graph = field(default_factory=Graph)
    kernels: list[Candidate] = field(default_factory=list)
    fitted: list[bool] = field(default_factory=list)
    _feeds: list[str] = field(default_factory=list)
    _index_high: dict[str, int] = field(default_factory=dict)  # int64 inputs: their range

    def __post_init__(self) -> None:
        shape = (WARMUP_ELEMS,)
        self.kernel([self.node("relu", (self.raw_input(shape),), shape)], probe=False)

    def raw_input(self, shape: tuple[int, ...]) -> str:
        """A graph input (read cold by whichever kernel reads it first)."""
        return self.graph.add_input(f"in{len(self.graph.inputs)}", TensorMeta(shape, F32))

    def input(self, shape: tuple[int, ...]) -> str:
        """An activation of ``shape`` produced by a feed kernel just before the next probe."""
        out = self.node("neg", (self.raw_input(shape),), shape)
        self._feeds.append(out)
        return out

    def param(self, shape: tuple[int, ...], scale: float = 0.05) -> str:
        name = f"p{len(self.graph.constants)}"
        return self.graph.add_constant(name, torch.randn(shape) * scale)

    def node(self, op: str, ins: tuple[str, ...], shape: tuple[int, ...], **attrs: object) -> str:
        """A node that is not an output on its own (part of a larger kernel)."""
        return self.graph.add_node(op, ins, TensorMeta(shape, F32), dict(attrs) or None)

    def add(self, op: str, ins: tuple[str, ...], shape: tuple[int, ...], **attrs: object) -> str:
        """A one-node probe kernel; returns its output."""
        out = self.node(op, ins, shape, **attrs)
        self.kernel([out])
        return out

    def kernel(self, values: list[str], probe: bool = True) -> None:
        """One kernel of the nodes computing ``values``, the last its result: a graph
        output for the warm-up, else read by a sink kernel."""
        g = self.graph
        names = [p.name for v in values if (p := g.producer(v)) is not None]
        sink = None
        if probe:  # a row of the result, copied to a graph output
            shape = g.meta(values[-1]).shape
            row = (1, *shape[1:])
            first = self.node("slice", (values[-1],), row, dim=0, start=0, end=1, step=1)
            sink = self.node("neg", (first,), row)
        g.outputs.append(sink or values[-1])
        steps = [(self._node_names(f), False) for f in self._feeds] + [(names, probe)]
        if sink is not None:
            steps.append((self._node_names(sink), False))
        self._feeds.clear()
        for nodes, fitted in steps:  # (liveness: made once the graph output exists)
            self.kernels.append(make_candidate(g, nodes))
            self.fitted.append(fitted)

    def _node_names(self, value: str) -> list[str]:
        producer = self.graph.producer(value)
        assert producer is not None
        return [producer.name]

    def gather(self, rows: int, table_rows: int, width: int) -> None:
        """A probe picking ``rows`` random rows of a (table_rows, width) parameter."""
        idx = self.graph.add_input(f"in{len(self.graph.inputs)}", TensorMeta((rows,), torch.int64))
        self._index_high[idx] = table_rows
        table = self.param((table_rows, width))
        self.add("index_select", (table, idx), (rows, width), dim=0)

    def inputs(self, seed: int = 0) -> list[torch.Tensor]:
        """Random example inputs, one per graph input (indices within their table)."""
        gen = torch.Generator().manual_seed(seed)
        out = []
        for v in self.graph.inputs:
            shape = self.graph.meta(v).shape
            if v in self._index_high:
                out.append(torch.randint(0, self._index_high[v], shape, generator=gen))
            else:
                out.append(torch.randn(shape, generator=gen))
        return out


def _gemvs(
    name: str, weights: list[tuple[int, int]], rows: tuple[int, ...], gathers: tuple[int, ...] = ()
) -> ProbeProgram:
    """GEMMs of each row count over each (K, N) weight, weight by weight; then gathers of
    rows from a table where the weights live."""
    p = ProbeProgram(name)
    for k, n in weights:
        w = p.param((k, n))
        for m in rows:
            p.add("mm", (p.input((m, k)), w), (m, n))
    for m in gathers:  # from an embedding-like table (rows of 256) as large as a weight
        k, n = weights[-1]
        p.gather(m, k * n // 256, 256)
    return p


def _gemms(name: str, shapes: list[tuple[int, int, int]]) -> ProbeProgram:
    p = ProbeProgram(name)
    for m, k, n in shapes:
        p.add("mm", (p.input((m, k)), p.param((k, n))), (m, n))
    return p


GEMM_SHAPES = [  # (M, K, N): register-block heights 1..MR, short and long K, narrow and wide N
    (2, 256, 256), (3, 64, 512), (4, 1024, 64), (6, 256, 256), (8, 64, 64), (8, 512, 512),
    (12, 256, 256), (12, 16, 64), (16, 128, 1024), (24, 1024, 64), (32, 32, 32), (48, 256, 256),
    (64, 64, 256), (96, 512, 128), (128, 256, 256), (256, 16, 128), (256, 128, 64),
    (512, 64, 64), (512, 256, 256), (200, 96, 192),
]  # fmt: skip


def _runtime_gemms() -> ProbeProgram:
    """GEMMs whose right operand is an input: contiguous rows, and transposed (K^T)."""
    p = ProbeProgram("gemm-runtime")
    for b, m, k, n in ((4, 128, 32, 128), (4, 64, 64, 64), (12, 50, 16, 50), (2, 1, 64, 256)):
        p.add("bmm", (p.input((b, m, k)), p.input((b, k, n))), (b, m, n))  # P @ V
        kt = p.node("permute", (p.input((b, n, k)),), (b, k, n), dims=(0, 2, 1))
        p.add("bmm", (p.input((b, m, k)), kt), (b, m, n))  # Q @ K^T
    for m, k, n in ((64, 256, 256), (8, 512, 128)):
        p.add("mm", (p.input((m, k)), p.input((k, n))), (m, n))
    return p


def _pointwise(name: str, sizes: list[int]) -> ProbeProgram:
    """Per size: relu, then tanh of it (10 FLOPs an element), then a two-input add."""
    p = ProbeProgram(name)
    for n in sizes:
        shape = (n // 256, 256) if n >= 256 else (n,)
        x = p.input(shape)
        y = p.add("relu", (x,), shape)
        z = p.add("tanh", (y,), shape)
        p.add("add", (z, y), shape)
    return p


def _rows() -> ProbeProgram:
    """Softmax rows (max, sub, exp, sum, div: one row kernel) and plain row sums."""
    p = ProbeProgram("rows")
    for r, c in ((1, 128), (16, 64), (128, 128), (64, 1024), (512, 256), (4096, 64), (4, 4096)):
        x, row = p.input((r, c)), (r, 1)
        mx = p.node("max", (x,), row, dims=(-1,), keepdim=True)
        d = p.node("sub", (x, mx), (r, c))
        e = p.node("exp", (d,), (r, c))
        s = p.node("sum", (e,), row, dims=(-1,), keepdim=True)
        p.kernel([mx, d, e, s, p.node("div", (e, s), (r, c))])
        p.add("sum", (p.input((r, c)),), row, dims=(-1,), keepdim=True)
    for rows in (16, 64, 512):  # gathers from a table in L2
        p.gather(rows, 256, 256)
    return p


def _dwconvs() -> ProbeProgram:
    p = ProbeProgram("dwconv")
    for n, c, hw, k, s in ((1, 32, 56, 3, 1), (1, 96, 28, 3, 1), (1, 256, 7, 3, 1),
                           (1, 64, 28, 5, 2), (8, 32, 14, 3, 1)):  # fmt: skip
        out = (hw + 2 * (k // 2) - k) // s + 1
        attrs = dict(stride=(s, s), padding=(k // 2, k // 2), dilation=(1, 1), groups=c)
        ins = (p.input((n, c, hw, hw)), p.param((c, 1, k, k)), p.param((c,)))
        p.add("conv", ins, (n, c, out, out), **attrs)
    for c, length, k in ((144, 100, 31), (256, 50, 15)):
        attrs = dict(stride=(1,), padding=(k // 2,), dilation=(1,), groups=c)
        ins = (p.input((1, c, length)), p.param((c, 1, k)), p.param((c,)))
        p.add("conv", ins, (1, c, length), **attrs)
    return p


def probe_programs(cache_bytes: tuple[int, int, int]) -> list[ProbeProgram]:
    """Every probe program, sized for caches of (L1d, L2, L3) bytes."""
    l2 = max(cache_bytes[1], 256 * 1024)
    l3 = max(cache_bytes[2], 4 * l2)
    n_l2 = max(64, l2 // (2 * 4 * 256) // 32 * 32)  # one (256, N) weight: half of L2
    n_l3 = max(256, int((l3 // 16 // 4) ** 0.5) // 32 * 32)  # 4 square ones: L3 / 4
    n_dram = max(512, int((l3 // 2 // 4) ** 0.5) // 32 * 32)  # 4: twice L3
    # floats per value: L2-sized, L3-sized and larger values in programs of their own (a
    # program's arena as large as L3 would leave the small probes' buffers cold)
    pointwise = {
        "pointwise": [256, 4096, 32768, l2 // 32, l2 // 16],
        "pointwise-l3": [l2 // 4, l3 // 16],
        "pointwise-dram": [l3 // 4],
    }
    return [
        _gemvs("gemv-l2", [(256, n_l2)], (1, 1, 2, 4)),
        _gemvs("gemv-l3", [(n_l3, n_l3)] * 4, (1,)),
        _gemvs("gemv-dram", [(n_dram, n_dram)] * 4, (1,), gathers=(16, 128)),
        _gemms("gemm", GEMM_SHAPES),
        _runtime_gemms(),
        *(
            _pointwise(k, sorted({max(256, n // 256 * 256) for n in v}))
            for k, v in pointwise.items()
        ),
        _rows(),
        _dwconvs(),
    ]
