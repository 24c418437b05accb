"""Did the calibrated cost model make the BLP's choices better? Old vs new, end to end.

``python -m kiln.bench.cost_ab [--models a,b] [--rounds 7]`` compiles each suite model twice
in this process: with the plain roofline (this machine's quick profile without kernel rates:
the cost model before the calibrated one) and with the calibrated model (the cached profile
and its kernel rates), then times whole-program calls of both, alternating within every
round (the order flips each round), each round's figure the median of ``--reps`` calls, the
result the median over rounds. It lists the kernels only one program has, so a slower model
points at the decision that changed. Results: ``results/cost-ab-<device>-<date>.{json,md}``.
"""

from __future__ import annotations

import argparse
import statistics
import time
from dataclasses import replace
from typing import Any

import torch

from kiln.bench import RESULTS_DIR, system
from kiln.bench.suite import MODELS

DEFAULT_MODELS = "swiglu_tower,bert_small,lstm,conformer,dlrm"


def compile_with_profile(model: torch.nn.Module, inputs: tuple[Any, ...], profile: Any) -> Any:
    """``kiln.compile`` pricing candidates with ``profile``."""
    import kiln
    from kiln.compiler import api

    saved = api.load_profile
    api.load_profile = lambda threads=2, refresh=False: profile  # type: ignore[assignment]
    try:
        return kiln.compile(model, inputs)
    finally:
        api.load_profile = saved  # type: ignore[assignment]


def kernel_keys(compiled: Any) -> list[str]:
    """Each kernel as "template: primitives" (what the BLP chose)."""
    return [f"{k.template}: {' '.join(k.primitives)}" for k in compiled.report.kernels]


def only_in(a: list[str], b: list[str]) -> list[str]:
    """Kernels of ``a`` that ``b`` lacks (as a multiset)."""
    rest = list(b)
    out = []
    for k in a:
        if k in rest:
            rest.remove(k)
        else:
            out.append(k)
    return out


def time_pair(
    fns: dict[str, Any], inputs: tuple[Any, ...], rounds: int, reps: int
) -> dict[str, float]:
    """Median over rounds of each variant's median call time (µs), alternating order."""
    per: dict[str, list[float]] = {v: [] for v in fns}
    names = list(fns)
    with torch.inference_mode():
        for fn in fns.values():
            for _ in range(5):
                fn(*inputs)
        for r in range(rounds):
            system.wait_quiet(1.0, 0.15, 0.05)
            for v in names if r % 2 == 0 else names[::-1]:
                times = []
                for _ in range(reps):
                    t0 = time.perf_counter_ns()
                    fns[v](*inputs)
                    times.append((time.perf_counter_ns() - t0) / 1e3)
                per[v].append(statistics.median(times))
    return {v: statistics.median(ts) for v, ts in per.items()}


def run(names: list[str], rounds: int, reps: int) -> dict[str, Any]:
    from kiln.core.calibrate import load_profile

    new = load_profile(torch.get_num_threads())
    old = replace(new, kernels=None)
    out: dict[str, Any] = {}
    for name in names:
        model, inputs = MODELS[name].build()
        variants = {"old": compile_with_profile(model, inputs, old)}
        variants["new"] = compile_with_profile(model, inputs, new)
        us = time_pair(variants, inputs, rounds, reps)
        keys = {v: kernel_keys(c) for v, c in variants.items()}
        out[name] = {
            "old_us": round(us["old"], 1), "new_us": round(us["new"], 1),
            "speedup": round(us["old"] / us["new"], 3),
            "kernels": {v: len(k) for v, k in keys.items()},
            "only_old": only_in(keys["old"], keys["new"]),
            "only_new": only_in(keys["new"], keys["old"]),
        }  # fmt: skip
        print(f"{name}: old {us['old']:.1f} us, new {us['new']:.1f} us", flush=True)
    cpu = system.cpu_info()
    return {
        "kind": "cost-ab", "date": time.strftime("%Y-%m-%d"),
        "device": {**cpu, "slug": system.device_slug(cpu)},
        "threads": torch.get_num_threads(), "profile": new.name,
        "fitted": bool(new.kernels and new.kernels.fitted), "models": out,
    }  # fmt: skip


def markdown(result: dict[str, Any]) -> str:
    lines = [
        f"# Cost model A/B: roofline vs calibrated ({result['date']})",
        "",
        f"{result['device']['name']}, {result['threads']} threads; kernel rates "
        f"{'fitted' if result['fitted'] else 'derived'}. Median µs per call (old/new > 1: "
        "the calibrated model's program is faster).",
        "",
        "| model | old µs | new µs | old/new | kernels old / new |",
        "|---|---:|---:|---:|---:|",
    ]
    for name, m in result["models"].items():
        lines.append(
            f"| {name} | {m['old_us']} | {m['new_us']} | {m['speedup']} "
            f"| {m['kernels']['old']} / {m['kernels']['new']} |"
        )
    for name, m in result["models"].items():
        if m["only_old"] or m["only_new"]:
            lines += ["", f"**{name}**: kernels only the old program has:"]
            lines += [f"- {k}" for k in m["only_old"][:12]]
            lines += ["", "only the new one:"] + [f"- {k}" for k in m["only_new"][:12]]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m kiln.bench.cost_ab", description=__doc__)
    p.add_argument("--models", default=DEFAULT_MODELS)
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--reps", type=int, default=50)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--out", default=str(RESULTS_DIR))
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    result = run([m for m in args.models.split(",") if m], args.rounds, args.reps)
    name = f"cost-ab-{result['device']['slug']}-{time.strftime('%Y%m%d')}.json"
    system.write_result(result, args.out, name, markdown(result))
    print(markdown(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
