"""Predicted vs measured kernel time over the suite: does the cost model match this machine?

``python -m kiln.bench.cost_accuracy [--models a,b,...]`` compiles each suite model at its
CPU shape (``kiln.compile``, this machine's hardware profile), times every kernel of the
program with a profiling build (``profile_program``: the whole program runs again and
again, each kernel's mean over ``--iters`` calls, the best of ``--rounds`` rounds, each
round started when co-tenants of a shared machine are quiet) and
compares each with the cost model's prediction, the figure the BLP chose kernels on. All
models are compiled first, then profiled in three passes over the suite, each kernel's
best time kept: a co-tenant's burst on a shared machine spoils one pass of a model at most.
Error is ``|pred - meas| / meas``; results give, per model, the kernel count, the median
error and a per-family summary (family: the kernel's template; a GEMM with at most 4 rows
is a ``gemv``), the median over all kernels, and the signed bias (median pred/meas ratio).
The hardware profile is calibrated first when this machine has none (``kiln calibrate``).
Results: ``results/cost-accuracy-<device>-<date>[-tag].{json,md}``.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from typing import Any

import torch

from kiln.bench import RESULTS_DIR, system
from kiln.bench.suite import MODELS

GEMV_ROWS = 4  # a GEMM with at most this many rows is reported as its own family
QUIET_WAIT_S, QUIET_SHARE = 1.0, 0.15  # each round waits (up to 1 s) for co-tenants to idle
PASSES, PASS_WAIT_S = 3, 5.0  # profiling passes over all models, each model's wait (up to 5 s)


def kernel_family(template: str, executor: str, rows: int | None) -> str:
    """The family a kernel is summarised under: its template (``extern`` for library and
    PyTorch calls), ``gemv`` for a GEMM of at most ``GEMV_ROWS`` rows."""
    if executor != "native":
        return "extern"
    if template == "gemm" and rows is not None and rows <= GEMV_ROWS:
        return "gemv"
    return template


def _gemm_rows(graph: Any, nodes: tuple[str, ...]) -> int | None:
    """Rows (M) of the kernel's mm/bmm, None when it has none."""
    for name in nodes:
        node = graph.node(name)
        if node.op in ("mm", "bmm"):
            return int(graph.meta(node.output).shape[-2])
    return None


class Measured:
    """One compiled suite model and the best time so far of each of its kernels."""

    def __init__(self, name: str) -> None:
        import kiln

        module, inputs = MODELS[name].build()
        self.name = name
        self.compiled = kiln.compile(module, inputs)
        assert self.compiled.program is not None
        self.inputs = [t for t in inputs if isinstance(t, torch.Tensor)]
        self.best: list[float] | None = None

    def profile(self, iters: int, rounds: int) -> None:
        """Time every kernel (``profile_program``) and keep each kernel's best so far."""
        from kiln.compiler.exec.profile import profile_program

        quiet = lambda: system.wait_quiet(QUIET_WAIT_S, QUIET_SHARE, 0.05)  # noqa: E731
        prog = self.compiled.program
        assert prog is not None
        times = profile_program(prog, self.inputs, iters, rounds=rounds, before_round=quiet)
        self.best = times if self.best is None else [min(a, b) for a, b in zip(self.best, times)]

    def rows(self) -> list[dict[str, Any]]:
        """One row per kernel: what it is, predicted and measured µs, relative error."""
        prog = self.compiled.program
        assert prog is not None and self.best is not None
        rows = []
        for k in self.compiled.report.kernels:
            kernel = prog.kernels[k.index]
            meas = self.best[k.index]
            if meas <= 0.0:
                continue  # nothing ran (an alias)
            rows.append({
                "index": k.index,
                "template": k.template,
                "family": kernel_family(
                    k.template, k.executor, _gemm_rows(prog.graph, kernel.nodes)
                ),
                "executor": k.executor,
                "primitives": " ".join(k.primitives),
                "predicted_us": round(k.predicted_us, 3),
                "measured_us": round(meas, 3),
                "error": round(abs(k.predicted_us - meas) / meas, 4),
            })  # fmt: skip
        return rows


