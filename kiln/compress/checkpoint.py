"""Save and load compressed models as safetensors plus a small JSON manifest.

A compressed checkpoint directory holds:

* ``model.safetensors`` — every tensor of the model (compressed layers hold only their
  compressed buffers; tied weights are stored once);
* ``kiln_compression.json`` — which layers are compressed, by ``kind`` (the key of
  ``modules.LAYER_KINDS``) and shape metadata, plus free-form ``info`` (the plan);
* for Hugging Face models, ``config.json`` and the tokenizer files, so the directory
  loads on its own with ``load_compressed(dir)``.

Loading rebuilds the model from its config, swaps in empty compressed layers of the
recorded kinds and shapes, then loads the tensors strictly: a missing or mis-shaped
tensor is an error naming it.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from torch import nn

from kiln.compress.modules import LAYER_KINDS, CompressedLinear
from kiln.compress.verbs import set_submodule

MANIFEST = "kiln_compression.json"
WEIGHTS = "model.safetensors"
FORMAT = "kiln-compressed/1"
# Hugging Face auto classes a checkpoint may name (no arbitrary imports from a file).
AUTO_CLASSES = ("AutoModelForCausalLM", "AutoModel")


def compressed_layers(model: nn.Module) -> dict[str, CompressedLinear]:
    return {n: m for n, m in model.named_modules() if isinstance(m, CompressedLinear)}


def save_compressed(
    model: nn.Module,
    out_dir: str | Path,
    *,
    tokenizer: Any = None,
    auto_class: str | None = None,
    info: dict[str, Any] | None = None,
) -> Path:
    """Write ``model`` (with any compressed layers) to ``out_dir``; returns the directory.

    ``auto_class`` ("AutoModelForCausalLM" or "AutoModel") marks a Hugging Face model
    whose ``config`` is saved beside the weights.
    """
    from safetensors.torch import save_model

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    layers = {
        name: {"kind": m.kind, "meta": m.meta(), "bias": m.bias is not None}
        for name, m in compressed_layers(model).items()
    }
    manifest: dict[str, Any] = {"format": FORMAT, "layers": layers, "info": info or {}}
    if auto_class is not None:
        if auto_class not in AUTO_CLASSES:
            raise ValueError(f"auto_class must be one of {AUTO_CLASSES}, got {auto_class!r}")
        config: Any = model.config
        if hasattr(config, "quantization_config"):  # the GGUF source's, not ours
            del config.quantization_config
        config.save_pretrained(out)
        manifest["auto_class"] = auto_class
    if tokenizer is not None:
        tokenizer.save_pretrained(out)
    save_model(model, str(out / WEIGHTS))
    (out / MANIFEST).write_text(json.dumps(manifest, indent=1))
    return out


def read_manifest(path: str | Path) -> dict[str, Any]:
    file = Path(path) / MANIFEST
    if not file.exists():
        raise FileNotFoundError(f"{path} is not a kiln compressed checkpoint (no {MANIFEST})")
    manifest = json.loads(file.read_text())
    if manifest.get("format") != FORMAT:
        raise ValueError(f"{file}: unsupported format {manifest.get('format')!r}, want {FORMAT}")
    return manifest


def load_into(model: nn.Module, path: str | Path) -> nn.Module:
    """Load a compressed checkpoint into ``model`` of the same architecture (in place)."""
    from safetensors.torch import load_model

    manifest = read_manifest(path)
    for name, entry in manifest["layers"].items():
        kind = entry["kind"]
        if kind not in LAYER_KINDS:
            raise ValueError(f"{name}: unknown compressed layer kind {kind!r}")
        try:
            model.get_submodule(name)
        except AttributeError as err:
            raise ValueError(f"checkpoint layer {name} does not exist in the model") from err
        set_submodule(model, name, LAYER_KINDS[kind].empty(entry["meta"], entry["bias"]))
    weights = Path(path) / WEIGHTS
    if not weights.exists():
        raise FileNotFoundError(f"{weights} is missing")
    load_model(model, str(weights), strict=True)
    return model


def load_compressed(path: str | Path) -> tuple[nn.Module, Any]:
    """Rebuild a saved Hugging Face model and its tokenizer from a compressed checkpoint."""
    import transformers

    manifest = read_manifest(path)
    auto_class = manifest.get("auto_class")
    if auto_class not in AUTO_CLASSES:
        raise ValueError(
            f"{path}: no Hugging Face model class recorded; use load_into(model, path)"
        )
    config = transformers.AutoConfig.from_pretrained(path)
    model = getattr(transformers, auto_class).from_config(config)
    load_into(model, path)
    if hasattr(model, "tie_weights"):
        model.tie_weights()
    tokenizer = None
    if (Path(path) / "tokenizer_config.json").exists():
        tokenizer = transformers.AutoTokenizer.from_pretrained(path)
    return model.eval(), tokenizer
