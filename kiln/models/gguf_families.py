"""The GGUF architectures kiln reads: ``<arch>.*`` metadata -> ``ModelConfig``, tensor names.

llama.cpp's converter (``convert_hf_to_gguf.py``) writes each family under its own
``general.architecture``; ``family_config`` gives the ``ModelConfig`` that ``hf.py`` gives
the same model's Hugging Face config (family = the architecture's name):

* ``llama`` (Llama, and Mistral and SmolLM, which are written as llama): the only
  architecture whose converter permutes the q/k rows (``PERMUTED_QK``: ``gguf.py`` undoes
  it); linear rope scaling. A sliding window is not written (llama.cpp runs none).
* ``qwen2``: q/k/v biases. ``qwen3``: q/k RMSNorms over each head (``attn_q_norm``),
  ``attention.key_length`` for its head size. Neither keeps a sliding window (llama.cpp
  runs none). ``hf.py`` has no Qwen3 family: it is mapped as transformers runs it.
* ``gemma2`` / ``gemma3``: the converter writes every norm weight (q/k norms too) as
  ``w + 1`` for llama.cpp's plain RMSNorm; kiln keeps Gemma's ``norm_weight_offset`` 1, so
  ``NORM_SHIFT`` is subtracted again on reading. Sandwich norms, GeGLU (tanh), embeddings
  times sqrt(hidden), soft-capping (Gemma 2 defaults 50 / 30), sliding-window layers (every
  2nd / 6th layer full, as llama.cpp; ``attention.sliding_window_pattern`` when written),
  Gemma 3's local rope base (``rope.freq_base_swa``, default 10000). The query scale
  (``query_pre_attn_scalar``) is not written: as llama.cpp, 1/sqrt(head_dim), but
  1/sqrt(hidden / heads) for the 27B models (46 / 62 layers), which is theirs.
* ``phi3``: fused ``attn_qkv`` (q, k, v rows) and ``ffn_up`` (gate rows, then up rows),
  split by ``FUSED``; ``attention.sliding_window`` (0: none) applies to every layer, as in
  transformers (llama.cpp ignores it). LongRoPE (``rope_factors_*``) is refused.
* ``gpt2``: LayerNorm with biases, learned positions (``position_embd``), a plain tanh-GELU
  MLP, fused ``attn_qkv``; the converter transposes the Conv1D weights, so every linear is
  stored (out, in) as usual.

Metadata floats are float32 in the file; they are read back as the shortest decimal that
rounds to the stored value (1e-06, not 9.99999997e-07), the number the config held.
"""

from __future__ import annotations

from collections.abc import Callable, Collection
from typing import Any

import numpy as np

from kiln.models.config import ConfigError, ModelConfig

Key = Callable[..., Any]  # key(name, default=...) -> the value of "<arch>.<name>"

ARCHITECTURES = ("llama", "qwen2", "qwen3", "gemma2", "gemma3", "phi3", "gpt2")
PERMUTED_QK = ("llama",)  # the converter permutes attn_q / attn_k rows (interleaved rotary)
NORM_SHIFT = {"gemma2": 1.0, "gemma3": 1.0}  # the converter stores norm weights + shift
LAYER = {
    "attn_norm": "attn_norm", "attn_q": "attn.q", "attn_k": "attn.k", "attn_v": "attn.v",
    "attn_output": "attn.o", "attn_q_norm": "attn.q_norm", "attn_k_norm": "attn.k_norm",
    "post_attention_norm": "post_attn_norm", "ffn_norm": "mlp_norm", "ffn_gate": "mlp.gate",
    "ffn_up": "mlp.up", "ffn_down": "mlp.down", "post_ffw_norm": "post_mlp_norm",
}  # fmt: skip
TOP = {"token_embd": "embed", "position_embd": "pos_embed", "output_norm": "final_norm",
       "output": "lm_head"}  # fmt: skip
_QKV = ("attn.q", "attn.k", "attn.v")
FUSED: dict[str, dict[str, tuple[str, ...]]] = {  # arch: {tensor: kiln modules, in row order}
    "gpt2": {"attn_qkv": _QKV},
    "phi3": {"attn_qkv": _QKV, "ffn_up": ("mlp.gate", "mlp.up")},
}
LINEARS = ("attn_q", "attn_k", "attn_v", "attn_qkv", "attn_output", "ffn_gate", "ffn_up",
           "ffn_down", "output")  # fmt: skip


def kiln_names(arch: str, name: str) -> tuple[str, ...] | None:
    """kiln's parameter name(s) for the GGUF tensor ``name`` of ``arch``: one, or one per
    part of a fused tensor in row order (None: nothing matches)."""
    parts = name.split(".")
    if len(parts) == 4 and parts[0] == "blk" and parts[1].isdigit():
        modules = FUSED.get(arch, {}).get(parts[2])
        if modules is None and parts[2] in LAYER:
            modules = (LAYER[parts[2]],)
        if modules is None:
            return None
        return tuple(f"layers.{parts[1]}.{m}.{parts[3]}" for m in modules)
    if len(parts) == 2 and parts[0] in TOP:
        return (f"{TOP[parts[0]]}.{parts[1]}",)
    return None


