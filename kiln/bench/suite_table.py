"""Markdown tables from a result dict, and the README block they go into.

``render_table(result)`` gives one row per model: eager's latency, each
contender's speed-up over eager, kiln's ratio over ONNX Runtime and OpenVINO,
the roofline floor and the worst output error; then a geomean row.
``update_readme(path, result)`` replaces the text between the
``<!-- bench:start -->`` and ``<!-- bench:end -->`` markers.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

START, END = "<!-- bench:start -->", "<!-- bench:end -->"
LOADED = 0.25  # co-tenant CPU share above which a round counts as disturbed
LABELS = {
    "inductor": "torch.compile",
    "ort": "ONNX Runtime",
    "openvino": "OpenVINO",
    "kiln": "kiln",
}


def _x(v: float | None) -> str:
    return f"{v:.2f}x" if v else "–"


def _geo(vals: list[float | None]) -> float | None:
    got = [v for v in vals if v and v > 0]
    return math.exp(sum(math.log(v) for v in got) / len(got)) if got else None


def _cell(model: dict[str, Any], c: str) -> str:
    res = model["results"].get(c, {})
    if "error" in res:
        return "unavailable" if "unavailable" in res["error"] else "error"
    return _x(model["speedup_vs_eager"].get(c))


def _worst_err(model: dict[str, Any]) -> str:
    worst: tuple[float, str] | None = None
    for c, res in model["results"].items():
        if "check_error" in res:
            return f"mismatch ({c})"
        e = res.get("max_rel_err")
        if c != "eager" and e is not None and (worst is None or e > worst[0]):
            worst = (e, c)
    return f"{worst[0]:.1e} ({worst[1]})" if worst else "–"


def render_table(result: dict[str, Any]) -> str:
    """The markdown table (with a one-line header on device and conditions)."""
    cons = [c for c in result["contenders"] if c != "eager"]
    has_kiln = "kiln" in cons
    peers = [p for p in ("ort", "openvino") if p in cons] if has_kiln else []
    head = ["Model", "eager ms", *[f"{LABELS.get(c, c)} ×" for c in cons]]
    head += [f"kiln vs {LABELS[p]}" for p in peers]
    head += ["kiln extern"] if has_kiln else []
    head += ["floor ms", "max rel err"]
    rows = [head, ["---"] + ["---:"] * (len(head) - 2) + ["---"]]
    for name, m in result["models"].items():
        eager = m["results"]["eager"].get("ms")
        loaded = any(r.get("best_round_cotenant_busy", 0) > LOADED for r in m["results"].values())
        eager_cell = (f"{eager:.3f}" + (" †" if loaded else "")) if eager else "error"
        row = [name, eager_cell, *[_cell(m, c) for c in cons]]
        row += [_x(m["kiln_vs"].get(p)) for p in peers]
        row += [_extern(m["results"]["kiln"])] if has_kiln else []
        row += [f"{m['floor_ms']:.3f} ({m['bound'][0]})", _worst_err(m)]
        rows.append(row)
    ms = list(result["models"].values())
    geo = ["**geomean**", "", *[_x(_geo([m["speedup_vs_eager"].get(c) for m in ms])) for c in cons]]
    geo += [_x(_geo([m["kiln_vs"].get(p) for m in ms])) for p in peers]
    geo += ["", "", ""] if has_kiln else ["", ""]
    rows.append(geo)
    dev, lb, la = result["device"], result.get("load_before", {}), result.get("load_after", {})
    proto = result["protocol"]
    intro = (
        f"{dev['name']} ({'AVX-512' if dev['avx512f'] else 'AVX2'}), {result['threads']} threads, "
        f"fp32, {result['date'][:10]}; torch {result['versions'].get('torch')}, onnxruntime "
        f"{result['versions'].get('onnxruntime')}, openvino {result['versions'].get('openvino')}. "
        f"Best of {proto['rounds']} interleaved rounds (median of {proto['reps']} reps each), "
        f"each contender in its own process. Load average before/after: "
        f"{_load(lb)} / {_load(la)}{_shares(result.get('summary', {}))}."
    )
    notes = (
        "× = speed-up over eager (higher is better); floor = roofline time at "
        f"{result['roofline']['peak_gflops']:.0f} GFLOP/s and {result['roofline']['mem_bw_gbs']:.0f} GB/s "
        "(c = compute-bound, m = memory-bound); max rel err = max|y − eager| / max|eager|, worst "
        f"contender in brackets; † = some contender's best round had co-tenants using more than "
        f"{LOADED:.0%} of the CPUs."
        + (
            "; kiln extern = share of kiln's kernel time in extern kernels (PyTorch or library "
            "calls), and the ops kiln could not lower (fallbacks)"
            if has_kiln
            else ""
        )
    )
    table = "\n".join("| " + " | ".join(r) + " |" for r in rows)
    return f"{intro}\n\n{table}\n\n{notes}\n"


def _extern(kiln: dict[str, Any]) -> str:
    """kiln's extern share and fallback count, from its profile (see kiln_contender)."""
    share = kiln.get("extern_share")
    if share is None:
        return "–"
    n = len(kiln.get("fallbacks", []))
    return f"{share:.0%}" + (f", {n} fallback{'s' if n > 1 else ''}" if n else "")


def _shares(summary: dict[str, Any]) -> str:
    med, top = summary.get("cotenant_busy_median"), summary.get("cotenant_busy_max")
    if med is None:
        return ""
    return f"; co-tenants' CPU share during rounds: median {med:.0%}, max {top:.0%}"


def _load(snap: dict[str, Any]) -> str:
    la = snap.get("loadavg")
    return f"{la[0]:.2f}" if la else "?"


def update_readme(readme_path: str | Path, result: dict[str, Any]) -> None:
    """Put ``render_table(result)`` between the bench markers of the README.

    If the markers are missing, a "Benchmarks" section holding them is appended
    (the file is created if needed); the text outside the markers is kept.
    """
    path = Path(readme_path)
    text = path.read_text() if path.exists() else ""
    block = f"{START}\n{render_table(result)}{END}"
    i, j = text.find(START), text.find(END)
    if i != -1 and j > i:
        text = text[:i] + block + text[j + len(END) :]
    else:
        text = text.rstrip("\n") + ("\n\n" if text else "") + f"## Benchmarks\n\n{block}\n"
    path.write_text(text)


def latest_result(results_dir: str | Path) -> dict[str, Any] | None:
    """The newest result file (by its recorded date) in ``results_dir``, or None."""
    found = []
    for p in Path(results_dir).glob("*.json"):
        try:
            data = json.loads(p.read_text())
        except (OSError, json.JSONDecodeError):
            continue
        if isinstance(data, dict) and "models" in data and "date" in data:
            found.append((data["date"], data))
    return max(found, key=lambda d: d[0])[1] if found else None
