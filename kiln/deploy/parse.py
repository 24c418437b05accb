"""Reading the command line's words into the values the jobs take.

Each function takes the text (or number) a user typed and returns the value, or raises
``ValueError`` saying what is wrong; the CLI turns that into a usage error.
"""

from __future__ import annotations

from collections.abc import Sequence

from kiln.compress.allocate import Objective
from kiln.compress.configs import CompressionConfig, parse_config
from kiln.compress.workflow import DEFAULT_OPTIONS
from kiln.deploy.planner import Objective as PlanObjective

OBJECTIVES: dict[str, Objective] = {"size": "bytes", "latency": "latency"}


def fraction(text: str) -> float:
    """A budget as a fraction: '1%' -> 0.01, '0.01' -> 0.01; positive, below 1000%."""
    try:
        value = float(text[:-1]) / 100 if text.endswith("%") else float(text)
    except ValueError:
        raise ValueError(f"not a fraction or percentage: {text!r}") from None
    if not 0 < value < 10:
        raise ValueError(f"budget must be positive (and below 1000%), got {text!r}")
    return value


def objective(name: str) -> Objective:
    """What compression minimises: 'size' (bytes) or 'latency' (measured per layer)."""
    if name not in OBJECTIVES:
        raise ValueError("--objective must be size or latency")
    return OBJECTIVES[name]


def compression_options(text: str) -> Sequence[CompressionConfig]:
    """A comma list of option names ('int8-gptq,int4-g32-gptq'); empty: the defaults."""
    return [parse_config(name) for name in text.split(",")] if text else DEFAULT_OPTIONS


def encoder_max_increase(min_cosine: float) -> float:
    """An encoder's loss budget from the smallest allowed mean embedding cosine."""
    if not 0 < min_cosine < 1:
        raise ValueError(f"--min-cosine must be in (0, 1), got {min_cosine}")
    return 1.0 - min_cosine


def layer_split(text: str) -> tuple[int, ...] | None:
    """Layers per pipeline stage: '16,14' -> (16, 14); empty: None (an even split)."""
    if not text:
        return None
    try:
        return tuple(int(n) for n in text.split(","))
    except ValueError:
        raise ValueError(f"--split takes layer counts, e.g. 16,14; got {text!r}") from None


def plan_objective(name: str) -> PlanObjective:
    """What the planner optimises: 'cost' (per 1M tokens), 'latency' or 'throughput'."""
    if name not in ("cost", "latency", "throughput"):
        raise ValueError(f"--objective must be cost, latency or throughput, got {name!r}")
    return name  # type: ignore[return-value]
