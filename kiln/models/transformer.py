"""A compact decoder-only transformer driven by ``ModelConfig``.

Pre-norm blocks — ``x + attn(norm(x))`` then ``x + mlp(norm(x))`` — with the switches the
config lists (Gemma's extra norms after attention and MLP, q/k norms, soft-capping, sliding
windows, learned or rotary positions). Every projection is a plain ``nn.Linear``, so
``kiln.compress`` verbs replace them with compressed layers and this file never notices,
and tensor parallelism slices them by rows or columns.

Parameter names (what the loaders produce):
  embed.weight (V, C)                         pos_embed.weight (P, C)      [learned positions]
  layers.{i}.attn_norm.{weight,bias}          layers.{i}.attn.{q,k,v,o}.{weight,bias}
  layers.{i}.attn.{q_norm,k_norm}.weight      layers.{i}.post_attn_norm.weight   [Gemma]
  layers.{i}.mlp_norm.{weight,bias}           layers.{i}.mlp.{gate,up,down}.{weight,bias}
  layers.{i}.post_mlp_norm.weight   [Gemma]   final_norm.{weight,bias}     lm_head.weight
A plain (ungated) MLP has ``up`` and ``down`` only. A tied head shares ``embed.weight``.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from kiln.models.config import ModelConfig
from kiln.models.kv_cache import KVCache


class Norm(nn.Module):
    """RMSNorm or LayerNorm, computed in fp32; multiplies by ``offset + weight``."""

    def __init__(self, size: int, cfg: ModelConfig) -> None:
        super().__init__()
        self.kind, self.eps, self.offset = cfg.norm, cfg.norm_eps, cfg.norm_weight_offset
        self.weight = nn.Parameter(torch.ones(size))
        self.bias = nn.Parameter(torch.zeros(size)) if cfg.norm_bias else None

    def forward(self, x: Tensor) -> Tensor:  # (..., C) -> (..., C)
        h = x.float()
        if self.kind == "rms":
            h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        else:
            h = F.layer_norm(h, h.shape[-1:], eps=self.eps)
        h = h * (self.offset + self.weight.float())
        if self.bias is not None:
            h = h + self.bias.float()
        return h.to(x.dtype)


def rotate(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotary embedding, half-split convention: x (B, H, T, D), cos/sin (T, D)."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


def rope_tables(
    base: float, scale: float, head_dim: int, positions: Tensor
) -> tuple[Tensor, Tensor]:
    """cos and sin (T, D) for integer ``positions`` (T,), computed in fp32."""
    steps = torch.arange(0, head_dim, 2, dtype=torch.float32, device=positions.device)
    inv_freq = base ** (-steps / head_dim)
    angles = positions.float()[:, None] / scale * inv_freq[None, :]  # (T, D/2)
    angles = torch.cat((angles, angles), dim=-1)  # (T, D)
    return angles.cos(), angles.sin()


def attention_mask(q_pos: Tensor, k_len: int, window: int | None) -> Tensor:
    """Boolean (T, S): query at absolute position p sees key j when j <= p (and p - j <
    window). Keys are the cache slots 0..k_len-1, which hold positions 0..k_len-1."""
    k_pos = torch.arange(k_len, device=q_pos.device)
    allowed = k_pos[None, :] <= q_pos[:, None]
    if window is not None:
        allowed &= q_pos[:, None] - k_pos[None, :] < window
    return allowed


class Attention(nn.Module):
    """Grouped-query attention over a preallocated KV cache."""

    def __init__(self, cfg: ModelConfig, layer: int) -> None:
        super().__init__()
        c, d = cfg.hidden_size, cfg.head_dim
        self.q = nn.Linear(c, cfg.n_heads * d, bias=cfg.qkv_bias)
        self.k = nn.Linear(c, cfg.n_kv_heads * d, bias=cfg.qkv_bias)
        self.v = nn.Linear(c, cfg.n_kv_heads * d, bias=cfg.qkv_bias)
        self.o = nn.Linear(cfg.n_heads * d, c, bias=cfg.o_bias)
        self.q_norm = Norm(d, cfg) if cfg.qk_norm else None
        self.k_norm = Norm(d, cfg) if cfg.qk_norm else None
        self.layer, self.head_dim = layer, d
        self.n_heads, self.n_kv_heads = cfg.n_heads, cfg.n_kv_heads
        self.rope = cfg.rope_params(layer) if cfg.positions == "rope" else None
        self.window = cfg.window(layer)
        self.scale = cfg.attn_scale if cfg.attn_scale is not None else d**-0.5
        self.softcap = cfg.attn_softcap

    def forward(self, x: Tensor, positions: Tensor, cache: KVCache) -> Tensor:
        b, t, _ = x.shape  # x (B, T, C), positions (T,) absolute, consecutive
        # The head counts come from the projections: tensor parallelism shards them.
        q = self.q(x).view(b, t, -1, self.head_dim).transpose(1, 2)  # (B, H, T, D)
        k = self.k(x).view(b, t, -1, self.head_dim).transpose(1, 2)  # (B, Hkv, T, D)
        v = self.v(x).view(b, t, -1, self.head_dim).transpose(1, 2)
        if self.q_norm is not None and self.k_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        if self.rope is not None:
            cos, sin = rope_tables(*self.rope, self.head_dim, positions)
            q, k = (
                rotate(q, cos.to(q.dtype), sin.to(q.dtype)),
                rotate(k, cos.to(k.dtype), sin.to(k.dtype)),
            )
        if cache.static:  # all max_len slots, masked: fixed shapes, no host sync
            keys, values = cache.write_at(self.layer, positions, k, v)
        else:
            start = int(positions[0])
            keys, values = cache.write(self.layer, start, k, v)  # (B, Hkv, start + T, D)
        y = self._attend(q, keys, values, positions, cache.static)  # (B, H, T, D)
        return self.o(y.transpose(1, 2).reshape(b, t, -1))

    def _attend(
        self, q: Tensor, k: Tensor, v: Tensor, positions: Tensor, static: bool = False
    ) -> Tensor:
        b, h, t, d = q.shape
        s, hkv = k.shape[2], k.shape[1]
        mask = None
        # A prompt from position 0 (the keys are the queries' own positions) within the
        # window sees exactly the causal triangle: SDPA's is_causal then runs torch's flash
        # kernel, which builds neither the (T, S) mask nor the scores (SmolLM2's heads, 2
        # threads: 4x faster at 512 tokens, 2x at 2048, the same values).
        causal = not static and 1 < t == s and (self.window is None or s <= self.window)
        if causal and self.softcap is None:
            return F.scaled_dot_product_attention(
                q, k, v, is_causal=True, scale=self.scale, enable_gqa=hkv != h
            )
        if static or t > 1 or (self.window is not None and s > self.window):
            mask = attention_mask(positions, s, self.window)  # (T, S)
        if self.softcap is None:
            return F.scaled_dot_product_attention(
                q, k, v, attn_mask=mask, scale=self.scale, enable_gqa=hkv != h
            )
        # Soft-capped scores need the explicit product: tanh between matmul and softmax.
        qg = q.view(b, hkv, h // hkv, t, d)  # query heads grouped by the kv head they read
        scores = torch.matmul(qg, k[:, :, None].transpose(-1, -2)).float() * self.scale
        scores = torch.tanh(scores / self.softcap) * self.softcap  # (B, Hkv, G, T, S)
        if mask is not None:
            scores = scores.masked_fill(~mask, -math.inf)
        probs = scores.softmax(-1).to(q.dtype)
        return torch.matmul(probs, v[:, :, None]).view(b, h, t, d)


class MLP(nn.Module):
    """Gated (SwiGLU/GeGLU) or plain two-layer MLP."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        c, f = cfg.hidden_size, cfg.intermediate_size
        self.gate = nn.Linear(c, f, bias=cfg.mlp_bias) if cfg.gated_mlp else None
        self.up = nn.Linear(c, f, bias=cfg.mlp_bias)
        self.down = nn.Linear(f, c, bias=cfg.mlp_bias)
        self.activation = cfg.activation

    def act(self, x: Tensor) -> Tensor:
        if self.activation == "silu":
            return F.silu(x)
        if self.activation == "relu":
            return F.relu(x)
        return F.gelu(x, approximate="tanh" if self.activation == "gelu_tanh" else "none")

    def forward(self, x: Tensor) -> Tensor:  # (B, T, C) -> (B, T, C)
        if self.gate is None:
            return self.down(self.act(self.up(x)))
        return self.down(self.act(self.gate(x)) * self.up(x))


