"""The planner's predictions against execution on this CPU: ``python -m kiln.bench.plan_accuracy``.

For each plan of a fixed list (weight format x batch x offload on SmolLM2), the planner's
estimate for ``--hardware cpu`` is put beside the plan executed in a fresh process
(``kiln.deploy.execute.measure``: decode ms/token, time to first token, peak RSS). Reported:
each relative error, their median and worst, and whether predicted memory was ever more than
5% below the measured peak (docs/benchmarks.md, "Large-model measurements").
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

from kiln.bench import RESULTS_DIR, system
from kiln.deploy.architecture import read_architecture
from kiln.deploy.estimate import FORMATS, Layout
from kiln.deploy.execute import measure
from kiln.deploy.hardware import parse_hardware
from kiln.deploy.plan_job import measurements
from kiln.deploy.planner import Request, activation_bytes, evaluate

PLANS = [  # (format, batch, offload)
    ("fp32", 1, "none"), ("fp32", 4, "none"), ("bf16", 1, "none"), ("bf16", 4, "none"),
    ("int8", 1, "none"), ("int8", 4, "none"), ("int4-g64", 1, "none"), ("int4-g64", 4, "none"),
    ("int4-g32", 1, "none"), ("fp32", 1, "disk"), ("int8", 1, "disk"),
]  # fmt: skip


def run(model: str, prompt_len: int, gen_len: int) -> dict[str, Any]:
    arch, hw = read_architecture(model), parse_hardware("cpu")
    known = measurements(model, hw)
    rows = []
    for fmt, batch, offload in PLANS:
        lay = Layout(FORMATS[fmt], 1, 1, 1, batch, prompt_len, gen_len, offload,
                     activation_bytes(hw, fmt))  # fmt: skip
        est = evaluate(arch, hw, lay, Request(batch=batch, prompt_len=prompt_len,
                                              gen_len=gen_len), known).estimate  # fmt: skip
        got = measure(model, {"tp": 1, "pp": 1, "batch": batch, "offload": offload}, fmt,
                      prompt_len, gen_len)  # fmt: skip
        row: dict[str, Any] = {
            "plan": f"{fmt}, batch {batch}, offload {offload}", "engine": got.engine,
            "predicted": {"ms_per_token": est.ms_per_token, "ttft_ms": est.ttft_ms,
                          "peak_bytes": est.peak_device_bytes},
            "measured": {"ms_per_token": got.ms_per_token, "ttft_ms": got.ttft_ms,
                         "peak_bytes": got.peak_rss_bytes},
        }  # fmt: skip
        row["error"] = {k: row["predicted"][k] / row["measured"][k] - 1 for k in row["measured"]}
        print(f"{row['plan']:32s} ms/token {est.ms_per_token:7.2f} vs {got.ms_per_token:7.2f}  "
              f"ttft {est.ttft_ms:7.1f} vs {got.ttft_ms:7.1f}  peak {est.peak_device_bytes / 1e9:5.2f}"
              f" vs {got.peak_rss_bytes / 1e9:5.2f} GB")  # fmt: skip
        rows.append(row)
    summary: dict[str, Any] = {}
    for k in ("ms_per_token", "ttft_ms", "peak_bytes"):
        errs = [abs(r["error"][k]) for r in rows]
        summary[k] = {"median_abs_error": statistics.median(errs), "max_abs_error": max(errs)}
    summary["memory_under_predicted_over_5pct"] = [
        r["plan"] for r in rows if r["error"]["peak_bytes"] < -0.05
    ]
    cpu = system.cpu_info()
    return {"kind": "plan-accuracy", "date": time.strftime("%Y-%m-%d"), "cpu": cpu,
            "versions": system.versions(), "model": model, "hardware": hw.spec,
            "device": {"bandwidth_gbs": hw.device.bandwidth_gbs, "tflops": dict(hw.device.tflops)},
            "prompt_len": prompt_len, "gen_len": gen_len, "rows": rows, "summary": summary}  # fmt: skip


def markdown(result: dict[str, Any]) -> str:
    cpu = result["cpu"]
    lines = [
        f"Planner predictions vs execution, {cpu['name']} ({'AVX-512' if cpu['avx512f'] else 'AVX2'}), "
        f"{result['date']}: {result['model']}, prompt {result['prompt_len']}, "
        f"{result['gen_len']} new tokens, 2 threads, each plan in its own process.",
        "",
        "| plan | engine | ms/token pred / meas | err | TTFT ms pred / meas | err | peak GB pred / meas | err |",
        "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for r in result["rows"]:
        p, m, e = r["predicted"], r["measured"], r["error"]
        lines.append(
            f"| {r['plan']} | {r['engine']} | {p['ms_per_token']:.2f} / {m['ms_per_token']:.2f} | "
            f"{e['ms_per_token']:+.0%} | {p['ttft_ms']:.0f} / {m['ttft_ms']:.0f} | {e['ttft_ms']:+.0%} | "
            f"{p['peak_bytes'] / 1e9:.2f} / {m['peak_bytes'] / 1e9:.2f} | {e['peak_bytes']:+.0%} |"
        )
    s = result["summary"]
    lines += ["", "| figure | median abs error | worst |", "| --- | ---: | ---: |"]
    for k in ("ms_per_token", "ttft_ms", "peak_bytes"):
        lines.append(f"| {k} | {s[k]['median_abs_error']:.1%} | {s[k]['max_abs_error']:.1%} |")
    under = s["memory_under_predicted_over_5pct"]
    lines.append("")
    lines.append(
        "Memory under-predicted by more than 5%: " + (", ".join(under) if under else "never")
    )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m kiln.bench.plan_accuracy", description=__doc__)
    p.add_argument("--model", default="smollm2")
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--gen-len", type=int, default=32)
    p.add_argument("--out", default=str(RESULTS_DIR))
    args = p.parse_args(argv)
    result = run(args.model, args.prompt_len, args.gen_len)
    name = f"plan-accuracy-{system.device_slug(result['cpu'])}-{time.strftime('%Y%m%d')}.json"
    system.write_result(result, args.out, name, markdown(result))
    print(markdown(result))
    print(f"wrote {result['path']}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
