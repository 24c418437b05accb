"""GGUF files (llama.cpp's format) read through the ``gguf`` package's ``GGUFReader``.

Metadata -> ``ModelConfig`` for the architectures ``gguf_families`` maps (llama — which
Mistral and SmolLM are written as — qwen2, qwen3, gemma2, gemma3, phi3, gpt2); others raise
``ConfigError`` naming them. The reader maps the file (copy-on-write) for its header and
tensor table; tensor data is read with explicit reads of just the rows asked for
(``file_reads``), so a streaming load keeps no page of the mapping resident:

* F32 / F16: taken as they are (converted to the requested dtype by the loader); those
  that need no reordering can also be zero-copy views of the mapping (``LazyTensor.view``).
* Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K and Q6_K linear weights, with ``packed=True``:
  kept as the file's blocks, a ``GgufLinear`` each (its C++ kernels decode the blocks in
  registers; ``kiln.kernels.cpu.gguf_blocks``), multiplied with the activations
  quantized to 8-bit blocks by default (decode; prefill on AVX-512 VNNI) (``GgufLinear.activations``: llama.cpp's arithmetic;
  ``"fp32"`` is exact). A file mixes types per tensor (a Q4_K_M file holds Q4_K, Q5_0, Q6_K
  and Q8_0 tensors): each layer runs its own type's kernel. Q4_0 / Q4_1 were repacked to
  kiln's INT4 layout before; their blocks with the integer-dot kernel took 0.6-0.8x that
  path's time per SmolLM2 layer (1 thread, AMD EPYC Zen 4).
* A tied head (no ``output`` tensor) whose ``token_embd`` is of one of those types is, with
  ``packed=True``, the embedding's blocks as stored (``lm_head.weight`` from the same bytes,
  a ``GgufLinear``): faithful and as small as the file. The embedding lookup itself stays a
  float table (dequantized, as below).
* Everything else (other quantized types — named in one logged line per type when
  ``packed=True`` —, every type with ``packed=False``, embeddings, norms): dequantized to
  float32 by ``gguf.quants.dequantize``, a few MB of rows at a time into the output tensor
  (so the dequantizer's temporaries stay small next to a 100 MB embedding table).

A fused tensor (GPT-2's and Phi-3's ``attn_qkv``, Phi-3's gate + up ``ffn_up``) becomes one
entry per part, each reading its own range of rows. For llama, llama.cpp's converter
permutes the rows of ``attn_q`` / ``attn_k`` within each head so its interleaved (GPT-J
style) rotary works; kiln rotates halves (like transformers), so the permutation is undone
here — per row, so packed rows are moved the same way; a range of rows is read out to whole
heads, reordered, then cut. Gemma's norm weights, stored as ``w + 1``, are read as ``w``.
"""

from __future__ import annotations

import functools
import logging
import math
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import torch
from torch import Tensor

from kiln.compress.gguf_linear import GgufLinear
from kiln.compress.modules import CompressedLinear
from kiln.models import gguf_families as families
from kiln.models.config import ConfigError, ModelConfig
from kiln.models.file_reads import read_bytes
from kiln.models.readers import LazyTensor, LoadError

Q = gguf.GGMLQuantizationType
ARCHITECTURES = families.ARCHITECTURES
# kept as their blocks: GgufLinear
_KEPT = (Q.Q4_0, Q.Q4_1, Q.Q8_0, Q.Q5_0, Q.Q5_1, Q.Q4_K, Q.Q5_K, Q.Q6_K)
_FLOATS = (Q.F32, Q.F16, Q.BF16, Q.F64)
_log = logging.getLogger(__name__)
_CHUNK_BYTES = 8 * 2**20  # fp32 bytes dequantized at a time