class Block(nn.Module):
    """One pre-norm transformer block."""

    def __init__(self, cfg: ModelConfig, layer: int) -> None:
        super().__init__()
        self.attn_norm = Norm(cfg.hidden_size, cfg)
        self.attn = Attention(cfg, layer)
        self.post_attn_norm = Norm(cfg.hidden_size, cfg) if cfg.sandwich_norms else None
        self.mlp_norm = Norm(cfg.hidden_size, cfg)
        self.mlp = MLP(cfg)
        self.post_mlp_norm = Norm(cfg.hidden_size, cfg) if cfg.sandwich_norms else None

    def forward(self, x: Tensor, positions: Tensor, cache: KVCache) -> Tensor:
        h = self.attn(self.attn_norm(x), positions, cache)
        if self.post_attn_norm is not None:
            h = self.post_attn_norm(h)
        x = x + h
        h = self.mlp(self.mlp_norm(x))
        if self.post_mlp_norm is not None:
            h = self.post_mlp_norm(h)
        return x + h


def _embedding(rows: int, width: int) -> nn.Embedding:
    """``nn.Embedding(rows, width)``, N(0, 1) as usual; built on the meta device (the
    skeleton a loader fills) its init is skipped: ``normal_`` on a meta tensor runs
    through torch's Python decompositions, whose first import alone costs ~150 MB of
    resident memory in every loading process."""
    if torch.get_default_device().type == "meta":
        return nn.Embedding(rows, width, _weight=torch.empty(rows, width))
    return nn.Embedding(rows, width)


