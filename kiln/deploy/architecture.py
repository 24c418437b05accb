"""A model's *shape* — layers, linear sizes, heads, windows, vocabulary — read without weights.

``read_architecture(MODEL)`` is what ``kiln plan`` sizes a deployment from. MODEL is

* a catalog name ("smollm2"): resolved as ``kiln.models.load`` resolves it (the GGUF file of
  an installed package);
* the name of a published configuration kiln ships (``PUBLISHED``: "glm-130b",
  "llama-2-70b", "qwen2-0.5b", "qwen2-1.5b"; the files are in ``kiln/deploy/configs/``),
  for planning models far beyond this machine without a file of one's own;
* a ``.gguf`` file: ``kiln.models.gguf.header`` parses the header and the tensor table
  only (memory-mapped; no tensor data is touched), once per process and file version;
* a folder holding ``config.json`` (a Hugging Face checkpoint, or one ``kiln compress``
  wrote: its config.json is the original model's) or a JSON config file on its own, for
  models far beyond this machine. Hugging Face configs go through
  ``kiln.models.hf.parse_config`` (the same translation ``kiln generate`` uses); GLM-130B's
  SAT-style release hyperparameters (``"model_type": "glm"``) are read here.

Everything kiln runs is described through its ``ModelConfig`` (``from_model_config``), so the
linears are kiln's own (q, k, v, o, gate, up, down — GPT-2's fused ``c_attn`` is split as kiln
splits it). GLM-130B is not a ``ModelConfig`` family; its block is modelled as its release
stores it (see ``_glm``). Errors are ``ArchitectureError`` naming the file and the key.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kiln.models import gguf as gguf_reader
from kiln.models import hf, load
from kiln.models.catalog import RealModelMissing
from kiln.models.config import ConfigError, ModelConfig
from kiln.models.readers import LoadError

# Hugging Face ``architectures`` -> ``model_type``, for configs that name only the class.
_HF_CLASSES = {
    "LlamaForCausalLM": "llama", "MistralForCausalLM": "mistral", "Qwen2ForCausalLM": "qwen2",
    "Gemma2ForCausalLM": "gemma2", "Gemma3ForCausalLM": "gemma3_text",
    "Gemma3ForConditionalGeneration": "gemma3", "GPT2LMHeadModel": "gpt2",
    "OPTForCausalLM": "opt",
}  # fmt: skip
_QUANT_SUFFIX = re.compile(r"\.(?:I?Q\d\w*|F16|F32|BF16)$", re.IGNORECASE)


class ArchitectureError(ValueError):
    """A model whose shape cannot be read; the message names the file and the key."""


@dataclass(frozen=True)
class Linear:
    """One weight matrix of a block, (out_features, in_features) as the checkpoint has it."""

    name: str
    out_features: int
    in_features: int
    bias: bool = False

    @property
    def params(self) -> int:
        return self.out_features * self.in_features + (self.out_features if self.bias else 0)


@dataclass(frozen=True)
class Architecture:
    """The shape of a decoder-only transformer whose blocks are all alike."""

    name: str
    family: str
    n_layers: int
    hidden_size: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    tied_embeddings: bool
    max_positions: int
    sliding_windows: tuple[int | None, ...]  # per layer, None = full attention
    layer_linears: tuple[Linear, ...]  # one block's linears (all blocks alike)
    norm_params_per_layer: int  # weights + biases of one block's norms
    source: str  # where it was read from, for messages
    learned_positions: int = 0  # rows of a learned position table (GPT-2, OPT), else 0
    final_norm_params: int = 0  # the norm before the head
    # the model as kiln builds it (None for a shape kiln only plans: GLM's release format);
    # on this CPU the planner times its engines on it (``arch_rates``)
    config: ModelConfig | None = field(default=None, compare=False, repr=False)

    def __post_init__(self) -> None:
        if len(self.sliding_windows) != self.n_layers:
            raise ArchitectureError(
                f"{self.source}: {len(self.sliding_windows)} sliding windows for "
                f"{self.n_layers} layers"
            )

    @property
    def params_per_layer(self) -> int:
        return sum(lin.params for lin in self.layer_linears) + self.norm_params_per_layer

    @property
    def embedding_params(self) -> int:
        return (self.vocab_size + self.learned_positions) * self.hidden_size

    @property
    def head_params(self) -> int:
        return 0 if self.tied_embeddings else self.vocab_size * self.hidden_size

    @property
    def total_params(self) -> int:
        return (
            self.embedding_params
            + self.n_layers * self.params_per_layer
            + self.final_norm_params
            + self.head_params
        )

    def kv_positions(self, layer: int, context: int) -> int:
        """Positions ``layer``'s KV cache holds at ``context`` tokens (a window caps it)."""
        if not 0 <= layer < self.n_layers:
            raise IndexError(f"layer {layer} out of range (0..{self.n_layers - 1})")
        window = self.sliding_windows[layer]
        return context if window is None else min(window, context)

    @staticmethod
    def from_model_config(cfg: ModelConfig, name: str, source: str) -> Architecture:
        """The shape of ``kiln.models.transformer.Transformer(cfg)``, parameter for parameter."""
        c, d = cfg.hidden_size, cfg.head_dim
        q, kv, f = cfg.n_heads * d, cfg.n_kv_heads * d, cfg.intermediate_size
        mlp = (Linear("gate", f, c, cfg.mlp_bias),) if cfg.gated_mlp else ()
        linears = (
            Linear("q", q, c, cfg.qkv_bias), Linear("k", kv, c, cfg.qkv_bias),
            Linear("v", kv, c, cfg.qkv_bias), Linear("o", c, q, cfg.o_bias),
            *mlp, Linear("up", f, c, cfg.mlp_bias), Linear("down", c, f, cfg.mlp_bias),
        )  # fmt: skip
        per_norm = 2 if cfg.norm_bias else 1
        norms = (4 if cfg.sandwich_norms else 2) * c + (2 * d if cfg.qk_norm else 0)
        learned = cfg.max_positions + cfg.learned_offset if cfg.positions == "learned" else 0
        return Architecture(
            name=name, family=cfg.family, n_layers=cfg.n_layers, hidden_size=c,
            n_heads=cfg.n_heads, n_kv_heads=cfg.n_kv_heads, head_dim=d,
            intermediate_size=f, vocab_size=cfg.vocab_size, tied_embeddings=cfg.tie_embeddings,
            max_positions=cfg.max_positions,
            sliding_windows=tuple(cfg.window(i) for i in range(cfg.n_layers)),
            layer_linears=linears, norm_params_per_layer=per_norm * norms, source=source,
            learned_positions=learned, final_norm_params=per_norm * c, config=cfg,
        )  # fmt: skip


