"""The load-memory benchmark: a case runs in its own process and reports its peak, and the
table shows each case's process, ranks and total."""

from __future__ import annotations

from pathlib import Path

import pytest

from kiln.bench import load_memory


@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="needs Linux /proc")
def test_a_case_reports_its_own_peak_from_a_fresh_process(tmp_path: Path) -> None:
    got = load_memory._spawn("imports", 1, tmp_path / "store")
    assert "error" not in got, got
    assert 50e6 < got["peak_rss_bytes"] < 2e9  # python + torch + kiln, nothing loaded


def test_the_table_sums_the_launcher_and_its_ranks() -> None:
    result = {
        "model": "m", "new_tokens": 4, "date": "2026-11-24T00:00:00+00:00",
        "device": {"name": "cpu", "avx512f": False, "avx2": True},
        "cases": [
            {"case": "tp2", "command": "kiln generate m --tp 2", "peak_rss_bytes": 400e6,
             "rank_peak_rss_bytes": [600e6, 650e6], "total_peak_rss_bytes": 1650e6,
             "load_s": 4.5, "tokens": [1, 2]},
            {"case": "resident", "command": "kiln generate m", "error": "boom"},
        ],
    }  # fmt: skip
    table = load_memory.render_markdown(result)
    assert "| tp2 | `kiln generate m --tp 2` | 400 | 600 / 650 | 1650 | 4.5 | 1 2 |" in table
    assert "| resident | kiln generate m | error |" in table
    assert "cpu (AVX2)" in table
