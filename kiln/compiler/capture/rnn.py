"""LSTM and GRU layers kept whole through capture, so the C++ backend can run each as one
kernel (``codegen/cpu/rnn.py``) instead of hundreds of per-step primitives.

``torch.export`` keeps ``nn.LSTM``/``nn.GRU`` as one ``aten.lstm.input``/``aten.gru.input``
node; ATen's decomposition then unrolls every layer and time step. Here that decomposition
is replaced for the plain case (eval mode, unidirectional, no projection): each layer
becomes one ``kiln::lstm_layer`` / ``kiln::gru_layer`` call, which lowers to the IR's
``rnn`` primitive. Anything else (bidirectional, ``proj_size``, training) keeps ATen's
unrolled decomposition.

The layer ops compute with PyTorch itself (``torch.lstm``/``torch.gru`` on one layer,
``ir.semantics.rnn_reference``): that is their eager meaning, the reference the compiled
kernel is verified against. An LSTM
layer's final cell state is a second call with ``final_cell=True``, left out by dead-code
elimination when the model does not use it (it rarely does).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor, fx

from kiln.compiler.capture.builder import Builder, pos, register
from kiln.compiler.ir.semantics import rnn_reference

aten = torch.ops.aten


@torch.library.custom_op("kiln::lstm_layer", mutates_args=())
def lstm_layer(
    x: Tensor,
    h0: Tensor,
    c0: Tensor,
    w_ih: Tensor,
    w_hh: Tensor,
    b_ih: Tensor,
    b_hh: Tensor,
    batch_first: bool,
    final_cell: bool,
) -> Tensor:
    """One LSTM layer: x (B, T, I) (batch_first) or (T, B, I), h0/c0 (B, H), w_ih (4H, I),
    w_hh (4H, H), biases (4H,) (gates i, f, g, o) -> the outputs (B, T, H) / (T, B, H), or
    with ``final_cell`` the last cell state (B, H)."""
    return rnn_reference("lstm", (x, h0, c0, w_ih, w_hh, b_ih, b_hh), batch_first, final_cell)


@lstm_layer.register_fake
def _lstm_layer_fake(
    x: Tensor,
    h0: Tensor,
    c0: Tensor,
    w_ih: Tensor,
    w_hh: Tensor,
    b_ih: Tensor,
    b_hh: Tensor,
    batch_first: bool,
    final_cell: bool,
) -> Tensor:
    if final_cell:
        return h0.new_empty(h0.shape)
    return x.new_empty((*x.shape[:2], w_hh.shape[1]))


@torch.library.custom_op("kiln::gru_layer", mutates_args=())
def gru_layer(
    x: Tensor,
    h0: Tensor,
    w_ih: Tensor,
    w_hh: Tensor,
    b_ih: Tensor,
    b_hh: Tensor,
    batch_first: bool,
) -> Tensor:
    """One GRU layer: x as for ``lstm_layer``, h0 (B, H), w_ih (3H, I), w_hh (3H, H), biases
    (3H,) (gates r, z, n) -> the outputs (B, T, H) / (T, B, H)."""
    return rnn_reference("gru", (x, h0, w_ih, w_hh, b_ih, b_hh), batch_first)


@gru_layer.register_fake
def _gru_layer_fake(
    x: Tensor, h0: Tensor, w_ih: Tensor, w_hh: Tensor, b_ih: Tensor, b_hh: Tensor, batch_first: bool
) -> Tensor:
    return x.new_empty((*x.shape[:2], w_hh.shape[1]))


Decomposition = Callable[..., Any]


def _layers(
    params: Sequence[Tensor], has_biases: bool, num_layers: int, gates: int
) -> list[tuple[Tensor, Tensor, Tensor, Tensor]] | None:
    """(w_ih, w_hh, b_ih, b_hh) per layer, zero biases when there are none; None when the
    parameters are not those of a plain stack (a projection adds a weight per layer)."""
    per = 4 if has_biases else 2
    if len(params) != per * num_layers:
        return None
    out = []
    for layer in range(num_layers):
        w_ih, w_hh = params[per * layer], params[per * layer + 1]
        if w_hh.shape[0] != gates * w_hh.shape[1]:
            return None
        if has_biases:
            b_ih, b_hh = params[per * layer + 2], params[per * layer + 3]
        else:
            b_ih = b_hh = w_hh.new_zeros(w_hh.shape[0])
        out.append((w_ih, w_hh, b_ih, b_hh))
    return out


def _last_step(y: Tensor, batch_first: bool) -> Tensor:
    return y[:, -1] if batch_first else y[-1]  # (B, H)


def lstm_decomposition(default: Decomposition) -> Decomposition:
    """``aten.lstm.input`` as one ``kiln::lstm_layer`` per layer; ``default`` otherwise."""

    def decompose(
        x: Tensor,
        hx: Sequence[Tensor],
        params: Sequence[Tensor],
        has_biases: bool,
        num_layers: int,
        dropout: float,
        train: bool,
        bidirectional: bool,
        batch_first: bool,
    ) -> tuple[Tensor, Tensor, Tensor]:
        layers = _layers(params, has_biases, num_layers, 4)
        if train or bidirectional or layers is None or x.dim() != 3:
            return default(
                x, hx, params, has_biases, num_layers, dropout, train, bidirectional, batch_first
            )  # fmt: skip
        h0, c0 = hx  # (layers, B, H) each
        hs, cs = [], []
        for i, (w_ih, w_hh, b_ih, b_hh) in enumerate(layers):
            args = (x, h0[i], c0[i], w_ih, w_hh, b_ih, b_hh, batch_first)
            x = torch.ops.kiln.lstm_layer(*args, False)
            cs.append(torch.ops.kiln.lstm_layer(*args, True))
            hs.append(_last_step(x, batch_first))
        return x, torch.stack(hs), torch.stack(cs)

    return decompose


def gru_decomposition(default: Decomposition) -> Decomposition:
    """``aten.gru.input`` as one ``kiln::gru_layer`` per layer; ``default`` otherwise."""

    def decompose(
        x: Tensor,
        hx: Tensor,
        params: Sequence[Tensor],
        has_biases: bool,
        num_layers: int,
        dropout: float,
        train: bool,
        bidirectional: bool,
        batch_first: bool,
    ) -> tuple[Tensor, Tensor]:
        layers = _layers(params, has_biases, num_layers, 3)
        if train or bidirectional or layers is None or x.dim() != 3:
            return default(
                x, hx, params, has_biases, num_layers, dropout, train, bidirectional, batch_first
            )  # fmt: skip
        hs = []
        for i, (w_ih, w_hh, b_ih, b_hh) in enumerate(layers):
            x = torch.ops.kiln.gru_layer(x, hx[i], w_ih, w_hh, b_ih, b_hh, batch_first)
            hs.append(_last_step(x, batch_first))
        return x, torch.stack(hs)

    return decompose


def rnn_decompositions(table: dict[Any, Any]) -> dict[Any, Any]:
    """``table`` with the LSTM and GRU entries replaced by the per-layer ops above (each
    falling back to the entry it replaces)."""
    out = dict(table)
    for op, make in ((aten.lstm.input, lstm_decomposition), (aten.gru.input, gru_decomposition)):
        if op in table:
            out[op] = make(table[op])
    return out


@register(torch.ops.kiln.lstm_layer.default)
def _lower_lstm(b: Builder, node: fx.Node) -> str:
    x, h0, c0, w_ih, w_hh, b_ih, b_hh, batch_first, final_cell = pos(node)
    ins = [b.tensor(v) for v in (x, h0, c0, w_ih, w_hh, b_ih, b_hh)]
    return b.emit(
        "rnn", ins, cell="lstm", batch_first=bool(batch_first), final_cell=bool(final_cell)
    )


@register(torch.ops.kiln.gru_layer.default)
def _lower_gru(b: Builder, node: fx.Node) -> str:
    x, h0, w_ih, w_hh, b_ih, b_hh, batch_first = pos(node)
    ins = [b.tensor(v) for v in (x, h0, w_ih, w_hh, b_ih, b_hh)]
    return b.emit("rnn", ins, cell="gru", batch_first=bool(batch_first), final_cell=False)
