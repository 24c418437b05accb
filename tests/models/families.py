"""Tiny random-weight checkpoints of every family kiln loads, written by transformers itself,
and the greedy prefill + decode loops that compare kiln with transformers on them.

Each checkpoint is a few hundred KB: hidden 64, 2–3 layers, vocab 256. Every parameter is
redrawn from N(0, 0.2) (norm weights too, so Gemma's ``1 + w`` and LayerNorm's beta are
exercised), large enough that the greedy argmax is decided by the weights, not by noise.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

from kiln.core.offline import hub_offline

hub_offline()

import gguf  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402
import transformers as tf  # noqa: E402

from kiln.models.transformer import Transformer  # noqa: E402

Q = gguf.GGMLQuantizationType
VOCAB, WINDOW = 256, 8  # the test sequence (12 + 33 tokens) exceeds the window
_SHAPE: dict[str, Any] = {"vocab_size": VOCAB, "hidden_size": 64, "num_attention_heads": 4}
_LLAMA: dict[str, Any] = {**_SHAPE, "intermediate_size": 96, "num_hidden_layers": 2, "num_key_value_heads": 2,
          "max_position_embeddings": 128}  # fmt: skip


def _gemma3() -> tuple[type, Any]:
    cfg = tf.Gemma3TextConfig(
        **{**_LLAMA, "num_hidden_layers": 3}, head_dim=16, query_pre_attn_scalar=24, sliding_window=WINDOW,
        layer_types=["sliding_attention", "full_attention", "sliding_attention"],
        rope_parameters={
            "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
            "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e6},
        },
        final_logit_softcapping=8.0,
    )  # fmt: skip
    return tf.Gemma3ForCausalLM, cfg


FAMILIES: dict[str, Any] = {
    # Llama: untied head, attention biases, linear rotary scaling.
    "llama": lambda: (tf.LlamaForCausalLM, tf.LlamaConfig(
        **_LLAMA, attention_bias=True, tie_word_embeddings=False,
        rope_parameters={"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0})),
    # Mistral: every layer slides over WINDOW keys.
    "mistral": lambda: (tf.MistralForCausalLM, tf.MistralConfig(
        **_LLAMA, sliding_window=WINDOW, tie_word_embeddings=False)),
    # Qwen2: q/k/v biases, tied head, sliding window on layers >= max_window_layers.
    "qwen2": lambda: (tf.Qwen2ForCausalLM, tf.Qwen2Config(
        **_LLAMA, tie_word_embeddings=True, use_sliding_window=True, sliding_window=WINDOW,
        max_window_layers=1)),
    # Gemma 2: sandwich norms, soft-capping of scores and logits, sliding + full layers.
    "gemma2": lambda: (tf.Gemma2ForCausalLM, tf.Gemma2Config(
        **_LLAMA, head_dim=16, query_pre_attn_scalar=24, sliding_window=WINDOW,
        attn_logit_softcapping=5.0, final_logit_softcapping=8.0)),
    # Gemma 3: q/k norms, local rotary base on sliding layers, linear scaling on global ones.
    "gemma3": _gemma3,
    "gpt2": lambda: (tf.GPT2LMHeadModel, tf.GPT2Config(
        vocab_size=VOCAB, n_embd=64, n_layer=2, n_head=4, n_positions=128,
        bos_token_id=VOCAB - 1, eos_token_id=VOCAB - 1)),
    "opt": lambda: (tf.OPTForCausalLM, tf.OPTConfig(
        vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
        ffn_dim=96, max_position_embeddings=128, word_embed_proj_dim=64)),
}  # fmt: skip


@pytest.fixture(scope="module")
def one_thread() -> Iterator[None]:
    """Run a module on one intra-op thread: models this small gain nothing from more, and
    on a busy 2-core machine torch's OpenMP workers spin (the family tests ran ~3x slower)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


# A plain Llama as llama.cpp converts one (no biases, no rotary scaling), for the GGUF tests.
EXTRA: dict[str, Any] = {
    "llama_plain": lambda: (tf.LlamaForCausalLM, tf.LlamaConfig(
        **_LLAMA, tie_word_embeddings=False, rms_norm_eps=1e-5,
        rope_parameters={"rope_type": "default", "rope_theta": 50000.0})),
}  # fmt: skip


def random_model(family: str, seed: int = 0) -> Any:
    """A transformers model of ``family`` with every parameter drawn from N(0, 0.2)."""
    cls, cfg = {**FAMILIES, **EXTRA}[family]()
    torch.manual_seed(seed)
    model = cls(cfg)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.2)
    return model.eval()


def write_checkpoint(family: str, folder: Path, **save: Any) -> Path:
    """Save a random ``family`` model with ``save_pretrained`` (``save`` passes options
    such as ``max_shard_size``); returns the folder."""
    random_model(family).save_pretrained(folder, **save)
    return folder


