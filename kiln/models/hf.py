"""Hugging Face checkpoint folders: ``config.json`` -> ``ModelConfig``, safetensors -> kiln names.

Families: ``llama``, ``mistral``, ``qwen2``, ``gemma2``, ``gemma3_text`` (and ``gemma3``,
whose ``text_config`` holds the language model), ``gpt2``, ``opt``. Both config layouts are
read: transformers 5's ``rope_parameters`` (per layer type for Gemma 3) and the older
``rope_theta`` / ``rope_scaling`` / ``rope_local_base_freq`` keys. Rotary scaling "linear"
is supported; every other type, and every switch kiln has no equivalent for, raises
``ConfigError`` naming it.

Weights come from ``model.safetensors`` or the shards listed by
``model.safetensors.index.json``: opened with ``safe_open`` a tensor is a view of the
memory-mapped file (``LazyTensor.view``); read explicitly (``file_reads``) it is a new copy
of just its bytes, or of a range of its rows (``LazyTensor.read_rows``). Gemma's four
norms map to attn_norm / post_attn_norm / mlp_norm / post_mlp_norm; GPT-2's ``Conv1D``
weights (in, out) are transposed and its fused ``c_attn`` split into q, k, v.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Collection
from pathlib import Path
from typing import Any

from safetensors import SafetensorError, safe_open
from torch import Tensor

from kiln.models.config import Activation, ConfigError, ModelConfig
from kiln.models.file_reads import SafetensorsLayout
from kiln.models.readers import LazyTensor, LoadError

FAMILIES = ("llama", "mistral", "qwen2", "gemma2", "gemma3_text", "gemma3", "gpt2", "opt")
ACTIVATIONS: dict[str, Activation] = {
    "silu": "silu", "swish": "silu", "relu": "relu", "gelu": "gelu",
    "gelu_new": "gelu_tanh", "gelu_pytorch_tanh": "gelu_tanh", "gelu_fast": "gelu_tanh",
}  # fmt: skip
FLOAT_DTYPES = ("F64", "F32", "F16", "BF16")


# ---------------------------------------------------------------------------- config
def read_config(folder: Path) -> ModelConfig:
    """The ``ModelConfig`` of the checkpoint in ``folder`` (its ``config.json``)."""
    path = folder / "config.json"
    if not path.is_file():
        raise LoadError(f"{folder}: no config.json (not a Hugging Face checkpoint folder)")
    try:
        raw = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise LoadError(f"{path}: not valid JSON ({err})") from err
    return parse_config(raw, str(path))


def parse_config(raw: dict[str, Any], where: str) -> ModelConfig:
    """Translate a transformers config dict; ``where`` names it in errors."""
    kind = raw.get("model_type")
    if kind == "gemma3":  # the multimodal wrapper: its language model is text_config
        if not isinstance(raw.get("text_config"), dict):
            raise ConfigError(f"{where}: model_type 'gemma3' without a text_config")
        raw, kind = {**raw["text_config"], "model_type": "gemma3_text"}, "gemma3_text"
    if kind not in FAMILIES:
        raise ConfigError(
            f"{where}: model_type {kind!r} is not supported (kiln runs {', '.join(FAMILIES)})"
        )
    if "quantization_config" in raw:
        method = raw["quantization_config"].get("quant_method", "?")
        raise ConfigError(f"{where}: quantized checkpoints ({method}) are not supported")
    c = _Keys(raw, where)
    if kind == "gpt2":
        return _gpt2(c)
    if kind == "opt":
        return _opt(c)
    if kind in ("gemma2", "gemma3_text"):
        return _gemma(c, "gemma2" if kind == "gemma2" else "gemma3")
    return _llama_like(c, kind)


class _Keys:
    """A config dict whose missing required keys raise ``ConfigError`` naming them."""

    def __init__(self, raw: dict[str, Any], where: str) -> None:
        self.raw, self.where = raw, where

    def __call__(self, key: str, default: Any = ...) -> Any:
        value = self.raw.get(key)
        if value is None:
            if default is ...:
                raise ConfigError(f"{self.where}: required key {key!r} is missing")
            return default
        return value

    def refuse(self, condition: bool, what: str) -> None:
        if condition:
            raise ConfigError(f"{self.where}: {what} is not supported")

    def activation(self, *keys: str) -> Activation:
        name = next((self.raw[k] for k in keys if self.raw.get(k) is not None), None)
        if name not in ACTIVATIONS:
            raise ConfigError(f"{self.where}: activation {name!r} is not supported")
        return ACTIVATIONS[name]


def _rope(c: _Keys, params: dict[str, Any] | None, theta: float) -> tuple[float, float]:
    """(base, linear position scale) from a rope parameter dict (or legacy rope_scaling)."""
    params = params or {}
    kind = params.get("rope_type", params.get("type", "default"))
    if kind == "default":
        scale = 1.0
    elif kind == "linear":
        scale = float(params["factor"])
    else:
        raise ConfigError(
            f"{c.where}: rope scaling type {kind!r} is not supported (kiln runs none and 'linear')"
        )
    return float(params.get("rope_theta", theta)), scale


def _global_rope(c: _Keys, default_theta: float) -> tuple[float, float]:
    """Merge the legacy (rope_theta + rope_scaling) and new (rope_parameters) layouts."""
    merged = {**c("rope_scaling", {}), **c("rope_parameters", {})}
    return _rope(c, merged, c("rope_theta", default_theta))


def _windows(c: _Keys, n: int, window: int | None, default: list[str]) -> tuple[int | None, ...]:
    """One window per layer from ``layer_types`` (or the family's default pattern)."""
    types = c("layer_types", default)
    if len(types) != n:
        raise ConfigError(f"{c.where}: layer_types has {len(types)} entries for {n} layers")
    out: list[int | None] = []
    for t in types:
        if t not in ("full_attention", "sliding_attention"):
            raise ConfigError(f"{c.where}: layer type {t!r} is not supported")
        out.append(window if t == "sliding_attention" else None)
    return tuple(out) if any(w is not None for w in out) else ()


def _common(c: _Keys) -> dict[str, Any]:
    """Keys every Llama-style family shares."""
    hidden, heads = c("hidden_size"), c("num_attention_heads")
    eos = c("eos_token_id", [])
    return {
        "vocab_size": c("vocab_size"), "hidden_size": hidden, "n_layers": c("num_hidden_layers"),
        "n_heads": heads, "n_kv_heads": c("num_key_value_heads", heads),
        "head_dim": c("head_dim", hidden // heads), "intermediate_size": c("intermediate_size"),
        "max_positions": c("max_position_embeddings"), "norm_eps": c("rms_norm_eps", 1e-6),
        "bos_token_id": c("bos_token_id", None),
        "eos_token_ids": tuple(eos if isinstance(eos, list) else [eos]),
    }  # fmt: skip


def _llama_like(c: _Keys, family: str) -> ModelConfig:
    n = c("num_hidden_layers")
    c.refuse(c("pretraining_tp", 1) != 1, "pretraining_tp != 1")
    c.refuse(bool(c("partial_rotary_factor", 1.0) != 1.0), "partial_rotary_factor")
    bias = bool(c("attention_bias", False))
    window = c("sliding_window", None)
    if family == "qwen2":
        window = window if c("use_sliding_window", False) else None
        first = c("max_window_layers", n)
        default = ["sliding_attention" if i >= first else "full_attention" for i in range(n)]
        windows = _windows(c, n, window, default) if window is not None else ()
    elif family == "mistral":
        windows = (window,) * n if window is not None else ()
    else:
        windows = ()
    theta, scale = _global_rope(c, 10000.0)
    return ModelConfig(
        family=family, **_common(c), rope_theta=theta, rope_scale=scale,
        activation=c.activation("hidden_act"),
        qkv_bias=bias or family == "qwen2", o_bias=bias, mlp_bias=bool(c("mlp_bias", False)),
        sliding_windows=windows, tie_embeddings=bool(c("tie_word_embeddings", False)),
    )  # fmt: skip


def _gemma(c: _Keys, family: str) -> ModelConfig:
    n, hidden = c("num_hidden_layers"), c("hidden_size")
    c.refuse(bool(c("use_bidirectional_attention", False)), "use_bidirectional_attention")
    if family == "gemma2":
        default = ["sliding_attention" if (i + 1) % 2 else "full_attention" for i in range(n)]
        theta, scale = _global_rope(c, 10000.0)
        local: float | None = None
        softcaps = (c("attn_logit_softcapping", 50.0), c("final_logit_softcapping", 30.0))
    else:
        every = c("sliding_window_pattern", c("_sliding_window_pattern", 6))
        default = ["sliding_attention" if (i + 1) % every else "full_attention" for i in range(n)]
        params = c("rope_parameters", {})
        if "full_attention" in params or "sliding_attention" in params:
            theta, scale = _rope(c, params.get("full_attention"), 1_000_000.0)
            local, local_scale = _rope(c, params.get("sliding_attention"), 10000.0)
        else:
            theta, scale = _global_rope(c, 1_000_000.0)
            local, local_scale = float(c("rope_local_base_freq", 10000.0)), 1.0
        c.refuse(local_scale != 1.0, "rotary scaling on sliding-window layers")
        softcaps = (c("attn_logit_softcapping", None), c("final_logit_softcapping", None))
    bias = bool(c("attention_bias", False))
    return ModelConfig(
        family=family, **_common(c), norm_weight_offset=1.0, sandwich_norms=True,
        qk_norm=family == "gemma3", rope_theta=theta, rope_local_theta=local, rope_scale=scale,
        activation=c.activation("hidden_activation", "hidden_act"), qkv_bias=bias, o_bias=bias,
        sliding_windows=_windows(c, n, c("sliding_window", 4096), default),
        attn_scale=float(c("query_pre_attn_scalar", c("head_dim", 256))) ** -0.5,
        attn_softcap=softcaps[0], final_softcap=softcaps[1],
        tie_embeddings=bool(c("tie_word_embeddings", True)), embed_scale=hidden**0.5,
    )  # fmt: skip


def _divide(c: _Keys, hidden: int, heads: int) -> int:
    if hidden % heads:
        raise ConfigError(f"{c.where}: hidden size {hidden} is not divisible by {heads} heads")
    return hidden // heads


def _gpt2(c: _Keys) -> ModelConfig:
    c.refuse(bool(c("scale_attn_by_inverse_layer_idx", False)), "scale_attn_by_inverse_layer_idx")
    c.refuse(bool(c("add_cross_attention", False)), "add_cross_attention")
    hidden, heads, eos = c("n_embd"), c("n_head"), c("eos_token_id", None)
    return ModelConfig(
        family="gpt2", vocab_size=c("vocab_size"), hidden_size=hidden, n_layers=c("n_layer"),
        n_heads=heads, n_kv_heads=heads, head_dim=_divide(c, hidden, heads),
        intermediate_size=c("n_inner", 4 * hidden), max_positions=c("n_positions"),
        norm="layer", norm_eps=c("layer_norm_epsilon", 1e-5), positions="learned",
        gated_mlp=False, activation=c.activation("activation_function"),
        qkv_bias=True, o_bias=True, mlp_bias=True, norm_bias=True,
        attn_scale=None if c("scale_attn_weights", True) else 1.0,
        tie_embeddings=bool(c("tie_word_embeddings", True)),
        bos_token_id=c("bos_token_id", None), eos_token_ids=() if eos is None else (eos,),
    )  # fmt: skip


def _opt(c: _Keys) -> ModelConfig:
    hidden, heads, eos = c("hidden_size"), c("num_attention_heads"), c("eos_token_id", None)
    c.refuse(not c("do_layer_norm_before", True), "do_layer_norm_before=False (post-norm OPT)")
    c.refuse(c("word_embed_proj_dim", hidden) != hidden, "word_embed_proj_dim != hidden_size")
    c.refuse(bool(c("_remove_final_layer_norm", False)), "_remove_final_layer_norm")
    c.refuse(not c("layer_norm_elementwise_affine", True), "layer_norm_elementwise_affine=False")
    bias = bool(c("enable_bias", True))
    return ModelConfig(
        family="opt", vocab_size=c("vocab_size"), hidden_size=hidden,
        n_layers=c("num_hidden_layers"), n_heads=heads, n_kv_heads=heads,
        head_dim=_divide(c, hidden, heads), intermediate_size=c("ffn_dim"),
        max_positions=c("max_position_embeddings"), norm="layer", norm_bias=True,
        positions="learned", learned_offset=2, gated_mlp=False,
        activation=c.activation("activation_function"), qkv_bias=bias, o_bias=bias,
        mlp_bias=bias, tie_embeddings=bool(c("tie_word_embeddings", True)),
        bos_token_id=c("bos_token_id", None), eos_token_ids=() if eos is None else (eos,),
    )  # fmt: skip


# ---------------------------------------------------------------------------- tensors
_LLAMA_LAYER = {
    "self_attn.q_proj": "attn.q", "self_attn.k_proj": "attn.k", "self_attn.v_proj": "attn.v",
    "self_attn.o_proj": "attn.o", "mlp.gate_proj": "mlp.gate", "mlp.up_proj": "mlp.up",
    "mlp.down_proj": "mlp.down", "input_layernorm": "attn_norm",
    "post_attention_layernorm": "mlp_norm",
}  # fmt: skip
_GEMMA_LAYER = {
    **_LLAMA_LAYER, "post_attention_layernorm": "post_attn_norm",
    "pre_feedforward_layernorm": "mlp_norm", "post_feedforward_layernorm": "post_mlp_norm",
    "self_attn.q_norm": "attn.q_norm", "self_attn.k_norm": "attn.k_norm",
}  # fmt: skip
_OPT_LAYER = {
    "self_attn.q_proj": "attn.q", "self_attn.k_proj": "attn.k", "self_attn.v_proj": "attn.v",
    "self_attn.out_proj": "attn.o", "self_attn_layer_norm": "attn_norm",
    "final_layer_norm": "mlp_norm", "fc1": "mlp.up", "fc2": "mlp.down",
}  # fmt: skip
_GPT2_LAYER = {
    "ln_1": "attn_norm", "ln_2": "mlp_norm", "attn.c_proj": "attn.o", "mlp.c_fc": "mlp.up",
    "mlp.c_proj": "mlp.down",
}  # fmt: skip
_LLAMA_TOP = {"embed_tokens": "embed", "norm": "final_norm"}
_NAMING: dict[str, tuple[tuple[str, ...], dict[str, str], dict[str, str]]] = {
    # family: (prefixes of the decoder, layer-local renames, top-level renames)
    "llama": (("model.",), _LLAMA_LAYER, _LLAMA_TOP),
    "mistral": (("model.",), _LLAMA_LAYER, _LLAMA_TOP),
    "qwen2": (("model.",), _LLAMA_LAYER, _LLAMA_TOP),
    "gemma2": (("model.",), _GEMMA_LAYER, _LLAMA_TOP),
    "gemma3": (("model.language_model.", "language_model.model.", "model."), _GEMMA_LAYER,
               _LLAMA_TOP),
    "opt": (("model.decoder.", "decoder."), _OPT_LAYER,
            {"embed_tokens": "embed", "embed_positions": "pos_embed",
             "final_layer_norm": "final_norm"}),
    "gpt2": (("transformer.", ""), _GPT2_LAYER,
             {"wte": "embed", "wpe": "pos_embed", "ln_f": "final_norm"}),
}  # fmt: skip
# Tensors a checkpoint may hold that are not weights of the language model: GPT-2's causal
# mask buffers (older files) and the image side of a multimodal Gemma 3.
_IGNORED = re.compile(
    r"(transformer\.)?h\.\d+\.attn\.(masked_)?bias"
    r"|(model\.)?(vision_tower|multi_modal_projector)\..*"
)
_HEADS = ("lm_head.weight", "language_model.lm_head.weight")


def rename(family: str, name: str) -> str | None:
    """kiln's name for the checkpoint tensor ``name`` (None: no kiln parameter matches)."""
    if name in _HEADS:
        return "lm_head.weight"
    prefixes, layer_names, top_names = _NAMING[family]
    body = next((name[len(p) :] for p in prefixes if name.startswith(p)), None)
    if body is None:
        return None
    if m := re.fullmatch(r"(?:layers|h)\.(\d+)\.(.+)\.(weight|bias)", body):
        module = layer_names.get(m[2])
        return None if module is None else f"layers.{m[1]}.{module}.{m[3]}"
    if m := re.fullmatch(r"(.+)\.(weight|bias)", body):
        module = top_names.get(m[1])
        return None if module is None else f"{module}.{m[2]}"
    return None


def _shards(folder: Path) -> list[Path]:
    """The safetensors files of the checkpoint, checked to exist."""
    single, index = folder / "model.safetensors", folder / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
        except (json.JSONDecodeError, KeyError, UnicodeDecodeError) as err:
            raise LoadError(f"{index}: not a safetensors index ({err!r})") from err
        files = [folder / f for f in sorted(set(weight_map.values()))]
        for f in files:
            if not f.is_file():
                raise LoadError(f"{index} lists {f.name}, which is missing from {folder}")
        return files
    if single.is_file():
        return [single]
    raise LoadError(
        f"{folder}: no model.safetensors or model.safetensors.index.json "
        "(kiln reads safetensors checkpoints only)"
    )


def _open(path: Path) -> Any:
    """A safetensors handle; a damaged or truncated file raises ``LoadError`` naming it."""
    try:
        return safe_open(str(path), framework="pt")
    except SafetensorError as err:
        raise LoadError(f"{path}: unreadable safetensors file ({err})") from err


def _edited_rows(
    layout: SafetensorsLayout, name: str, edit: Callable[[Tensor], Tensor]
) -> Callable[[int, int], Tensor]:
    """Rows of ``edit(tensor)`` (a transpose, a split): the stored tensor is read whole,
    then the rows are copied out of the edited view."""
    return lambda start, stop: edit(layout.read(name))[start:stop].contiguous()


def read_tensors(
    folder: Path, cfg: ModelConfig, skip_modules: Collection[str] = ()
) -> dict[str, LazyTensor]:
    """Every weight of the checkpoint under kiln's names, not read yet (memory-mapped).
    Tensors of ``skip_modules`` (compressed layers, read by ``compressed.py``) are left out."""
    out: dict[str, LazyTensor] = {}
    for path in _shards(folder):
        handle, layout = _open(path), SafetensorsLayout(path)
        for name in handle.keys():  # noqa: SIM118 (a safe_open handle)
            if _IGNORED.fullmatch(name) or name.rpartition(".")[0] in skip_modules:
                continue
            sl = handle.get_slice(name)
            shape, dtype = tuple(sl.get_shape()), sl.get_dtype()
            if dtype not in FLOAT_DTYPES:
                raise LoadError(f"{path}: tensor {name} has dtype {dtype}, not a float")
            for target, lazy in _entries(cfg.family, handle, layout, name, shape).items():
                if target in out:
                    raise LoadError(f"{folder}: {lazy.origin} and {out[target].origin} both "
                                    f"map to {target}")  # fmt: skip
                out[target] = lazy
    return out


_C_ATTN = re.compile(r"(?:transformer\.)?h\.(\d+)\.attn\.c_attn\.(weight|bias)")
_CONV1D = re.compile(r"(?:transformer\.)?h\.\d+\.(?:attn\.c_proj|mlp\.c_fc|mlp\.c_proj)\.weight")


def _entries(
    family: str, handle: Any, layout: SafetensorsLayout, name: str, shape: tuple[int, ...]
) -> dict[str, LazyTensor]:
    """The kiln parameter(s) one checkpoint tensor provides, with their readers."""
    path = layout.path
    origin = f"{name} in {path.name}"
    if family == "gpt2" and (m := _C_ATTN.fullmatch(name)):
        return _split_c_attn(layout, name, shape, origin, f"layers.{m[1]}.attn.{{}}.{m[2]}")
    target = rename(family, name)
    if target is None:
        raise LoadError(f"{path}: unexpected tensor {name!r} (no {family} parameter of kiln's "
                        "model matches it)")  # fmt: skip
    if family == "gpt2" and _CONV1D.fullmatch(name):  # Conv1D stores (in, out)
        return {target: LazyTensor(origin, shape[::-1], _edited_rows(layout, name, Tensor.t))}
    return {
        target: LazyTensor(
            origin,
            shape,
            lambda start, stop: layout.read(name, (start, stop)),
            view=lambda: handle.get_tensor(name),
        )  # fmt: skip
    }


def _split_c_attn(
    layout: SafetensorsLayout, name: str, shape: tuple[int, ...], origin: str, target: str
) -> dict[str, LazyTensor]:
    """GPT-2's fused Conv1D ``c_attn`` (in, 3 * out) [or bias (3 * out,)] -> q, k, v.
    A width not divisible by 3 is passed on whole, for the shape check to report."""
    width = shape[-1] // 3 if shape[-1] % 3 == 0 else shape[-1]
    out = {}
    for i, part in enumerate("qkv"):
        cols = slice(i * width, (i + 1) * width)

        def edit(t: Tensor, cols: slice = cols) -> Tensor:
            return t[:, cols].t() if t.dim() == 2 else t[cols]

        out[target.format(part)] = LazyTensor(
            f"{origin} [columns {cols.start}:{cols.stop}]",
            (width, *shape[:-1]), _edited_rows(layout, name, edit),
        )  # fmt: skip
    return out
