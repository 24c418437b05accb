"""Hugging Face checkpoints: every family, written by transformers' ``save_pretrained`` with
random weights, loaded by kiln, gives transformers' logits (prefill + 32 decode steps through
kiln's KVCache, max abs error <= 1e-3 in fp32) and the same greedy tokens."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from kiln.models import hf
from kiln.models.load import load_model
from kiln.models.transformer import Transformer
from tests.models.families import (
    FAMILIES,
    VOCAB,
    WINDOW,
    hf_greedy,
    kiln_greedy,
    load_reference,
    one_thread,  # noqa: F401  (the fixture, used by name)
    write_checkpoint,
)

pytestmark = pytest.mark.usefixtures("one_thread")

STEPS = 32
PROMPT = torch.randint(0, VOCAB, (1, 12), generator=torch.Generator().manual_seed(0))


def _max_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max())


@pytest.mark.parametrize("family", list(FAMILIES))
def test_family_matches_transformers(family: str, tmp_path: Path) -> None:
    folder = write_checkpoint(family, tmp_path / family)
    want_logits, want_tokens = hf_greedy(load_reference(folder), PROMPT, STEPS)
    loaded = load_model(folder)
    logits, tokens = kiln_greedy(loaded.model, PROMPT, STEPS)
    assert loaded.config.family == family and loaded.tokenizer is None
    assert torch.equal(tokens, want_tokens), f"{family}: greedy tokens differ"
    assert _max_err(logits, want_logits) <= 1e-3  # the fp32 bound (measured ~3e-6)
    if loaded.config.sliding_windows:  # the window really bites on this sequence
        assert PROMPT.shape[1] + STEPS > WINDOW
        unwindowed = Transformer(dataclasses.replace(loaded.config, sliding_windows=()))
        unwindowed.load_state_dict(loaded.model.state_dict())
        full, _ = kiln_greedy(unwindowed.eval(), PROMPT, STEPS)
        assert _max_err(full, want_logits) > 1e-2


def test_sharded_checkpoint_loads(tmp_path: Path) -> None:
    sharded = write_checkpoint("llama", tmp_path / "sharded", max_shard_size="60KB")
    single = write_checkpoint("llama", tmp_path / "single")
    index = json.loads((sharded / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1
    a, b = load_model(sharded).model.state_dict(), load_model(single).model.state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def _mapped_file(t: torch.Tensor) -> str | None:
    """The file whose memory mapping holds ``t``'s data (None: anonymous memory)."""
    ptr = t.data_ptr()
    for line in Path("/proc/self/maps").read_text().splitlines():
        fields = line.split()
        lo, hi = (int(x, 16) for x in fields[0].split("-"))
        if lo <= ptr < hi:
            return fields[5] if len(fields) > 5 else None
    return None


@pytest.mark.skipif(not Path("/proc/self/maps").exists(), reason="needs Linux /proc")
def test_weights_stay_memory_mapped(tmp_path: Path) -> None:
    folder = write_checkpoint("mistral", tmp_path / "m")
    model = load_model(folder).model
    where = _mapped_file(model.get_parameter("layers.1.mlp.up.weight"))
    assert where is not None and where.endswith("model.safetensors")


@pytest.mark.parametrize(("dtype", "tol"), [(torch.bfloat16, 0.05), (torch.float16, 0.01)])
def test_low_precision_dtypes(dtype: torch.dtype, tol: float, tmp_path: Path) -> None:
    folder = write_checkpoint("llama", tmp_path / "l")
    want, _ = hf_greedy(load_reference(folder), PROMPT, 0)
    model = load_model(folder, dtype=dtype).model
    assert {p.dtype for p in model.parameters()} == {dtype}
    got, _ = kiln_greedy(model, PROMPT, 0)
    # Half-precision weights and activations: error relative to the largest logit, bf16's
    # 8-bit mantissa (~4e-3 per rounding) compounding over two layers.
    assert _max_err(got, want) <= tol * float(want.abs().max())


def test_gemma3_multimodal_layout(tmp_path: Path) -> None:
    """model_type gemma3 (the image-text wrapper): the text_config is the model, the
    language model's tensors live under model.language_model., the vision ones are skipped."""
    text = write_checkpoint("gemma3", tmp_path / "text")
    config = json.loads((text / "config.json").read_text())
    wrapped = tmp_path / "wrapped"
    wrapped.mkdir()
    outer = {"model_type": "gemma3", "text_config": config, "vision_config": {"hidden_size": 8}}
    (wrapped / "config.json").write_text(json.dumps(outer))
    tensors = {
        name.replace("model.", "model.language_model.", 1): t
        for name, t in load_file(text / "model.safetensors").items()
    }
    tensors["model.vision_tower.patch.weight"] = torch.zeros(8, 8)
    tensors["model.multi_modal_projector.proj.weight"] = torch.zeros(8, 8)
    save_file(tensors, wrapped / "model.safetensors")
    a, b = load_model(wrapped), load_model(text)
    assert a.config == b.config
    sa, sb = a.model.state_dict(), b.model.state_dict()
    assert sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)


LEGACY_LLAMA = {
    "model_type": "llama", "vocab_size": 100, "hidden_size": 64, "intermediate_size": 96,
    "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
    "max_position_embeddings": 64, "rms_norm_eps": 1e-5, "hidden_act": "silu",
}  # fmt: skip


def test_legacy_and_new_rope_keys_agree() -> None:
    old = {**LEGACY_LLAMA, "rope_theta": 5e5, "rope_scaling": {"type": "linear", "factor": 4}}
    new = {**LEGACY_LLAMA, "rope_parameters": {"rope_type": "linear", "factor": 4.0,
                                              "rope_theta": 5e5}}  # fmt: skip
    a, b = hf.parse_config(old, "old"), hf.parse_config(new, "new")
    assert a == b and (a.rope_theta, a.rope_scale) == (5e5, 4.0)
    assert (a.head_dim, a.tie_embeddings) == (16, False)


def test_legacy_gemma3_keys() -> None:
    cfg = hf.parse_config(
        {**LEGACY_LLAMA, "model_type": "gemma3_text", "head_dim": 16, "num_hidden_layers": 4,
         "query_pre_attn_scalar": 16, "sliding_window": 5, "sliding_window_pattern": 2,
         "rope_theta": 1e6, "rope_local_base_freq": 1e4,
         "rope_scaling": {"rope_type": "linear", "factor": 8.0}},
        "gemma3",
    )  # fmt: skip
    assert cfg.sliding_windows == (5, None, 5, None)
    assert cfg.rope_params(0) == (1e4, 1.0) and cfg.rope_params(1) == (1e6, 8.0)
    assert cfg.embed_scale == 8.0 and cfg.norm_weight_offset == 1.0 and cfg.qk_norm


def test_tensor_names() -> None:
    assert hf.rename("llama", "model.layers.3.post_attention_layernorm.weight") == (
        "layers.3.mlp_norm.weight"
    )
    assert hf.rename("gemma2", "model.layers.3.post_attention_layernorm.weight") == (
        "layers.3.post_attn_norm.weight"
    )
    assert hf.rename("gpt2", "h.0.ln_1.bias") == "layers.0.attn_norm.bias"  # prefix-less GPT-2
    assert hf.rename("opt", "model.decoder.layers.1.fc2.bias") == "layers.1.mlp.down.bias"
    assert hf.rename("opt", "model.decoder.final_layer_norm.weight") == "final_norm.weight"
    assert hf.rename("llama", "model.layers.0.self_attn.rotary_emb.inv_freq") is None
