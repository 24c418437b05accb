"""Writing one Triton kernel: pointer parameters, strided index arithmetic, loads,
the fused node expressions, stores; and loading the generated source as a module.

A generated kernel takes one pointer per storage root it touches (program input,
parameter, arena value, output) and nothing else: shapes, strides and offsets are
static, so they are literals in the source and Triton folds them. Triton's ``jit``
reads a function's source with ``inspect``, so each kernel is written to a file under
the cache directory (named by its hash) and imported from there.
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from kiln.compiler.codegen.gpu.expr import (
    KERNEL_DTYPES,
    TL_DTYPES,
    Unsupported,
    as_float,
    literal,
    node_expr,
)
from kiln.compiler.ir.graph import Graph, Node, OpClass, ValueKind
from kiln.core.cache import cache_dir


def interpreting() -> bool:
    """True when Triton runs kernels in its CPU interpreter (``TRITON_INTERPRET=1``)."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def next_pow2(n: int, floor: int = 1) -> int:
    p = floor
    while p < n:
        p *= 2
    return p


def index_expr(flat: str, sizes: tuple[int, ...], strides: tuple[int, ...]) -> str:
    """Element offset of the row-major flat index ``flat`` over ``sizes`` in a tensor with
    ``strides``: sum over dims of ((flat // inner) % size) * stride; dims of size 1 or
    stride 0 vanish and adjacent dims walked contiguously merge."""
    dims = [(s, st) for s, st in zip(sizes, strides) if s != 1]
    merged: list[tuple[int, int]] = []
    for s, st in reversed(dims):  # innermost first
        if merged and merged[-1][1] * merged[-1][0] == st and st != 0:
            ps, pst = merged.pop()
            merged.append((ps * s, pst))
        elif merged and st == 0 and merged[-1][1] == 0:
            ps, _ = merged.pop()
            merged.append((ps * s, 0))
        else:
            merged.append((s, st))
    terms, inner = [], 1
    total = 1
    for s, _ in merged:
        total *= s
    for s, st in merged:
        if st != 0:
            q = flat if inner == 1 else f"({flat} // {inner})"
            q = q if inner * s == total else f"({q} % {s})"
            terms.append(q if st == 1 else f"{q} * {st}")
        inner *= s
    return " + ".join(terms) if terms else "0"


