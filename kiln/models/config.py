"""One frozen description of every decoder-only transformer kiln runs.

The Llama family and its relatives differ in a handful of switches — which norm (and
whether its weight is stored as ``w`` or ``w - 1``), rotary or learned positions, gated or
plain MLP and its activation, biases, sliding-window layers, soft-capping, extra norms —
so one ``ModelConfig`` with those switches, read by one ``Transformer``, covers Llama,
Mistral, Qwen2, Gemma 2/3, GPT-2 and OPT. The loaders (``hf.py``, ``gguf.py``) translate a
checkpoint's own configuration into this; nothing downstream reads a family name except
to report it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

Norm = Literal["rms", "layer"]
Activation = Literal["silu", "gelu", "gelu_tanh", "relu"]
Positions = Literal["rope", "learned"]


class ConfigError(ValueError):
    """A checkpoint's configuration describes something kiln cannot run."""


@dataclass(frozen=True)
class ModelConfig:
    """Shapes and architecture switches of a decoder-only transformer."""

    family: str  # "llama", "mistral", "qwen2", "gemma2", "gemma3", "gpt2", "opt" (reporting)
    vocab_size: int
    hidden_size: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    intermediate_size: int
    max_positions: int
    # -- norms --
    norm: Norm = "rms"
    norm_eps: float = 1e-5
    norm_weight_offset: float = 0.0  # Gemma stores w - 1: the norm multiplies by (offset + w)
    sandwich_norms: bool = False  # Gemma 2/3: norms after attention and after the MLP too
    qk_norm: bool = False  # Gemma 3: RMSNorm over each head of q and k
    # -- positions --
    positions: Positions = "rope"
    rope_theta: float = 10000.0
    rope_local_theta: float | None = None  # Gemma 3: sliding layers use another base
    rope_scale: float = 1.0  # linear position interpolation (positions / scale), global layers
    learned_offset: int = 0  # OPT's position table starts at index 2
    # -- MLP --
    gated_mlp: bool = True  # SwiGLU / GeGLU: down(act(gate(x)) * up(x))
    activation: Activation = "silu"
    # -- biases --
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    norm_bias: bool = False  # LayerNorm's beta
    # -- attention --
    sliding_windows: tuple[int | None, ...] = ()  # one per layer; None = full attention
    attn_scale: float | None = None  # None = head_dim ** -0.5
    attn_softcap: float | None = None  # Gemma 2: tanh soft-capping of attention scores
    # -- embeddings and head --
    tie_embeddings: bool = True
    embed_scale: float = 1.0  # Gemma multiplies embeddings by sqrt(hidden_size)
    final_softcap: float | None = None  # Gemma 2: tanh soft-capping of the logits
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = field(default=())

    def __post_init__(self) -> None:
        positive = ("vocab_size", "hidden_size", "n_layers", "n_heads", "n_kv_heads")
        for name in (*positive, "head_dim", "intermediate_size", "max_positions"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"{name} must be positive, got {getattr(self, name)}")
        if self.n_heads % self.n_kv_heads:
            raise ConfigError(
                f"{self.n_heads} query heads cannot share {self.n_kv_heads} key/value heads"
            )
        if self.sliding_windows and len(self.sliding_windows) != self.n_layers:
            raise ConfigError(
                f"sliding_windows has {len(self.sliding_windows)} entries for "
                f"{self.n_layers} layers"
            )
        if self.positions == "rope" and self.head_dim % 2:
            raise ConfigError(f"rotary positions need an even head_dim, got {self.head_dim}")

    def window(self, layer: int) -> int | None:
        """The sliding window of ``layer`` (None: it attends to every earlier token)."""
        return self.sliding_windows[layer] if self.sliding_windows else None

    def rope_params(self, layer: int) -> tuple[float, float]:
        """(base, position scale) of ``layer``'s rotary embedding. Gemma 3's sliding layers
        use a local base and no position scaling; every other layer uses the global ones."""
        if self.rope_local_theta is not None and self.window(layer) is not None:
            return self.rope_local_theta, 1.0
        return self.rope_theta, self.rope_scale
