"""Weight-only quantized matmuls vs fp32 at decode: one decode step's worth of linears.

``python -m kiln.bench.quant_matmul --out FILE.json [--rows 1,4,8] [--threads N]``

A single 576x576 fp32 weight fits in cache, which decode never sees. So each format is
timed on SmolLM2-135M's linears for a whole decode step: 30 layers x 7 linears (q, k, v,
o, gate, up, down; K x N = 576x576, 576x192, 576x192, 576x576, 576x1536, 576x1536,
1536x576), every layer with its own weights (~425 MB fp32), run in sequence. Between
timed steps a 64 MB buffer is read to evict the last-level cache (a real decode step also
streams the embedding / LM head), so the weights come from DRAM. One warm-up step, then the
median over ``--reps`` rounds. Rounds are interleaved: every (format, rows) pair runs one
step per round, in an order rotated by one each round, all formats' weights built before the
first (run one after another, the formats met the machine in different states: fp32 at 4
rows once measured slower than at 8). Each linear call is also timed inside the step and
summed by shape class (the class figures are medians of those sums).

Formats: fp32 ``F.linear``; INT8 per channel and INT4 groups of 32/64/128 through
``kiln.kernels.registry`` (backend "auto", recorded; K = 576 is not a multiple of 128, so
"int4-g128" uses groups of 128 for the down projection only and 64 elsewhere); with ``--torch`` also torch's packed kernels
(``aten._weight_int8pack_mm``, ``aten._weight_int4pack_mm_for_cpu``, g32) for comparison;
GGUF Q8_0 / Q4_0 / Q5_0 blocks (the 32-element types: K = 576 is no multiple of the
K-quants' 256) through ``GgufKernel`` with its default 8-bit activations.
Weights are random codes (speed does not depend on values). Reported: per (rows, format)
the step and per-class times and the speed-up over fp32 (fp32 time / format time). The
thread count is torch's (``--threads`` to set it); on a shared machine co-tenants add noise.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from kiln.bench.system import cpu_info, load_snapshot, versions
from kiln.kernels.cpu.gguf_blocks import BLOCKS, TYPE_IDS, GgufKernel
from kiln.kernels.cpu.woq import Backend, CpuWeightOnlyKernel, cpu_int4_kernel, cpu_int8_kernel

LAYERS = 30
# (name, shape class, N, K) of one decoder layer's linears, in execution order.
LINEARS = (
    ("q", "q/o 576x576", 576, 576),
    ("k", "k/v 576x192", 192, 576),
    ("v", "k/v 576x192", 192, 576),
    ("o", "q/o 576x576", 576, 576),
    ("gate", "gate/up 576x1536", 1536, 576),
    ("up", "gate/up 576x1536", 1536, 576),
    ("down", "down 1536x576", 576, 1536),
)
FORMATS = ("fp32", "int8", "int4-g32", "int4-g64", "int4-g128", "gguf-q8_0", "gguf-q4_0",
           "gguf-q5_0")  # fmt: skip
TORCH_FORMATS = ("int8-torch", "int4-g32-torch")
Linear = Callable[[Tensor], Tensor]


def _make_linear(fmt: str, n: int, k: int, gen: torch.Generator) -> Linear:
    """One layer's linear in format ``fmt`` with fresh random weights."""
    if fmt == "fp32":
        w = torch.randn(n, k, generator=gen)
        return lambda x: F.linear(x, w)
    if fmt.startswith("gguf-"):  # random blocks of the type, its default (int8) arithmetic
        t = TYPE_IDS[fmt.removeprefix("gguf-").upper()]
        elems, nbytes = BLOCKS[t][1:]
        raw = torch.randint(0, 256, (n * k // elems, nbytes), dtype=torch.uint8, generator=gen)
        raw[:, :2] = torch.tensor([0x66, 0x1E], dtype=torch.uint8)  # d = fp16 0.0062
        return GgufKernel(raw.reshape(n, -1), t, k)
    backend: Backend = "torch" if fmt.endswith("-torch") else "auto"
    kern: CpuWeightOnlyKernel
    if fmt.startswith("int8"):
        q = torch.randint(-127, 128, (n, k), dtype=torch.int8, generator=gen)
        kern = cpu_int8_kernel(q, torch.rand(n, generator=gen) * 0.01, backend)
    else:
        g = _group_size(fmt, k)
        packed = torch.randint(0, 256, (n, k // 2), dtype=torch.uint8, generator=gen)
        scale = (torch.rand(n, k // g, generator=gen) * 0.01).half()
        offset = (-8 * scale.float()).half()
        kern = cpu_int4_kernel(packed, scale, offset, g, backend)
    return kern


def _group_size(fmt: str, k: int) -> int:
    """The format's group size, or the largest of 64 / 32 dividing K (576 % 128 != 0)."""
    g = int(fmt.removesuffix("-torch").split("-")[1][1:])
    return next(size for size in (g, 64, 32) if k % size == 0)


def _backend(fn: Linear, rows: int) -> str:
    if isinstance(fn, (CpuWeightOnlyKernel, GgufKernel)):
        return fn.backend(rows)
    return "torch F.linear"


def _one_step(
    step: list[tuple[str, Linear, Tensor]], flush: Tensor
) -> tuple[float, dict[str, float]]:
    """One decode step's linears after a cache flush: (step ms, ms per shape class)."""
    flush.sum()  # evict the last-level cache
    sums: dict[str, float] = dict.fromkeys((c for c, _, _ in step), 0.0)
    t_step = time.perf_counter()
    for cls, fn, x in step:
        t0 = time.perf_counter()
        fn(x)
        sums[cls] += time.perf_counter() - t0
    elapsed = time.perf_counter() - t_step
    return elapsed * 1e3, {c: v * 1e3 for c, v in sums.items()}


def run(
    rows: list[int], formats: list[str], reps: int, layers: int = LAYERS
) -> list[dict[str, Any]]:
    """Time every format at every row count, interleaved: all formats' weights are built
    first, then each round times one step of every (format, rows) pair, in an order
    rotated by one per round (so no pair always runs first or after the same neighbour);
    round 0 is the warm-up. One result dict per (format, rows): medians over ``reps``."""
    flush = torch.ones(16 * 2**20)  # 64 MB
    gen = torch.Generator().manual_seed(0)
    built = {fmt: [(c, _make_linear(fmt, n, k, gen), k) for _ in range(layers)
                   for _, c, n, k in LINEARS] for fmt in formats}  # fmt: skip
    xs = {m: {k: torch.randn(m, k, generator=gen) for _, _, _, k in LINEARS} for m in rows}
    pairs = [(fmt, m) for m in rows for fmt in formats]
    steps: dict[tuple[str, int], list[float]] = {pair: [] for pair in pairs}
    classes: dict[tuple[str, int], dict[str, list[float]]] = {pair: {} for pair in pairs}
    for rnd in range(reps + 1):
        turn = rnd % len(pairs)
        for fmt, m in pairs[turn:] + pairs[:turn]:
            step_ms, class_ms = _one_step([(c, fn, xs[m][k]) for c, fn, k in built[fmt]], flush)
            if rnd:
                steps[fmt, m].append(step_ms)
                for c, v in class_ms.items():
                    classes[fmt, m].setdefault(c, []).append(v)
    results: list[dict[str, Any]] = []
    for fmt, m in pairs:
        names = sorted({_backend(fn, m) for _, fn, _ in built[fmt]})
        results.append({"format": fmt, "rows": m, "backend": ",".join(names),
                        "step_ms": round(statistics.median(steps[fmt, m]), 3),
                        "class_ms": {c: round(statistics.median(v), 3)
                                     for c, v in classes[fmt, m].items()}})  # fmt: skip
        print(
            f"  {fmt:>15} M={m}: step {results[-1]['step_ms']:8.2f} ms  ({results[-1]['backend']})"
        )
    return results


def speedups(results: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """fp32 time / format time, for the step and each shape class, per (format, rows)."""
    base = {r["rows"]: r for r in results if r["format"] == "fp32"}
    out = []
    for r in results:
        b = base.get(r["rows"])
        if r["format"] == "fp32" or b is None:
            continue
        out.append({"format": r["format"], "rows": r["rows"],
                    "step": round(b["step_ms"] / r["step_ms"], 2),
                    "classes": {c: round(b["class_ms"][c] / v, 2)
                                for c, v in r["class_ms"].items()}})  # fmt: skip
    return out


def render(results: list[dict[str, Any]], ups: list[dict[str, Any]]) -> str:
    """A markdown table: step ms and speed-ups over fp32 (step and per class)."""
    classes = list(dict.fromkeys(c for _, c, _, _ in LINEARS))
    head = "| M | format | backend | step ms | step x | " + " | ".join(f"{c} x" for c in classes)
    lines = [head + " |", "|" + "---|" * (5 + len(classes))]
    up = {(u["format"], u["rows"]): u for u in ups}
    for r in sorted(
        results, key=lambda r: (r["rows"], FORMATS.index(r["format"].removesuffix("-torch")))
    ):
        u = up.get((r["format"], r["rows"]))
        ratios = [f"{u['classes'][c]:.2f}" if u else "1" for c in classes]
        lines.append(f"| {r['rows']} | {r['format']} | {r['backend']} | {r['step_ms']:.2f} | "
                     f"{u['step'] if u else 1:.2f} | " + " | ".join(ratios) + " |")  # fmt: skip
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m kiln.bench.quant_matmul", description=__doc__)
    p.add_argument("--out", required=True, help="result JSON path")
    p.add_argument("--rows", default="1,4,8", help="comma list of activation rows M")
    p.add_argument("--reps", type=int, default=7, help="rounds: timed steps per (format, rows)")
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    p.add_argument("--torch", action="store_true", help="also time torch's packed kernels")
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    rows = [int(v) for v in args.rows.split(",")]
    formats = [*FORMATS, *(TORCH_FORMATS if args.torch else ())]
    before = load_snapshot()
    t0 = time.perf_counter()
    results = run(rows, formats, args.reps)
    ups = speedups(results)
    record = {
        "benchmark": "quant_matmul",
        "cpu": cpu_info(),
        "versions": versions(),
        "threads": torch.get_num_threads(),
        "reps": args.reps,
        "layers": LAYERS,
        "load_before": before,
        "load_after": load_snapshot(),
        "wall_s": round(time.perf_counter() - t0, 1),
        "results": results,
        "speedup_vs_fp32": ups,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(record, indent=1) + "\n")
    print(render(results, ups))


if __name__ == "__main__":
    main()
