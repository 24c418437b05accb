"""The fast CPU decode step: a whole transformer step in one C++ call.

Eager decoding spends most of a small model's step in framework work: a few hundred torch
ops per token, each a dispatch, an allocation and a tiny kernel. ``FastDecoder`` collects a
kiln ``Transformer``'s weights once into a flat descriptor (``kiln.llm.native.step``) and
runs every decode step — embedding, norms, projections, rotary, KV-cache write, attention,
MLP, final norm and head — inside one call of ``decode.cpp``, whose linear layers stream
each weight once (a GEMV over fp32, bf16 or fp16 weights, kiln's INT8 / INT4 weight-only
kernels, or a GGUF tensor's blocks decoded in registers). A bf16 / fp16 model stays 16-bit in memory (weights, embedding table, KV cache:
half the bytes per step) and computes in fp32.

Usage::

    dec = FastDecoder(model, batch=1, max_len=256)    # raises DecodeUnsupported if it can't
    logits = dec.prefill(prompt)                        # (B, T, V)
    tok = logits[:, -1].argmax(-1)
    for pos in range(prompt.shape[1], n):
        tok = dec.step(tok, pos).argmax(-1)             # (B, V) logits of position pos

A prompt of up to ``STEP_PREFILL_MAX`` rows (batch x tokens) is prefilled by C++ steps of
up to ``max_chunk`` rows (``extend``); a longer one by the eager model, whose matmuls then
win (INT8 / INT4 / GGUF layers through kiln's prefill GEMM, ``kiln.kernels.cpu.packed_gemm``;
a prompt from position 0 attends with SDPA's causal flash kernel). The prefill and every step share ``dec.cache`` (the model's own KVCache), so eager
and fast steps can be mixed. The decoder points at the model's tensors as they are when it is
built: build it after the last change to the model (quantize_ etc.). One decoder runs one
step at a time (its workspace is shared; the step releases the GIL). A model the C++ step cannot run exactly (a linear layer of
another kind — 2:4 sparse, low-rank —, weights of another dtype, a non-CPU device, shapes that
disagree with the config) raises ``DecodeUnsupported`` at construction, naming the reason:
the caller then decodes with the eager model, never with silently different numbers.

The tied head of a small model is a large share of its bytes (SmolLM2-135M: 113 MB of
538 MB fp32); ``quantize_head_`` unties it and quantizes the head alone (the embedding
lookup stays fp32), on the model itself, so eager and fast decoding stay the same model.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor, nn

from kiln.compress.configs import Int4WeightOnly, Int8WeightOnly
from kiln.compress.gguf_linear import GgufLinear
from kiln.compress.modules import Int4Linear, Int8Linear
from kiln.compress.verbs import quantize_
from kiln.core import native
from kiln.llm.hugepages import move_to_huge_pages_
from kiln.llm.native.step import (
    LAYER_END,
    LAYOUT_MAGIC,
    STORAGE,
    Descriptor,
    LinearArgs,
    dense_args,
    gguf_args,
    int4_args,
    int8_args,
    load_extension,
)
from kiln.llm.upcast import fp32_linears
from kiln.models.config import ModelConfig
from kiln.models.transformer import Block, Norm, Transformer, rope_tables

ACTIVATIONS = {"silu": 0, "gelu": 1, "gelu_tanh": 2, "relu": 3}  # decode.cpp's codes
NORMS = {"rms": 0, "layer": 1}
# Prompts of up to this many rows (batch x tokens) prefill by C++ steps of up to max_chunk
# (8) rows: SmolLM2 on 2 threads, steps vs the eager model at batch 1: fp32 48 vs 157 ms at
# 8 tokens, 178 vs 212 at 32, 390 vs 265 at 64 (bf16 and INT4 break even near 64); batch
# 4 x 4 tokens: fp32 72 vs 228 ms, bf16 85 vs 332. Calls of 32 rows are slower than 4 of 8
# (batch 4 x 21 tokens in calls of 4 x 8: 563 ms, eager 298).
STEP_PREFILL_MAX = 32


class DecodeUnsupported(ValueError):
    """The C++ decode step cannot run this model exactly; decode with the eager model."""


def _dense_linear(mod: nn.Module) -> LinearArgs:
    assert isinstance(mod, nn.Linear)
    return dense_args(mod.weight, mod.bias)  # ValueError for other dtypes


def _int8_linear(mod: nn.Module) -> LinearArgs:
    assert isinstance(mod, Int8Linear)
    return int8_args(mod.qweight, mod.scale, mod.bias)


def _int4_linear(mod: nn.Module) -> LinearArgs:
    assert isinstance(mod, Int4Linear)
    return int4_args(mod.packed, mod.scale, mod.offset, mod.group_size, mod.bias)


def _gguf_linear(mod: nn.Module) -> LinearArgs:
    assert isinstance(mod, GgufLinear)
    return gguf_args(mod.blocks, mod.ggml_type, mod.in_features, mod.bias, mod.activations)


# The one registry: linear module type (exact) -> its kernel arguments for decode.cpp.
LINEAR_KINDS: dict[type[nn.Module], Callable[[nn.Module], LinearArgs]] = {
    nn.Linear: _dense_linear,
    Int8Linear: _int8_linear,
    Int4Linear: _int4_linear,
    GgufLinear: _gguf_linear,
}


def linear_args(name: str, mod: nn.Module, n: int, k: int) -> LinearArgs:
    """``mod``'s kernel arguments through LINEAR_KINDS; checks it maps k -> n features."""
    convert = LINEAR_KINDS.get(type(mod))
    if convert is None:
        kinds = ", ".join(t.__name__ for t in LINEAR_KINDS)
        raise DecodeUnsupported(
            f"{name} is a {type(mod).__name__}; the C++ decode step runs only {kinds}"
        )
    try:
        args = convert(mod)
    except ValueError as err:  # malformed or unsupported tensors of a known kind
        raise DecodeUnsupported(f"{name}: {err}") from err
    if (args.n, args.k) != (n, k):
        raise DecodeUnsupported(
            f"{name} maps {args.k} -> {args.n} features; the config says {k} -> {n}"
        )
    return args


