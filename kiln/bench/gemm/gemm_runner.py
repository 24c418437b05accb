"""The GEMM shape-class benchmark runner (protocol: docs/benchmarks.md).

Requirement measured: per shape class (tiny, small, large), kiln's kernel within
1.2x of the fastest library routine on this machine, fused epilogue included.

The runner writes each shape's ``X`` (M, K), ``W`` (N, K), ``b`` (N,) to disk,
exports the ONNX files in a torch process of their own, then starts one worker
per contender (``python -m kiln.bench.gemm.gemm_worker``; each imports only its
runtime and prepares all cases, one worker after another so compiles are
uncontended). All workers stay alive while the runner interleaves rounds: in a
round every case is timed by every contender, in an order rotated per case and
round, each after waiting for co-tenants to go quiet; a contender's figure is
its best round's median. A timing disturbed by co-tenants (more than
``quiet_busy`` of the CPUs busy meanwhile) is retried; every round's co-tenant
share is recorded. Outputs are checked against a float64 torch reference.
"""

from __future__ import annotations

import datetime as dt
import os
import statistics
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

from kiln.bench import RESULTS_DIR, system
from kiln.bench import output_errors as errors
from kiln.bench.gemm.gemm_contenders import LIBRARIES, NAMES, THREADS
from kiln.bench.gemm.shapes import CLASSES, EPILOGUES, Case, make_cases
from kiln.bench.suite_runner import Worker, geomean, timed_request, worker_env

TARGET = 1.2  # kiln / fastest library routine, per class
Event = Callable[[str, dict[str, Any]], None]


class GemmWorker(Worker):
    """``kiln.bench.suite_runner.Worker`` (reply queue, timeouts, close) started on
    ``kiln.bench.gemm.gemm_worker`` instead of the suite's per-model worker."""

    def __init__(self, args: list[str], env: dict[str, str], log: Path) -> None:
        super().__init__(args, env, log, module="kiln.bench.gemm.gemm_worker")


def write_data(cases: list[Case], data: Path, seed: int = 0) -> None:
    """``data/<shape>/{x,w,b}.npy`` per shape: x ~ N(0, 1), W and b ~ U(±1/√K)
    (nn.Linear's initialisation), float32, from a fixed seed."""
    g = torch.Generator().manual_seed(seed)
    for case in {c.shape: c for c in cases}.values():
        d = data / case.shape
        d.mkdir(parents=True, exist_ok=True)
        bound = case.k**-0.5
        x = torch.randn(case.m, case.k, generator=g)
        w = (torch.rand(case.n, case.k, generator=g) * 2 - 1) * bound
        b = (torch.rand(case.n, generator=g) * 2 - 1) * bound
        for name, t in (("x", x), ("w", w), ("b", b)):
            np.save(d / f"{name}.npy", t.numpy())


def reference(case: Case, data: Path) -> torch.Tensor:
    """``act(X Wᵀ + b)`` in float64 torch (independent of every contender's fp32 path)."""
    x, w, b = (torch.from_numpy(np.load(data / case.shape / f"{n}.npy")).double() for n in "xwb")
    y = torch.nn.functional.linear(x, w, b)
    return torch.nn.functional.gelu(y) if case.epilogue == "gelu" else y


def _start(cons: list[str], cases: list[Case], tmp: Path, opts: dict[str, Any], emit: Event
           ) -> tuple[dict[str, GemmWorker], dict[str, dict[str, Any]]]:  # fmt: skip
    """Export ONNX if needed, then start and prepare one worker per contender in turn."""
    env = worker_env(tmp / "inductor-cache")
    base = ["--data", str(tmp / "data"), "--workdir", str(tmp / "work"),
            "--cases", ",".join(c.name for c in cases)]  # fmt: skip
    facts: dict[str, dict[str, Any]] = {c: {} for c in cons}
    if "ort" in cons:
        emit("export", {})
        w = GemmWorker([*base, "--export"], env, tmp / "export.log")
        msg = w.recv(opts["prepare_timeout_s"])
        w.close()
        facts["ort"] = {n: {"export": f} for n, f in msg.get("cases", {}).items()}
    workers: dict[str, GemmWorker] = {}
    for c in cons:
        emit("prepare", {"contender": c})
        w = GemmWorker([*base, "--contender", c, "--warmup-s", str(opts["warmup_s"]),
                        "--rep-ms", str(opts["rep_ms"])], env, tmp / f"{c}.log")  # fmt: skip
        msg = w.recv(opts["prepare_timeout_s"])
        if "error" in msg:
            facts[c] = {n.name: {"error": msg["error"]} for n in cases}
            w.close()
        else:
            for name, f in msg["cases"].items():
                facts[c].setdefault(name, {}).update(f)
            workers[c] = w
        emit("prepared", {"contender": c, "cases": facts[c]})
    return workers, facts