CONFIGS = Path(__file__).parent / "configs"
PUBLISHED = tuple(sorted(p.stem for p in CONFIGS.glob("*.json")))


def published_config(name: str) -> Path | None:
    """The shipped config file of a published model named ``name`` (None when ``name`` is
    no such model, or is an existing path: a user's own file always wins)."""
    if name not in PUBLISHED or Path(name).exists():
        return None
    return CONFIGS / f"{name}.json"


def read_architecture(model: str) -> Architecture:
    """The shape of MODEL: a catalog name, a ``.gguf`` file, a folder holding config.json,
    or a JSON config file (Hugging Face, or GLM's SAT-style keys). Reads no weights."""
    try:
        return _read(model)
    except (ConfigError, LoadError, RealModelMissing) as err:
        raise ArchitectureError(str(err)) from err


def _read(model: str) -> Architecture:
    published = published_config(model)
    if published is not None:
        return _from_json(published, model, str(published))
    if model in load.CATALOG and not Path(model).exists():
        path = load.resolve(model)  # its LoadError names the pip command
        return _from_gguf(path, f"{model} ({path})")
    path = Path(model).expanduser()
    if not path.exists():
        raise ArchitectureError(
            f"{path}: no such file or folder (nor a catalog name: {', '.join(load.CATALOG)}; "
            f"nor a published config: {', '.join(PUBLISHED)})"
        )
    if path.is_dir():
        config = path / "config.json"
        if not config.is_file():
            raise ArchitectureError(f"{path}: no config.json in this folder")
        return _from_json(config, path.name, str(path))
    if path.suffix == ".gguf":
        return _from_gguf(path, str(path))
    name = path.parent.name if path.stem == "config" else path.stem
    return _from_json(path, name, str(path))