def open_reader(path: Path) -> gguf.GGUFReader:
    """Parse ``path``'s header and tensor table; a damaged or truncated file -> LoadError."""
    try:
        reader = gguf.GGUFReader(path, "c")
    except (ValueError, IndexError, OverflowError) as err:
        raise LoadError(f"{path}: unreadable or truncated GGUF file ({err})") from err
    size = path.stat().st_size
    for t in reader.tensors:
        if t.data_offset + t.n_bytes > size:
            raise LoadError(f"{path}: truncated, tensor {t.name} ends past the file's {size} bytes")
    return reader


def header(path: Path) -> tuple[ModelConfig, bool]:
    """``path``'s config and whether it carries a tokenizer, parsed once per process and
    version of the file (its size and modification time): parsing a header builds a view
    per metadata item, and a tokenizer's vocabulary is 100k of them (2.3 s for SmolLM2's).
    The reader itself (a map of the whole file) is not kept."""
    stat = path.stat()
    return _header(str(path.resolve()), stat.st_size, stat.st_mtime_ns)


@functools.lru_cache(maxsize=16)
def _header(path: str, size: int, mtime_ns: int) -> tuple[ModelConfig, bool]:
    reader = open_reader(Path(path))
    return read_config(reader, Path(path)), has_tokenizer(reader)


def _field(reader: gguf.GGUFReader, path: Path, key: str, default: Any = ...) -> Any:
    """Metadata value ``key``; a missing required key raises ``ConfigError`` naming it."""
    field = reader.fields.get(key)
    if field is None:
        if default is ...:
            raise ConfigError(f"{path}: metadata key {key!r} is missing")
        return default
    return field.contents()


def read_config(reader: gguf.GGUFReader, path: Path) -> ModelConfig:
    """``ModelConfig`` from the GGUF metadata (``general.architecture`` must be one of
    ``ARCHITECTURES``; ``gguf_families`` maps each)."""
    arch = _field(reader, path, "general.architecture")
    if arch not in ARCHITECTURES:
        raise ConfigError(
            f"{path}: GGUF architecture {arch!r} is not supported (kiln reads {ARCHITECTURES})"
        )

    def key(name: str, default: Any = ...) -> Any:
        return _field(reader, path, f"{arch}.{name}", default)

    names = {t.name for t in reader.tensors}
    embed = next((t for t in reader.tensors if t.name == "token_embd.weight"), None)
    vocab = key("vocab_size", None) or (int(embed.shape[1]) if embed is not None else 0)
    eos = _field(reader, path, "tokenizer.ggml.eos_token_id", None)
    return ModelConfig(
        **families.family_config(arch, key, names, str(path)), vocab_size=vocab,
        bos_token_id=_field(reader, path, "tokenizer.ggml.bos_token_id", None),
        eos_token_ids=() if eos is None else (eos,),
    )  # fmt: skip


