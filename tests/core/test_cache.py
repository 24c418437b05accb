"""kiln's cache folder and the per-kind overrides a benchmark uses for cold compiles."""

from __future__ import annotations

from pathlib import Path

import pytest

from kiln.core.cache import cache_dir


def test_sub_folders_live_under_the_root_unless_moved(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("KILN_CACHE_DIR", str(tmp_path / "root"))
    monkeypatch.delenv("KILN_PROGRAMS_DIR", raising=False)
    assert cache_dir() == tmp_path / "root"
    assert cache_dir("programs") == tmp_path / "root" / "programs"
    monkeypatch.setenv("KILN_PROGRAMS_DIR", str(tmp_path / "cold"))
    assert cache_dir("programs") == tmp_path / "cold" and (tmp_path / "cold").is_dir()
    assert cache_dir("captures") == tmp_path / "root" / "captures"  # others stay put
    assert cache_dir() == tmp_path / "root"
