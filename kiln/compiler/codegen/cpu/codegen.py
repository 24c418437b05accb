"""Program -> one C++ translation unit with a single entry point.

Each chosen kernel becomes a static function; ``kiln_entry`` resolves every stored
value's pointer once (inputs, outputs, params, arena slices), then calls the kernels
in order. Kernels with no native template (``conv`` kernels, opaque ops, or a kernel
the generator cannot express) become *extern* calls back into PyTorch/oneDNN, listed
in ``CppProgram.externs`` with the reason.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from kiln.compiler.codegen.cpu.chain import chain_kernel
from kiln.compiler.codegen.cpu.colreduce import column_reduction
from kiln.compiler.codegen.cpu.conv_nhwc import conv_nhwc_kernel
from kiln.compiler.codegen.cpu.dwconv import dwconv_kernel
from kiln.compiler.codegen.cpu.emit import NATIVE_DTYPES, Operand, cfloat, supports_pointwise
from kiln.compiler.codegen.cpu.entry import (
    PROFILE_PRELUDE,
    assemble,
    conv_chain,
    extern_call,
    is_conv,
    timed,
)
from kiln.compiler.codegen.cpu.extern import (
    Extern,
    conv_chain_extern,
    conv_extern,
    reference_extern,
)
from kiln.compiler.codegen.cpu.gemm import GemmSpec, emit_gemm
from kiln.compiler.codegen.cpu.pack import pack_b
from kiln.compiler.codegen.cpu.pointconv import pointconv_kernel
from kiln.compiler.codegen.cpu.pointwise import emit_copy, emit_pointwise
from kiln.compiler.codegen.cpu.pool import pool_kernel
from kiln.compiler.codegen.cpu.reduction import RowSpec, emit_rows
from kiln.compiler.codegen.cpu.rnn import rnn_kernel
from kiln.compiler.fusion.program import Kernel, Program, is_extern
from kiln.compiler.ir.graph import Node, OpClass
from kiln.compiler.ir.layout import Access, access, contiguous_strides


@dataclass
class CppProgram:
    source: str
    params: list[torch.Tensor]  # native param buffers, in buffer order
    externs: list[Extern]
    arena_bytes: int
    native_kernels: list[int] = field(default_factory=list)  # indices into program.kernels
    fallbacks: list[tuple[int, str]] = field(default_factory=list)  # (kernel index, reason)


class Unsupported(Exception):
    """The kernel has no native form; it becomes a reference extern."""


class _Gen:
    def __init__(self, prog: Program, nr: int, threads: int) -> None:
        self.prog, self.g, self.nr, self.threads = prog, prog.graph, nr, threads
        self.slot: dict[str, int] = {}  # stored value -> pointer table index
        self.params: list[torch.Tensor] = []
        self.prepared: dict[tuple[object, ...], int] = {}  # key of a prepared constant -> PP index
        self.externs: list[Extern] = []
        self.local: list[str] | None = None  # operand pointers of the kernel being emitted
        self.functions: dict[str, str] = {}  # kernel body -> function name

    # -- pointers and operands ------------------------------------------------
    def ptr(self, root: str) -> str:
        """C++ pointer expression for a stored value: inside a kernel function a local
        operand ``ops[i]`` (so identical kernels share one function), else ``P[slot]``."""
        if root not in self.slot:
            self.slot[root] = len(self.slot)
        ctype = "uint8_t" if self.g.meta(root).dtype == torch.bool else "float"
        if self.local is None:
            return f"(({ctype}*)P[{self.slot[root]}])"
        return f"(({ctype}*)ops[{self.local_ref(f'P[{self.slot[root]}]')}])"

    def local_ref(self, ref: str) -> int:
        """Index of pointer expression ``ref`` in the current kernel's operand array."""
        assert self.local is not None
        if ref not in self.local:
            self.local.append(ref)
        return self.local.index(ref)

    def prepared_param(self, key: tuple[object, ...], make: Callable[[], torch.Tensor]) -> str:
        """Pointer (``const float*``, a local operand) to a constant prepared at compile time
        (a packed weight, a reshaped conv filter): made once per ``key``, so kernels that use
        the same weight (the steps of an unrolled recurrence, tied weights) read one copy that
        stays in cache instead of one copy each."""
        index = self.prepared.get(key)
        if index is None:
            index = self.prepared[key] = len(self.params)
            self.params.append(make())
        return f"((const float*)ops[{self.local_ref(f'(char*)PP[{index}]')}])"

    def function(self, body: list[str], refs: list[str]) -> list[str]:
        """Emit ``body`` as a kernel function (once per distinct body); return its call."""
        text = "\n".join("  " + line for line in body) + "\n  return 0;"
        name = self.functions.get(text)
        if name is None:
            name = self.functions[text] = f"k{len(self.functions)}"
        return [
            f"  {{ char* const a[] = {{{', '.join(refs)}}}; if (int e = {name}(a, rt)) return e; }}"
        ]

    def operand(self, value: str, shape: tuple[int, ...]) -> Operand:
        a = self.prog.access(value).broadcast_to(shape)
        dtype = self.g.meta(value).dtype
        if dtype not in NATIVE_DTYPES:
            raise Unsupported(f"dtype {dtype} of {value}")
        return Operand(self.ptr(a.root), dtype, a.offset, a.strides)

    def out_operand(self, value: str, strides: tuple[int, ...] | None = None) -> Operand:
        meta = self.g.meta(value)
        if meta.dtype not in NATIVE_DTYPES:
            raise Unsupported(f"dtype {meta.dtype} of {value}")
        st = strides if strides is not None else contiguous_strides(meta.shape)
        return Operand(self.ptr(value), meta.dtype, 0, st)

    def consts(self, values: list[str]) -> dict[str, str]:
        out = {}
        for v in values:
            if self.g.values[v].kind.value == "const":
                out[v] = cfloat(float(self.g.constants[v].item()))
        return out

    # -- kernels ------------------------------------------------------------------
    def kernel(self, k: Kernel) -> list[str]:
        nodes = [self.g.node(n) for n in k.nodes]
        if k.template == "copy":
            # Materialise a view chain contiguously: read it through the views that
            # lead to it from stored data (the value itself is not stored yet).
            v = k.outputs[0]
            shape = self.g.meta(v).shape
            a = access(self.g, v, [s for s in self.prog.storage if s != v])
            assert isinstance(a, Access)
            src = Operand(self.ptr(a.root), self.g.meta(v).dtype, a.offset, a.strides)
            return emit_copy(src, self.out_operand(v), shape, self.threads)
        if k.template == "dwconv":
            return dwconv_kernel(self, k, nodes)
        if k.template in ("dconv", "wconv"):
            return conv_nhwc_kernel(self, k, nodes)
        if k.template == "gemm" and nodes[0].op == "conv":
            return pointconv_kernel(self, k, nodes)
        if k.template == "chain":
            return chain_kernel(self, k, nodes)
        classes = {n.cls for n in nodes}
        if classes == {OpClass.POINTWISE}:
            return self.pointwise(k, nodes)
        if len(nodes) == 1 and nodes[0].cls == OpClass.REDUCTION:
            column = column_reduction(self, nodes[0], self.nr // 2)
            if column is not None:
                return column
        if OpClass.REDUCTION in classes and classes <= {OpClass.REDUCTION, OpClass.POINTWISE}:
            return self.rows(k, nodes)
        if any(n.op in ("mm", "bmm") for n in nodes) and classes <= {
            OpClass.GEMM,
            OpClass.POINTWISE,
        }:
            return self.gemm(k, nodes)
        if len(nodes) == 1 and nodes[0].op == "cat":
            return self.cat(nodes[0])
        if len(nodes) == 1 and nodes[0].op == "rnn":
            return rnn_kernel(self, nodes[0])
        if len(nodes) == 1 and nodes[0].op == "pool2d":
            return pool_kernel(self, nodes[0], self.nr // 2)
        if len(nodes) == 1 and nodes[0].op == "index_select":
            return self.index_select(nodes[0])
        raise Unsupported(f"no native template for {sorted(n.op for n in nodes)}")

    def external_inputs(self, nodes: list[Node]) -> list[str]:
        inside = {n.output for n in nodes}
        seen = dict.fromkeys(i for n in nodes for i in n.inputs if i not in inside)
        return list(seen)

    def pointwise(self, k: Kernel, nodes: list[Node]) -> list[str]:
        for n in nodes:
            if not supports_pointwise(n):
                raise Unsupported(f"pointwise op {n.op}")
        shape = self.g.meta(nodes[-1].output).shape
        ext = self.external_inputs(nodes)
        consts = self.consts(ext)
        ins = {v: self.operand(v, shape) for v in ext if v not in consts}
        outs = {v: self.out_operand(v) for v in k.outputs}
        return emit_pointwise(nodes, ins, consts, outs, self.dtypes(), shape, self.threads)

    def rows(self, k: Kernel, nodes: list[Node]) -> list[str]:
        reds = [n for n in nodes if n.cls == OpClass.REDUCTION]
        shape_in = self.g.meta(reds[0].inputs[0]).shape
        nd = len(shape_in)
        dims = sorted({d % nd for d in reds[0].attrs["dims"]})
        for r in reds:
            if (
                self.g.meta(r.inputs[0]).shape != shape_in
                or sorted({d % nd for d in r.attrs["dims"]}) != dims
            ):
                raise Unsupported("reductions over different axes")
        kept_dims = [d for d in range(nd) if d not in dims]
        order = kept_dims + dims
        keep_shape = tuple(1 if d in dims else s for d, s in enumerate(shape_in))
        row_values = frozenset(
            n.output
            for n in nodes
            if n.cls == OpClass.POINTWISE and self.g.meta(n.output).shape == shape_in
        )
        for n in nodes:
            if n.op not in ("sum", "max", "min") and not supports_pointwise(n):
                raise Unsupported(f"op {n.op} in a row kernel")

        def perm(st: tuple[int, ...]) -> tuple[int, ...]:
            return tuple(st[d] for d in order)

        def scalar_strides(value: str, a: Access | None) -> tuple[int, ...]:
            shape = self.g.meta(value).shape
            strides = a.strides if a is not None else contiguous_strides(shape)
            if len(shape) == nd:
                return tuple(strides[d] for d in kept_dims)
            if len(shape) == len(kept_dims):
                return tuple(strides)
            raise Unsupported(f"scalar value {value} of shape {shape}")

        ext = self.external_inputs(nodes)
        consts = self.consts(ext)
        row_readers = {
            i
            for n in nodes
            if n.output in row_values or n.cls == OpClass.REDUCTION
            for i in n.inputs
        }
        row_in, scalar_in = {}, {}
        for v in ext:
            if v in consts:
                continue
            if v in row_readers:
                op = self.operand(v, shape_in)
                row_in[v] = Operand(op.ptr, op.dtype, op.offset, perm(op.strides))
            else:
                target = keep_shape if len(self.g.meta(v).shape) <= nd else shape_in
                op = self.operand(v, target)
                scalar_in[v] = Operand(
                    op.ptr, op.dtype, op.offset, tuple(op.strides[d] for d in kept_dims)
                )
        row_out, scalar_out = {}, {}
        for v in k.outputs:
            if v in row_values:
                op = self.out_operand(v)
                row_out[v] = Operand(op.ptr, op.dtype, 0, perm(op.strides))
            else:
                op = self.out_operand(v)
                scalar_out[v] = Operand(op.ptr, op.dtype, 0, scalar_strides(v, None))
        spec = RowSpec(
            kept=tuple(shape_in[d] for d in kept_dims),
            reduced=tuple(shape_in[d] for d in dims),
            nodes=tuple(nodes),
            row_values=row_values,
            row_in=row_in,
            scalar_in=scalar_in,
            consts=consts,
            row_out=row_out,
            scalar_out=scalar_out,
            dtypes=self.dtypes(),
        )
        return emit_rows(spec, self.threads)

    def gemm(self, k: Kernel, nodes: list[Node]) -> list[str]:
        mms = [n for n in nodes if n.op in ("mm", "bmm")]
        if len(mms) != 1 or nodes[0] is not mms[0]:
            raise Unsupported("gemm kernel must start with exactly one mm/bmm")
        mm = mms[0]
        a_val, b_val = mm.inputs
        if any(self.g.meta(v).dtype != torch.float32 for v in mm.inputs):
            raise Unsupported("non-fp32 gemm")
        out_shape = self.g.meta(mm.output).shape
        batched = mm.op == "bmm"
        bt, m, n_ = out_shape if batched else (1, *out_shape)
        kk = self.g.meta(a_val).shape[-1]

        def b3(op: Operand) -> Operand:
            return op if batched else Operand(op.ptr, op.dtype, op.offset, (0, *op.strides))

        a = b3(self.operand(a_val, self.g.meta(a_val).shape))
        b_op, b_packed = None, self.packed_b(b_val, batched)
        if b_packed is None:
            b_op = b3(self.operand(b_val, self.g.meta(b_val).shape))
        epi = [x for x in nodes if x is not mm]
        for e in epi:
            if not supports_pointwise(e) or self.g.meta(e.output).shape != out_shape:
                raise Unsupported(f"epilogue op {e.op} {self.g.meta(e.output).shape}")
        ext = [v for v in self.external_inputs(epi) if v != mm.output]
        consts = self.consts(ext)
        ext_ops = {v: b3(self.operand(v, out_shape)) for v in ext if v not in consts}
        outs = {v: b3(self.out_operand(v)) for v in k.outputs}
        spec = GemmSpec(
            bt,
            m,
            kk,
            n_,
            a,
            b_op,
            b_packed,
            mm.output,
            tuple(epi),
            ext_ops,
            consts,
            outs,
            self.dtypes(),
        )
        return emit_gemm(spec, self.nr, self.threads)

    def packed_b(self, b_val: str, batched: bool) -> str | None:
        """Pointer to a GEMM's right operand packed into column panels at compile time
        (batch panels back to back), or None when it is not a constant. A view of a
        constant (a tied weight's transpose) packs the viewed data."""
        acc = self.prog.access(b_val)
        if not self.g.is_constant(acc.root):
            return None

        def pack() -> torch.Tensor:
            root = self.g.constants[acc.root]
            w = root.as_strided(acc.shape, acc.strides, acc.offset).float()
            ws = w if batched else w.unsqueeze(0)
            return torch.cat([pack_b(ws[i].contiguous()).reshape(-1) for i in range(ws.shape[0])])

        key = ("gemm_b", acc.root, acc.shape, acc.strides, acc.offset, batched)
        return self.prepared_param(key, pack)

    def cat(self, node: Node) -> list[str]:
        out_shape = self.g.meta(node.output).shape
        dim = node.attrs["dim"] % len(out_shape)
        st = contiguous_strides(out_shape)
        lines, start = [], 0
        for piece in node.inputs:
            shape = self.g.meta(piece).shape
            dst = self.out_operand(node.output)
            dst = Operand(dst.ptr, dst.dtype, start * st[dim], st)
            lines += (
                ["{"]
                + [
                    "  " + x
                    for x in emit_copy(self.operand(piece, shape), dst, shape, self.threads)
                ]
                + ["}"]
            )
            start += shape[dim]
        return lines

    def index_select(self, node: Node) -> list[str]:
        """out = x.index_select(dim, idx): rows of ``x`` picked by int64 indices
        (embedding lookups, constant gathers); an index out of range returns error 2."""
        x, idx = node.inputs
        xs, out_shape = self.g.meta(x).shape, self.g.meta(node.output).shape
        dim = node.attrs["dim"] % len(xs)
        if self.g.meta(idx).dtype != torch.int64 or len(self.g.meta(idx).shape) != 1:
            raise Unsupported("index_select needs a 1-D int64 index")
        src = self.operand(x, xs)
        ia = self.prog.access(idx)
        ctx = self.local_ref(f"P[{self.slot.setdefault(ia.root, len(self.slot))}]")
        ip = f"((const int64_t*)ops[{ctx}])"
        dst = self.out_operand(node.output)
        outer = 1
        for s in xs[:dim]:
            outer *= s
        inner = 1
        for s in xs[dim + 1 :]:
            inner *= s
        k, size = out_shape[dim], xs[dim]
        # The source must walk the trailing dims contiguously for a flat row copy.
        if inner > 1 and src.strides[dim + 1 :] != tuple(contiguous_strides(xs[dim + 1 :])):
            raise Unsupported("index_select of a strided row")
        o_terms = " + ".join(
            [f"{src.offset}"]
            + [f"((o / {_prod(xs[d + 1 : dim])}) % {xs[d]}) * {src.strides[d]}" for d in range(dim)]
        )
        return [
            "int err = 0;",
            f"for (int64_t o = 0; o < {outer}; ++o) {{",
            f"  const int64_t ob = {o_terms};",
            f"  for (int64_t q = 0; q < {k}; ++q) {{",
            f"    int64_t r = {ip}[{ia.offset} + q * {ia.strides[0]}];",
            f"    if (r < 0) r += {size};",
            f"    if (r < 0 || r >= {size}) {{ err = 2; continue; }}",
            f"    const {src.ctype}* s = {src.ptr} + ob + r * {src.strides[dim]};",
            f"    {dst.ctype}* d = {dst.ptr} + (o * {k} + q) * {inner};",
            f"    if ({inner} == 1) d[0] = s[0]; else std::memcpy(d, s, {inner} * sizeof({dst.ctype}));",
            "  }",
            "}",
            "if (err) return err;",
        ]

    def dtypes(self) -> dict[str, torch.dtype]:
        return {v: val.meta.dtype for v, val in self.g.values.items()}


def generate(
    prog: Program, nr: int, threads: int | None = None, profile: bool = False
) -> CppProgram:
    """C++ for ``prog``. With ``profile``, every kernel call is timed into a counter
    array the program exports as ``kiln_profile()`` (µs per kernel, summed over calls;
    the last slot holds the final output copies)."""
    threads = threads or torch.get_num_threads()
    gen = _Gen(prog, nr, threads)
    g = prog.graph
    bodies: list[str] = []
    calls: list[str] = []
    fallbacks: list[tuple[int, str]] = []
    native: list[int] = []
    consumers = g.consumers()
    idx = 0
    while idx < len(prog.kernels):
        k = prog.kernels[idx]
        start = len(calls)
        chain = conv_chain(prog, idx, consumers)
        ext = conv_chain_extern(g, chain, prog) if len(chain) > 1 else None
        if ext is not None:
            calls += extern_call(gen, ext, chain[-1].outputs[0])
        else:
            chain = [k]
            _generate_kernel(gen, idx, k, calls, fallbacks, native)
        if profile:
            calls[start:] = timed(calls[start:], idx)
        idx += len(chain)
    start = len(calls)
    for j, v in prog.final_copies:
        shape = g.meta(v).shape
        gen.local = []
        src = gen.operand(v, shape)
        ctype = "uint8_t" if g.meta(v).dtype == torch.bool else "float"
        slot = gen.local_ref(f"(char*)buffers[{len(g.inputs) + j}]")
        dst = Operand(f"(({ctype}*)ops[{slot}])", g.meta(v).dtype, 0, contiguous_strides(shape))
        calls += gen.function(emit_copy(src, dst, shape, threads), gen.local)
        gen.local = None
    if profile:
        calls[start:] = timed(calls[start:], len(prog.kernels))
        bodies.append(PROFILE_PRELUDE.format(n=len(prog.kernels) + 1))
    for text, name in gen.functions.items():
        bodies.append(f"static int {name}(char* const* ops, const KilnRuntime* rt) {{")
        bodies.append(text)
        bodies.append("}")
    return CppProgram(
        assemble(gen, bodies, calls), gen.params, gen.externs, prog.arena_bytes, native, fallbacks
    )


def _generate_kernel(
    gen: _Gen,
    idx: int,
    k: Kernel,
    calls: list[str],
    fallbacks: list[tuple[int, str]],
    native: list[int],
) -> None:
    """Append the call(s) running kernel ``idx``: a generated function or extern(s)."""
    g, prog = gen.g, gen.prog
    if is_extern(g, k):
        for out in k.outputs:
            ext = conv_extern(g, k, prog, out) if is_conv(g, k) else None
            calls += extern_call(gen, ext or reference_extern(g, k, prog, out), out)
        return
    gen.local = []
    try:
        body = gen.kernel(k)
    except (Unsupported, ValueError) as e:
        gen.local = None
        fallbacks.append((idx, str(e)))
        for out in k.outputs:
            calls += extern_call(gen, reference_extern(g, k, prog, out), out)
        return
    native.append(idx)
    calls += gen.function(body, gen.local)
    gen.local = None


def _prod(shape: tuple[int, ...]) -> int:
    out = 1
    for s in shape:
        out *= s
    return out
