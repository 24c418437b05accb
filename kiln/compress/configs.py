"""Compression configs: one frozen, validated dataclass per method.

Each config names *what* to do to a linear layer; ``methods.py`` registers *how* (one
record per config type), and the verbs in ``kiln.compress`` (``quantize_``, ``sparsify_``,
``lowrank_``) apply it. A config also has a short
``name`` used in reports and in the per-layer plan (``"int4-g64"``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from kiln.kernels.formats import INT4_GROUP_SIZES

Method = Literal["rtn", "gptq"]
SparseMethod = Literal["magnitude", "sparsegpt"]


@dataclass(frozen=True)
class Int8WeightOnly:
    """INT8 weights, one fp32 scale per output channel, symmetric (activations stay fp32).

    ``method="gptq"`` compensates each column's rounding error on the columns not yet
    quantized, using the calibration inputs' second moment (needs calibration data).
    """

    method: Method = "rtn"

    def __post_init__(self) -> None:
        _check_method(self.method)

    @property
    def name(self) -> str:
        return "int8" + ("" if self.method == "rtn" else f"-{self.method}")


@dataclass(frozen=True)
class Int4WeightOnly:
    """INT4 weights in groups of ``group_size`` along the input dimension.

    Symmetric: q in [-8, 7] around zero, one fp16 scale per group. Asymmetric: q in
    [0, 15] between the group's minimum and maximum, fp16 scale and offset per group.
    Two 4-bit values share a byte. A layer whose input dim is not a multiple of
    ``group_size`` gets the largest smaller group size that divides it (576 -> 64).
    """

    group_size: int = 128
    symmetric: bool = True
    method: Method = "rtn"

    def __post_init__(self) -> None:
        if self.group_size not in INT4_GROUP_SIZES:
            raise ValueError(f"group_size must be one of {INT4_GROUP_SIZES}, got {self.group_size}")
        _check_method(self.method)

    @property
    def name(self) -> str:
        sym = "" if self.symmetric else "-asym"
        method = "" if self.method == "rtn" else f"-{self.method}"
        return f"int4-g{self.group_size}{sym}{method}"


@dataclass(frozen=True)
class SemiStructured24:
    """2:4 sparsity: in every group of 4 consecutive input weights, 2 are zero.

    ``magnitude`` keeps the 2 largest |w|; ``sparsegpt`` picks the pair whose removal
    costs least under the calibration inputs' second moment and updates the kept
    weights to compensate (needs calibration data).
    """

    method: SparseMethod = "magnitude"

    def __post_init__(self) -> None:
        if self.method not in ("magnitude", "sparsegpt"):
            raise ValueError(f"method must be 'magnitude' or 'sparsegpt', got {self.method!r}")

    @property
    def name(self) -> str:
        return "2:4" + ("" if self.method == "magnitude" else f"-{self.method}")


@dataclass(frozen=True)
class LowRank:
    """W (N, K) ~ U (N, r) @ V (r, K) by truncated SVD.

    Exactly one of ``rank`` (fixed) or ``max_error`` (the rank is the smallest whose
    relative Frobenius error is at most this) must be given. With ``activation_aware``
    the error is measured on the layer's outputs over the calibration inputs (the SVD of
    W S, where S S^T is the inputs' second moment) rather than on the weights.
    A factorisation that would not save bytes is refused at compression time.
    """

    rank: int | None = None
    max_error: float | None = None
    activation_aware: bool = False

    def __post_init__(self) -> None:
        if (self.rank is None) == (self.max_error is None):
            raise ValueError("LowRank needs exactly one of rank= or max_error=")
        if self.rank is not None and self.rank < 1:
            raise ValueError(f"rank must be >= 1, got {self.rank}")
        if self.max_error is not None and not 0.0 < self.max_error < 1.0:
            raise ValueError(f"max_error must be in (0, 1), got {self.max_error}")

    @property
    def name(self) -> str:
        what = f"r{self.rank}" if self.rank is not None else f"e{self.max_error:g}"
        return f"lowrank-{what}" + ("-aa" if self.activation_aware else "")


CompressionConfig = Int8WeightOnly | Int4WeightOnly | SemiStructured24 | LowRank


def _check_method(method: str) -> None:
    if method not in ("rtn", "gptq"):
        raise ValueError(f"method must be 'rtn' or 'gptq', got {method!r}")


def parse_config(name: str) -> CompressionConfig:
    """The config whose ``name`` is ``name`` (the inverse of ``config.name``):
    int8[-gptq], int4-g{32,64,128}[-asym][-gptq], 2:4[-sparsegpt],
    lowrank-r{rank}|-e{max_error}[-aa]."""
    parts = name.strip().split("-")
    head, rest = parts[0], parts[1:]
    try:
        if head == "int8" and rest in ([], ["gptq"]):
            return Int8WeightOnly(method="gptq" if rest else "rtn")
        if head == "int4" and rest and rest[0].startswith("g"):
            flags = rest[1:]
            if set(flags) <= {"asym", "gptq"} and len(set(flags)) == len(flags):
                return Int4WeightOnly(
                    group_size=int(rest[0][1:]),
                    symmetric="asym" not in flags,
                    method="gptq" if "gptq" in flags else "rtn",
                )
        if head == "2:4" and rest in ([], ["sparsegpt"]):
            return SemiStructured24(method="sparsegpt" if rest else "magnitude")
        if head == "lowrank" and rest and rest[1:] in ([], ["aa"]):
            aware = rest[1:] == ["aa"]
            if rest[0].startswith("r"):
                return LowRank(rank=int(rest[0][1:]), activation_aware=aware)
            if rest[0].startswith("e"):
                return LowRank(max_error=float(rest[0][1:]), activation_aware=aware)
    except ValueError as err:
        raise ValueError(f"bad compression option {name!r}: {err}") from None
    raise ValueError(
        f"unknown compression option {name!r} (e.g. int8-gptq, int4-g64-gptq, "
        "int4-g32-asym, 2:4-sparsegpt, lowrank-e0.3-aa, lowrank-r64)"
    )
