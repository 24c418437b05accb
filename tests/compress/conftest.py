"""Measured plans go to a temporary folder, never to the user's cache."""

from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture(autouse=True)
def rounds_in_tmp(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    from kiln.compress import rounds

    folder = tmp_path / "compress-rounds"
    monkeypatch.setattr(rounds, "cache_dir", lambda sub="": folder)
    return folder
