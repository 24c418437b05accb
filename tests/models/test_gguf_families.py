"""GGUF files of every family kiln runs, written here the way llama.cpp's converter
(convert_hf_to_gguf.py) writes them from a tiny random transformers model: each
architecture's ``<arch>.*`` keys, the gguf package's tensor names, llama's permuted q/k
rows, Gemma's norms stored as ``w + 1``, GPT-2's transposed Conv1D weights, Phi-3's fused
qkv and gate + up, 1-D tensors in F32 and the rest in F32 or F16. kiln's load of the file
gives transformers' logits (prefill + decode, across sliding windows) and the
``ModelConfig`` that ``hf.py`` gives the model's own config."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import pytest
import torch

from kiln.models import hf
from kiln.models.config import ConfigError
from kiln.models.gguf_families import ARCHITECTURES, family_config
from kiln.models.load import load_model
from kiln.models.readers import LoadError
from tests.models.families import (
    VOCAB,
    hf_greedy,
    kiln_greedy,
    llama_cpp_permute,
    one_thread,  # noqa: F401  (the fixture, used by name)
    tf,
)
from tests.support.compare import assert_close_to_reference

Q = gguf.GGMLQuantizationType
WINDOW, STEPS = 8, 4  # 12 prompt tokens + 4 decode steps pass the window
pytestmark = pytest.mark.usefixtures("one_thread")
_BASE: dict[str, Any] = {
    "vocab_size": VOCAB, "hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2,
    "intermediate_size": 96, "num_hidden_layers": 2, "max_position_embeddings": 64,
}  # fmt: skip

# family: (GGUF architecture, the transformers model). Each config keeps to what the
# converter writes: no sliding window for llama / qwen, Gemma's query scale = head_dim.
MODELS: dict[str, tuple[str, Callable[[], Any]]] = {
    # Llama: untied head, q/k biases (permuted with the weights), linear rotary scaling.
    "llama": ("llama", lambda: tf.LlamaForCausalLM(tf.LlamaConfig(
        **_BASE, attention_bias=True, tie_word_embeddings=False, rms_norm_eps=1e-5,
        rope_parameters={"rope_type": "linear", "factor": 2.0, "rope_theta": 50000.0}))),
    # Mistral is written as llama.
    "mistral": ("llama", lambda: tf.MistralForCausalLM(tf.MistralConfig(
        **_BASE, sliding_window=None, tie_word_embeddings=False,
        rope_parameters={"rope_type": "default", "rope_theta": 1e6}))),
    # Qwen2: q/k/v biases, tied head.
    "qwen2": ("qwen2", lambda: tf.Qwen2ForCausalLM(tf.Qwen2Config(
        **_BASE, tie_word_embeddings=True, use_sliding_window=False))),
    # Qwen3: q/k norms, a head size other than hidden / heads.
    "qwen3": ("qwen3", lambda: tf.Qwen3ForCausalLM(tf.Qwen3Config(
        **_BASE, head_dim=24, tie_word_embeddings=False,
        rope_parameters={"rope_type": "default", "rope_theta": 1e6}))),
    # Gemma 2: sandwich norms, soft-capping, sliding and full layers, tied head.
    "gemma2": ("gemma2", lambda: tf.Gemma2ForCausalLM(tf.Gemma2Config(
        **_BASE, head_dim=16, query_pre_attn_scalar=16, sliding_window=WINDOW,
        attn_logit_softcapping=5.0, final_logit_softcapping=8.0))),
    # Gemma 3: q/k norms, 5 sliding layers (local rope base) then a full one (linear
    # scaling), untied head.
    "gemma3": ("gemma3", lambda: tf.Gemma3ForCausalLM(tf.Gemma3TextConfig(
        **{**_BASE, "num_hidden_layers": 6}, head_dim=24, query_pre_attn_scalar=24,
        sliding_window=WINDOW, tie_word_embeddings=False,
        rope_parameters={
            "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
            "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e6},
        }))),
    # Phi-3: fused qkv and gate + up, a sliding window on every layer.
    "phi3": ("phi3", lambda: tf.Phi3ForCausalLM(tf.Phi3Config(
        **_BASE, sliding_window=WINDOW, tie_word_embeddings=False, pad_token_id=0,
        bos_token_id=1, eos_token_id=2))),
    # GPT-2: LayerNorm, learned positions, fused Conv1D qkv, tied head.
    "gpt2": ("gpt2", lambda: tf.GPT2LMHeadModel(tf.GPT2Config(
        vocab_size=VOCAB, n_embd=64, n_layer=2, n_head=4, n_positions=64,
        bos_token_id=VOCAB - 1, eos_token_id=VOCAB - 1))),
}  # fmt: skip


def random_model(family: str, f16: bool) -> Any:
    """``family``'s model with every parameter drawn from N(0, 0.2) (eager attention: Gemma's
    soft-capping needs it); ``f16``: matrices rounded to fp16, as the F16 file holds them."""
    torch.manual_seed(0)
    model = MODELS[family][1]()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.2)
            if f16 and p.dim() == 2:
                p.copy_(p.half().float())
    model.set_attn_implementation("eager")
    return model.eval()


def _metadata(w: gguf.GGUFWriter, arch: str, c: Any) -> None:
    """The ``<arch>.*`` keys the converter writes for config ``c``."""
    if arch == "gpt2":  # GPT2Model: its own short list
        w.add_block_count(c.n_layer)
        w.add_context_length(c.n_positions)
        w.add_embedding_length(c.n_embd)
        w.add_feed_forward_length(4 * c.n_embd)
        w.add_head_count(c.n_head)
        w.add_layer_norm_eps(c.layer_norm_epsilon)
        return
    w.add_block_count(c.num_hidden_layers)
    w.add_context_length(c.max_position_embeddings)
    w.add_embedding_length(c.hidden_size)
    w.add_feed_forward_length(c.intermediate_size)
    w.add_head_count(c.num_attention_heads)
    w.add_head_count_kv(c.num_key_value_heads)
    w.add_layer_norm_rms_eps(c.rms_norm_eps)
    rope = c.rope_parameters.get("full_attention", c.rope_parameters)  # Gemma 3: per layer type
    if arch != "gemma2":  # Gemma2Model writes no rope base (llama.cpp's default, 10000)
        w.add_rope_freq_base(rope["rope_theta"])
    if rope.get("rope_type") == "linear":
        w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        w.add_rope_scaling_factor(rope["factor"])
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    if arch in ("qwen3", "gemma2", "gemma3"):  # configs that name their head size
        w.add_key_length(head_dim)
        w.add_value_length(head_dim)
    if arch in ("llama", "phi3"):
        w.add_rope_dimension_count(head_dim)
    if arch == "llama":
        w.add_vocab_size(c.vocab_size)
    if arch == "phi3":
        w.add_rope_scaling_orig_ctx_len(c.original_max_position_embeddings)
        w.add_sliding_window(c.sliding_window or 0)
    if arch == "gemma2":
        w.add_attn_logit_softcapping(c.attn_logit_softcapping)
        w.add_final_logit_softcapping(c.final_logit_softcapping)
    if arch in ("gemma2", "gemma3"):
        w.add_sliding_window(c.sliding_window)


def _tensor(arch: str, c: Any, name: str, value: torch.Tensor) -> torch.Tensor:
    """``value`` as the converter stores the checkpoint tensor ``name``."""
    if arch == "llama" and ".self_attn.q_proj." in name:
        return llama_cpp_permute(value, c.num_attention_heads)
    if arch == "llama" and ".self_attn.k_proj." in name:
        return llama_cpp_permute(value, c.num_key_value_heads)
    if arch.startswith("gemma") and name.endswith("norm.weight"):
        return value + 1  # llama.cpp's RMSNorm multiplies by the stored weight
    if arch == "gpt2" and name.endswith((".c_attn.weight", ".c_proj.weight", ".c_fc.weight")):
        return value.t()  # Conv1D (in, out) -> (out, in)
    return value


def write_gguf(path: Path, family: str, model: Any, kind: Q) -> Path:
    """``model`` as a GGUF file of ``family``'s architecture, matrices in ``kind`` (F32 or
    F16), 1-D tensors in F32; a tied head is not written (the checkpoint has none)."""
    arch, c = MODELS[family][0], model.config
    w = gguf.GGUFWriter(str(path), arch=arch)
    _metadata(w, arch, c)
    if c.bos_token_id is not None:
        w.add_bos_token_id(c.bos_token_id)
    if c.eos_token_id is not None:
        w.add_eos_token_id(c.eos_token_id)
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH[arch.upper()], c.num_hidden_layers)
    for name, value in model.state_dict().items():
        if name == "lm_head.weight" and c.tie_word_embeddings:
            continue
        module, _, suffix = name.rpartition(".")
        gguf_name = names.get_name(module)
        assert gguf_name is not None, f"no GGUF name for {name}"
        array = _tensor(arch, c, name, value.detach()).float().contiguous().numpy()
        if kind == Q.F16 and array.ndim == 2:
            array = array.astype(np.float16)
        w.add_tensor(f"{gguf_name}.{suffix}", array)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.mark.parametrize("kind", [Q.F32, Q.F16], ids=["f32", "f16"])
@pytest.mark.parametrize("family", list(MODELS))
def test_gguf_family_matches_transformers(family: str, kind: Q, tmp_path: Path) -> None:
    model = random_model(family, f16=kind == Q.F16)
    path = write_gguf(tmp_path / f"{family}.gguf", family, model, kind)
    loaded = load_model(path, with_tokenizer=False)
    prompt = torch.randint(0, VOCAB, (1, 12), generator=torch.Generator().manual_seed(1))
    want, _ = hf_greedy(model, prompt, STEPS)
    logits, _ = kiln_greedy(loaded.model, prompt, STEPS)
    assert_close_to_reference(logits, want, rtol_to_max=1e-5)
    cfg = loaded.config
    if family in ("qwen3", "phi3"):  # no hf.py family: the switches that make them
        assert (cfg.qk_norm, cfg.head_dim) == ((True, 24) if family == "qwen3" else (False, 16))
        assert cfg.sliding_windows == ((WINDOW,) * 2 if family == "phi3" else ())
        return
    expected = hf.parse_config(model.config.to_dict(), "config.json")
    assert cfg == dataclasses.replace(expected, family=MODELS[family][0])


def _config(arch: str, meta: dict[str, Any]) -> dict[str, Any]:
    """``family_config`` over metadata ``meta`` (keys without the ``<arch>.`` prefix)."""
    shape = {"embedding_length": 64, "attention.head_count": 4, "block_count": 6,
             "feed_forward_length": 96, "context_length": 64}  # fmt: skip

    def key(name: str, default: Any = ...) -> Any:
        value = {**shape, **meta}.get(name, default)
        assert value is not ..., name
        return value

    return family_config(arch, key, {"output.weight"}, "test.gguf")


def test_gemma_pattern_and_query_scale() -> None:
    flags = [True, False, True, True, False, True]
    cfg = _config("gemma3", {"attention.sliding_window_pattern": flags, "attention.key_length": 32})
    assert cfg["sliding_windows"] == tuple(4096 if f else None for f in flags)
    assert cfg["attn_scale"] == 32**-0.5  # head_dim, as llama.cpp for every size but 27B
    assert cfg["rope_local_theta"] == 10000.0 and cfg["attn_softcap"] is None
    # Gemma 2 27B (46 layers): query_pre_attn_scalar = hidden / heads, not head_dim.
    big = _config("gemma2", {"block_count": 46, "attention.key_length": 8})
    assert big["attn_scale"] == 16**-0.5 and big["sliding_windows"][:2] == (4096, None)
    assert (big["attn_softcap"], big["final_softcap"]) == (50.0, 30.0)


def test_fused_tensor_with_wrong_rows_is_refused(tmp_path: Path) -> None:
    model = random_model("phi3", f16=False)
    model.config.num_key_value_heads = 4  # the file says 4 kv heads; attn_qkv holds 2
    path = write_gguf(tmp_path / "phi3.gguf", "phi3", model, Q.F32)
    with pytest.raises(LoadError, match=r"attn_qkv.weight has 128 rows, expected 64 \+ 64 \+ 64"):
        load_model(path, with_tokenizer=False)


def test_unknown_gguf_architecture_is_refused(tmp_path: Path) -> None:
    w = gguf.GGUFWriter(str(tmp_path / "bert.gguf"), arch="bert")
    w.add_block_count(1)
    w.add_tensor("token_embd.weight", np.zeros((4, 8), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(ConfigError, match="GGUF architecture 'bert' is not supported"):
        load_model(tmp_path / "bert.gguf", with_tokenizer=False)


def test_every_architecture_is_tested() -> None:
    assert {arch for arch, _ in MODELS.values()} == set(ARCHITECTURES)