def summarize(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Kernel count, median error, median pred/meas ratio and summed µs, overall and per
    family."""

    def stats(rs: list[dict[str, Any]]) -> dict[str, Any]:
        return {
            "kernels": len(rs),
            "median_error": round(statistics.median(r["error"] for r in rs), 4) if rs else None,
            "median_ratio": (
                round(statistics.median(r["predicted_us"] / r["measured_us"] for r in rs), 4)
                if rs else None
            ),
            "predicted_us": round(sum(r["predicted_us"] for r in rs), 2),
            "measured_us": round(sum(r["measured_us"] for r in rs), 2),
        }  # fmt: skip

    families: dict[str, list[dict[str, Any]]] = {}
    for r in rows:
        families.setdefault(r["family"], []).append(r)
    return {**stats(rows), "families": {f: stats(rs) for f, rs in sorted(families.items())}}


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{100 * x:.0f}%"


def markdown(result: dict[str, Any]) -> str:
    """The result as a markdown report: overall, per family, per model."""
    o = result["overall"]
    lines = [
        f"# Cost model accuracy: predicted vs measured kernel time ({result['date']})",
        "",
        f"Device: {result['device']['name']} ({result['isa']}, {result['threads']} threads); "
        f"profile: `{result['profile']['name']}` ({result['profile']['source']}).",
        "Error = |pred - meas| / meas per kernel; ratio = median pred/meas (>1: over-predicted).",
        "",
        f"**Median |error| over all {o['kernels']} kernels: {_pct(o['median_error'])}** "
        f"(median ratio {o['median_ratio']}).",
        "",
        "| family | kernels | median error | median ratio | pred µs | meas µs |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for fam, s in o["families"].items():
        lines.append(
            f"| {fam} | {s['kernels']} | {_pct(s['median_error'])} | {s['median_ratio']} "
            f"| {s['predicted_us']:.1f} | {s['measured_us']:.1f} |"
        )
    lines += [
        "",
        "| model | kernels | median error | pred µs | meas µs | per family (kernels, median error) |",
        "|---|---:|---:|---:|---:|---|",
    ]
    for name, m in result["models"].items():
        if "error" in m and "summary" not in m:
            lines.append(f"| {name} | - | - | - | - | failed: {m['error']} |")
            continue
        s = m["summary"]
        fams = ", ".join(
            f"{f} {fs['kernels']} ({_pct(fs['median_error'])})" for f, fs in s["families"].items()
        )
        lines.append(
            f"| {name} | {s['kernels']} | {_pct(s['median_error'])} | {s['predicted_us']:.1f} "
            f"| {s['measured_us']:.1f} | {fams} |"
        )
    return "\n".join(lines) + "\n"


def run(names: list[str], iters: int, rounds: int) -> dict[str, Any]:
    """Measure ``names`` and assemble the result (device, profile, per model, overall)."""
    from kiln.compiler.codegen.cpu import build
    from kiln.compiler.exec.calibrate_kernels import load_fitted_profile

    threads = torch.get_num_threads()
    profile = load_fitted_profile(threads)
    cpu = system.cpu_info()
    models: dict[str, Any] = {}
    measured: list[Measured] = []
    for name in names:
        try:
            measured.append(Measured(name))
        except Exception as e:  # noqa: BLE001 - one model failing must not lose the others
            models[name] = {"error": f"{type(e).__name__}: {e}"[:300]}
            print(f"{name}: failed: {models[name]['error']}", file=sys.stderr)
    for _ in range(PASSES):  # passes over every model: a co-tenant's burst hits one at most
        for m in measured:
            system.wait_quiet(PASS_WAIT_S, QUIET_SHARE, 0.1)
            m.profile(iters, rounds)
    every: list[dict[str, Any]] = []
    for m in measured:
        rows = m.rows()
        every += rows
        models[m.name] = {"summary": summarize(rows), "kernels": rows}
        print(
            f"{m.name}: {len(rows)} kernels, median error "
            f"{_pct(models[m.name]['summary']['median_error'])}",
            file=sys.stderr,
        )
    models = {n: models[n] for n in names if n in models}
    return {
        "kind": "cost-accuracy",
        "date": time.strftime("%Y-%m-%d"),
        "device": {**cpu, "slug": system.device_slug(cpu)},
        "isa": build.isa(),
        "threads": threads,
        "profile": {
            "name": profile.name,
            "source": "fitted kernel rates" if profile.kernels else "quick calibration only",
        },
        "versions": system.versions(),
        "overall": summarize(every),
        "models": models,
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m kiln.bench.cost_accuracy", description=__doc__)
    p.add_argument("--models", default="", help="comma list of suite models (default: all)")
    p.add_argument("--iters", type=int, default=10, help="program runs per round")
    p.add_argument("--rounds", type=int, default=10, help="rounds; each kernel's best is kept")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--tag", default="", help="suffix of the result files' names")
    p.add_argument("--out", default=str(RESULTS_DIR))
    args = p.parse_args(argv)
    names = [m for m in args.models.split(",") if m] or list(MODELS)
    unknown = [m for m in names if m not in MODELS]
    if unknown:
        p.error(f"unknown models {unknown}; known: {', '.join(MODELS)}")
    saved = torch.get_num_threads()
    torch.set_num_threads(args.threads)
    try:
        result = run(names, args.iters, args.rounds)
    finally:
        torch.set_num_threads(saved)
    tag = f"-{args.tag}" if args.tag else ""
    stem = f"cost-accuracy-{result['device']['slug']}-{time.strftime('%Y%m%d')}{tag}.json"
    system.write_result(result, args.out, stem, markdown(result))
    print(markdown(result))
    print(f"wrote {result['path']}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