def part_rows(cfg: ModelConfig, target: str) -> int:
    """Rows of the part of a fused tensor that is kiln's parameter ``target``
    ("layers.0.attn.k.weight": n_kv_heads * head_dim; a gate or up part: the MLP width)."""
    module = target.split(".")[-2]
    kv = cfg.n_kv_heads * cfg.head_dim
    return {"q": cfg.n_heads * cfg.head_dim, "k": kv, "v": kv}.get(module, cfg.intermediate_size)


def _decimal(value: float | None) -> float | None:
    """The shortest decimal that rounds to the float32 ``value`` (numpy's repr); None stays."""
    return None if value is None else float(str(np.float32(value)))


def family_config(arch: str, key: Key, names: Collection[str], where: str) -> dict[str, Any]:
    """``ModelConfig`` keyword arguments (all but vocabulary and token ids) from ``arch``'s
    metadata (``key``) and tensor ``names``; what kiln cannot run raises ``ConfigError``."""
    if key("expert_count", 0):
        raise ConfigError(
            f"{where}: mixture-of-experts ({key('expert_count')} experts) is not supported"
        )
    hidden, heads = key("embedding_length"), key("attention.head_count")
    head_dim = key("attention.key_length", hidden // heads)
    if key("rope.dimension_count", head_dim) != head_dim:
        raise ConfigError(
            f"{where}: partial rotary ({key('rope.dimension_count')} of {head_dim} dims)"
        )
    scaling = key("rope.scaling.type", "none")
    if scaling not in ("none", "linear"):
        raise ConfigError(
            f"{where}: rope scaling type {scaling!r} is not supported (kiln runs none and 'linear')"
        )
    if "rope_freqs.weight" in names:
        raise ConfigError(
            f"{where}: per-frequency rope factors (rope_freqs, Llama 3 scaling) are not supported"
        )
    if "rope_factors_long.weight" in names or "rope_factors_short.weight" in names:
        raise ConfigError(f"{where}: LongRoPE factors (rope_factors_*) are not supported")
    out: dict[str, Any] = {
        "family": arch, "hidden_size": hidden, "n_layers": key("block_count"),
        "n_heads": heads, "n_kv_heads": key("attention.head_count_kv", heads),
        "head_dim": head_dim, "intermediate_size": key("feed_forward_length"),
        "max_positions": key("context_length"),
        "norm_eps": _decimal(key("attention.layer_norm_rms_epsilon", 1e-5)),
        "rope_theta": _decimal(key("rope.freq_base", 10000.0)),
        "rope_scale": _decimal(key("rope.scaling.factor", 1.0)) if scaling == "linear" else 1.0,
        "qkv_bias": "blk.0.attn_q.bias" in names or "blk.0.attn_qkv.bias" in names,
        "o_bias": "blk.0.attn_output.bias" in names, "mlp_bias": "blk.0.ffn_down.bias" in names,
        "tie_embeddings": "output.weight" not in names,
    }  # fmt: skip
    if arch == "qwen3":
        out["qk_norm"] = True
    elif arch == "phi3":
        window = key("attention.sliding_window", 0)
        out["sliding_windows"] = (window,) * out["n_layers"] if window else ()
    elif arch in ("gemma2", "gemma3"):
        out.update(_gemma(arch, key, out, where))
    elif arch == "gpt2":
        out.update(
            norm="layer", norm_eps=_decimal(key("attention.layer_norm_epsilon", 1e-5)),
            positions="learned", gated_mlp=False, activation="gelu_tanh", qkv_bias=True,
            o_bias=True, mlp_bias=True, norm_bias=True,
        )  # fmt: skip
    return out


def _gemma(arch: str, key: Key, base: dict[str, Any], where: str) -> dict[str, Any]:
    """Gemma 2 / 3's switches over the shared ``base`` arguments."""
    n, hidden, heads = base["n_layers"], base["hidden_size"], base["n_heads"]
    pattern = key("attention.sliding_window_pattern", 2 if arch == "gemma2" else 6)
    if isinstance(pattern, int):  # every pattern-th layer is full (0: none is)
        sliding = [pattern == 0 or (i + 1) % pattern != 0 for i in range(n)]
    elif len(pattern) == n:  # one flag per layer, True = sliding
        sliding = [bool(s) for s in pattern]
    else:
        raise ConfigError(
            f"{where}: sliding_window_pattern has {len(pattern)} entries for {n} layers"
        )
    window = key("attention.sliding_window", 4096)
    windows = tuple(window if s else None for s in sliding)
    large = n == (46 if arch == "gemma2" else 62)  # the 27B models, as llama.cpp tells them
    scalar = hidden // heads if large else base["head_dim"]
    gemma2 = arch == "gemma2"
    return {
        "norm_weight_offset": NORM_SHIFT[arch], "sandwich_norms": True, "qk_norm": not gemma2,
        "activation": "gelu_tanh", "embed_scale": hidden**0.5,
        "rope_local_theta": None if gemma2 else _decimal(key("rope.freq_base_swa", 10000.0)),
        "sliding_windows": windows if any(sliding) else (), "attn_scale": float(scalar) ** -0.5,
        "attn_softcap": _decimal(key("attn_logit_softcapping", 50.0 if gemma2 else None)),
        "final_softcap": _decimal(key("final_logit_softcapping", 30.0 if gemma2 else None)),
    }  # fmt: skip
