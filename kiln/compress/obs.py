"""Error-compensating compression (GPTQ for quantization, SparseGPT for 2:4 sparsity).

Both minimise the layer's output error || (W - Q) X ||^2 over the calibration inputs X
one input column at a time, in the Optimal Brain Surgeon style: after column k is
rounded (or pruned), its error is spread over the columns not yet processed, weighted by
the inverse of H = X X^T / n. The Cholesky factor of H^-1 gives every update in one
pass; updates to later blocks are applied lazily, one matrix product per block.

What differs between methods is only how one column is rounded, so that is a small
``ColumnRounder`` object; the loop below is shared.
"""

from __future__ import annotations

import functools
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Protocol

import torch
from torch import Tensor

from kiln.compress import quantizers as qz

DAMP = 0.01  # fraction of mean(diag H) added to the diagonal
BLOCK = 128  # a multiple of every INT4 group size, so groups never straddle blocks


class ColumnRounder(Protocol):
    def start(self, k: int, upcoming: Tensor, hinv_diag: Tensor) -> None:
        """Called before column ``k`` is rounded. ``upcoming`` holds the current (already
        error-updated) weights of columns k.. to the end of the block (N, rest);
        ``hinv_diag`` the matching diagonal of the inverse-Hessian factor (rest,)."""

    def round(self, k: int, w: Tensor) -> Tensor:
        """The compressed value of column ``k``: (N,) -> (N,) (dequantized)."""


def dampened(h: Tensor, damp: float) -> Tensor:
    """H + damp * mean(diag H) I in fp64, with dead inputs (zero diagonal) set to 1."""
    h = h.double().clone()
    dead = torch.diag(h) == 0
    h[dead, dead] = 1.0
    return h + torch.eye(h.shape[0], dtype=h.dtype) * damp * torch.diag(h).mean()


def inverse_hessian_factor(h: Tensor, damp: float = DAMP) -> Tensor:
    """Upper Cholesky factor of the dampened H^-1: (K, K) -> (K, K) fp32.

    Dampening keeps the factorisation stable when H is near-singular (few calibration
    tokens, correlated inputs); retried with 10x more dampening if it still fails.
    """
    for attempt in range(4):
        chol, info = torch.linalg.cholesky_ex(dampened(h, damp * 10**attempt))
        if int(info) == 0:
            hinv = torch.cholesky_inverse(chol)
            return torch.linalg.cholesky(hinv, upper=True).float()
    raise ValueError("input second moment is not positive definite even after dampening")


class InputMoment:
    """H = mean x x^T of a layer's inputs plus its factorisations, each computed once
    and shared by every method compressing layers that read those inputs."""

    def __init__(self, h: Tensor) -> None:
        self.h = h  # (K, K)

    @functools.cached_property
    def hinv_factor(self) -> Tensor:
        """Upper Cholesky factor of the dampened H^-1 (GPTQ / SparseGPT)."""
        return inverse_hessian_factor(self.h)

    @functools.cached_property
    def cholesky(self) -> Tensor:
        """Lower Cholesky factor L of the dampened H, H ~ L L^T (fp64; low rank)."""
        return torch.linalg.cholesky(dampened(self.h, DAMP))


Moment = Tensor | InputMoment


def as_moment(h: Moment) -> InputMoment:
    return h if isinstance(h, InputMoment) else InputMoment(h)


