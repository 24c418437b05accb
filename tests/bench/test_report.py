"""The markdown table and the README block, from a hand-made result."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from kiln.bench.__main__ import main
from kiln.bench.suite_table import END, START, latest_result, render_table, update_readme


def _result(date: str = "2026-01-02T03:04:05+00:00") -> dict[str, Any]:
    def model(eager: float, ort: float, kiln: float | None) -> dict[str, Any]:
        res: dict[str, Any] = {
            "eager": {"ms": eager},
            "ort": {
                "ms": ort,
                "max_rel_err": 1e-6,
                "best_round_cotenant_busy": 0.5 if eager > 1 else 0,
            },
            "kiln": {"ms": kiln, "max_rel_err": 3e-6, "extern_share": 0.25, "fallbacks": ["f: why"]}
            if kiln
            else {"error": "unavailable: x"},
        }
        return {
            "results": res,
            "speedup_vs_eager": {c: eager / r["ms"] if "ms" in r else None for c, r in res.items()},
            "kiln_vs": {"ort": ort / kiln if kiln else None, "openvino": None},
            "floor_ms": 0.01,
            "bound": "compute",
        }

    return {
        "date": date,
        "device": {"name": "Test CPU", "avx512f": False},
        "versions": {"torch": "2.13", "onnxruntime": "1.32", "openvino": "2026.4"},
        "threads": 2,
        "protocol": {"rounds": 3, "reps": 10},
        "roofline": {"peak_gflops": 100.0, "mem_bw_gbs": 20.0},
        "load_before": {"loadavg": [0.5, 0.4, 0.3]},
        "load_after": {"loadavg": [0.6, 0.4, 0.3]},
        "contenders": ["eager", "ort", "kiln"],
        "summary": {"cotenant_busy_median": 0.1, "cotenant_busy_max": 0.5},
        "models": {"a": model(1.0, 0.25, 0.2), "b": model(2.0, 2.0, None)},
    }


def test_render_table() -> None:
    text = render_table(_result())
    lines = [ln for ln in text.splitlines() if ln.startswith("|")]
    assert lines[0].split("|")[1:-1] == [
        " Model ", " eager ms ", " ONNX Runtime × ", " kiln × ", " kiln vs ONNX Runtime ",
        " kiln extern ", " floor ms ", " max rel err ",
    ]  # fmt: skip
    assert (
        "| a | 1.000 | 4.00x | 5.00x | 1.25x | 25%, 1 fallback | 0.010 (c) | 3.0e-06 (kiln) |"
        in lines
    )
    assert "| b | 2.000 † | 1.00x | unavailable | – |" in lines[3]
    # geomean over models that have the figure: ort sqrt(4 * 1) = 2, kiln only model a
    assert lines[-1].startswith("| **geomean** |  | 2.00x | 5.00x | 1.25x |")
    assert "Test CPU (AVX2)" in text and "median 10%, max 50%" in text


def test_update_readme_replaces_only_the_block(tmp_path: Path) -> None:
    readme = tmp_path / "README.md"
    readme.write_text(f"# kiln\n\nintro\n\n{START}\nold table\n{END}\n\nafter\n")
    update_readme(readme, _result())
    text = readme.read_text()
    assert "old table" not in text and "| **geomean** |" in text
    assert text.startswith("# kiln\n\nintro\n\n" + START) and text.endswith(END + "\n\nafter\n")
    update_readme(readme, _result())
    assert text == readme.read_text()


def test_update_readme_appends_markers(tmp_path: Path) -> None:
    readme = tmp_path / "README.md"
    readme.write_text("# kiln\n")
    update_readme(readme, _result())
    text = readme.read_text()
    assert text.count(START) == 1 and text.count(END) == 1 and "## Benchmarks" in text


def test_latest_result_and_cli_render(tmp_path: Path, capsys: Any) -> None:
    (tmp_path / "old.json").write_text(json.dumps(_result("2026-01-01T00:00:00+00:00")))
    new = _result("2026-02-01T00:00:00+00:00")
    (tmp_path / "new.json").write_text(json.dumps(new))
    (tmp_path / "junk.json").write_text("{not json")
    latest = latest_result(tmp_path)
    assert latest is not None and latest["date"] == new["date"]
    assert main(["--from-result", str(tmp_path / "new.json")]) == 0
    assert "| **geomean** |" in capsys.readouterr().out
