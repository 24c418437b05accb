"""Loading what ``kiln compress`` wrote into kiln's ``Transformer``.

A compressed checkpoint (``kiln.compress.checkpoint``) is a Hugging Face folder whose
``model.safetensors`` holds, for each compressed linear layer, that layer's own buffers
(``qweight``/``scale``, ``packed``/``scale``/``offset``, ...) under the Hugging Face module
name, and a manifest recording each layer's kind and shapes. Everything else is read by
``hf.read_tensors`` as usual; each compressed layer becomes one ``LazyTensor`` whose read
returns the rebuilt layer, which ``build_model`` swaps in for the ``nn.Linear``. The
compressed classes are the same ones ``kiln compress`` produced: they plug in unchanged.
"""

from __future__ import annotations

from functools import partial
from pathlib import Path
from typing import Any

from kiln.compress.checkpoint import MANIFEST, WEIGHTS, read_manifest
from kiln.compress.modules import LAYER_KINDS, CompressedLinear
from kiln.models import hf
from kiln.models.config import ModelConfig
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
    handle = hf._open(folder / WEIGHTS)
    names = set(handle.keys())
    for module, entry in layers.items():
        target = hf.rename(cfg.family, f"{module}.weight")
        if target is None:
            raise LoadError(f"{folder}: compressed layer {module} is not a {cfg.family} linear")
        if entry.get("kind") not in LAYER_KINDS:
            raise LoadError(f"{folder}: {module} has unknown kind {entry.get('kind')!r}")
        layer = LAYER_KINDS[entry["kind"]].empty(entry["meta"], entry["bias"])
        shape = (layer.out_features, layer.in_features)
        out[target] = LazyTensor(
            f"{module} in {WEIGHTS}", shape, _reader(handle, names, module, layer)
        )
        if entry["bias"]:  # build_model sets a compressed layer's bias from its own entry
            bias = f"{module}.bias"
            out[target.removesuffix("weight") + "bias"] = LazyTensor(
                f"{bias} in {WEIGHTS}", (layer.out_features,), partial(handle.get_tensor, bias)
            )
    return out


def _reader(handle: Any, names: set[str], module: str, layer: CompressedLinear) -> Any:
    def read() -> CompressedLinear:
        for buffer, empty in layer.named_buffers():
            if buffer == "bias":
                continue
            key = f"{module}.{buffer}"
            if key not in names:
                raise LoadError(f"{WEIGHTS}: {key} is missing (a {layer.kind} layer needs it)")
            value = handle.get_tensor(key)
            if value.shape != empty.shape or value.dtype != empty.dtype:
                raise LoadError(f"{WEIGHTS}: {key} is {tuple(value.shape)} {value.dtype}, "
                                f"a {layer.kind} layer needs {tuple(empty.shape)} {empty.dtype}")  # fmt: skip
            setattr(layer, buffer, value)
        return layer.eval()

    return read