def _from_gguf(path: Path, source: str) -> Architecture:
    cfg, _ = gguf_reader.header(path)  # the header only, parsed once
    name = _QUANT_SUFFIX.sub("", path.name.removesuffix(".gguf"))
    return Architecture.from_model_config(cfg, name, source)


def _from_json(path: Path, name: str, source: str) -> Architecture:
    try:
        raw = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise ArchitectureError(f"{path}: not a readable JSON config ({err})") from err
    if not isinstance(raw, dict):
        raise ArchitectureError(f"{path}: a config must be a JSON object")
    kind = raw.get("model_type")
    if kind is None:  # only the class named: take the family from it
        classes = raw.get("architectures") or []
        kind = next((_HF_CLASSES[a] for a in classes if a in _HF_CLASSES), None)
        if kind is None:
            raise ArchitectureError(
                f"{path}: no 'model_type' key (and 'architectures' {classes} names no family "
                f"kiln reads)"
            )
        raw = {**raw, "model_type": kind}
    if kind == "glm":
        return _glm(raw, path, name, source)
    if kind not in hf.FAMILIES:
        raise ArchitectureError(
            f"{path}: model_type {kind!r} is not supported (kiln reads "
            f"{', '.join((*hf.FAMILIES, 'glm'))})"
        )
    return Architecture.from_model_config(hf.parse_config(raw, str(path)), name, source)


def _key(raw: dict[str, Any], path: Path, key: str, default: Any = ...) -> Any:
    value = raw.get(key)
    if value is None:
        if default is ...:
            raise ArchitectureError(f"{path}: required key {key!r} is missing")
        return default
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise ArchitectureError(f"{path}: key {key!r} must be a positive integer, got {value!r}")
    return value


def _glm(raw: dict[str, Any], path: Path, name: str, source: str) -> Architecture:
    """GLM-130B as its release (SwissArmyTransformer) stores it. Each block:

    * ``input_layernorm`` and ``post_attention_layernorm``: LayerNorm, weight and bias
      (GLM-130B is post-LN with DeepNorm scaling; the parameters are the same two norms);
    * ``attention.query_key_value``: one fused projection hidden -> 3 * hidden with bias
      (multi-head attention: 96 heads, no grouped key/value heads), ``attention.dense``
      hidden -> hidden with bias;
    * GeGLU MLP: ``mlp.dense_h_to_4h`` hidden -> 2 * inner with bias, which the release
      stores as one matrix and splits into the gate and the up half (kept here as two
      linears, gate and up, hidden -> inner each, with their halves of the bias), and
      ``mlp.dense_4h_to_h`` inner -> hidden with bias.

    Positions are rotary (no parameters); the output layer reuses the word embeddings
    (tied); a final LayerNorm closes the stack. 70 x 1.81B + 1.85B embeddings = ~128.7B.
    """
    if str(raw.get("activation", "geglu")).lower() != "geglu":
        raise ArchitectureError(
            f"{path}: GLM activation {raw['activation']!r} is not supported (GLM-130B's geglu)"
        )
    hidden, heads = _key(raw, path, "hidden_size"), _key(raw, path, "num_attention_heads")
    if hidden % heads and "hidden_size_per_attention_head" not in raw:
        raise ArchitectureError(f"{path}: hidden_size {hidden} is not divisible by {heads} heads")
    head_dim = _key(raw, path, "hidden_size_per_attention_head", hidden // heads)
    inner = _key(raw, path, "inner_hidden_size", 4 * hidden)  # SAT's default: 4 * hidden
    n_layers, attn = _key(raw, path, "num_layers"), heads * head_dim
    linears = (
        Linear("qkv", 3 * attn, hidden, bias=True), Linear("o", hidden, attn, bias=True),
        Linear("gate", inner, hidden, bias=True), Linear("up", inner, hidden, bias=True),
        Linear("down", hidden, inner, bias=True),
    )  # fmt: skip
    return Architecture(
        name=name, family="glm", n_layers=n_layers, hidden_size=hidden, n_heads=heads,
        n_kv_heads=heads, head_dim=head_dim, intermediate_size=inner,
        vocab_size=_key(raw, path, "vocab_size"), tied_embeddings=True,
        max_positions=_key(raw, path, "max_sequence_length"),
        sliding_windows=(None,) * n_layers, layer_linears=linears,
        norm_params_per_layer=2 * 2 * hidden, source=source, final_norm_params=2 * hidden,
    )  # fmt: skip