def load_reference(folder: Path) -> Any:
    """transformers' own fp32 load of ``folder`` (eager attention: soft-capping needs it)."""
    model = tf.AutoModelForCausalLM.from_pretrained(
        folder, dtype=torch.float32, attn_implementation="eager"
    )
    return model.eval()


@torch.inference_mode()
def hf_greedy(model: Any, prompt: torch.Tensor, steps: int) -> tuple[torch.Tensor, torch.Tensor]:
    """transformers: prefill ``prompt`` (1, T), then ``steps`` greedy decode steps through
    its own cache. Returns logits (T + steps, V) and the steps + 1 chosen tokens."""
    out = model(input_ids=prompt, use_cache=True)
    logits, past = [out.logits[0]], out.past_key_values
    tokens = [out.logits[0, -1].argmax()]
    for _ in range(steps):
        out = model(input_ids=tokens[-1].view(1, 1), past_key_values=past, use_cache=True)
        logits.append(out.logits[0])
        past = out.past_key_values
        tokens.append(out.logits[0, -1].argmax())
    return torch.cat(logits).float(), torch.stack(tokens)


@torch.inference_mode()
def kiln_greedy(
    model: Transformer, prompt: torch.Tensor, steps: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """The same loop on kiln's model and its preallocated ``KVCache``."""
    t = prompt.shape[1]
    cache = model.new_cache(1, t + steps)
    out = model(prompt, 0, cache)
    logits, tokens = [out[0]], [out[0, -1].argmax()]
    for i in range(steps):
        out = model(tokens[-1].view(1, 1), t + i, cache)
        logits.append(out[0])
        tokens.append(out[0, -1].argmax())
    return torch.cat(logits).float(), torch.stack(tokens)


def llama_cpp_permute(w: torch.Tensor, heads: int) -> torch.Tensor:
    """The row order llama.cpp's converter gives attn_q / attn_k (convert_hf_to_gguf.py)."""
    return (
        w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)
    )


def write_tiny_gguf(
    path: Path, arch: str = "llama", extra: dict[str, np.ndarray] | None = None
) -> Path:
    """A random 2-layer Llama as llama.cpp's converter writes it: q/k rows permuted, a mix
    of tensor types (Q4_1, Q4_0, Q8_0, F16, F32) and an untied Q4_0 output head; ``extra``
    float32 tensors are added as they are."""
    model = random_model("llama_plain")
    sd = {k: v.numpy() for k, v in model.state_dict().items()}
    w = gguf.GGUFWriter(str(path), arch=arch)
    w.add_context_length(128)
    w.add_embedding_length(64)
    w.add_block_count(2)
    w.add_feed_forward_length(96)
    w.add_head_count(4)
    w.add_head_count_kv(2)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_rope_freq_base(50000.0)
    w.add_rope_dimension_count(16)
    w.add_vocab_size(VOCAB)

    def add(name: str, value: Any, kind: Q) -> None:
        arr = np.ascontiguousarray(value, dtype=np.float32)
        if kind in (Q.F32, Q.F16):
            w.add_tensor(name, arr.astype(np.float16) if kind == Q.F16 else arr)
        else:
            w.add_tensor(name, gguf.quants.quantize(arr, kind), raw_dtype=kind)

    add("token_embd.weight", sd["model.embed_tokens.weight"], Q.Q8_0)
    add("output_norm.weight", sd["model.norm.weight"], Q.F32)
    add("output.weight", sd["lm_head.weight"], Q.Q4_0)
    for i in range(2):
        p = f"model.layers.{i}."
        q = llama_cpp_permute(torch.from_numpy(sd[p + "self_attn.q_proj.weight"]), 4)
        k = llama_cpp_permute(torch.from_numpy(sd[p + "self_attn.k_proj.weight"]), 2)
        add(f"blk.{i}.attn_norm.weight", sd[p + "input_layernorm.weight"], Q.F32)
        add(f"blk.{i}.ffn_norm.weight", sd[p + "post_attention_layernorm.weight"], Q.F32)
        add(f"blk.{i}.attn_q.weight", q, Q.Q4_1)
        add(f"blk.{i}.attn_k.weight", k, Q.Q4_0)
        add(f"blk.{i}.attn_v.weight", sd[p + "self_attn.v_proj.weight"], Q.Q8_0)
        add(f"blk.{i}.attn_output.weight", sd[p + "self_attn.o_proj.weight"], Q.F16)
        for part in ("gate", "up", "down"):
            add(f"blk.{i}.ffn_{part}.weight", sd[p + f"mlp.{part}_proj.weight"], Q.Q4_1)
    for name, value in (extra or {}).items():
        add(name, value, Q.F32)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path
