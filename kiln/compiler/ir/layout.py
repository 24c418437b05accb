"""Strided views: how a layout-view value addresses the storage it aliases.

Every materialised value is stored contiguously. A ``view``/``permute``/``expand``/
``slice`` value owns no storage: it reads its root's storage through strides and an
offset. ``access`` computes those by replaying the view chain on a meta tensor, so the
rules are exactly PyTorch's (including when a reshape cannot be a view).
"""

from __future__ import annotations

from collections.abc import Container
from dataclasses import dataclass

import torch

from kiln.compiler.ir.graph import LAYOUT_VIEWS, Graph


@dataclass(frozen=True)
class Access:
    """Read ``root``'s contiguous storage as a tensor of ``shape`` with ``strides``
    (in elements) starting at element ``offset``."""

    root: str
    shape: tuple[int, ...]
    strides: tuple[int, ...]
    offset: int

    def broadcast_to(self, shape: tuple[int, ...]) -> Access:
        """The same data seen with numpy broadcasting to ``shape`` (stride 0 on new dims)."""
        if self.shape == shape:
            return self
        pad = len(shape) - len(self.shape)
        if pad < 0:
            raise ValueError(f"cannot broadcast {self.shape} to {shape}")
        src_shape = (1,) * pad + self.shape
        src_strides = (0,) * pad + self.strides
        strides = []
        for s, d, st in zip(src_shape, shape, src_strides):
            if s == d:
                strides.append(st if d != 1 else 0)
            elif s == 1:
                strides.append(0)
            else:
                raise ValueError(f"cannot broadcast {self.shape} to {shape}")
        return Access(self.root, shape, tuple(strides), self.offset)


def contiguous_strides(shape: tuple[int, ...]) -> tuple[int, ...]:
    strides, acc = [], 1
    for s in reversed(shape):
        strides.append(acc)
        acc *= max(s, 1)
    return tuple(reversed(strides))


def is_view(graph: Graph, value: str, stored: Container[str] = ()) -> bool:
    """True if ``value`` is a layout view without storage of its own (``stored``
    lists views that were materialised anyway)."""
    if value in stored:
        return False
    p = graph.producer(value)
    return p is not None and p.op in LAYOUT_VIEWS


def storage_root(graph: Graph, value: str, stored: Container[str] = ()) -> str:
    """The non-view value whose storage ``value`` aliases (``value`` itself if not a view)."""
    while is_view(graph, value, stored):
        p = graph.producer(value)
        assert p is not None
        value = p.inputs[0]
    return value


def access(graph: Graph, value: str, stored: Container[str] = ()) -> Access | str:
    """Strided access of ``value`` into its root's storage. When the view chain cannot
    be expressed with strides (a reshape of a non-contiguous view), returns the name
    of the value that must be materialised contiguously first."""
    chain = []
    v = value
    while is_view(graph, v, stored):
        p = graph.producer(v)
        assert p is not None
        chain.append(p)
        v = p.inputs[0]
    root_shape = graph.meta(v).shape
    t = torch.empty(root_shape, device="meta")
    for n in reversed(chain):
        a = n.attrs
        if n.op == "view":
            try:
                t = t.view(a["shape"])
            except RuntimeError:
                return n.inputs[0]
        elif n.op == "permute":
            t = t.permute(a["dims"])
        elif n.op == "expand":
            t = t.expand(a["shape"])
        else:  # slice
            t = t[(slice(None),) * a["dim"] + (slice(a["start"], a["end"], a["step"]),)]
    return Access(v, tuple(t.shape), tuple(t.stride()), int(t.storage_offset()))
