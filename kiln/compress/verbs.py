"""The public verbs: compress a model's linear layers in place.

    quantize_(model, Int4WeightOnly(group_size=64))
    sparsify_(model, SemiStructured24(method="sparsegpt"), calibration=moments)
    lowrank_(model, LowRank(max_error=0.2))

``filter_fn(module, name) -> bool`` picks the layers (default: every ``nn.Linear``
whose weight is not tied to another module and whose shape the method supports).
``calibration`` maps layer names to their inputs' second moment (from
``calibrate.collect_stats`` / ``input_moments``) for the calibration-aware methods.
Each verb returns the names of the layers it replaced.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

from torch import Tensor, nn

from kiln.compress.configs import (
    CompressionConfig,
    Int4WeightOnly,
    Int8WeightOnly,
    LowRank,
    SemiStructured24,
)
from kiln.compress.layer import compress_linear
from kiln.compress.methods import METHODS, NoSaving, Verb, method_of
from kiln.compress.moments import linear_layers

FilterFn = Callable[[nn.Module, str], bool]


def quantize_(
    model: nn.Module,
    config: Int8WeightOnly | Int4WeightOnly,
    *,
    filter_fn: FilterFn | None = None,
    calibration: Mapping[str, Tensor] | None = None,
) -> list[str]:
    """Replace linear layers by weight-only INT8 / INT4 layers."""
    return _apply(model, config, filter_fn, calibration, "quantize_")


def sparsify_(
    model: nn.Module,
    config: SemiStructured24,
    *,
    filter_fn: FilterFn | None = None,
    calibration: Mapping[str, Tensor] | None = None,
) -> list[str]:
    """Replace linear layers by 2:4 semi-structured sparse layers."""
    return _apply(model, config, filter_fn, calibration, "sparsify_")


def lowrank_(
    model: nn.Module,
    config: LowRank,
    *,
    filter_fn: FilterFn | None = None,
    calibration: Mapping[str, Tensor] | None = None,
) -> list[str]:
    """Replace linear layers by low-rank factorisations. Layers where the chosen rank
    would not save bytes are left dense (and not in the returned list)."""
    return _apply(model, config, filter_fn, calibration, "lowrank_")


def supports(config: CompressionConfig, layer: nn.Linear) -> bool:
    """Whether ``config`` can compress a layer of this shape."""
    return method_of(config).supports(config, layer.in_features)


def _apply(
    model: nn.Module,
    config: CompressionConfig,
    filter_fn: FilterFn | None,
    calibration: Mapping[str, Tensor] | None,
    verb: Verb,
) -> list[str]:
    if type(config) not in METHODS or METHODS[type(config)].verb != verb:
        takes = [t.__name__ for t, m in METHODS.items() if m.verb == verb]
        raise TypeError(f"{verb} takes {' or '.join(takes)}, got {config!r}")
    layers = linear_layers(model, filter_fn)
    if filter_fn is None:
        layers = {n: m for n, m in layers.items() if supports(config, m)}
    else:
        for name, mod in layers.items():
            if not supports(config, mod):
                raise ValueError(f"{config.name} cannot compress {name} {tuple(mod.weight.shape)}")
    done = []
    for name, mod in layers.items():
        h = None if calibration is None else calibration.get(name)
        try:
            replacement = compress_linear(mod, config, h)
        except NoSaving:
            continue
        set_submodule(model, name, replacement)
        done.append(name)
    return done


def set_submodule(model: nn.Module, name: str, module: nn.Module) -> nn.Module:
    """Replace the submodule at dotted ``name``; returns the one it replaced."""
    parent_name, _, child = name.rpartition(".")
    parent = model.get_submodule(parent_name) if parent_name else model
    old = getattr(parent, child)
    setattr(parent, child, module)
    return old