@contextmanager
def _one_thread() -> Iterator[None]:
    """The column loop is thousands of small ops; a second thread only adds contention
    (measured 4x slower with 2 threads on a busy 2-core machine). Restored on exit."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def obs_compress(w: Tensor, h: Moment, rounder: ColumnRounder) -> Tensor:
    """Compress (N, K) weights column by column with error feedback; returns (N, K) fp32.

    ``h`` is the inputs' second moment (K, K). Inputs that never fire (zero diagonal)
    get zero weight, as they cannot affect the output. Rows are independent given H, so
    layers reading the same input may be stacked along N and compressed in one pass.
    """
    moment = as_moment(h)
    u = moment.hinv_factor  # (K, K) upper
    with _one_thread():
        return _column_loop(w, moment.h, u, rounder)


def _column_loop(w: Tensor, h: Tensor, u: Tensor, rounder: ColumnRounder) -> Tensor:
    w = w.detach().float().clone()
    n, k = w.shape
    dead = torch.diag(h) == 0
    w[:, dead] = 0.0
    out = torch.empty_like(w)
    for b0 in range(0, k, BLOCK):
        b1 = min(b0 + BLOCK, k)
        block = w[:, b0:b1].clone()  # (N, B)
        err = torch.empty_like(block)
        ub = u[b0:b1, b0:b1]
        diag = torch.diag(ub)
        for i in range(b1 - b0):
            rounder.start(b0 + i, block[:, i:], diag[i:])
            col = block[:, i]
            q = rounder.round(b0 + i, col)
            out[:, b0 + i] = q
            e = (col - q) / diag[i]
            block[:, i:] -= e[:, None] * ub[i, i:][None, :]
            err[:, i] = e
        w[:, b1:] -= err @ u[b0:b1, b1:]
    return out


class Int8Rounder:
    """Per-channel INT8 with the scale fixed from the original weights."""

    def __init__(self, w: Tensor) -> None:
        self.scale = qz.int8_scale(w)  # (N,)

    def start(self, k: int, upcoming: Tensor, hinv_diag: Tensor) -> None:
        pass

    def round(self, k: int, w: Tensor) -> Tensor:
        return qz.int8_round(w, self.scale).float() * self.scale


class Int4Rounder:
    """Group-wise INT4; each group's scale/offset come from its error-updated weights."""

    def __init__(self, n: int, k: int, group_size: int, symmetric: bool) -> None:
        self.g, self.symmetric = group_size, symmetric
        self.scale = torch.empty(n, k // group_size, dtype=torch.float16)
        self.offset = torch.empty_like(self.scale)

    def start(self, k: int, upcoming: Tensor, hinv_diag: Tensor) -> None:
        if k % self.g == 0:
            s, o = qz.int4_group_params(upcoming[:, : self.g], self.symmetric)
            self.scale[:, k // self.g], self.offset[:, k // self.g] = s, o

    def round(self, k: int, w: Tensor) -> Tensor:
        s, o = self.scale[:, k // self.g], self.offset[:, k // self.g]
        return qz.int4_round(w, s, o).float() * s.float() + o.float()


class Sparse24Rounder:
    """2:4 pruning: at each group of 4 columns, keep the 2 with the largest w^2 / d^2
    (the OBS saliency: the output error that removing the weight would cause)."""

    def __init__(self, n: int, k: int) -> None:
        self.keep = torch.zeros(n, k, dtype=torch.bool)

    def start(self, k: int, upcoming: Tensor, hinv_diag: Tensor) -> None:
        if k % 4 == 0:
            saliency = upcoming[:, :4] ** 2 / hinv_diag[None, :4] ** 2  # (N, 4)
            self.keep[:, k : k + 4] = qz.mask_24_from_scores(saliency)

    def round(self, k: int, w: Tensor) -> Tensor:
        return w * self.keep[:, k]


def gptq_int8(w: Tensor, h: Moment) -> tuple[Tensor, Tensor]:
    """GPTQ INT8: (N, K) weights, (K, K) H -> (qweight int8, scale fp32)."""
    rounder = Int8Rounder(w)
    deq = obs_compress(w, h, rounder)
    return qz.int8_round(deq, rounder.scale), rounder.scale


def gptq_int4(
    w: Tensor, h: Moment, group_size: int, symmetric: bool
) -> tuple[Tensor, Tensor, Tensor]:
    """GPTQ INT4: -> (codes uint8 (N, K), scale fp16 (N, G), offset fp16 (N, G))."""
    n, k = w.shape
    qz.check_int4_shape(k, group_size)
    rounder = Int4Rounder(n, k, group_size, symmetric)
    deq = obs_compress(w, h, rounder)
    g = group_size
    q = qz.int4_round(
        deq.reshape(n, k // g, g), rounder.scale[..., None], rounder.offset[..., None]
    )
    return q.reshape(n, k), rounder.scale, rounder.offset


def sparsegpt_24(w: Tensor, h: Moment) -> Tensor:
    """SparseGPT 2:4: -> (N, K) fp32 weights with exactly 2 zeros in every 4 inputs."""
    n, k = w.shape
    if k % 4:
        raise ValueError(f"2:4 sparsity needs an input dim divisible by 4, got {k}")
    rounder = Sparse24Rounder(n, k)
    return obs_compress(w, h, rounder) * rounder.keep
