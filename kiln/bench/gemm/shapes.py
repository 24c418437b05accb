"""The GEMM cases: ``Y = act(X · Wᵀ + b)`` in fp32 with ``W`` constant.

A shape is written ``MxKxN``: ``X`` is (M, K), ``W`` is (N, K), ``b`` is (N,), ``Y``
is (M, N). Shapes are grouped into the classes the requirement names (tiny,
small, large); each shape runs with each epilogue: ``gelu`` (bias + exact erf
GELU, the fused epilogue) and ``bias`` (bias only). This module imports no
runtime, so workers of every kind can read it.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

# class -> shapes (M, K, N), in the order the requirement lists them
CLASSES: dict[str, list[tuple[int, int, int]]] = {
    "tiny": [(1, 64, 64), (8, 64, 64), (1, 256, 256)],
    "small": [(8, 256, 688), (8, 512, 2048), (8, 320, 864)],
    "large": [(64, 512, 2048), (512, 1024, 1024)],
}
EPILOGUES: tuple[str, ...] = ("gelu", "bias")


@dataclass(frozen=True)
class Case:
    """One timed GEMM: a shape, its class and an epilogue."""

    m: int
    k: int
    n: int
    shape_class: str
    epilogue: str  # "gelu" (bias + erf GELU) or "bias"

    @property
    def shape(self) -> str:
        return f"{self.m}x{self.k}x{self.n}"

    @property
    def name(self) -> str:
        """Unique id, e.g. ``8x256x688-gelu`` (also a file-name-safe folder name)."""
        return f"{self.shape}-{self.epilogue}"

    @property
    def flops(self) -> int:
        """Multiply-adds of the GEMM, counted as 2 FLOPs each (epilogue not counted)."""
        return 2 * self.m * self.k * self.n


def classify(m: int, k: int, n: int) -> str:
    """The class of a listed shape; for others: tiny below 1 MFLOP, small below
    32 MFLOP, large above (the listed shapes fall on the same side of these)."""
    for cls, shapes in CLASSES.items():
        if (m, k, n) in shapes:
            return cls
    flops = 2 * m * k * n
    return "tiny" if flops < 1_000_000 else ("small" if flops < 32_000_000 else "large")


def parse_shapes(spec: str | list[str] | None) -> list[tuple[int, int, int]]:
    """Shapes from class names and/or ``MxKxN`` strings (comma- or list-separated).

    ``None`` or ``"all"`` gives every listed shape. Duplicates are dropped, order kept.
    """
    items = spec if isinstance(spec, list) else (spec or "all").split(",")
    out: list[tuple[int, int, int]] = []
    for raw in items:
        item = raw.strip().lower()
        if not item:
            continue
        if item == "all":
            out += [s for shapes in CLASSES.values() for s in shapes]
        elif item in CLASSES:
            out += CLASSES[item]
        else:
            m = re.fullmatch(r"(\d+)[x×*](\d+)[x×*](\d+)", item)
            if not m:
                raise ValueError(f"bad shape {raw!r}: use a class ({', '.join(CLASSES)}) or MxKxN")
            dims = (int(m.group(1)), int(m.group(2)), int(m.group(3)))
            if min(dims) < 1:
                raise ValueError(f"bad shape {raw!r}: dimensions must be positive")
            out.append(dims)
    return list(dict.fromkeys(out))


def make_cases(
    shapes: list[tuple[int, int, int]], epilogues: tuple[str, ...] | list[str] = EPILOGUES
) -> list[Case]:
    """Every shape with every epilogue, shape-major."""
    bad = [e for e in epilogues if e not in EPILOGUES]
    if bad:
        raise ValueError(f"unknown epilogue(s) {bad}; known: {', '.join(EPILOGUES)}")
    return [Case(m, k, n, classify(m, k, n), e) for (m, k, n) in shapes for e in epilogues]


def case_from_name(name: str) -> Case:
    """Inverse of ``Case.name``."""
    shape, _, epilogue = name.partition("-")
    ((m, k, n),) = parse_shapes(shape)
    (case,) = make_cases([(m, k, n)], (epilogue,))
    return case
