"""The prefill benchmark's results: one entry per (contender, prompt length) with its ratios,
and the markdown table (``kiln.bench.prefill`` measures, this file summarises)."""

from __future__ import annotations

from statistics import median
from typing import Any

from kiln.bench.gguf_variants import format_types

KILN = ("kiln-before", "kiln-after")


def summarize(rounds: dict[tuple[str, int], list[dict[str, Any]]]) -> list[dict[str, Any]]:
    """One entry per (contender, length): least and median TTFT, the ratios."""
    entries: list[dict[str, Any]] = []
    for (name, n), rs in rounds.items():
        done = [r for r in rs if "error" not in r]
        e: dict[str, Any] = {"contender": name, "length": n, "rounds": rs}
        if done:
            best = min(done, key=lambda r: r["ttft_s"])
            e["best_round_cotenant_busy"] = best.get("cotenant_busy")
            e.update(ttft_ms=min(r["ttft_s"] for r in done) * 1e3,
                     median_ms=median(r["ttft_s"] for r in done) * 1e3,
                     tokens_per_s=n / min(r["ttft_s"] for r in done),
                     token=done[0].get("token"))  # fmt: skip
        else:
            e["error"] = rs[-1]["error"] if rs else "no rounds ran"
        entries.append(e)
    by = {(e["contender"], e["length"]): e for e in entries if "ttft_ms" in e}
    for e in entries:
        if "ttft_ms" not in e:
            continue
        n = e["length"]
        before = by.get(("kiln-before", n))
        if e["contender"] in KILN and before is not None:
            e["speedup_vs_before"] = before["ttft_ms"] / e["ttft_ms"]
            e["same_token"] = e["token"] == before["token"]
        for peer in ("llamacpp", "llama-bench"):
            p = by.get((peer, n))
            e[f"vs_{peer}"] = p["ttft_ms"] / e["ttft_ms"] if p else None
    return entries


def _fmt(v: float | None, spec: str) -> str:
    return "–" if v is None else format(v, spec)


def render_markdown(result: dict[str, Any]) -> str:
    """The TTFT table, the skipped contenders and (when profiled) the breakdown."""
    dev, g = result["device"], result.get("gguf")
    model = "SmolLM2-135M Q4_1 GGUF" if g is None else f"{g['file']} ({g['file_type']})"
    lines = [
        f"Prefill (time to first token), {model}, {dev['name']} "
        f"({dev['isa']}, {result['threads']} threads), {result['date'][:10]}: batch 1, "
        f"{result['prompt']}, least of {result['repeats']} interleaved rounds.",
        *([] if g is None else [f"File tensor types: {format_types(g['tensor_types'])}."]),
        "",
        "| contender | prompt tokens | TTFT ms | median ms | tokens/s | speed-up vs before "
        "| vs llama.cpp | same first token | co-tenant busy |",
        "|---|--:|--:|--:|--:|--:|--:|--:|--:|",
    ]
    for e in sorted(result["results"], key=lambda e: (e["length"], e["contender"])):
        if "ttft_ms" not in e:
            lines.append(f"| {e['contender']} | {e['length']} | error: {e['error'][:80]} |")
            continue
        peer = e.get("vs_llamacpp") or e.get("vs_llama-bench")
        same = e.get("same_token")
        lines.append(
            f"| {e['contender']} | {e['length']} | {e['ttft_ms']:.0f} | {e['median_ms']:.0f} "
            f"| {e['tokens_per_s']:.0f} | {_fmt(e.get('speedup_vs_before'), '.2f')} "
            f"| {_fmt(peer, '.2f')} | {'–' if same is None else ('yes' if same else 'NO')} "
            f"| {_fmt(e.get('best_round_cotenant_busy'), '.0%')} |"
        )
    lines.append(
        "\nCo-tenant busy: the share of all CPUs other processes used during the "
        "best round (a figure measured beside co-tenants is slower than the machine)."
    )
    for name, facts in result["contenders"].items():
        if "error" in facts:
            lines.append(f"\n{name}: {facts['error'][:200]}")
    for name, per_len in result.get("breakdown", {}).items():
        lines += ["", f"Where {name}'s prefill time goes (ms; least of the profiled runs "
                      "per category; hooks add a little):", ""]  # fmt: skip
        cats = ("total", "linear_all", "attention_core", "norm", "mlp_activation", "head",
                "other")  # fmt: skip
        lines += ["| tokens | " + " | ".join(cats) + " |", "|--:|" + "--:|" * len(cats)]
        for n, b in per_len.items():
            if "error" in b:
                lines.append(f"| {n} | error: {b['error'][:80]} |")
                continue
            cells = [f"{b.get(c, 0.0) * 1e3:.0f} ({b.get(c, 0.0) / b['total']:.0%})"
                     if c != "total" else f"{b['total'] * 1e3:.0f}" for c in cats]  # fmt: skip
            lines.append(f"| {n} | " + " | ".join(cells) + " |")
    kern = result.get("kernels")
    if isinstance(kern, list):
        lines += ["", "One INT4 g32 layer, 1 thread, best of 20 (ms):", "",
                  "| K x N | rows | decode kernel | prefill GEMM | dequant + F.linear "
                  "| MKL on fp32 W | GEMM GFLOP/s |", "|---|--:|--:|--:|--:|--:|--:|"]  # fmt: skip
        for r in kern:
            lines.append(f"| {r['k']} x {r['n']} | {r['m']} | {r['decode_kernel_ms']:.3f} "
                         f"| {r['gemm_ms']:.3f} | {r['dequant_linear_ms']:.3f} "
                         f"| {r['mkl_fp32_ms']:.3f} | {r['gemm_gflops']:.0f} |")  # fmt: skip
    return "\n".join(lines) + "\n"
