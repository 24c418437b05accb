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
from kiln.compress.layer import NoSaving, compress_linear
from kiln.compress.moments import linear_layers
from kiln.kernels.formats import INT4_GROUP_SIZES

FilterFn = Callable[[nn.Module, str], bool]


def quantize_(
    model: nn.Module,
    config: Int8WeightOnly | Int4WeightOnly,
    *,
    filter_fn: FilterFn | None = None,
    calibration: Mapping[str, Tensor] | None = None,
) -> list[str]:
    """Replace linear layers by weight-only INT8 / INT4 layers."""
    if not isinstance(config, Int8WeightOnly | Int4WeightOnly):
        raise TypeError(f"quantize_ takes Int8WeightOnly or Int4WeightOnly, got {config!r}")
    return _apply(model, config, filter_fn, calibration)


def sparsify_(
    model: nn.Module,
    config: SemiStructured24,
    *,
    filter_fn: FilterFn | None = None,
    calibration: Mapping[str, Tensor] | None = None,
) -> list[str]:
    """Replace linear layers by 2:4 semi-structured sparse layers."""
    if not isinstance(config, SemiStructured24):
        raise TypeError(f"sparsify_ takes SemiStructured24, got {config!r}")
    return _apply(model, config, filter_fn, calibration)


def lowrank_(
    model: nn.Module,
    config: LowRank,
    *,
    filter_fn: FilterFn | None = None,
    calibration: Mapping[str, Tensor] | None = None,
) -> list[str]:
    """Replace linear layers by low-rank factorisations. Layers where the chosen rank
    would not save bytes are left dense (and not in the returned list)."""
    if not isinstance(config, LowRank):
        raise TypeError(f"lowrank_ takes LowRank, got {config!r}")
    return _apply(model, config, filter_fn, calibration)


def supports(config: CompressionConfig, layer: nn.Linear) -> bool:
    """Whether ``config`` can compress a layer of this shape."""
    k = layer.in_features
    if isinstance(config, Int4WeightOnly):
        return k % min(INT4_GROUP_SIZES) == 0  # smaller groups where group_size does not divide K
    if isinstance(config, SemiStructured24):
        return k % 8 == 0  # 2:4 groups, with two groups' positions per byte
    return True


def _apply(
    model: nn.Module,
    config: CompressionConfig,
    filter_fn: FilterFn | None,
    calibration: Mapping[str, Tensor] | None,
) -> list[str]:
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