class Transformer(nn.Module):
    """Embeddings -> blocks -> final norm -> head. ``forward`` fills ``cache`` in place."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.embed = _embedding(cfg.vocab_size, cfg.hidden_size)
        self.pos_embed = (
            _embedding(cfg.max_positions + cfg.learned_offset, cfg.hidden_size)
            if cfg.positions == "learned"
            else None
        )
        self.layers = nn.ModuleList(Block(cfg, i) for i in range(cfg.n_layers))
        self.final_norm = Norm(cfg.hidden_size, cfg)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_embeddings:
            self.lm_head.weight = self.embed.weight

    def new_cache(self, batch: int, max_len: int) -> KVCache:
        """An empty KV cache for ``batch`` sequences of up to ``max_len`` tokens."""
        p = next(self.parameters())
        return KVCache.empty(self.cfg, range(self.cfg.n_layers), batch, max_len, p.dtype, p.device)

    def embed_tokens(self, tokens: Tensor, positions: Tensor) -> Tensor:
        x = self.embed(tokens)  # (B, T, C)
        if self.cfg.embed_scale != 1.0:
            x = x * torch.tensor(self.cfg.embed_scale, dtype=x.dtype)
        if self.pos_embed is not None:
            x = x + self.pos_embed(positions + self.cfg.learned_offset)
        return x

    def logits(self, x: Tensor) -> Tensor:  # (B, T, C) -> (B, T, V) fp32
        y = self.lm_head(self.final_norm(x)).float()
        if self.cfg.final_softcap is not None:
            y = torch.tanh(y / self.cfg.final_softcap) * self.cfg.final_softcap
        return y

    def forward(
        self, tokens: Tensor, start: int, cache: KVCache, last_only: bool = False
    ) -> Tensor:
        """tokens (B, T) at positions start..start+T-1 -> logits (B, T, V), fp32;
        ``last_only``: the last position's alone (B, 1, V), all a generation's prefill
        needs (the head, a model's largest matmul, then runs on one row, not T)."""
        if start + tokens.shape[1] > cache.max_len:
            raise ValueError(
                f"{start + tokens.shape[1]} tokens do not fit the cache ({cache.max_len})"
            )
        positions = torch.arange(start, start + tokens.shape[1], device=tokens.device)
        return self.forward_at(tokens, positions, cache, last_only)

    def forward_at(
        self, tokens: Tensor, positions: Tensor, cache: KVCache, last_only: bool = False
    ) -> Tensor:
        """``forward`` with the positions (T,) given as a tensor: with a static cache, a
        decode step that never reads a value back to the host (what a CUDA graph replays)."""
        x = self.embed_tokens(tokens, positions)
        for block in self.layers:
            x = block(x, positions, cache)
        return self.logits(x[:, -1:] if last_only else x)
