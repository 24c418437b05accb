"""Does timing a model's own blocks predict the whole model? ``python -m kiln.bench.arch_fit``.

The planner prices a model kiln builds from two timed probes of its own block shape (one
block and ``probe_layers`` blocks, the same head: ``kiln.deploy.arch_rates``): a block
is the difference of the two, the rest what remains (``split_fit``). This benchmark puts
that prediction beside the whole model, all three built with random weights of the
checkpoint's config in each ``--formats`` format and timed side by side in one process, in
alternating rounds (the fastest of ``--rounds`` kept per model): kiln's C++ decode step
at one row (``step_seconds``) and a 64- and a 256-row prefill (``prefill_once``). The
probes and the model are timed in the same minutes, so the error is the method's alone,
not the host's speed moving between the time a table was timed and a plan's run.

    python -m kiln.bench.arch_fit [--model smollm2] [--formats bf16,int8] [--rounds 5]
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from functools import partial
from typing import Any

import torch

from kiln.bench import RESULTS_DIR, system
from kiln.deploy.arch_rates import (
    build_in_format,
    prefill_once,
    probe_config,
    probe_evictors,
    probe_layers,
    split_fit,
)
from kiln.deploy.generate_job import GenerateRequest, choose_decoder, weight_bytes_per_token
from kiln.deploy.kernel_rates import matmul_params, prefill_flops, prefill_shape, step_seconds
from kiln.llm.fast_decoder import FastDecoder
from kiln.models.config import ModelConfig
from kiln.models.load import load_model

PREFILL_ROWS = (64, 256)


def fit_error(
    layers: tuple[int, int, int], amounts: tuple[float, float, float],
    seconds: tuple[float, float, float],
) -> dict[str, float]:  # fmt: skip
    """The probes' prediction of the whole model (``split_fit`` of the first two timings,
    as the planner fits them) against its measured time (the third)."""
    (l1, l3, _), (a1, a3, a_full), (t1, t3, t_full) = layers, amounts, seconds
    fitted = split_fit((l1, a1, t1), (l3, a3, t3))
    if fitted is None:
        return {"predicted_s": float("nan"), "measured_s": t_full, "error": float("nan")}
    blocks, rest = fitted
    block_amount = (a3 - a1) / (l3 - l1)
    rest_amount = a1 - l1 * block_amount
    predicted = blocks.seconds(a_full - rest_amount) + rest.seconds(rest_amount)
    return {"predicted_s": predicted, "measured_s": t_full, "error": predicted / t_full - 1}


def measure(cfg: ModelConfig, fmt: str, rounds: int, evict: bool = True) -> list[dict[str, Any]]:
    """The fit against the whole model for one format: decode at 1 row, prefills. With
    ``evict`` (the planner's way) each probe's decode step follows the traffic of the rest
    of the model (``arch_rates.probe_evictors``); without, the probes run warm."""
    probe_counts = probe_layers(cfg)
    layers = (*probe_counts, cfg.n_layers)
    models = [build_in_format(probe_config(cfg, n), fmt) for n in layers[:2]]
    evicts = probe_evictors(cfg, models, probe_counts) if evict else [None, None]
    models.append(build_in_format(cfg, fmt))
    timers: dict[str, list[Callable[[], float]]] = {
        "decode, 1 row": [
            partial(step_seconds, FastDecoder(m, 1, 64), 1, 6, 1, e)
            for m, e in zip(models, [*evicts, None], strict=True)
        ]  # fmt: skip
    }
    amounts = {"decode, 1 row": tuple(float(weight_bytes_per_token(m)) for m in models)}
    request = GenerateRequest(checkpoint="", prompt="")
    for rows in PREFILL_ROWS:
        batch, tokens = prefill_shape(rows)
        decs = [choose_decoder(m, request, batch, tokens + 4)[0] for m in models]
        timers[f"prefill, {rows} rows"] = [partial(prefill_once, d, rows) for d in decs]
        amounts[f"prefill, {rows} rows"] = tuple(
            prefill_flops(rows, *matmul_params(m.cfg)) for m in models
        )
    rows_out = []
    for what, calls in timers.items():
        for call in calls:  # first calls allocate (and JIT oneDNN's kernels)
            call()
        best = [float("inf")] * 3
        for _ in range(rounds):  # the three in turn: a drift of the host hits all of them
            best = [min(b, call()) for b, call in zip(best, calls, strict=True)]
        a = amounts[what]
        fit = fit_error(layers, (a[0], a[1], a[2]), (best[0], best[1], best[2]))
        rows_out.append({"format": fmt, "engine": what, "layers": list(layers), **fit})
    return rows_out


def markdown(result: dict[str, Any]) -> str:
    cpu = result["cpu"]
    lines = [
        f"# The per-architecture fit against the whole model: {result['model']} ({result['date']})",
        "",
        f"{cpu['name']} ({'AVX-512' if cpu['avx512f'] else 'AVX2'}), {result['threads']} threads; "
        f"random weights of the checkpoint's config; probes and model timed side by side in "
        f"one process, fastest of {result['rounds']} alternating rounds. Error = predicted / "
        "measured - 1. "
        + {
            True: "Each probe decode step follows the rest of the model's traffic (the planner's way).",
            False: "Probes timed warm (--no-evict).",
            None: "",
        }[result.get("probes_after_the_rest_of_the_model")],
        "",
        "| format | engine | blocks (probes, model) | predicted ms | measured ms | error |",
        "| --- | --- | --- | ---: | ---: | ---: |",
    ]
    for r in result["rows"]:
        lines.append(
            f"| {r['format']} | {r['engine']} | {', '.join(map(str, r['layers']))} "
            f"| {1e3 * r['predicted_s']:.2f} | {1e3 * r['measured_s']:.2f} | {100 * r['error']:+.1f}% |"
        )
    errors = [abs(r["error"]) for r in result["rows"]]
    lines += [
        "",
        f"Median |error| {100 * statistics.median(errors):.1f}%, worst {100 * max(errors):.1f}%.",
    ]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m kiln.bench.arch_fit", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    p.add_argument("--model", default="smollm2", help="a checkpoint kiln loads (its config)")
    p.add_argument("--formats", default="bf16,int8", help="comma list of weight formats")
    p.add_argument("--rounds", type=int, default=5, help="alternating rounds per timing")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--no-evict", action="store_true",
                   help="time the probes warm (not after the rest of the model's traffic)")  # fmt: skip
    p.add_argument("--out", default=str(RESULTS_DIR))
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    cfg = load_model(args.model).model.cfg
    rows: list[dict[str, Any]] = []
    for fmt in [f.strip() for f in args.formats.split(",") if f.strip()]:
        rows += measure(cfg, fmt, args.rounds, evict=not args.no_evict)
        for r in rows[-3:]:
            print(f"{fmt} {r['engine']}: predicted {1e3 * r['predicted_s']:.2f} ms, "
                  f"measured {1e3 * r['measured_s']:.2f} ms ({100 * r['error']:+.1f}%)", flush=True)  # fmt: skip
    cpu = system.cpu_info()
    result = {"benchmark": "arch_fit", "model": args.model, "date": time.strftime("%Y-%m-%d"),
              "cpu": cpu, "threads": args.threads, "rounds": args.rounds,
              "probes_after_the_rest_of_the_model": not args.no_evict,
              "versions": system.versions(), "rows": rows}  # fmt: skip
    system.publish(result, args.out, f"arch-fit-{system.device_slug(cpu)}", markdown(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
