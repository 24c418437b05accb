"""GGUF block bytes for tests: random valid blocks of any type kiln decodes, and a simple
quantizer for the K-quants (the gguf package's ``quantize`` covers only Q4_0 .. Q8_0),
and the reference of the 8-bit-activation kernels (``q8_reference``: x quantized to 8-bit
blocks from their definition, multiplied in float64).

Both write the layouts of ``kiln/kernels/cpu/gguf_blocks.h`` from scratch (numpy); the
gguf package's ``dequantize`` reads them back in the tests, so a layout written wrong here
would fail there rather than agree with kiln's decoder by construction.
"""

from __future__ import annotations

import gguf
import numpy as np

Q = gguf.GGMLQuantizationType
# byte offsets of each type's fp16 scale fields (d, and m / dmin where there is one)
_HALVES = {Q.Q4_0: (0,), Q.Q4_1: (0, 2), Q.Q5_0: (0,), Q.Q5_1: (0, 2), Q.Q8_0: (0,),
           Q.Q4_K: (0, 2), Q.Q5_K: (0, 2), Q.Q6_K: (208,)}  # fmt: skip


def random_blocks(kind: Q, n: int, k: int, seed: int = 0, scale: float = 0.02) -> np.ndarray:
    """(N, K / elems * bytes) uint8: random quants and scale bytes, every fp16 field a sane
    value in [scale / 20, scale] (random bytes there could be inf or nan)."""
    elems, nbytes = gguf.GGML_QUANT_SIZES[kind]
    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 256, size=(n * (k // elems), nbytes), dtype=np.uint8)
    for at in _HALVES[kind]:
        halves = rng.uniform(scale / 20, scale, size=(raw.shape[0], 1)).astype(np.float16)
        raw[:, at : at + 2] = halves.view(np.uint8)
    return raw.reshape(n, -1)


def _half(x: np.ndarray) -> np.ndarray:
    """(B,) float -> (B, 2) the fp16 bytes."""
    return x.astype(np.float16).reshape(-1, 1).view(np.uint8)


def _codes(w: np.ndarray, step: np.ndarray, offset: np.ndarray, top: int) -> np.ndarray:
    """round((w + offset) / step) in [0, top]; a zero step gives 0."""
    with np.errstate(divide="ignore", invalid="ignore"):
        q = np.where(step > 0, np.rint((w + offset) / step), 0)
    return np.clip(q, 0, top).astype(np.uint8)


def _pack_scales(sc: np.ndarray, mn: np.ndarray) -> np.ndarray:
    """(B, 8) 6-bit scales and mins -> (B, 12) bytes: j < 4 in the low 6 bits of bytes j and
    j + 4; j >= 4: low 4 bits in byte j + 4 (scale low, min high nibble), top 2 bits in the
    top bits of bytes j - 4 (scale) and j (min)."""
    out = np.zeros((sc.shape[0], 12), np.uint8)
    out[:, 0:4] = sc[:, :4] | ((sc[:, 4:] >> 4) << 6)
    out[:, 4:8] = mn[:, :4] | ((mn[:, 4:] >> 4) << 6)
    out[:, 8:12] = (sc[:, 4:] & 15) | ((mn[:, 4:] & 15) << 4)
    return out


def _k_affine(w: np.ndarray, top: int) -> tuple[np.ndarray, ...]:
    """Q4_K / Q5_K: w (B, 256) -> d, dmin (B,), 6-bit sc, mn (B, 8), codes (B, 8, 32) with
    w ~ d sc q - dmin mn per sub-block of 32 (q in [0, top])."""
    sub = w.reshape(-1, 8, 32)
    lo = np.minimum(sub.min(-1), 0.0)  # (B, 8), <= 0
    step = (sub.max(-1) - lo) / top
    d = (step.max(-1) / 63).astype(np.float16).astype(np.float32)  # (B,)
    dmin = (-lo.min(-1) / 63).astype(np.float16).astype(np.float32)
    with np.errstate(divide="ignore", invalid="ignore"):
        sc = np.clip(np.where(d[:, None] > 0, np.rint(step / d[:, None]), 0), 0, 63)
        mn = np.clip(np.where(dmin[:, None] > 0, np.rint(-lo / dmin[:, None]), 0), 0, 63)
    sc, mn = sc.astype(np.uint8), mn.astype(np.uint8)
    q = _codes(sub, (d[:, None] * sc)[..., None], (dmin[:, None] * mn)[..., None], top)
    return d, dmin, sc, mn, q


def _nibble_runs(q: np.ndarray) -> np.ndarray:
    """(B, 8, 32) codes -> (B, 128): run c = sub-block 2c (low nibble) | 2c + 1 (high)."""
    q = q & 15
    return (q[:, 0::2] | (q[:, 1::2] << 4)).reshape(q.shape[0], 128)


def quantize_k(w: np.ndarray, kind: Q) -> np.ndarray:
    """float (N, K) with K % 256 == 0 -> Q4_K, Q5_K or Q6_K blocks (N, K / 256 * bytes).
    Plain min / max scales (not llama.cpp's search): values within a step of w."""
    n = w.shape[0]
    sup = w.astype(np.float32).reshape(-1, 256)  # super-blocks
    if kind == Q.Q6_K:
        sub = sup.reshape(-1, 16, 16)
        step = np.abs(sub).max(-1) / 31  # (B, 16): q - 32 in [-32, 31]
        d = (step.max(-1) / 127).astype(np.float16).astype(np.float32)
        with np.errstate(divide="ignore", invalid="ignore"):
            sc = np.clip(np.where(d[:, None] > 0, np.rint(step / d[:, None]), 0), 0, 127)
        q = _codes(sub, (d[:, None] * sc)[..., None], 32 * (d[:, None] * sc)[..., None], 63)
        q = q.reshape(-1, 2, 4, 32)  # (B, half, quarter, l)
        ql = (q[:, :, 0:2] & 15) | ((q[:, :, 2:4] & 15) << 4)  # quarters 0, 1 low; 2, 3 high
        qh = (q >> 4).astype(np.uint8)
        qh = qh[:, :, 0] | (qh[:, :, 1] << 2) | (qh[:, :, 2] << 4) | (qh[:, :, 3] << 6)
        parts = [ql.reshape(-1, 128), qh.reshape(-1, 64), sc.astype(np.int8).view(np.uint8),
                 _half(d)]  # fmt: skip
    else:
        top = 15 if kind == Q.Q4_K else 31
        d, dmin, sc, mn, q = _k_affine(sup, top)
        parts = [_half(d), _half(dmin), _pack_scales(sc, mn)]
        if kind == Q.Q5_K:  # bit s of qh[l]: bit 4 of sub-block s's element l
            high = (q >> 4) & 1  # (B, 8, 32)
            parts.append(
                (high << np.arange(8, dtype=np.uint8)[None, :, None]).sum(1, dtype=np.uint8)
            )
        parts.append(_nibble_runs(q))
    return np.concatenate(parts, axis=1).reshape(n, -1)


def quantize(w: np.ndarray, kind: Q) -> np.ndarray:
    """float (N, K) -> blocks of ``kind``: the gguf package's quantizer where it has one,
    ``quantize_k`` for the K-quants."""
    if kind in (Q.Q4_K, Q.Q5_K, Q.Q6_K):
        return quantize_k(w, kind)
    return gguf.quants.quantize(np.ascontiguousarray(w, dtype=np.float32), kind)


def q8_activations(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The activations' 8-bit blocks, written from their definition: per block of 32,
    d = max|x| / 127 and q = round_half_even(x * (1 / d)) in float32 (d = 0: q = 0).
    x (M, K) float32 -> q int8 (M, K), d float32 (M, K / 32)."""
    blocks = x.reshape(x.shape[0], -1, 32)
    d = np.abs(blocks).max(axis=-1) / np.float32(127)
    inv = np.divide(np.float32(1), d, out=np.zeros_like(d), where=d > 0)
    q = np.rint(blocks * inv[..., None]).astype(np.int8)
    return q.reshape(x.shape), d


def q8_reference(x: np.ndarray, w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(y, bound): x quantized by ``q8_activations``, multiplied with the weights' values w (N,
    K) in float64 (exact for these integers and fp16-derived values up to float64
    rounding); bound: the most the exact product x @ w.T can differ from it, sum |w| d / 2
    per output (each activation moved by at most half its block's step)."""
    q, d = q8_activations(x)
    dx = np.repeat(d.astype(np.float64), 32, axis=1)  # (M, K)
    y = (q.astype(np.float64) * dx) @ w.astype(np.float64).T
    return y, (dx / 2) @ np.abs(w.astype(np.float64)).T