def unpermute_rows(x: Tensor, heads: int) -> Tensor:
    """Undo llama.cpp's q/k row order: within each head, rows (j, i) -> (i, j) for the
    half i in {0, 1} and the pair j. x (N, ...) with N = heads * head_dim."""
    n = x.shape[0]
    return x.reshape(heads, n // heads // 2, 2, *x.shape[1:]).transpose(1, 2).reshape(x.shape)


def _stored_rows(path: Path, t: Any, start: int, stop: int) -> np.ndarray:
    """Rows [start, stop) of ``t``'s stored data as laid out in the file — (rows, cols) for
    floats, (rows, bytes per row) for quantized blocks, elements for a 1-D tensor — read
    explicitly into new memory. ``t.data`` (the mapping) gives only dtype and shape."""
    layout = t.data  # no page of it is touched here
    row_bytes = t.n_bytes // layout.shape[0]
    raw = read_bytes(path, t.data_offset + start * row_bytes, (stop - start) * row_bytes)
    return raw.numpy().view(layout.dtype).reshape(stop - start, *layout.shape[1:])


def _float_rows(path: Path, t: Any, shape: tuple[int, ...], start: int, stop: int) -> Tensor:
    """Rows [start, stop) of tensor ``t`` (kiln ``shape``) as a float torch tensor."""
    if t.tensor_type in (Q.F32, Q.F16):
        return torch.from_numpy(_stored_rows(path, t, start, stop)).reshape(
            stop - start, *shape[1:]
        )
    if len(shape) == 1:  # a block of a quantized vector holds several elements: read it whole
        whole = _dequantize(t, _stored_rows(path, t, 0, t.data.shape[0]), shape)
        return whole if (start, stop) == (0, shape[0]) else whole[start:stop].clone()
    return _dequantize(t, _stored_rows(path, t, start, stop), (stop - start, *shape[1:]))


def _dequantize(t: Any, blocks: np.ndarray, shape: tuple[int, ...]) -> Tensor:
    """Quantized ``blocks`` of tensor ``t`` -> float32 (``shape``), a few MB of rows at a
    time (the dequantizer's temporaries are several times its output)."""
    out = torch.empty(shape, dtype=torch.float32)
    step = max(1, _CHUNK_BYTES // (4 * math.prod(shape[1:]))) if len(shape) > 1 else len(blocks)
    for r in range(0, len(blocks), step):
        try:
            values = gguf.quants.dequantize(blocks[r : r + step], t.tensor_type)
        except NotImplementedError as err:
            raise LoadError(
                f"tensor {t.name}: cannot dequantize {t.tensor_type.name} ({err})"
            ) from err
        part = out[r : r + step]
        part.copy_(torch.from_numpy(np.asarray(values, dtype=np.float32)).reshape(part.shape))
    return out


def _head_rows(
    read: Callable[[int, int], Any], heads_rows: int | None, reorder: Callable[[Any, int], Any],
    start: int, stop: int,
) -> Any:  # fmt: skip
    """``read(start, stop)`` for a tensor whose rows are permuted within each head of
    ``heads_rows`` rows (None: not permuted): the whole heads around the range are read and
    reordered (``reorder(value, heads)``), then cut to [start, stop)."""
    if heads_rows is None:
        return read(start, stop)
    a, b = start // heads_rows * heads_rows, -(-stop // heads_rows) * heads_rows
    value = reorder(read(a, b), (b - a) // heads_rows)
    return value if (a, b) == (start, stop) else _cut_rows(value, start - a, stop - a)


def _cut_rows(value: Any, start: int, stop: int) -> Any:
    """Rows [start, stop) of a float tensor (copied) or of a packed layer."""
    if isinstance(value, CompressedLinear):
        return value.slice_rows(start, stop)
    return value[start:stop].contiguous()


def is_packed_linear(t: Any, packed: bool, linear: bool) -> bool:
    """Whether tensor ``t`` is read as a packed layer (``GgufLinear``)."""
    return packed and linear and len(t.shape) == 2 and t.tensor_type in _KEPT


def _lazy(
    t: Any, path: Path, packed: bool, rows: tuple[int, int] | None = None,
    per_head: int | None = None, shift: float = 0.0, linear: bool | None = None,
) -> LazyTensor:  # fmt: skip
    """How to read tensor ``t``, or its rows ``rows`` (a part of a fused tensor): packed
    layer, or float. ``per_head``: the rows are permuted within heads of that many rows
    (llama's q/k weights and biases: the converter permutes both); ``shift`` is subtracted
    from the values (Gemma's norm weights); ``linear``: read as a linear layer's weight
    (default: by its name)."""
    full = tuple(int(s) for s in reversed(t.shape))  # (N,) or (N, K)
    base, end = rows or (0, full[0])
    shape = (end - base, *full[1:])
    origin = f"{t.name} ({t.tensor_type.name}) in {path.name}"
    origin += "" if rows is None else f" [rows {base}:{end}]"
    if linear is None:
        linear = t.name.split(".")[-2] in families.LINEARS
    if is_packed_linear(t, packed, linear):
        kind, k = int(t.tensor_type), shape[1]

        def block_rows(start: int, stop: int) -> GgufLinear:
            raw = torch.from_numpy(_stored_rows(path, t, base + start, base + stop))
            return GgufLinear(raw, kind, k, bias=None)  # (rows, K / elems * bytes) uint8

        def reorder_blocks(layer: GgufLinear, n: int) -> GgufLinear:
            return GgufLinear(unpermute_rows(layer.blocks, n), kind, k, bias=None)

        read = partial(_head_rows, block_rows, per_head, reorder_blocks)
        return LazyTensor(origin, shape, read, compressed=True)

    def float_rows(start: int, stop: int) -> Tensor:
        value = _float_rows(path, t, full, base + start, base + stop)
        return value.float() - shift if shift else value

    lazy_rows = partial(_head_rows, float_rows, per_head, unpermute_rows)
    if per_head is None and not shift and t.tensor_type in (Q.F32, Q.F16):  # stored = value
        return LazyTensor(
            origin, shape, lazy_rows,
            view=lambda: torch.from_numpy(t.data).reshape(full)[base:end],
        )  # fmt: skip
    return LazyTensor(origin, shape, lazy_rows)


def read_tensors(
    reader: gguf.GGUFReader, cfg: ModelConfig, path: Path, packed: bool
) -> dict[str, LazyTensor]:
    """Every tensor of the file under kiln's names, not read yet; a fused tensor (``attn_qkv``,
    Phi-3's ``ffn_up``) gives one entry per part, each reading its own rows. With ``packed``,
    a tied head stored in a packed type is ``lm_head.weight``, read from ``token_embd``'s
    bytes; a linear weight of a quantized type kiln has no kernel for is logged (one line
    per type) and dequantized."""
    out: dict[str, LazyTensor] = {}
    permuted = cfg.family in families.PERMUTED_QK
    norm_shift = families.NORM_SHIFT.get(cfg.family, 0.0)
    unpacked: dict[str, int] = {}  # quantized types of linear weights read as float
    for t in reader.tensors:
        targets = families.kiln_names(cfg.family, t.name)
        if targets is None:
            raise LoadError(f"{path}: unexpected tensor {t.name!r} (no {cfg.family} parameter "
                            "of kiln's model matches it)")  # fmt: skip
        linear = t.name.split(".")[-2] in families.LINEARS and len(t.shape) == 2
        quantized = linear and t.tensor_type not in _FLOATS
        if packed and quantized and not is_packed_linear(t, packed, linear):
            unpacked[t.tensor_type.name] = unpacked.get(t.tensor_type.name, 0) + 1
        n = int(t.shape[-1])  # rows
        if len(targets) > 1:
            sizes = [families.part_rows(cfg, target) for target in targets]
            if sum(sizes) != n:
                raise LoadError(f"{path}: tensor {t.name} has {n} rows, expected "
                                f"{' + '.join(map(str, sizes))} ({', '.join(targets)})")  # fmt: skip
            start = 0
            for target, size in zip(targets, sizes, strict=True):
                out[target] = _lazy(t, path, packed, rows=(start, start + size))
                start += size
            continue
        heads = {"attn_q": cfg.n_heads, "attn_k": cfg.n_kv_heads}.get(t.name.split(".")[-2])
        # A wrong row count is left to the shape check: nothing to reorder.
        per_head = cfg.head_dim if permuted and heads and n == heads * cfg.head_dim else None
        shift = norm_shift if t.name.endswith("norm.weight") else 0.0
        out[targets[0]] = _lazy(t, path, packed, per_head=per_head, shift=shift)
        tied_head = t.name == "token_embd.weight" and cfg.tie_embeddings
        if tied_head and is_packed_linear(t, packed, linear=True):  # the head as stored
            out["lm_head.weight"] = _lazy(t, path, packed, linear=True)
    for name, count in unpacked.items():
        _log.warning("%s: %d linear weight(s) stored as %s, which kiln has no packed kernel "
                     "for, are dequantized to float", path.name, count, name)  # fmt: skip
    return out


def has_tokenizer(reader: gguf.GGUFReader) -> bool:
    """True when the file carries a tokenizer (``tokenizer.ggml.*`` metadata)."""
    return "tokenizer.ggml.model" in reader.fields
