"""Per-layer, per-option sensitivity: what each compression choice costs in loss.

For a linear layer with calibration stats (``calibrate.LayerStats``) and a candidate
compressed weight W' = W + dW, the second-order (empirical Fisher) estimate of the mean
loss increase is

    dL ~ 1/2 sum_n F_n (dW_n H dW_n^T)

with H the inputs' second moment and F_n the mean squared output gradient. It treats
output channels as independent and the gradient and input magnitudes as uncorrelated —
cheap enough to evaluate for every (layer, option) pair; the planner confirms the
options it picks by measurement.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
from torch import Tensor, nn

from kiln.compress.configs import CompressionConfig
from kiln.compress.layer import compress_linear, weight_error
from kiln.compress.methods import NoSaving, method_of
from kiln.compress.modules import CompressedLinear, dense_nbytes
from kiln.compress.moments import LayerStats
from kiln.compress.obs import InputMoment
from kiln.compress.verbs import supports

DENSE = "dense"  # the option of leaving a layer uncompressed


def fisher_loss(dw: Tensor, stats: LayerStats) -> float:
    """1/2 sum_n F_n dW_n H dW_n^T for dW (N, K)."""
    if stats.fisher is None:
        raise ValueError("sensitivity needs output gradients: collect stats with a loss_fn")
    quad = ((dw @ stats.h) * dw).sum(dim=1)  # (N,) dW_n H dW_n^T
    return 0.5 * float((stats.fisher * quad).sum())


@dataclass
class LayerOption:
    name: str  # config name, or DENSE
    nbytes: int
    predicted: float  # predicted loss increase (nats per token for a language model)
    module: CompressedLinear | None  # None for DENSE


@dataclass
class SensitivityTable:
    """Every (layer, option) with its bytes, predicted loss, and the compressed module."""

    options: dict[str, list[LayerOption]] = field(default_factory=dict)  # layer -> options

    @property
    def layers(self) -> list[str]:
        return list(self.options)

    def option(self, layer: str, name: str) -> LayerOption:
        for opt in self.options[layer]:
            if opt.name == name:
                return opt
        raise KeyError(f"{layer} has no option {name!r}")

    def without(self, names: set[str]) -> SensitivityTable:
        """The same table with the named options removed from every layer."""
        return SensitivityTable(
            {
                layer: [o for o in opts if o.name not in names]
                for layer, opts in self.options.items()
            }
        )

    def dense_bytes(self) -> int:
        return sum(self.option(layer, DENSE).nbytes for layer in self.options)


def analyse(
    layers: dict[str, nn.Linear],
    stats: dict[str, LayerStats],
    configs: Sequence[CompressionConfig],
    *,
    progress: Callable[[int, int], None] | None = None,
) -> SensitivityTable:
    """Compress every layer with every config (those its shape supports and that save
    bytes) and predict each one's loss increase.

    Layers reading the same input (a block's q/k/v, gate/up projections) are stacked
    along their outputs and compressed in one pass, then split: exact, because rows are
    independent given the shared input statistics, and up to 3x fewer column loops."""
    table = SensitivityTable(
        {
            name: [LayerOption(DENSE, dense_nbytes(layer), 0.0, None)]
            for name, layer in layers.items()
        }
    )
    done = 0
    for group in shared_input_groups(layers, stats):
        members = {name: layers[name] for name in group}
        h = InputMoment(stats[group[0]].h)  # factorised once for every option
        for config in configs:
            for name, module in _compress_group(members, config, h).items():
                dw = weight_error(layers[name], module)
                table.options[name].append(
                    LayerOption(config.name, module.nbytes(), fisher_loss(dw, stats[name]), module)
                )
        done += len(group)
        if progress is not None:
            progress(done, len(layers))
    return table


def shared_input_groups(
    layers: dict[str, nn.Linear], stats: dict[str, LayerStats]
) -> list[list[str]]:
    """Layers whose input statistics are identical (they read the same tensor)."""
    groups: dict[tuple[int, float, float], list[list[str]]] = {}
    out: list[list[str]] = []
    for name in layers:
        h = stats[name].h
        key = (h.shape[0], float(h.sum()), float(h[0, 0]))
        for group in groups.setdefault(key, []):
            if torch.equal(stats[group[0]].h, h):
                group.append(name)
                break
        else:
            groups[key].append([name])
            out.append(groups[key][-1])
    return out


def _compress_group(
    members: dict[str, nn.Linear], config: CompressionConfig, h: InputMoment
) -> dict[str, CompressedLinear]:
    """Compress layers sharing input statistics ``h``: stacked when exact, else one by one.
    Layers the config cannot take (shape) or that would not shrink are left out."""
    layers = {n: m for n, m in members.items() if supports(config, m)}
    stackable = (
        method_of(config).rows_independent and len({m.bias is None for m in layers.values()}) == 1
    )
    if len(layers) > 1 and stackable:
        stacked = _stack(list(layers.values()))
        whole = compress_linear(stacked, config, h)
        out, row = {}, 0
        for name, layer in layers.items():
            out[name] = whole.slice_rows(row, row + layer.out_features)
            row += layer.out_features
        return out
    out = {}
    for name, layer in layers.items():
        try:
            out[name] = compress_linear(layer, config, h)
        except NoSaving:
            continue
    return out


def _stack(layers: list[nn.Linear]) -> nn.Linear:
    """One linear layer computing all of ``layers``' outputs, concatenated."""
    k = layers[0].in_features
    stacked = nn.Linear(k, sum(m.out_features for m in layers), bias=layers[0].bias is not None)
    with torch.no_grad():
        stacked.weight.copy_(torch.cat([m.weight.detach().float().cpu() for m in layers]))
        if stacked.bias is not None:
            stacked.bias.copy_(torch.cat([m.bias.detach().float().cpu() for m in layers]))  # type: ignore[misc]
    return stacked


@torch.no_grad()
def measured_layer_loss(
    model: nn.Module, swaps: dict[str, nn.Module], measure: Callable[[nn.Module], float]
) -> float:
    """``measure(model)`` with the given submodules swapped in, then restored."""
    from kiln.compress.verbs import set_submodule

    originals = {name: set_submodule(model, name, mod) for name, mod in swaps.items()}
    try:
        return measure(model)
    finally:
        for name, mod in originals.items():
            set_submodule(model, name, mod)
