"""What `kiln compress` writes loads into kiln's Transformer with its compressed layers."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from kiln.compress import Int4WeightOnly, Int8WeightOnly, quantize_
from kiln.compress.checkpoint import MANIFEST, save_compressed
from kiln.compress.modules import Int4Linear, Int8Linear
from kiln.models.load import load_model
from kiln.models.readers import LoadError
from tests.models.families import kiln_greedy, random_model
from tests.support.compare import assert_close_to_reference


def compressed_checkpoint(family: str, folder: Path) -> torch.nn.Module:
    """A random HF model with INT4 MLPs and INT8 attention, saved by save_compressed."""
    model = random_model(family)
    quantize_(model, Int4WeightOnly(group_size=32), filter_fn=lambda m, n: "mlp" in n)
    quantize_(model, Int8WeightOnly(), filter_fn=lambda m, n: "self_attn" in n)
    save_compressed(model, folder, auto_class="AutoModelForCausalLM")
    return model


@pytest.mark.parametrize("family", ["qwen2", "llama"])  # tied head + q/k/v biases; untied
def test_compressed_checkpoint_loads_with_its_layers(family: str, tmp_path: Path) -> None:
    reference = compressed_checkpoint(family, tmp_path)
    model = load_model(tmp_path, with_tokenizer=False).model
    assert isinstance(model.layers[0].mlp.up, Int4Linear)
    assert isinstance(model.layers[1].attn.k, Int8Linear)
    tokens = torch.randint(0, 256, (1, 9))
    with torch.no_grad():
        expected = reference(tokens).logits[0]
    logits, _ = kiln_greedy(model, tokens, 0)
    assert_close_to_reference(logits, expected, 1e-5)


def test_missing_compressed_buffer_is_named(tmp_path: Path) -> None:
    compressed_checkpoint("llama", tmp_path)
    manifest = json.loads((tmp_path / MANIFEST).read_text())
    entry = manifest["layers"]["model.layers.0.mlp.up_proj"]
    entry["kind"] = "int8"  # the file holds packed/scale/offset, not qweight
    entry["meta"] = {"in_features": 64, "out_features": 96}
    (tmp_path / MANIFEST).write_text(json.dumps(manifest))
    with pytest.raises(LoadError, match=r"model.layers.0.mlp.up_proj.qweight is missing"):
        load_model(tmp_path, with_tokenizer=False)
