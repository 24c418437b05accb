"""``load_model``: a Hugging Face folder, a GGUF file or a catalog name -> a ready ``Transformer``.

The readers (``hf.py``, ``gguf.py``) give a ``ModelConfig`` and every tensor as a
``LazyTensor`` (name, shape, where it lives). ``build_model`` checks that set against the
model before reading anything — a missing tensor, an unexpected one or a wrong shape is a
``LoadError`` naming it, the file, and both shapes — then builds the model on the meta
device and reads the tensors one at a time into it: no random initialisation, no second
copy of the checkpoint. Tensors already in the requested dtype stay views of the
memory-mapped file; packed GGUF layers replace their ``nn.Linear`` with ``Int4Linear``.

    loaded = load_model("smollm2")                     # the catalog's GGUF, Q4_1 kept packed
    loaded = load_model("/ckpt/llama", dtype=torch.bfloat16)
    logits = loaded.model(tokens, 0, loaded.model.new_cache(1, 256))
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from kiln.compress.modules import CompressedLinear
from kiln.core.offline import hub_offline
from kiln.models import catalog, compressed, hf
from kiln.models import gguf as gguf_reader
from kiln.models.config import ModelConfig
from kiln.models.readers import LazyTensor, LoadError
from kiln.models.transformer import Transformer

DTYPES = (torch.float32, torch.bfloat16, torch.float16)
CATALOG = {"smollm2": catalog.smollm2_gguf_path}
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


@dataclass
class LoadedModel:
    """A loaded checkpoint: the model (eval mode), its config, its tokenizer (None when the
    checkpoint has none) and ``source``, the file or folder it was read from."""

    model: Transformer
    config: ModelConfig
    tokenizer: Any | None
    source: str


def load_model(
    path: str | Path,
    dtype: torch.dtype = torch.float32,
    packed: bool = True,
    device: torch.device | str = "cpu",
    with_tokenizer: bool = True,
) -> LoadedModel:
    """Load a Hugging Face folder, a ``.gguf`` file or a catalog name ("smollm2").

    ``dtype`` (float32 / bfloat16 / float16) is that of every float parameter; ``packed``
    keeps a GGUF's Q4_0 / Q4_1 linear weights 4-bit (``Int4Linear``, which computes in
    fp32) instead of dequantizing them; HF checkpoints ignore it. Raises ``LoadError`` or
    ``ConfigError`` naming the file and what is wrong.
    """
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {DTYPES}, got {dtype}")
    where = resolve(path)
    tokenizer = None
    if where.is_dir():
        cfg = hf.read_config(where)
        if compressed.is_compressed(where):  # written by kiln compress
            tensors = compressed.read_compressed_tensors(where, cfg)
        else:
            tensors = hf.read_tensors(where, cfg)
        model = build_model(cfg, tensors, dtype, str(where))
        if with_tokenizer and any((where / f).is_file() for f in _TOKENIZER_FILES):
            tokenizer = _auto_tokenizer(where)
    else:
        reader = gguf_reader.open_reader(where)
        cfg = gguf_reader.read_config(reader, where)
        tensors = gguf_reader.read_tensors(reader, cfg, where, packed)
        model = build_model(cfg, tensors, dtype, str(where))
        if with_tokenizer and gguf_reader.has_tokenizer(reader):
            tokenizer = _auto_tokenizer(where.parent, gguf_file=where.name)
    return LoadedModel(model.to(device), cfg, tokenizer, str(where))


def resolve(path: str | Path) -> Path:
    """The folder or GGUF file ``path`` names (a catalog name is looked up first)."""
    if isinstance(path, str) and path in CATALOG and not Path(path).exists():
        try:
            return CATALOG[path]()
        except catalog.RealModelMissing as err:
            raise LoadError(f"catalog model {path!r}: {err}") from err
    where = Path(path).expanduser()
    if not where.exists():
        raise LoadError(f"{where}: no such file or folder (nor a catalog name: {list(CATALOG)})")
    if where.is_file() and where.suffix != ".gguf":
        raise LoadError(f"{where}: expected a Hugging Face checkpoint folder or a .gguf file")
    return where


def _auto_tokenizer(folder: Path, **kwargs: Any) -> Any:
    """The checkpoint's tokenizer through transformers, offline."""
    hub_offline()
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(folder), **kwargs)


def _check(
    expected: Mapping[str, tuple[int, ...]], tensors: Mapping[str, LazyTensor], where: str
) -> None:
    """Every parameter present once, with its shape; nothing left over."""
    missing = [name for name in expected if name not in tensors]
    if missing:
        more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
        raise LoadError(f"{where}: missing tensor {missing[0]}{more}; kiln's model needs it")
    for name, lazy in tensors.items():
        if name not in expected:
            raise LoadError(f"{where}: unexpected tensor {lazy.origin} (kiln name {name}); "
                            "the config describes no such parameter")  # fmt: skip
        if tuple(lazy.shape) != expected[name]:
            raise LoadError(f"{where}: tensor {lazy.origin} has shape {tuple(lazy.shape)}, "
                            f"but {name} must be {expected[name]}")  # fmt: skip


def build_model(
    cfg: ModelConfig, tensors: Mapping[str, LazyTensor], dtype: torch.dtype, where: str
) -> Transformer:
    """A ``Transformer(cfg)`` holding ``tensors`` (kiln names), checked before reading."""
    with torch.device("meta"):
        model = Transformer(cfg)
    expected = {name: tuple(p.shape) for name, p in model.named_parameters()}  # tied: once
    tensors = dict(tensors)
    if cfg.tie_embeddings:  # some tied checkpoints repeat the head; it is the embedding
        head = tensors.pop("lm_head.weight", None)
        if "embed.weight" not in tensors and head is not None:
            tensors["embed.weight"] = head  # safetensors kept the shared tensor's other name
    _check(expected, tensors, where)
    # Weights before biases: a bias may belong to a layer just replaced by a packed one.
    for name in sorted(tensors, key=lambda n: n.endswith(".bias")):
        lazy = tensors[name]
        owner, leaf = name.rsplit(".", 1)
        module = model.get_submodule(owner)
        value = lazy.read()
        if isinstance(value, CompressedLinear):
            parent, _, attr = owner.rpartition(".")  # "" for the top-level lm_head
            setattr(model.get_submodule(parent), attr, value)
            continue
        if tuple(value.shape) != expected[name]:
            raise LoadError(f"{where}: tensor {lazy.origin} read as {tuple(value.shape)}, "
                            f"but {name} must be {expected[name]}")  # fmt: skip
        if isinstance(module, CompressedLinear):  # the bias of a packed layer: fp32 buffer
            module.bias = value.float().contiguous()
            continue
        weight = value.to(dtype=dtype, memory_format=torch.contiguous_format)
        setattr(module, leaf, nn.Parameter(weight, requires_grad=False))
    if cfg.tie_embeddings:
        model.lm_head.weight = model.embed.weight
    _no_meta_left(model, where)
    return model.eval()


def _no_meta_left(model: nn.Module, where: str) -> None:
    left: list[tuple[str, Tensor]] = [*model.named_parameters(), *model.named_buffers()]
    for name, t in left:
        if t.is_meta:
            raise LoadError(f"{where}: {name} was not filled (a loader bug, please report)")