@dataclass
class KernelWriter:
    """Builds one kernel's source. ``roots`` are the storage roots in parameter order;
    ``lines`` the body, indented one level."""

    graph: Graph
    name: str
    roots: list[str] = field(default_factory=list)
    lines: list[str] = field(default_factory=list)
    env: dict[str, tuple[str, bool]] = field(default_factory=dict)  # value -> (expr, is_bool)
    _tmp: int = 0

    def ptr(self, root: str) -> str:
        if root not in self.roots:
            self.roots.append(root)
        return f"p{self.roots.index(root)}"

    def emit(self, line: str) -> None:
        self.lines.append("    " + line)

    def fresh(self, prefix: str = "t") -> str:
        self._tmp += 1
        return f"{prefix}{self._tmp}"

    def const(self, value: str) -> tuple[str, bool] | None:
        """A 0-d constant as a literal (None if ``value`` is not one)."""
        if self.graph.values[value].kind != ValueKind.CONST:
            return None
        t = self.graph.constants[value]
        if t.dtype == torch.bool:
            return literal(bool(t.item())), True
        if not t.dtype.is_floating_point and t.dtype not in (torch.int64, torch.int32):
            raise Unsupported(f"constant of dtype {t.dtype}")
        return literal(float(t.item())), False

    def load(self, value: str, root: str, offset: str, mask: str | None) -> tuple[str, bool]:
        """Load ``value`` (stored in ``root``) at ``offset``, upcast to fp32 (bool: int1)."""
        dtype = self.graph.meta(value).dtype
        if dtype not in KERNEL_DTYPES:
            raise Unsupported(f"dtype {dtype} of {value}")
        var = self.fresh("x")
        m = f", mask={mask}, other=0" if mask else ""
        if dtype == torch.bool:
            self.emit(f"{var} = tl.load({self.ptr(root)} + {offset}{m}) != 0")
            return var, True
        self.emit(f"{var} = tl.load({self.ptr(root)} + {offset}{m}).to(tl.float32)")
        return var, False

    def store(self, value: str, offset: str, mask: str | None) -> None:
        expr, is_bool = self.env[value]
        dtype = self.graph.meta(value).dtype
        if dtype not in KERNEL_DTYPES:
            raise Unsupported(f"dtype {dtype} of {value}")
        cast = "tl.int8" if dtype == torch.bool else TL_DTYPES[dtype]
        src = expr if dtype == torch.bool else as_float(expr, is_bool)
        m = f", mask={mask}" if mask else ""
        self.emit(f"tl.store({self.ptr(value)} + {offset}, ({src}).to({cast}){m})")

    def compute(self, nodes: list[Node]) -> None:
        """Bind every pointwise node's output to a register variable, in order (its
        inputs must already be in ``env``: loaded, reduced or computed)."""
        for n in nodes:
            if n.cls != OpClass.POINTWISE:
                raise Unsupported(f"{n.op} is not pointwise")
            args, bools, consts = [], [], {}
            for i, v in enumerate(n.inputs):
                if v not in self.env:
                    c = self.const(v)
                    if c is None:
                        raise Unsupported(f"{n.name} reads {v}, which the kernel never loads")
                    self.env[v] = c
                if self.graph.values[v].kind == ValueKind.CONST:
                    consts[i] = float(self.graph.constants[v].item())
                expr, is_bool = self.env[v]
                args.append(expr)
                bools.append(is_bool)
            var = self.fresh("v")
            self.emit(f"{var} = {node_expr(n, args, bools, consts)}")
            self.env[n.output] = (var, self.graph.meta(n.output).dtype == torch.bool)

    def launch(
        self, index: int, constexprs: tuple[str, ...], variants: Sequence[Variant]
    ) -> Launch:
        """Compile the kernel and describe its launch; ``variants`` pass ``constexprs``
        (and may add ``num_warps``/``num_stages``)."""
        src = self.source(constexprs)
        return Launch(index, load_kernel(src, self.name), tuple(self.roots), list(variants), src)

    def source(self, constexprs: tuple[str, ...] = ()) -> str:
        params = [f"p{i}" for i in range(len(self.roots))]
        params += [f"{c}: tl.constexpr" for c in constexprs]
        head = [
            "import triton",
            "import triton.language as tl",
            "",
            "",
            "@triton.jit",
            f"def {self.name}({', '.join(params)}):",
        ]
        return "\n".join(head + self.lines) + "\n"


_MODULES: dict[str, Any] = {}


def load_kernel(source: str, name: str) -> Callable[..., Any]:
    """The ``triton.jit`` function ``name`` defined by ``source`` (one file per distinct
    source under the cache directory; imported once per process)."""
    key = hashlib.sha256(source.encode()).hexdigest()[:24]
    mod = _MODULES.get(key)
    if mod is None:
        path = cache_dir("triton-src") / f"k_{key}.py"
        if not path.exists():
            tmp = path.with_suffix(f".{os.getpid()}.tmp")
            tmp.write_text(source, encoding="utf-8")
            tmp.replace(path)
        spec = importlib.util.spec_from_file_location(f"kiln_triton_{key}", path)
        assert spec is not None and spec.loader is not None
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
        _MODULES[key] = mod
    return getattr(mod, name)  # type: ignore[no-any-return]


Variant = tuple[tuple[int, ...], dict[str, Any]]  # (grid, constexprs and launch options)


@dataclass
class Launch:
    """One Triton kernel launch of a program: ``fn[grid](*pointers(roots), **options)``
    with ``(grid, options) = variants[choice]``. The variants are launch configurations
    (block sizes, warps, stages) of the same source; ``choice`` is the tuned one
    (the first until tuned). ``kernel`` is the index of the program kernel it runs."""

    kernel: int
    fn: Any  # a triton JITFunction: fn[grid](*pointers, **options)
    roots: tuple[str, ...]
    variants: list[Variant]
    source: str
    choice: int = 0

    @property
    def grid(self) -> tuple[int, ...]:
        return self.variants[self.choice][0]

    @property
    def options(self) -> dict[str, Any]:
        return self.variants[self.choice][1]
