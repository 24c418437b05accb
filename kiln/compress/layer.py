"""One linear layer + one config -> its compressed replacement.

This is the single place where a config meets an algorithm; the model-level verbs,
the sensitivity analysis and the planner all go through ``compress_linear``.
"""

from __future__ import annotations

from torch import Tensor, nn

from kiln.compress import obs
from kiln.compress import quantizers as qz
from kiln.compress.configs import (
    CompressionConfig,
    Int4WeightOnly,
    Int8WeightOnly,
    LowRank,
    SemiStructured24,
    needs_calibration,
)
from kiln.compress.lowrank import breakeven_rank, factorize
from kiln.compress.modules import (
    CompressedLinear,
    Int4Linear,
    Int8Linear,
    LowRankLinear,
    Sparse24Linear,
)
from kiln.compress.obs import Moment
from kiln.kernels.formats import INT4_GROUP_SIZES, pack_int4


class NoSaving(ValueError):
    """The config would not make this layer smaller (e.g. a low rank above break-even)."""


def compress_linear(
    layer: nn.Linear, config: CompressionConfig, h: Moment | None = None
) -> CompressedLinear:
    """Compress ``layer``; ``h`` is its inputs' second moment (K, K), needed by the
    calibration-aware methods (GPTQ, SparseGPT, activation-aware low rank)."""
    if needs_calibration(config) and h is None:
        raise ValueError(f"{config.name} needs calibration data (the layer's input statistics)")
    w = layer.weight.detach().float().cpu()  # (N, K)
    bias = None if layer.bias is None else layer.bias.detach().float().cpu()
    out = _compress_weight(w, bias, config, h)
    return out.to(layer.weight.device)


def _compress_weight(
    w: Tensor, bias: Tensor | None, config: CompressionConfig, h: Moment | None
) -> CompressedLinear:
    n, k = w.shape
    if isinstance(config, Int8WeightOnly):
        if config.method == "gptq":
            assert h is not None
            q, scale = obs.gptq_int8(w, h)
        else:
            q, scale = qz.quantize_int8(w)
        return Int8Linear(q, scale, bias)
    if isinstance(config, Int4WeightOnly):
        g, sym = effective_group_size(k, config.group_size), config.symmetric
        if config.method == "gptq":
            assert h is not None
            codes, scale, offset = obs.gptq_int4(w, h, g, sym)
        else:
            codes, scale, offset = qz.quantize_int4(w, g, sym)
        return Int4Linear(pack_int4(codes), scale, offset, g, bias)
    if isinstance(config, SemiStructured24):
        if config.method == "sparsegpt":
            assert h is not None
            sparse = obs.sparsegpt_24(w, h)
        else:
            sparse = w * qz.mask_24_magnitude(w)
        return Sparse24Linear.from_dense(sparse, bias)
    if isinstance(config, LowRank):
        u, v = factorize(
            w,
            rank=config.rank,
            max_error=config.max_error,
            h=h if config.activation_aware else None,
        )
        if u.shape[1] > breakeven_rank(n, k):
            raise NoSaving(
                f"rank {u.shape[1]} of a {n}x{k} layer saves no bytes "
                f"(break-even rank {breakeven_rank(n, k)})"
            )
        return LowRankLinear(u, v, bias)
    raise TypeError(f"unknown compression config {config!r}")


def effective_group_size(k: int, group_size: int) -> int:
    """The largest supported group size <= ``group_size`` that divides ``k``.

    SmolLM2's hidden size 576 = 4.5 x 128: its layers reading the hidden state cannot
    have groups of 128, so an INT4-g128 config quantizes them in groups of 64.
    """
    for g in sorted(INT4_GROUP_SIZES, reverse=True):
        if g <= group_size and k % g == 0:
            return g
    raise ValueError(f"input dim {k} is not a multiple of any INT4 group size {INT4_GROUP_SIZES}")


def weight_error(layer: nn.Linear, compressed: CompressedLinear) -> Tensor:
    """Delta W = W_compressed - W: (N, K) fp32 on the CPU."""
    return compressed.dense_weight().cpu() - layer.weight.detach().float().cpu()
