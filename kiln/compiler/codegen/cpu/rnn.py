"""The ``rnn`` kernel: one LSTM or GRU layer (``capture/rnn.py``) as one call of
``kr::rnn_layer`` (``kiln_rnn.h``): the input projections of all time steps in one GEMM,
then the whole time loop in one parallel region, each step's recurrent GEMM and gate
arithmetic fused.

The weights are prepared at compile time: W_ih^T in the GEMM's column panels, W_hh^T in
gate blocks padded to whole panels (so a thread's units are the same panels of every
gate), the biases folded: an LSTM's two biases summed; a GRU's r and z biases summed,
its b_hn kept apart (it sits inside r * (W_hn h + b_hn)).
"""

from __future__ import annotations

import torch

from kiln.compiler.codegen.cpu.dwconv import KernelState
from kiln.compiler.codegen.cpu.emit import Operand
from kiln.compiler.codegen.cpu.pack import pack_b
from kiln.compiler.ir.graph import Node
from kiln.compiler.ir.layout import contiguous_strides

SCRATCH_SLOT = 5  # kgen::scratch slot of the projections and the step's state


def blocked_gates(w_hh: torch.Tensor, gates: int, nr: int) -> torch.Tensor:
    """W_hh (G*H, H) -> W_hh^T (H, G * Hp) with gate q of unit j in column q * Hp + j
    (Hp = H rounded up to whole nr-column panels, the padding zero), packed into panels."""
    gh, h = w_hh.shape
    hp = -(-h // nr) * nr
    cols = torch.zeros(h, gates * hp, dtype=torch.float32)
    wt = w_hh.float().t()  # (H, G*H): column q * H + j is gate q of unit j
    for q in range(gates):
        cols[:, q * hp : q * hp + h] = wt[:, q * h : (q + 1) * h]
    return pack_b(cols).reshape(-1)


def folded_biases(b_ih: torch.Tensor, b_hh: torch.Tensor, gates: int) -> torch.Tensor:
    """The projections' bias (G*H), then for a GRU b_hn (H)."""
    b_ih, b_hh = b_ih.float(), b_hh.float()
    if gates == 4:
        return (b_ih + b_hh).contiguous()
    h = b_ih.numel() // 3
    proj = b_ih + torch.cat([b_hh[: 2 * h], torch.zeros(h)])
    return torch.cat([proj, b_hh[2 * h :]]).contiguous()


def _contiguous(op: Operand, shape: tuple[int, ...], what: str) -> None:
    if op.strides != contiguous_strides(shape) and any(s > 1 for s in shape):
        raise ValueError(f"rnn: {what} is not contiguous")


def rnn_kernel(gen: KernelState, node: Node) -> list[str]:
    """C++ lines of a kernel holding one ``rnn`` node; ValueError when it cannot run
    natively (it then runs as its PyTorch reference)."""
    g, a = gen.g, node.attrs
    lstm = a["cell"] == "lstm"
    gates = 4 if lstm else 3
    x, h0, *rest = node.inputs
    c0 = rest.pop(0) if lstm else None
    w_ih, w_hh, b_ih, b_hh = rest
    if not all(g.is_constant(v) for v in (w_ih, w_hh, b_ih, b_hh)):
        raise ValueError("rnn: weights are not constants")
    if any(g.meta(v).dtype != torch.float32 for v in node.inputs):
        raise ValueError("rnn: not float32")
    x_shape = g.meta(x).shape  # (B, T, I) or (T, B, I)
    batch_first = bool(a["batch_first"])
    b, t = (x_shape[0], x_shape[1]) if batch_first else (x_shape[1], x_shape[0])
    i, h = x_shape[2], g.meta(w_hh).shape[1]
    xo = gen.operand(x, x_shape)
    _contiguous(xo, x_shape, "the input")
    out = gen.out_operand(node.output)
    _contiguous(out, g.meta(node.output).shape, "the output")
    nr = gen.nr
    wih = gen.prepared_param(
        ("rnn_ih", w_ih, nr), lambda: pack_b(g.constants[w_ih].float().t().contiguous()).reshape(-1)
    )
    whh = gen.prepared_param(
        ("rnn_hh", w_hh, gates, nr), lambda: blocked_gates(g.constants[w_hh], gates, nr)
    )
    bias = gen.prepared_param(
        ("rnn_bias", b_ih, b_hh, gates),
        lambda: folded_biases(g.constants[b_ih], g.constants[b_hh], gates),
    )

    def state(v: str | None) -> tuple[str, int, int]:
        if v is None:
            return "nullptr", 0, 0
        op = gen.operand(v, (b, h))
        return f"({op.ptr} + {op.offset})", op.strides[0], op.strides[1]

    hp, hsb, hsh = state(h0)
    cp, csb, csh = state(c0)
    final_cell = lstm and bool(a.get("final_cell", False))
    dst = f"({out.ptr} + {out.offset})"
    return [
        "{",
        f"  float* scr = kgen::scratch({SCRATCH_SLOT}, kr::scratch_floats({b}, {t}, {h}, {gates}));",
        f"  const kr::RnnLayer L{{{b}, {t}, {i}, {h}, {gates}, {str(batch_first).lower()},",
        f"      ({xo.ptr} + {xo.offset}), {hp}, {hsb}, {hsh}, {cp}, {csb}, {csh},",
        f"      {wih}, {whh}, {bias}, {'nullptr' if final_cell else dst}, {dst if final_cell else 'nullptr'}}};",
        "  kr::rnn_layer(rt, L, scr);",
        "}",
    ]
