"""The one registry of compression methods: config type -> how it compresses a layer.

A method is a frozen config dataclass (``configs.py``) plus one ``Method`` record here: the
verb that applies it, which layers it can take, whether it needs calibration data, whether
its rows may be compressed stacked with other layers', and the function that turns a weight
into a compressed layer. Adding a method is a config class and one ``register`` call;
``compress_linear``, the verbs and the sensitivity analysis all ask ``method_of(config)``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

from torch import Tensor

from kiln.compress import obs
from kiln.compress import quantizers as qz
from kiln.compress.configs import (
    CompressionConfig,
    Int4WeightOnly,
    Int8WeightOnly,
    LowRank,
    SemiStructured24,
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

Verb = Literal["quantize_", "sparsify_", "lowrank_"]
# (weight (N, K) fp32, bias (N,) | None, config, input second moment (K, K) | None) -> layer
CompressFn = Callable[[Tensor, Tensor | None, Any, Moment | None], CompressedLinear]


class NoSaving(ValueError):
    """The config would not make this layer smaller (e.g. a low rank above break-even)."""


@dataclass(frozen=True)
class Method:
    """How one config type compresses a linear layer.

    verb               the public verb that applies it (``quantize_``, ...)
    compress           weight, bias, config, input moment -> the compressed layer
    needs_calibration  whether this config needs the layer's input second moment
    supports           whether it can take a layer with ``K`` inputs
    rows_independent   compressing stacked layers row-wise equals compressing each alone
    """

    verb: Verb
    compress: CompressFn
    needs_calibration: Callable[[Any], bool]
    supports: Callable[[Any, int], bool] = lambda config, k: True
    rows_independent: bool = True


METHODS: dict[type, Method] = {}


def register(config_type: type, method: Method) -> None:
    """Make ``config_type`` a compression method (once per type)."""
    if config_type in METHODS:
        raise ValueError(f"{config_type.__name__} is already registered")
    METHODS[config_type] = method


def method_of(config: CompressionConfig) -> Method:
    """The registered method of ``config``'s type; TypeError for anything else."""
    try:
        return METHODS[type(config)]
    except KeyError:
        raise TypeError(f"unknown compression config {config!r}") from None


def needs_calibration(config: CompressionConfig) -> bool:
    """Whether ``config`` needs the layer's calibration inputs (their second moment)."""
    return method_of(config).needs_calibration(config)


def effective_group_size(k: int, group_size: int) -> int:
    """The largest supported group size <= ``group_size`` that divides ``k``.

    SmolLM2's hidden size 576 = 4.5 x 128: its layers reading the hidden state cannot
    have groups of 128, so an INT4-g128 config quantizes them in groups of 64.
    """
    for g in sorted(INT4_GROUP_SIZES, reverse=True):
        if g <= group_size and k % g == 0:
            return g
    raise ValueError(f"input dim {k} is not a multiple of any INT4 group size {INT4_GROUP_SIZES}")


# ------------------------------------------------------------------ the methods
def _int8(w: Tensor, bias: Tensor | None, config: Int8WeightOnly, h: Moment | None) -> Int8Linear:
    q, scale = (
        obs.gptq_int8(w, h) if h is not None and config.method == "gptq" else qz.quantize_int8(w)
    )
    return Int8Linear(q, scale, bias)


def _int4(w: Tensor, bias: Tensor | None, config: Int4WeightOnly, h: Moment | None) -> Int4Linear:
    g, sym = effective_group_size(w.shape[1], config.group_size), config.symmetric
    if h is not None and config.method == "gptq":
        codes, scale, offset = obs.gptq_int4(w, h, g, sym)
    else:
        codes, scale, offset = qz.quantize_int4(w, g, sym)
    return Int4Linear(pack_int4(codes), scale, offset, g, bias)


def _sparse24(
    w: Tensor, bias: Tensor | None, config: SemiStructured24, h: Moment | None
) -> Sparse24Linear:
    if h is not None and config.method == "sparsegpt":
        sparse = obs.sparsegpt_24(w, h)
    else:
        sparse = w * qz.mask_24_magnitude(w)
    return Sparse24Linear.from_dense(sparse, bias)


def _lowrank(w: Tensor, bias: Tensor | None, config: LowRank, h: Moment | None) -> LowRankLinear:
    n, k = w.shape
    u, v = factorize(
        w, rank=config.rank, max_error=config.max_error, h=h if config.activation_aware else None
    )
    if u.shape[1] > breakeven_rank(n, k):
        raise NoSaving(
            f"rank {u.shape[1]} of a {n}x{k} layer saves no bytes "
            f"(break-even rank {breakeven_rank(n, k)})"
        )
    return LowRankLinear(u, v, bias)


register(Int8WeightOnly, Method("quantize_", _int8, lambda c: c.method == "gptq"))
register(
    Int4WeightOnly,
    Method(
        "quantize_",
        _int4,
        lambda c: c.method == "gptq",
        # smaller groups where group_size does not divide K
        supports=lambda c, k: k % min(INT4_GROUP_SIZES) == 0,
    ),
)
register(
    SemiStructured24,
    Method(
        "sparsify_",
        _sparse24,
        lambda c: c.method == "sparsegpt",
        supports=lambda c, k: k % 8 == 0,  # 2:4 groups, two groups' positions per byte
    ),
)
register(
    LowRank,
    Method("lowrank_", _lowrank, lambda c: c.activation_aware, rows_independent=False),
)
