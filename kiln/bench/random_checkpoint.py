"""Hugging Face checkpoints of published architectures with random weights, for timing.

Speed and memory do not depend on the weights' values, so a published model's config
(``kiln.deploy.architecture.PUBLISHED``, e.g. "qwen2-1.5b") with random weights is as good a
subject for the planner's predictions as the real model, and needs no download.
``random_checkpoint(name)`` writes one with transformers (bf16 safetensors, the dtype these
models are published in) under kiln's cache and returns the folder; a second call reuses it.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch

from kiln.core.cache import cache_dir
from kiln.core.offline import hub_offline
from kiln.deploy.architecture import PUBLISHED, published_config


def random_checkpoint(name: str, directory: Path | None = None, seed: int = 0) -> Path:
    """The folder of ``name``'s random-weight checkpoint (written on first use)."""
    config = published_config(name)
    if config is None:
        raise ValueError(f"no published config named {name!r}; known: {', '.join(PUBLISHED)}")
    folder = (directory or cache_dir("random-checkpoints")) / f"{name}-seed{seed}"
    if (folder / "config.json").is_file() and any(folder.glob("*.safetensors")):
        return folder
    hub_offline()
    from transformers import AutoConfig, AutoModelForCausalLM

    raw = json.loads(config.read_text(encoding="utf-8"))
    tmp = folder.with_name(folder.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    (tmp / "config.json").write_text(json.dumps(raw), encoding="utf-8")
    cfg = AutoConfig.from_pretrained(str(tmp))
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
    model.save_pretrained(str(tmp), safe_serialization=True)
    del model
    shutil.rmtree(folder, ignore_errors=True)
    tmp.rename(folder)  # complete or absent: an interrupted write is never reused
    return folder