def _time_once(w: GemmWorker, case: Case, reps: int, opts: dict[str, Any]
               ) -> tuple[dict[str, Any], float, float]:  # fmt: skip
    """Time ``case`` on ``w``: ``(reply, co-tenants' CPU share during, share before)``."""
    return timed_request(w, f"time {case.name} {reps}", opts)


def _rounds(workers: dict[str, GemmWorker], facts: dict[str, dict[str, Any]], cases: list[Case],
            rounds: int, reps: int, opts: dict[str, Any], emit: Event
            ) -> dict[str, dict[str, dict[str, list[float]]]]:  # fmt: skip
    """Interleaved rounds; per case and contender: medians (s), busy shares, calls
    per repetition. A timing during which co-tenants used more than ``quiet_busy``
    of the CPUs is repeated up to ``retries`` times; the quietest attempt counts
    (chosen by the co-tenants' share, never by the time measured)."""
    rec: dict[str, dict[str, dict[str, list[float]]]] = {
        c.name: {k: {"med": [], "busy": [], "before": [], "inner": [], "attempts": []}
                 for k in workers} for c in cases
    }  # fmt: skip
    for r in range(rounds):
        for i, case in enumerate(cases):
            live = [k for k in workers if "error" not in facts[k].get(case.name, {"error": 1})]
            s = (r + i) % len(live) if live else 0
            for k in live[s:] + live[:s]:
                w = workers[k]
                tries: list[tuple[dict[str, Any], float, float]] = []
                while len(tries) <= opts["retries"]:
                    tries.append(_time_once(w, case, reps, opts))
                    if "error" in tries[-1][0] or tries[-1][1] <= opts["quiet_busy"]:
                        break
                msg, busy, quiet = min(tries, key=lambda t: ("error" in t[0], t[1]))
                if w.proc.poll() is not None:  # timed out (closed) or died: drop it
                    del workers[k]
                if "error" in msg:
                    facts[k][case.name]["error"] = f"round {r}: {msg['error']}"
                    continue
                slot = rec[case.name][k]
                slot["med"].append(statistics.median(msg["times_s"]))
                slot["busy"].append(busy)
                slot["before"].append(quiet)
                slot["inner"].append(msg["inner"])
                slot["attempts"].append(len(tries))
        emit("round", {"round": r + 1, "rounds": rounds})
    return rec


def _case_entry(case: Case, rec: dict[str, dict[str, list[float]]], facts: dict[str, Any],
                outs: dict[str, torch.Tensor], ref: torch.Tensor) -> dict[str, Any]:  # fmt: skip
    """One case's figures: µs per contender, fastest library, kiln's ratio, errors."""
    us: dict[str, float | None] = {}
    entry: dict[str, Any] = {"shape": case.shape, "m": case.m, "k": case.k, "n": case.n,
                             "shape_class": case.shape_class, "epilogue": case.epilogue,
                             "gflop": case.flops / 1e9}  # fmt: skip
    for k in facts:
        meds = rec.get(k, {}).get("med", [])
        ok = meds and "error" not in facts[k].get(case.name, {})
        us[k] = min(meds) * 1e6 if ok else None
        if ok:
            best = meds.index(min(meds))
            entry.setdefault("round_us", {})[k] = [m * 1e6 for m in meds]
            entry.setdefault("round_cotenant_busy", {})[k] = rec[k]["busy"]
            entry.setdefault("best_round_cotenant_busy", {})[k] = rec[k]["busy"][best]
            entry.setdefault("round_inner", {})[k] = rec[k]["inner"]
            entry.setdefault("round_attempts", {})[k] = rec[k]["attempts"]
    entry["us"] = us
    entry["gflops"] = {k: case.flops / (v * 1e3) for k, v in us.items() if v}
    entry["accuracy"] = {k: errors.compare([o], [ref]) for k, o in outs.items()}
    entry["facts"] = {k: f.get(case.name, {}) for k, f in facts.items()}
    libs = {k: v for k, v in us.items() if k in LIBRARIES and v}
    fastest = min(libs, key=lambda k: libs[k]) if libs else None
    entry["fastest_library"] = fastest
    entry["fastest_library_us"] = libs.get(fastest) if fastest else None
    kiln_us = us.get("kiln")
    entry["kiln_ratio"] = kiln_us / libs[fastest] if kiln_us and fastest else None
    entry["kiln_kernels"] = entry["facts"].get("kiln", {}).get("kernel_table")
    return entry


