"""The entry point of a generated program: the pointer table, the call sequence,
extern calls back into PyTorch/oneDNN, optional per-kernel timing, and the merging
of depthwise conv chains into one channels-last extern.
"""

from __future__ import annotations

from typing import Protocol

import torch

from kiln.compiler.codegen.cpu.emit import PRELUDE
from kiln.compiler.codegen.cpu.extern import Extern
from kiln.compiler.fusion.program import Kernel, Program, Slot, is_extern
from kiln.compiler.ir.graph import Graph, Node


class ProgramState(Protocol):
    """What the entry point needs of the program being generated (``codegen._Gen``)."""

    prog: Program
    g: Graph
    slot: dict[str, int]  # stored value -> pointer table index
    params: list[torch.Tensor]
    externs: list[Extern]

    def ptr(self, root: str) -> str: ...


PROFILE_PRELUDE = """
#include <chrono>
static double kiln_prof[{n}];
extern "C" double* kiln_profile() {{ return kiln_prof; }}
static inline double kiln_now() {{
  return std::chrono::duration<double, std::micro>(
      std::chrono::steady_clock::now().time_since_epoch()).count();
}}
"""


def timed(lines: list[str], slot: int) -> list[str]:
    if not lines:
        return lines
    return [
        "  { const double t0_ = kiln_now();",
        *lines,
        f"  kiln_prof[{slot}] += kiln_now() - t0_; }}",
    ]


def conv_chain(prog: Program, first: int, consumers: dict[str, list[Node]]) -> list[Kernel]:
    """Kernels first, first+1, ... that are conv externs each reading (unviewed) only
    the previous one's output, which nothing else reads."""
    g = prog.graph
    chain: list[Kernel] = []
    for k in prog.kernels[first:]:
        if not (is_extern(g, k) and is_conv(g, k)) or len(k.outputs) != 1:
            break
        if any(g.node(n).attrs.get("channels_last") for n in k.nodes):
            break  # already channels-last: each conv runs as its own NHWC call
        if chain:
            prev = chain[-1].outputs[0]
            conv = next(g.node(n) for n in k.nodes if g.node(n).op == "conv")
            sole_reader = [n.name for n in consumers[prev]] == [conv.name]
            if conv.inputs[0] != prev or not sole_reader or prev in g.outputs:
                break
        chain.append(k)
    # NHWC pays for grouped/depthwise convolutions; dense ones run faster in oneDNN's
    # blocked layout with reordered weights (measured: ResNet-18 slows down in NHWC).
    grouped = any(
        g.node(n).op == "conv" and g.node(n).attrs["groups"] > 1 for k in chain for n in k.nodes
    )
    return chain if grouped else chain[:1]


def is_conv(g: Graph, k: Kernel) -> bool:
    return any(g.node(n).op == "conv" for n in k.nodes)


def extern_call(gen: ProgramState, ext: Extern, value: str) -> list[str]:
    i = len(gen.externs)
    gen.externs.append(ext)
    ins = ", ".join(f"(void*){gen.ptr(r)}" for r in ext.roots)
    out = gen.slot.setdefault(value, len(gen.slot))
    lines = [f"  {{ void* ins[] = {{{ins or 'nullptr'}}};"]
    lines.append(f"    char* r = (char*)rt->extern_call(rt->ctx, {i}, ins);")
    lines.append("    if (!r) return 1;")
    st = gen.prog.storage.get(value)
    if st is not None and st.slot != Slot.EXTERN:  # planned storage: copy the result in
        lines.append(f"    std::memcpy(P[{out}], r, {gen.g.meta(value).nbytes});")
    else:
        lines.append(f"    P[{out}] = r;")
    lines.append("  }")
    return lines


def assemble(gen: ProgramState, bodies: list[str], calls: list[str]) -> str:
    prog, g = gen.prog, gen.g
    n_in, n_out = len(g.inputs), len(g.outputs)
    # Native param buffers: constants referenced by kernels (packed weights already added).
    setup = []
    for v, idx in gen.slot.items():
        st = prog.storage.get(v)
        if st is None or st.slot == Slot.EXTERN:
            continue
        if st.slot == Slot.INPUT:
            setup.append(f"  P[{idx}] = (char*)buffers[{st.index}];")
        elif st.slot == Slot.OUTPUT:
            setup.append(f"  P[{idx}] = (char*)buffers[{n_in + st.index}];")
        elif st.slot == Slot.ARENA:
            setup.append(f"  P[{idx}] = arena + {st.offset};")
        else:  # PARAM
            setup.append(f"  P[{idx}] = (char*)PP[{len(gen.params)}];")
            gen.params.append(g.constants[v].contiguous())
    n_params = len(gen.params)
    head = [
        PRELUDE,
        *bodies,
        'extern "C" int kiln_entry(void* const* buffers, const KilnRuntime* rt) {',
        f"  char* P[{max(1, len(gen.slot))}] = {{}};",
        f"  void* const* PP = buffers + {n_in + n_out};",
        f"  char* arena = (char*)buffers[{n_in + n_out + n_params}];",
        "  (void)arena; (void)PP;",
        *setup,
        *calls,
        "  return 0;",
        "}",
    ]
    return "\n".join(head) + "\n"
