"""Calibration statistics of linear layers, gathered with hooks on real inputs.

For each chosen ``nn.Linear`` (y = x W^T):

* ``h`` — the inputs' second moment H = mean_t x_t x_t^T (K, K): what GPTQ, SparseGPT and
  activation-aware low rank minimise the output error under;
* ``fisher`` — the mean squared gradient of the loss with respect to each output,
  F_n = mean_t (dL_t / dy_tn)^2 (N,), present when a loss is given.

Together they give the second-order (empirical Fisher) estimate of the loss increase a
weight change dW causes: dL ~ 1/2 sum_n F_n dW_n H dW_n^T (``sensitivity.py``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

Progress = Callable[[int, int], None]
LossFn = Callable[[nn.Module, Any], Tensor]


@dataclass
class LayerStats:
    h: Tensor  # (K, K) fp32, mean x x^T
    fisher: Tensor | None  # (N,) fp32, mean (dL/dy)^2
    n_rows: int  # rows (tokens) averaged over


def linear_layers(
    model: nn.Module, filter_fn: Callable[[nn.Module, str], bool] | None = None
) -> dict[str, nn.Linear]:
    """The model's ``nn.Linear`` layers by qualified name, in module order.

    By default a layer whose weight is shared with another module (a language model's
    output head tied to its embedding) is left out: compressing it would untie it.
    """
    shared = _shared_weight_ids(model)
    out: dict[str, nn.Linear] = {}
    for name, mod in model.named_modules():
        if not isinstance(mod, nn.Linear):
            continue
        if filter_fn is not None:
            if filter_fn(mod, name):
                out[name] = mod
        elif id(mod.weight) not in shared:
            out[name] = mod
    return out


def _shared_weight_ids(model: nn.Module) -> set[int]:
    owners: dict[int, int] = {}
    for mod in model.modules():
        for p in mod.parameters(recurse=False):
            owners[id(p)] = owners.get(id(p), 0) + 1
    return {pid for pid, count in owners.items() if count > 1}


def causal_lm_loss(model: Callable[[Tensor], Any], input_ids: Tensor) -> Tensor:
    """Summed next-token cross-entropy of a causal LM on (B, T) ids (a per-token sum, so
    each token's gradient is its own, not divided by the token count). ``model``: ids ->
    logits (B, T, V), or an output with ``.logits``."""
    out = model(input_ids)
    logits = out.logits if hasattr(out, "logits") else out  # (B, T, V)
    return F.cross_entropy(
        logits[:, :-1].flatten(0, 1).float(), input_ids[:, 1:].flatten(), reduction="sum"
    )


def collect_stats(
    model: nn.Module,
    batches: Iterable[Any],
    layers: dict[str, nn.Linear],
    *,
    loss_fn: LossFn | None = None,
    n_batches: int | None = None,
    progress: Progress | None = None,
) -> dict[str, LayerStats]:
    """Run ``batches`` through ``model`` with hooks on ``layers``; returns their stats.

    With ``loss_fn(model, batch) -> scalar`` each batch is also back-propagated (the
    model's parameters get no gradient kept) to gather the output Fisher.
    """
    h = {name: torch.zeros(m.in_features, m.in_features) for name, m in layers.items()}
    fisher = {name: torch.zeros(m.out_features) for name, m in layers.items()}
    rows = dict.fromkeys(layers, 0)
    handles = []
    for name, mod in layers.items():
        handles.append(mod.register_forward_hook(_input_hook(name, h, rows)))
        if loss_fn is not None:
            handles.append(mod.register_full_backward_hook(_grad_hook(name, fisher)))
    requires = [p.requires_grad for p in model.parameters()]
    try:
        for p in model.parameters():
            p.requires_grad_(False)
        for i, batch in enumerate(batches):
            if loss_fn is None:
                with torch.no_grad():
                    _call(model, batch)
            else:
                _backward_through_inputs(model, batch, loss_fn)
            if progress is not None:
                progress(i + 1, n_batches or i + 1)
    finally:
        for handle in handles:
            handle.remove()
        for p, r in zip(model.parameters(), requires):
            p.requires_grad_(r)
    return {
        name: LayerStats(
            h=h[name] / max(rows[name], 1),
            fisher=None if loss_fn is None else fisher[name] / max(rows[name], 1),
            n_rows=rows[name],
        )
        for name in layers
    }


def _call(model: nn.Module, batch: Any) -> Any:
    return model(**batch) if isinstance(batch, dict) else model(batch)


def _backward_through_inputs(model: nn.Module, batch: Any, loss_fn: LossFn) -> None:
    """Backward with frozen weights: gradients flow to activations only, which is all
    the hooks need. For the hooks to fire, the graph must start from something that
    requires grad: the outputs of embedding tables, or a floating-point input batch."""
    handles = [
        m.register_forward_hook(lambda _m, _i, out: out.requires_grad_(True))
        for m in model.modules()
        if isinstance(m, nn.Embedding)
    ]
    if isinstance(batch, Tensor) and batch.is_floating_point():
        batch = batch.detach().requires_grad_(True)
    try:
        with torch.enable_grad():
            loss = loss_fn(model, batch)
            loss.backward()
    finally:
        for handle in handles:
            handle.remove()


def _input_hook(name: str, h: dict[str, Tensor], rows: dict[str, int]) -> Callable[..., None]:
    def hook(_mod: nn.Module, inputs: tuple[Tensor, ...], _out: Tensor) -> None:
        x = inputs[0].detach().reshape(-1, inputs[0].shape[-1]).float()  # (rows, K)
        h[name].addmm_(x.T, x)
        rows[name] += x.shape[0]

    return hook


def _grad_hook(name: str, fisher: dict[str, Tensor]) -> Callable[..., None]:
    def hook(_mod: nn.Module, _gin: Any, grad_out: tuple[Tensor, ...]) -> None:
        g = grad_out[0].detach().reshape(-1, grad_out[0].shape[-1]).float()  # (rows, N)
        fisher[name] += g.pow(2).sum(0)

    return hook


def input_moments(stats: dict[str, LayerStats]) -> dict[str, Tensor]:
    """Just the H matrices, the calibration the compression verbs take."""
    return {name: s.h for name, s in stats.items()}
