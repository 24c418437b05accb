"""The orchestrated program: chosen kernels in execution order plus a static memory plan.

Where every materialised value lives:

* graph inputs and params: their own buffers;
* a graph output computed by a native kernel: written straight into the output buffer;
* everything else a native kernel writes: a slice of one preallocated arena, shared by
  values whose lifetimes do not overlap (offsets chosen by best fit, largest first);
* the result of an extern kernel (library or PyTorch call): the tensor it returns.

Views own no storage (see ``layout.py``). A view PyTorch cannot express with strides
gets a ``copy`` kernel that materialises its input first.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum

from kiln.compiler.ir.graph import Graph, ValueKind
from kiln.compiler.ir.layout import Access, access

ALIGN = 64  # bytes; one cache line, and an AVX-512 vector


@dataclass(frozen=True)
class Kernel:
    """One kernel of the program. ``nodes`` in topological order; ``outputs`` are
    the values it writes to memory; ``inputs`` the storage it reads."""

    template: str  # pointwise | reduction | gemm | conv | single | copy
    nodes: tuple[str, ...]
    outputs: tuple[str, ...]
    inputs: tuple[str, ...]
    cost_us: float = 0.0  # predicted


class Slot(str, Enum):
    INPUT = "input"
    OUTPUT = "output"
    PARAM = "param"
    ARENA = "arena"
    EXTERN = "extern"


@dataclass(frozen=True)
class Storage:
    slot: Slot
    index: int = 0  # input / output / param / extern number
    offset: int = 0  # bytes into the arena


@dataclass
class Program:
    graph: Graph
    kernels: list[Kernel]
    storage: dict[str, Storage]
    params: list[str]  # PARAM values in buffer order
    arena_bytes: int
    # (output index, value): outputs that are views, inputs, params, extern results
    # or repeated values; copied into their output buffer at the end.
    final_copies: list[tuple[int, str]] = field(default_factory=list)

    def access(self, value: str) -> Access:
        """How a kernel reads ``value``: root storage plus strides."""
        a = access(self.graph, value, self.storage)
        assert isinstance(a, Access), f"{value} needs materialising ({a})"
        return a


EXTERN_TEMPLATES = {"conv"}


def is_extern(graph: Graph, k: Kernel) -> bool:
    """Kernels run as library/PyTorch calls rather than generated loops."""
    if k.template in EXTERN_TEMPLATES:
        return True
    return k.template == "single" and graph.node(k.nodes[0]).op in ("opaque", "conv")


def build_program(graph: Graph, kernels: list[Kernel]) -> Program:
    """Assign storage to every value the kernels write and plan the arena."""
    kernels = _materialise_views(graph, kernels)
    storage: dict[str, Storage] = {}
    params = [v for v, val in graph.values.items() if val.kind == ValueKind.PARAM]
    for i, v in enumerate(graph.inputs):
        storage[v] = Storage(Slot.INPUT, i)
    for i, v in enumerate(params):
        storage[v] = Storage(Slot.PARAM, i)

    n_extern = 0
    for k in kernels:
        if is_extern(graph, k):
            for o in k.outputs:
                storage[o] = Storage(Slot.EXTERN, n_extern)
            n_extern += 1

    final_copies: list[tuple[int, str]] = []
    written = {o for k in kernels for o in k.outputs}
    for j, o in enumerate(graph.outputs):
        if o in written and o not in storage:
            storage[o] = Storage(Slot.OUTPUT, j)
        else:
            final_copies.append((j, o))

    arena_values = [o for k in kernels for o in k.outputs if o not in storage]
    offsets, arena_bytes = _plan_arena(graph, kernels, arena_values, final_copies)
    for v, off in offsets.items():
        storage[v] = Storage(Slot.ARENA, offset=off)
    return Program(graph, kernels, storage, params, arena_bytes, final_copies)


def _materialise_views(graph: Graph, kernels: list[Kernel]) -> list[Kernel]:
    """Insert a ``copy`` kernel before the first reader of any view chain that cannot
    be expressed with strides, materialising the value the failing reshape reads."""
    stored: set[str] = {o for k in kernels for o in k.outputs}
    stored |= set(graph.inputs) | {v for v in graph.values if graph.is_constant(v)}
    out: list[Kernel] = []
    for k in kernels:
        reads = [i for n in k.nodes for i in graph.node(n).inputs]
        for v in reads:
            a = access(graph, v, stored)
            while not isinstance(a, Access):  # a is the value to materialise
                src = access(graph, a, stored)
                assert isinstance(src, Access), "nested non-strided views"
                out.append(Kernel("copy", (), (a,), (src.root,)))
                stored.add(a)
                a = access(graph, v, stored)
        out.append(k)
    return out


def _plan_arena(
    graph: Graph,
    kernels: list[Kernel],
    values: list[str],
    final_copies: list[tuple[int, str]],
) -> tuple[dict[str, int], int]:
    """Best-fit static allocation: values whose [first write, last read] intervals
    overlap get disjoint byte ranges."""
    stored = set(values) | {o for k in kernels for o in k.outputs}
    birth: dict[str, int] = {}
    death: dict[str, int] = {}
    for step, k in enumerate(kernels):
        for o in k.outputs:
            birth.setdefault(o, step)
            death.setdefault(o, step)
        reads = {i for n in k.nodes for i in graph.node(n).inputs} | set(k.inputs)
        for r in reads:
            a = access(graph, r, stored)
            root = a.root if isinstance(a, Access) else r
            death[root] = step
    for _, v in final_copies:
        a = access(graph, v, stored)
        if isinstance(a, Access):
            death[a.root] = len(kernels)

    def size(v: str) -> int:
        return -(-graph.meta(v).nbytes // ALIGN) * ALIGN

    placed: list[tuple[int, int, int, int]] = []  # (offset, end, birth, death)
    offsets: dict[str, int] = {}
    for v in sorted(values, key=lambda v: (-size(v), birth[v])):
        b, d, sz = birth[v], death.get(v, birth[v]), size(v)
        busy = sorted((lo, hi) for lo, hi, pb, pd in placed if not (pd < b or d < pb))
        best: tuple[int, int] | None = None
        cursor = 0
        for lo, hi in busy:
            if lo - cursor >= sz and (best is None or lo - cursor < best[1]):
                best = (cursor, lo - cursor)
            cursor = max(cursor, hi)
        off = best[0] if best is not None else cursor
        placed.append((off, off + sz, b, d))
        offsets[v] = off
    total = max((e for _, e, _, _ in placed), default=0)
    return offsets, total
