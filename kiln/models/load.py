"""``load_model``: a Hugging Face folder, a GGUF file or a catalog name -> a ready ``Transformer``.

The readers (``hf.py``, ``gguf.py``, ``compressed.py``) give a ``ModelConfig`` and every
tensor as a ``LazyTensor`` (name, shape, how to read it); ``open_checkpoint`` stops there
(a ``Checkpoint``: config, tensor table, tokenizer on request, no weight read).
``kiln.models.fill`` checks the table against the model before reading anything, builds
the model on the meta device and reads the tensors one block at a time: no random
initialisation, no second copy of the checkpoint. A load can be a part of the model and
stream each block to where it goes (``kiln.models.parts``): ``layers`` (a pipeline
stage: the other blocks are never read), ``shard`` (a tensor-parallel rank's rows or
columns of each block linear: only those are read), ``on_block`` (quantize the block,
write it to an offload store, ... as soon as it is filled). Tensors kept as stored in the
requested dtype stay views of the memory-mapped file; packed GGUF layers replace their
``nn.Linear`` with ``GgufLinear`` (the file's blocks: Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K,
Q5_K, Q6_K; 8-bit activations by default, ``GgufLinear.activations``).

    loaded = load_model("smollm2")                     # the catalog's GGUF, kept packed
    loaded = load_model("/ckpt/llama", dtype=torch.bfloat16)
    logits = loaded.model(tokens, 0, loaded.model.new_cache(1, 256))
    stage = load_model("/ckpt/llama", layers=range(16, 32)).model  # blocks 0-15 on meta
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from kiln.core.offline import hub_offline
from kiln.models import catalog, compressed, hf
from kiln.models import gguf as gguf_reader
from kiln.models.config import ModelConfig
from kiln.models.fill import build_model
from kiln.models.parts import BlockHook, BlockShard
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


@dataclass
class Checkpoint:
    """An opened checkpoint: its config and every tensor's name, shape and reader, with no
    weight read yet. ``load`` reads (a part of) it into a ``Transformer``."""

    config: ModelConfig
    tensors: dict[str, LazyTensor]
    source: Path
    tokenizer_source: tuple[Path, dict[str, Any]] | None = field(default=None, repr=False)

    def load(
        self,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
        *,
        layers: range | None = None,
        shard: BlockShard | None = None,
        on_block: BlockHook | None = None,
    ) -> Transformer:
        """The model holding this checkpoint's weights (``load_model`` documents the
        arguments); blocks outside ``layers`` stay on the meta device."""
        if dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {DTYPES}, got {dtype}")
        return build_model(
            self.config, self.tensors, dtype, str(self.source), layers=layers, shard=shard,
            on_block=on_block, device=device,
        )  # fmt: skip

    def tokenizer(self) -> Any | None:
        """The checkpoint's tokenizer through transformers (None when it has none)."""
        if self.tokenizer_source is None:
            return None
        folder, kwargs = self.tokenizer_source
        return _auto_tokenizer(folder, **kwargs)


def open_checkpoint(path: str | Path, packed: bool = True) -> Checkpoint:
    """Read the config and tensor table of a Hugging Face folder, a ``.gguf`` file or a
    catalog name; no weight is read. ``packed``: keep a GGUF's quantized linear weights (and
    a tied head stored quantized) packed as their blocks (``GgufLinear``) instead of
    dequantizing them (HF checkpoints ignore it)."""
    where = resolve(path)
    if where.is_dir():
        cfg = hf.read_config(where)
        if compressed.is_compressed(where):  # written by kiln compress
            tensors = compressed.read_compressed_tensors(where, cfg)
        else:
            tensors = hf.read_tensors(where, cfg)
        has_tokenizer = any((where / f).is_file() for f in _TOKENIZER_FILES)
        folder: tuple[Path, dict[str, Any]] | None = (where, {}) if has_tokenizer else None
        return Checkpoint(cfg, tensors, where, folder)
    reader = gguf_reader.open_reader(where)
    cfg = gguf_reader.read_config(reader, where)
    tensors = gguf_reader.read_tensors(reader, cfg, where, packed)
    gguf_source = (where.parent, {"gguf_file": where.name})
    return Checkpoint(
        cfg, tensors, where, gguf_source if gguf_reader.has_tokenizer(reader) else None
    )


def load_model(
    path: str | Path,
    dtype: torch.dtype = torch.float32,
    packed: bool = True,
    device: torch.device | str = "cpu",
    with_tokenizer: bool = True,
    *,
    layers: range | None = None,
    shard: BlockShard | None = None,
    on_block: BlockHook | None = None,
) -> LoadedModel:
    """Load a Hugging Face folder, a ``.gguf`` file or a catalog name ("smollm2").

    ``dtype`` (float32 / bfloat16 / float16) is that of every float parameter; ``packed``
    keeps a GGUF's quantized linear weights packed (``GgufLinear``, whose decode rows
    multiply 8-bit activation blocks by default, exactly in fp32 with ``activations="fp32"``;
    ``open_checkpoint``) instead of dequantizing them; HF checkpoints ignore it. Each tensor goes to
    ``device`` as soon as it is read.

    A part of the model, streamed (``kiln.models.parts``): ``layers`` reads only those
    blocks (plus the embedding when they start at 0, the final norm and head when they
    end at the last block; the rest stays on the meta device, unread); ``shard`` reads
    only a slice of each block linear; ``on_block(i, block)`` runs as soon as block ``i``
    is filled, so a hook that quantizes, offloads or releases it keeps at most one float
    block resident. Raises ``LoadError`` or ``ConfigError`` naming the file and what is
    wrong.
    """
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {DTYPES}, got {dtype}")
    checkpoint = open_checkpoint(path, packed)
    # The tokenizer first: the memory its loading passes through is reused by the weights.
    tokenizer = checkpoint.tokenizer() if with_tokenizer else None
    model = checkpoint.load(dtype, device, layers=layers, shard=shard, on_block=on_block)
    return LoadedModel(model, checkpoint.config, tokenizer, str(checkpoint.source))


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


def has_tokenizer(path: str | Path) -> bool:
    """Whether checkpoint ``path`` (a folder, a .gguf file or a catalog name) carries a
    tokenizer; reads no weight (a GGUF's header is parsed once per process)."""
    where = resolve(path)
    if where.is_dir():
        return any((where / f).is_file() for f in _TOKENIZER_FILES)
    return gguf_reader.header(where)[1]


def _auto_tokenizer(folder: Path, **kwargs: Any) -> Any:
    """The checkpoint's tokenizer through transformers, offline; built once per process
    and version of its source (a GGUF's vocabulary takes seconds to read). Callers share
    it: kiln only calls a tokenizer, never changes one."""
    source = folder / kwargs["gguf_file"] if "gguf_file" in kwargs else folder
    stamp = source.stat().st_mtime_ns
    return _tokenizer(str(folder.resolve()), tuple(sorted(kwargs.items())), stamp)


@functools.lru_cache(maxsize=8)
def _tokenizer(folder: str, kwargs: tuple[tuple[str, Any], ...], stamp: int) -> Any:
    hub_offline()
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(folder, **dict(kwargs))
