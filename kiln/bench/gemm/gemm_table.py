"""Markdown for a GEMM benchmark result: ``render_table(result) -> str``.

One row per case (shape x epilogue): µs per contender, the fastest library
routine, kiln's ratio to it and kiln's error against the float64 reference;
then one row per shape class with the verdict (kiln within 1.2x of the fastest
library routine on every case of the class) and the geomean ratio.
"""

from __future__ import annotations

from typing import Any

from kiln.bench.gemm.gemm_contenders import LABELS, UNFUSED

LOADED = 0.25  # co-tenant CPU share above which a best round counts as disturbed


def _us(v: float | None) -> str:
    if not v:
        return "–"
    return f"{v:.1f}" if v < 100 else f"{v:.0f}"


def _ratio(v: float | None, digits: int = 2) -> str:
    return f"{v:.{digits}f}x" if v else "–"


def _cell(entry: dict[str, Any], c: str) -> str:
    v = entry["us"].get(c)
    if v is None:
        err = str(entry["facts"].get(c, {}).get("error", ""))
        return "unavailable" if "unavailable" in err or "ImportError" in err else "error"
    fastest = entry.get("fastest_library") == c
    loaded = entry.get("best_round_cotenant_busy", {}).get(c, 0) > LOADED
    return ("**" + _us(v) + "**" if fastest else _us(v)) + (" †" if loaded else "")


def _kernels(entry: dict[str, Any]) -> str:
    ks = entry["facts"].get("kiln", {}).get("kernels") or []
    return " + ".join(f"{k['template']}/{k['executor']}" for k in ks) or "–"


def _verdict(v: bool | None) -> str:
    return "–" if v is None else ("yes" if v else "no")


def _header(result: dict[str, Any]) -> str:
    dev, ver, proto = result["device"], result["versions"], result["protocol"]
    lb, la = result.get("load_before", {}), result.get("load_after", {})
    med, top = result.get("cotenant_busy_median"), result.get("cotenant_busy_max")
    shares = (
        f"; co-tenants' CPU share during rounds: median {med:.0%}, max {top:.0%}" if med else ""
    )
    return (
        f"GEMM Y = act(X·Wᵀ + b), fp32, W constant. {dev['name']} "
        f"({'AVX-512' if dev['avx512f'] else 'AVX2'}), {result['threads']} threads, "
        f"{result['date'][:10]}; torch {ver.get('torch')}, onnxruntime {ver.get('onnxruntime')}, "
        f"numpy {ver.get('numpy')}. Best of {proto['rounds']} interleaved rounds (median of "
        f"{proto['reps']} reps of ≈{proto['rep_ms']:g} ms each), each contender in its own "
        f"process. Load average before/after: {_load(lb)} / {_load(la)}{shares}."
    )


def _load(snap: dict[str, Any]) -> str:
    la = snap.get("loadavg")
    return f"{la[0]:.2f}" if la else "?"


def render_table(result: dict[str, Any]) -> str:
    """The per-case table and the per-class verdict table, with a header line."""
    cons = result["contenders"]
    head = ["Class", "M×K×N", "Epilogue"]
    head += [f"{LABELS.get(c, c)} µs" + (" (unfused)" if c in UNFUSED else "") for c in cons]
    head += ["fastest library", "kiln / fastest", "kiln rel err", "kiln kernels"]
    rows = [head, ["---"] * 3 + ["---:"] * (len(cons) + 2) + ["---:", "---"]]
    for e in result["cases"].values():
        err = e.get("accuracy", {}).get("kiln", {})
        rel = err.get("max_rel_err")
        err_cell = f"{rel:.1e}" if rel is not None else err.get("check_error", "–")
        fastest = e.get("fastest_library")
        rows.append(
            [
                e["shape_class"],
                e["shape"].replace("x", "×"),
                e["epilogue"],
                *[_cell(e, c) for c in cons],
                f"{LABELS.get(fastest, fastest)} {_us(e['fastest_library_us'])}"
                if fastest
                else "–",
                _ratio(e.get("kiln_ratio")),
                err_cell,
                _kernels(e),
            ]  # fmt: skip
        )
    target = result.get("target_ratio", 1.2)
    crow = [["Class", "cases", "geomean kiln / fastest", "worst (case)",
             "gelu geomean / worst", "bias geomean / worst", f"within {target}x (every case)"],
            ["---", "---:", "---:", "---", "---:", "---:", "---"]]  # fmt: skip
    for cls, s in result["classes"].items():
        worst = f"{_ratio(s['worst_ratio'], 3)} ({s['worst_case']})" if s["worst_case"] else "–"
        epi = [
            f"{_ratio(s['by_epilogue'].get(x, {}).get('geomean_ratio'), 3)} / "
            f"{_ratio(s['by_epilogue'].get(x, {}).get('worst_ratio'), 3)}"
            for x in ("gelu", "bias")
        ]
        crow.append([cls, f"{s['measured']}/{len(s['cases'])}", _ratio(s["geomean_ratio"], 3),
                     worst, *epi, _verdict(s["within_1_2x"])])  # fmt: skip
    notes = (
        "µs = best round's median per call (lower is better); **bold** = fastest library routine; "
        "kiln / fastest > 1 means kiln is slower. Libraries: oneDNN with W pre-packed "
        "(`mkldnn._linear_pointwise`, GELU as a fused post-op), torch `F.gelu(F.linear(...))` "
        "(MKL sgemm, GELU unfused), ONNX Runtime (IOBinding), numpy `x @ Wt + b` then scipy "
        "`erf` GELU (OpenBLAS, unfused). kiln rel err = max|y − ref| / max|ref| against float64 "
        f"torch. † = co-tenants used more than {LOADED:.0%} of the CPUs during that best round."
    )

    def md(rs: list[list[str]]) -> str:
        return "\n".join("| " + " | ".join(r) + " |" for r in rs)

    return f"{_header(result)}\n\n{md(rows)}\n\n{md(crow)}\n\n{notes}\n"