def summarise_classes(cases: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """Per class: geomean and worst kiln / fastest-library ratio, overall and per
    epilogue, and the verdict: every case of the class within ``TARGET``."""
    out: dict[str, Any] = {}
    for cls in [*CLASSES, *sorted({e["shape_class"] for e in cases.values()} - set(CLASSES))]:
        members = {n: e for n, e in cases.items() if e["shape_class"] == cls}
        if not members:
            continue
        ratios = {n: e["kiln_ratio"] for n, e in members.items() if e["kiln_ratio"]}
        complete = len(ratios) == len(members)
        worst = max(ratios, key=lambda n: ratios[n]) if ratios else None
        geo = geomean(list(ratios.values()))
        by_epi = {}
        for epi in sorted({e["epilogue"] for e in members.values()}):
            r = [v for n, v in ratios.items() if members[n]["epilogue"] == epi]
            by_epi[epi] = {"geomean_ratio": geomean(r), "worst_ratio": max(r) if r else None}
        out[cls] = {
            "cases": list(members),
            "measured": len(ratios),
            "geomean_ratio": geo,
            "worst_ratio": ratios[worst] if worst else None,
            "worst_case": worst,
            "by_epilogue": by_epi,
            "within_1_2x": (ratios[worst] <= TARGET) if worst and complete else None,
            "within_1_2x_geomean": (geo <= TARGET) if geo and complete else None,
        }
    return out


def run_gemm(
    shapes: list[tuple[int, int, int]],
    contenders: list[str] | tuple[str, ...] = NAMES,
    epilogues: list[str] | tuple[str, ...] = EPILOGUES,
    rounds: int = 3,
    reps: int = 10,
    out_dir: str | Path = RESULTS_DIR,
    *,
    warmup_s: float = 0.2,
    rep_ms: float = 5.0,
    quiet_wait_s: float = 1.0,
    quiet_busy: float = 0.25,
    retries: int = 1,
    prepare_timeout_s: float = 600.0,
    round_timeout_s: float = 120.0,
    on_event: Event | None = None,
) -> dict[str, Any]:
    """Time every shape x epilogue with every contender; write and return the result.

    The result goes to ``out_dir/gemm-<device-slug>-<yyyymmdd>.json`` (same-day
    runs on one device overwrite it); its path is ``result["path"]``. Per case it
    holds µs per contender, the fastest library routine and kiln's ratio to it;
    ``result["classes"]`` holds the per-class verdict (``within_1_2x``).
    """
    emit: Event = on_event or (lambda kind, info: None)
    bad = [c for c in contenders if c not in NAMES]
    if bad:
        raise ValueError(f"unknown contender(s) {bad}; known: {', '.join(NAMES)}")
    cons = [c for c in NAMES if c in contenders]
    cases = make_cases(shapes, tuple(epilogues))
    cpu = system.cpu_info()
    now = dt.datetime.now(dt.timezone.utc)
    opts = {"warmup_s": warmup_s, "rep_ms": rep_ms, "quiet_wait_s": quiet_wait_s,
            "quiet_busy": quiet_busy, "retries": retries, "prepare_timeout_s": prepare_timeout_s,
            "round_timeout_s": round_timeout_s}  # fmt: skip
    result: dict[str, Any] = {
        "schema": 1,
        "benchmark": "gemm",
        "requirement": f"per shape class, kiln within {TARGET}x of the fastest library routine, "
        "fused epilogue included",
        "target_ratio": TARGET,
        "date": now.isoformat(timespec="seconds"),
        "device": {**cpu, "slug": system.device_slug(cpu)},
        "versions": system.versions(),
        "threads": THREADS,
        "dtype": "float32",
        "protocol": {"rounds": rounds, "reps": reps, **opts, "statistic": "best round's median"},
        "contenders": cons,
        "libraries": [c for c in cons if c in LIBRARIES],
        "load_before": system.load_snapshot(),
        "cases": {},
    }
    with tempfile.TemporaryDirectory(prefix="kiln-gemm-") as td:
        tmp = Path(td)
        write_data(cases, tmp / "data")
        workers, facts = _start(cons, cases, tmp, opts, emit)
        load_at_rounds = list(os.getloadavg())
        try:
            rec = _rounds(workers, facts, cases, rounds, reps, opts, emit)
            for w in workers.values():
                w.send("save")
                w.recv(round_timeout_s)
                w.send("finish")
                w.recv(round_timeout_s)
        finally:
            for w in workers.values():
                w.close()
        for case in cases:
            outs = {k: torch.from_numpy(np.load(p)) for k in cons
                    if (p := tmp / "work" / "out" / case.name / f"{k}.npy").exists()}  # fmt: skip
            entry = _case_entry(case, rec[case.name], facts, outs, reference(case, tmp / "data"))
            result["cases"][case.name] = entry
            emit("case_done", {"case": case.name, **entry})
    result["loadavg_at_rounds"] = load_at_rounds
    result["load_after"] = system.load_snapshot()
    shares = [b for e in result["cases"].values() for v in e.get("round_cotenant_busy", {}).values()
              for b in v]  # fmt: skip
    result["cotenant_busy_median"] = statistics.median(shares) if shares else None
    result["cotenant_busy_max"] = max(shares) if shares else None
    result["classes"] = summarise_classes(result["cases"])
    name = f"gemm-{result['device']['slug']}-{now:%Y%m%d}.json"
    return system.write_result(result, out_dir, name)
