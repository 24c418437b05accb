"""One CPU compiler feature on and off, side by side: ``python -m kiln.bench.feature_ab``.

Features (``FEATURES``: a template the CPU target offers the BLP, withheld when off):

* ``chains``: GEMM chains (``codegen/cpu/chain.py``), MLP layers in one kernel;
* ``winograd``: 3x3 convs by Winograd's F(2x2, 3x3) (``codegen/cpu/conv_winograd.py``).

For each suite model, ``kiln.compile`` builds it twice in one process: as the BLP chooses
(the feature's kernels among its candidates) and with them withheld. The two programs run
the same inputs in alternating rounds (``--rounds``, each the mean of enough calls for
~150 ms), after a warm-up; reported per model: each program's median and best round, the
ratio of medians (off / on: above 1 when the feature pays) and the number of the
feature's kernels chosen. One process, so both share the thread pool and the cache state;
nothing else may run on the machine meanwhile.

    python -m kiln.bench.feature_ab --feature winograd [--models resnet18,...] [--rounds 9]
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch

import kiln
from kiln.bench import RESULTS_DIR, system
from kiln.bench.suite import get
from kiln.compiler import api
from kiln.compiler.fusion.candidates import FusionTarget
from kiln.core.calibrate import load_profile

Withhold = Callable[[FusionTarget], FusionTarget]
FEATURES: dict[str, tuple[str, tuple[str, ...], Withhold]] = {
    # feature -> (its kernels' template, default models, the target without it)
    "chains": ("chain", ("nerf_mlp", "tcnn_mlp", "dlrm", "bert_small", "vit_tiny", "conformer",
                         "speech_encoder", "swiglu_tower"),
               lambda t: dataclasses.replace(t, chains=False)),
    "winograd": ("wconv", ("resnet18", "style_transfer", "unet"),
                 lambda t: dataclasses.replace(t, winograd=False)),
}  # fmt: skip


def without(target: FusionTarget, feature: str) -> FusionTarget:
    """``target`` with ``feature``'s kernels withheld from the candidates."""
    return FEATURES[feature][2](target)


ROUND_MS = 150.0


def _round_ms(fn: Callable[[], object], calls: int) -> float:
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - t0) / calls * 1e3


def measure(name: str, feature: str, rounds: int) -> dict[str, Any]:
    """The A/B of ``feature`` on suite model ``name`` at its CPU batch."""
    bm = get(name)
    model, inputs = bm.builder(bm.cpu_batch)
    return {"model": name, **compare(model.eval(), inputs, feature, rounds)}


def compare(
    model: torch.nn.Module, inputs: tuple[torch.Tensor, ...], feature: str, rounds: int
) -> dict[str, Any]:
    """``model`` compiled with and without ``feature``, timed in alternating rounds."""
    template = FEATURES[feature][0]
    on = kiln.compile(model, inputs)
    target = api.CPU_TARGET
    api.CPU_TARGET = without(target, feature)
    try:
        off = kiln.compile(model, inputs)
    finally:
        api.CPU_TARGET = target
    chosen = sum(k.template == template for k in on.report.kernels)
    with torch.no_grad():
        run_on, run_off = (lambda: on(*inputs)), (lambda: off(*inputs))
        for fn in (run_on, run_off):
            _round_ms(fn, 100)
        calls = max(20, int(ROUND_MS / max(_round_ms(run_on, 30), 1e-3)))
        t_on, t_off = [], []
        for _ in range(rounds):
            t_on.append(_round_ms(run_on, calls))
            t_off.append(_round_ms(run_off, calls))
    return {
        "feature_kernels": chosen, "kernels_on": len(on.report.kernels),
        "kernels_off": len(off.report.kernels), "on_ms": t_on, "off_ms": t_off,
        "on_median_ms": statistics.median(t_on), "off_median_ms": statistics.median(t_off),
        "ratio_median": statistics.median(t_off) / statistics.median(t_on),
        "ratio_best": min(t_off) / min(t_on),
    }  # fmt: skip


def markdown(result: dict[str, Any]) -> str:
    cpu = result["cpu"]
    lines = [
        f"# CPU compiler feature on vs off: {result['feature']} ({result['date']})",
        "",
        f"{cpu['name']} ({'AVX-512' if cpu['avx512f'] else 'AVX2'}), {result['threads']} "
        f"threads, fp32, cost model rates {'fitted here' if result['fitted_rates'] else 'derived'}; one process, "
        f"{result['rounds']} alternating rounds; off / on > 1: the feature pays.",
        "",
        f"| model | {FEATURES[result['feature']][0]} kernels | kernels on / off | on ms (median) | off ms (median) "
        "| off / on (median) | off / on (best) |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for r in result["models"]:
        lines.append(
            f"| {r['model']} | {r['feature_kernels']} | {r['kernels_on']} / {r['kernels_off']} "
            f"| {r['on_median_ms']:.3f} | {r['off_median_ms']:.3f} | {r['ratio_median']:.3f} "
            f"| {r['ratio_best']:.3f} |"
        )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m kiln.bench.feature_ab", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    p.add_argument("--feature", choices=sorted(FEATURES), default="chains")
    p.add_argument("--models", help="comma list of suite models (default: the feature's)")
    p.add_argument("--rounds", type=int, default=9, help="alternating rounds per model")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--out", default=str(RESULTS_DIR))
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    cpu = system.cpu_info()
    rows, (template, defaults, _) = [], FEATURES[args.feature]
    names = args.models.split(",") if args.models else defaults
    for name in [m.strip() for m in names if m.strip()]:
        rows.append(measure(name, args.feature, args.rounds))
        r = rows[-1]
        print(f"{name}: {r['feature_kernels']} {template} kernels, off/on {r['ratio_median']:.3f}",
              flush=True)  # fmt: skip
    profile = load_profile()
    fitted = profile.kernels is not None and profile.kernels.fitted
    result = {"benchmark": "feature_ab", "feature": args.feature, "date": time.strftime("%Y-%m-%d"), "cpu": cpu,
              "threads": args.threads, "rounds": args.rounds, "profile": profile.name,
              "fitted_rates": fitted, "versions": system.versions(), "models": rows}  # fmt: skip
    slug = "chain-ab" if args.feature == "chains" else f"{args.feature}-ab"
    system.publish(result, args.out, f"{slug}-{system.device_slug(cpu)}", markdown(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
