"""Two source trees of kiln side by side: did a change move the headline figures?

``python -m kiln.bench.ab OTHER_TREE`` measures, for this tree ("this") and another checkout
of kiln ("other", e.g. a ``git worktree`` of the previous commit), in one run:

- **demo**: the default suite model's speed-up of ``kiln.compile`` over eager (median of
  ``--reps`` calls each, same inputs, 2 threads);
- **int4 decode**: SmolLM2's decode tokens/s with the GGUF's 4-bit weights kept packed (the
  ``kiln-int4`` decode contender: batch 1, 64 new tokens, greedy, best of 3 generations).

Each measurement runs in its own process with ``PYTHONPATH`` set to the tree under test, the
trees alternating within each of ``--rounds`` rounds (docs/benchmarks.md); each tree's figure
is its best round. A tree is probed through the module names of this layout, or, in a tree
without ``kiln/bench``, through those of the layout before it (``benchmarks.models``,
``benchmarks.contenders.llm_kiln``), so a refactor can be checked against its parent.
Results: ``results/ab-<device>-<date>.{json,md}``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from kiln.bench import RESULTS_DIR, system

PROBES = ("demo", "int4")
# Run inside the tree under test (its root is the working directory): prints one JSON line.
PROBE = r"""
import importlib, json, os, statistics, sys, time
import torch
torch.set_num_threads(2)

def module(new, old):
    # this layout's module, or the old layout's in a tree without kiln/bench
    return importlib.import_module(new if os.path.isdir("kiln/bench") else old)

def median_ms(fn, reps):
    for _ in range(5):
        fn()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter(); fn(); times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)

what, reps = sys.argv[1], int(sys.argv[2])
if what == "demo":
    import kiln
    suite = module("kiln.bench.suite", "benchmarks.models")
    bm = suite.get(suite.DEFAULT_MODEL)
    model, inputs = bm.build()
    fast = kiln.compile(model, inputs)
    with torch.inference_mode():
        eager_ms = median_ms(lambda: model(*inputs), reps)
        kiln_ms = median_ms(lambda: fast(*inputs), reps)
    print(json.dumps({"model": suite.DEFAULT_MODEL, "eager_ms": eager_ms, "kiln_ms": kiln_ms,
                      "value": eager_ms / kiln_ms, "unit": "x over eager"}))
else:
    llm = module("kiln.bench.contenders.llm_kiln", "benchmarks.contenders.llm_kiln")
    dec = llm.KilnDecode("int4")
    dec.prepare([1], 128)
    prompt = list(range(100, 121))  # 21 tokens, as the decode benchmark's prompt length
    dec.generate(prompt, 8, 1)  # warm-up
    best = max((64 - 1) / dec.generate(prompt, 64, 1).decode_s for _ in range(3))
    print(json.dumps({"value": best, "unit": "decode tokens/s"}))
"""


def probe(tree: Path, what: str, reps: int) -> dict[str, Any]:
    """One measurement of ``what`` in a fresh process importing kiln from ``tree``."""
    env = {**os.environ, "PYTHONPATH": str(tree), "OMP_NUM_THREADS": "2"}
    cmd = [sys.executable, "-c", PROBE, what, str(reps)]
    proc = subprocess.run(cmd, cwd=tree, env=env, capture_output=True, text=True, timeout=900)
    if proc.returncode != 0:
        raise RuntimeError(f"probe {what} in {tree} failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def run(other: Path, rounds: int, reps: int, out_dir: Path) -> dict[str, Any]:
    """Alternate the two trees over ``rounds`` rounds; write and return the result."""
    trees = {"this": Path.cwd(), "other": other.resolve()}
    samples: dict[str, dict[str, list[dict[str, Any]]]] = {
        t: {w: [] for w in PROBES} for t in trees
    }
    load_before = system.load_snapshot()
    for r in range(rounds):
        order = list(trees) if r % 2 == 0 else list(reversed(trees))
        for what in PROBES:
            for t in order:
                samples[t][what].append(probe(trees[t], what, reps))
                print(f"round {r + 1} {what:5s} {t:5s} {samples[t][what][-1]['value']:.3f}")
    best = {t: {w: max(s["value"] for s in samples[t][w]) for w in PROBES} for t in trees}
    cpu = system.cpu_info()
    result = {
        "date": time.strftime("%Y-%m-%d"),
        "cpu": cpu,
        "versions": system.versions(),
        "load_before": load_before,
        "load_after": system.load_snapshot(),
        "trees": {"this": "the working directory", "other": system.portable_path(other)},
        "rounds": rounds,
        "samples": samples,
        "best": best,
        "this_over_other": {w: best["this"][w] / best["other"][w] for w in PROBES},
    }
    name = f"ab-{system.device_slug(cpu)}-{time.strftime('%Y%m%d')}.json"
    system.write_result(result, out_dir, name, markdown(result))
    return result


def markdown(result: dict[str, Any]) -> str:
    """The side-by-side table of one run."""
    units = {w: result["samples"]["this"][w][0]["unit"] for w in PROBES}
    lines = [
        f"{result['cpu']['name']} ({'AVX-512' if result['cpu']['avx512f'] else 'AVX2'}), {result['date']}; best of {result['rounds']} "
        "interleaved rounds, each measurement in its own process.",
        "",
        "| figure | this tree | other tree | this / other |",
        "| --- | ---: | ---: | ---: |",
    ]
    for w in PROBES:
        b = result["best"]
        lines.append(
            f"| {w} ({units[w]}) | {b['this'][w]:.2f} | {b['other'][w]:.2f} "
            f"| {result['this_over_other'][w]:.3f} |"
        )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m kiln.bench.ab", description=__doc__)
    p.add_argument("other", type=Path, help="another checkout of kiln (its repository root)")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--reps", type=int, default=200, help="calls per demo timing")
    p.add_argument("--out", type=Path, default=RESULTS_DIR)
    args = p.parse_args(argv)
    result = run(args.other, args.rounds, args.reps, args.out)
    print(markdown(result))
    print(f"wrote {result['path']}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
