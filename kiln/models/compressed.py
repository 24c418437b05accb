"""Loading what ``kiln compress`` wrote into kiln's ``Transformer``.

A compressed checkpoint (``kiln.compress.checkpoint``) is a Hugging Face folder whose
``model.safetensors`` holds, for each compressed linear layer, that layer's own buffers
(``qweight``/``scale``, ``packed``/``scale``/``offset``, ...) under the Hugging Face module
name, and a manifest recording each layer's kind and shapes. Everything else is read by
``hf.read_tensors`` as usual; each compressed layer becomes one ``LazyTensor`` whose read
returns the rebuilt layer (its buffers read explicitly, ``file_reads``), which
``kiln.models.fill`` swaps in for the ``nn.Linear``. The compressed classes are the same
ones ``kiln compress`` produced: they plug in unchanged.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from kiln.compress.checkpoint import MANIFEST, WEIGHTS, read_manifest
from kiln.compress.modules import LAYER_KINDS, CompressedLinear
from kiln.models import hf
from kiln.models.config import ModelConfig
from kiln.models.file_reads import SafetensorsLayout
from kiln.models.readers import LazyTensor, LoadError


def is_compressed(folder: Path) -> bool:
    """True when ``folder`` is a checkpoint written by ``kiln compress``."""
    return (folder / MANIFEST).is_file()


def read_compressed_tensors(folder: Path, cfg: ModelConfig) -> dict[str, LazyTensor]:
    """kiln names -> lazy tensors, the compressed layers as whole-layer entries."""
    try:
        layers: dict[str, Any] = read_manifest(folder)["layers"]
    except (ValueError, KeyError) as err:
        raise LoadError(f"{folder / MANIFEST}: {err}") from err
    out = hf.read_tensors(folder, cfg, skip_modules=set(layers))
    hf._open(folder / WEIGHTS)  # a damaged file is refused before anything is read
    layout = SafetensorsLayout(folder / WEIGHTS)
    for module, entry in layers.items():
        target = hf.rename(cfg.family, f"{module}.weight")
        if target is None:
            raise LoadError(f"{folder}: compressed layer {module} is not a {cfg.family} linear")
        if entry.get("kind") not in LAYER_KINDS:
            raise LoadError(f"{folder}: {module} has unknown kind {entry.get('kind')!r}")
        kind: type[CompressedLinear] = LAYER_KINDS[entry["kind"]]
        with torch.device("meta"):  # shapes only
            empty = kind.empty(entry["meta"], entry["bias"])
        shape = (empty.out_features, empty.in_features)
        out[target] = LazyTensor(
            f"{module} in {WEIGHTS}", shape, _reader(layout, module, kind, entry)
        )
        if entry["bias"]:  # build_model sets a compressed layer's bias from its own entry
            bias = f"{module}.bias"
            out[target.removesuffix("weight") + "bias"] = LazyTensor(
                f"{bias} in {WEIGHTS}", (empty.out_features,), partial(_rows, layout, bias)
            )
    return out


def _rows(layout: SafetensorsLayout, name: str, start: int, stop: int) -> Tensor:
    return layout.read(name, (start, stop))


def _reader(
    layout: SafetensorsLayout, module: str, kind: type[CompressedLinear], entry: dict[str, Any]
) -> Callable[[int, int], CompressedLinear]:
    """Reads the layer's buffers into a new layer (explicit reads: compressed formats pack
    several rows together, so the layer is read whole and then cut to the rows asked for)."""

    def read_rows(start: int, stop: int) -> CompressedLinear:
        layer = kind.empty(entry["meta"], entry["bias"])
        for buffer, empty in layer.named_buffers():
            if buffer == "bias":
                continue
            key = f"{module}.{buffer}"
            if key not in layout.tensors:
                raise LoadError(f"{WEIGHTS}: {key} is missing (a {layer.kind} layer needs it)")
            value = layout.read(key)
            if value.shape != empty.shape or value.dtype != empty.dtype:
                raise LoadError(f"{WEIGHTS}: {key} is {tuple(value.shape)} {value.dtype}, "
                                f"a {layer.kind} layer needs {tuple(empty.shape)} {empty.dtype}")  # fmt: skip
            setattr(layer, buffer, value)
        if (start, stop) != (0, layer.out_features):
            layer = layer.slice_rows(start, stop)
        return layer.eval()

    return read_rows