def _norm(d: Descriptor, norm: Norm | None) -> None:
    if norm is None:
        d.norm(None, None)
    else:
        d.norm(norm.weight, norm.bias)


def _check_tensors(model: Transformer) -> None:
    """Parameters must be fp32, bf16 or fp16 on the CPU (compressed layers' buffers are
    checked by their LINEAR_KINDS converter)."""
    for name, t in [*model.named_parameters(), *model.named_buffers()]:
        if t.device.type != "cpu":
            raise DecodeUnsupported(f"{name} is on {t.device}; the C++ decode step runs on CPU")
    for name, t in model.named_parameters():
        if t.dtype not in STORAGE:
            raise DecodeUnsupported(
                f"{name} is {t.dtype}; the C++ decode step runs fp32, bf16 and fp16 models"
            )


def quantize_head_(model: Transformer, config: Int8WeightOnly | Int4WeightOnly) -> None:
    """Untie the output head from the embedding and quantize the head alone, in place.

    The embedding table stays fp32 (a lookup reads one row per token); the head, read whole
    every step, becomes an Int8Linear / Int4Linear. Eager and fast decoding both use it.
    """
    quantize_(model, config, filter_fn=lambda mod, name: name == "lm_head")


class FastDecoder:
    """Decode ``batch`` sequences of up to ``max_len`` tokens of ``model`` in C++ steps.

    ``threads``: None (default) uses torch's thread count (libgomp's pool), or 1 when a step
    streams less than a few MB (waking a second thread costs more than it saves); a number
    forces that many threads. ``huge_pages`` (default) first moves the model's parameters
    into transparent huge pages (``kiln.llm.hugepages``: same values, fewer TLB misses per
    step); ``self.huge_pages`` then says how many bytes moved, or why none did. INT8 / INT4
    layers run from their repacked panels, shared with the layers' own kernels and made in
    huge pages (``kiln.kernels.cpu.panels``), so the step adds no copy of them.
    ``max_chunk``: the most positions per sequence ``extend`` takes in one call (sizes the
    workspace; a speculative verifier needs its draft length + 1).
    """

    def __init__(
        self,
        model: Transformer,
        batch: int,
        max_len: int,
        threads: int | None = None,
        huge_pages: bool = True,
        max_chunk: int = 8,
    ) -> None:
        if not isinstance(model, Transformer):
            raise DecodeUnsupported(f"FastDecoder runs a kiln Transformer, got {type(model)}")
        if min(batch, max_len, max_chunk, threads or 1) < 1:
            raise ValueError(f"batch, max_len, max_chunk and threads must be positive, got "
                             f"{batch}, {max_len}, {max_chunk}, {threads}")  # fmt: skip
        cfg = model.cfg
        _check_tensors(model)
        self.huge_pages = "not asked for"
        if huge_pages:
            moved, why = move_to_huge_pages_(model)
            self.huge_pages = f"{moved / 2**20:.0f} MiB moved" if moved else why
        try:
            self._ext = load_extension()
        except (native.KilnCompileError, RuntimeError, OSError) as err:
            raise DecodeUnsupported(f"kiln's decode extension is unavailable: {err}") from err
        self.model, self.batch, self.max_len, self.threads = model, batch, max_len, threads
        self.max_chunk = max_chunk
        self.vocab = cfg.vocab_size
        self.cache = model.new_cache(batch, max_len)
        d = self._describe(model, cfg)
        self._desc = d.to_tensor()
        self._keep = (d.keep, d.linears)  # every tensor the descriptor points to
        rows = batch * max_chunk
        self._ws_floats = int(self._ext.workspace_floats(self._desc.data_ptr(), rows))
        self._ws = torch.empty(self._ws_floats)

    def _describe(self, model: Transformer, cfg: ModelConfig) -> Descriptor:
        c, h, hkv, dh, f, v = (cfg.hidden_size, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim,
                               cfg.intermediate_size, cfg.vocab_size)  # fmt: skip
        if len(model.layers) != cfg.n_layers:
            raise DecodeUnsupported(f"model has {len(model.layers)} layers, config {cfg.n_layers}")
        if self.max_len > cfg.max_positions and cfg.positions == "learned":
            raise DecodeUnsupported(f"max_len {self.max_len} > {cfg.max_positions} positions")
        d = Descriptor()
        d.ints(LAYOUT_MAGIC, cfg.n_layers, self.batch, c, h, hkv, dh, f, v, self.max_len)
        d.ints(NORMS[cfg.norm])
        d.float(cfg.norm_eps)
        d.float(cfg.norm_weight_offset)
        d.ints(ACTIVATIONS[cfg.activation])
        d.float(cfg.attn_scale if cfg.attn_scale is not None else dh**-0.5)
        d.float(cfg.attn_softcap or 0.0)
        d.float(cfg.final_softcap or 0.0)
        d.float(cfg.embed_scale)
        embed = model.embed.weight.detach()
        if tuple(embed.shape) != (v, c):
            raise DecodeUnsupported(f"embed.weight is {tuple(embed.shape)}, expected {(v, c)}")
        pos = None if model.pos_embed is None else model.pos_embed.weight.detach()
        if pos is not None and pos.dtype != embed.dtype:
            raise DecodeUnsupported(f"pos_embed is {pos.dtype}, embed {embed.dtype}: one dtype")
        d.ints(STORAGE[embed.dtype])
        d.tensor(embed.contiguous())
        d.tensor(None if pos is None else pos.contiguous())
        d.ints(cfg.learned_offset)
        d.ints(self._cache_storage())
        _norm(d, model.final_norm)
        d.linear(linear_args("lm_head", model.lm_head, v, c))
        ropes: dict[tuple[float, float], tuple[Tensor, Tensor]] = {}
        for i, block in enumerate(model.layers):
            if not isinstance(block, Block):
                raise DecodeUnsupported(f"layers.{i} is a {type(block).__name__}, not a Block")
            self._describe_layer(d, cfg, i, block, ropes)
        return d

    def _cache_storage(self) -> int:
        """The storage code of the cache: one dtype for every layer's keys and values."""
        dtypes = {t.dtype for t in [*self.cache.keys.values(), *self.cache.values.values()]}
        if len(dtypes) != 1 or next(iter(dtypes)) not in STORAGE:
            raise DecodeUnsupported(f"the KV cache must be of one of {list(STORAGE)}: {dtypes}")
        return STORAGE[dtypes.pop()]

    def _describe_layer(
        self, d: Descriptor, cfg: ModelConfig, i: int, block: Block,
        ropes: dict[tuple[float, float], tuple[Tensor, Tensor]],
    ) -> None:  # fmt: skip
        c, h, hkv, dh, f = (cfg.hidden_size, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim,
                            cfg.intermediate_size)  # fmt: skip
        attn, mlp, p = block.attn, block.mlp, f"layers.{i}"
        _norm(d, block.attn_norm)
        _norm(d, attn.q_norm)
        _norm(d, attn.k_norm)
        d.linear(linear_args(f"{p}.attn.q", attn.q, h * dh, c))
        d.linear(linear_args(f"{p}.attn.k", attn.k, hkv * dh, c))
        d.linear(linear_args(f"{p}.attn.v", attn.v, hkv * dh, c))
        d.linear(linear_args(f"{p}.attn.o", attn.o, c, h * dh))
        _norm(d, block.post_attn_norm)
        _norm(d, block.mlp_norm)
        d.linear(None if mlp.gate is None else linear_args(f"{p}.mlp.gate", mlp.gate, f, c))
        d.linear(linear_args(f"{p}.mlp.up", mlp.up, f, c))
        d.linear(linear_args(f"{p}.mlp.down", mlp.down, c, f))
        _norm(d, block.post_mlp_norm)
        d.tensor(self.cache.keys[i])  # (B, Hkv, S, D), written in place
        d.tensor(self.cache.values[i])
        d.ints(cfg.window(i) or 0)
        if cfg.positions == "rope":
            rp = cfg.rope_params(i)
            if rp not in ropes:  # the eager model's own tables, every position at once
                ropes[rp] = rope_tables(*rp, dh, torch.arange(self.max_len))
            d.tensor(ropes[rp][0].contiguous())
            d.tensor(ropes[rp][1].contiguous())
        else:
            d.tensor(None)
            d.tensor(None)
        d.ints(LAYER_END)

    @torch.no_grad()
    def prefill(self, tokens: Tensor, start: int = 0) -> Tensor:
        """tokens (B, T) at positions start.. -> logits, filling this decoder's cache: by
        ``extend`` steps of up to ``max_chunk`` rows when B x T <= ``STEP_PREFILL_MAX``
        (logits (B, T, V)), else by the eager model (the last position's (B, 1, V) only),
        whose 16-bit linear layers then multiply in fp32 on a CPU without 16-bit dot-product
        instructions (``upcast``: 3x faster than torch's bf16 matmuls there)."""
        if tokens.dim() != 2 or tokens.shape[0] != self.batch:
            raise ValueError(f"tokens must be ({self.batch}, T), got {tuple(tokens.shape)}")
        n, c = tokens.shape[1], max(1, self.max_chunk // self.batch)  # positions a call
        if self.batch * n <= STEP_PREFILL_MAX:
            return torch.cat(
                [self.extend(tokens[:, i : i + c], start + i) for i in range(0, n, c)], 1
            )
        with fp32_linears(self.model):
            return self.model(tokens, start, self.cache, last_only=True)

    def step(self, tokens: Tensor, pos: int) -> Tensor:
        """tokens (B,) at position ``pos`` (the cache holds 0..pos-1) -> logits (B, V) fp32."""
        if tokens.shape != (self.batch,):
            raise ValueError(f"tokens must be ({self.batch},), got {tuple(tokens.shape)}")
        return self.extend(tokens.view(self.batch, 1), pos)[:, 0]

    def extend(self, tokens: Tensor, pos: int) -> Tensor:
        """tokens (B, T) at positions pos..pos+T-1 (the cache holds 0..pos-1; T <=
        ``max_chunk``) -> logits (B, T, V) fp32, in one C++ call: every weight is read once
        for all B*T rows, each position attends causally (speculative verification)."""
        if tokens.dim() != 2 or tokens.shape[0] != self.batch or tokens.device.type != "cpu":
            raise ValueError(f"tokens must be a CPU tensor ({self.batch}, T), got "
                             f"{tokens.device.type} {tuple(tokens.shape)}")  # fmt: skip
        t = tokens.shape[1]
        if not 1 <= t <= self.max_chunk:
            raise ValueError(f"{t} positions per call; this decoder takes 1..{self.max_chunk}")
        if tokens.dtype != torch.int64 or not tokens.is_contiguous():
            tokens = tokens.to(torch.int64).contiguous()
        logits = torch.empty(self.batch, t, self.vocab)  # (B, T, V)
        self._ext.step(self._desc.data_ptr(), tokens.data_ptr(), pos, t, logits.data_ptr(),
                       self._ws.data_ptr(), self._ws_floats, self.threads or 0)  # fmt: skip
        return logits
