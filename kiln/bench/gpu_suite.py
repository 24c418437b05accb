"""The GPU side-by-side: ``python -m kiln.bench.gpu_suite [--models a,b] [--rounds N] [--out DIR]``.

The CPU suite's protocol (docs/benchmarks.md, "Timing protocol") on a CUDA GPU: for each suite
model at its GPU batch, one worker process per contender (``suite_worker --device cuda``:
eager, torch.compile in modes default / reduce-overhead / max-autotune, kiln), prepared in
turn, each with fresh inductor, Triton and kiln cache folders so its compile time is cold and
uncontended. Then interleaved rounds (round r times every contender once, the order rotated
each round); a round is ``--reps`` repetitions, each synchronised before and after and sized
to last ``--rep-ms``; a contender's figure is its best round's median per-call time. Also per
contender: cold compile seconds, steady-state peak GPU memory (``max_memory_allocated`` after a
reset following warm-up, and ``memory_reserved``), and max abs / normwise rel error of its
outputs against eager's (eager fp32 against fp64 is the noise floor).

Ratios: speed-up over eager, kiln over each contender and over the best torch.compile mode
(per model), geomeans over models. The JSON and a markdown table go to ``--out`` as
``gpu-suite-<device-slug>-<yyyymmdd>.{json,md}``, rewritten after every model, so a run cut
short (``--budget-s``, or killed) still leaves the models it finished. Without CUDA it exits
with status 2 and a message.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as dt
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from kiln.bench import RESULTS_DIR, system
from kiln.bench import output_errors as errors
from kiln.bench.contenders import GPU_NAMES, canonical
from kiln.bench.suite import MODELS, get
from kiln.bench.suite_runner import REPO, Worker, geomean
from kiln.core.offline import offline_env

TORCH_COMPILE = tuple(c for c in GPU_NAMES if c.startswith("inductor-"))
Emit = Callable[[str], None]


def _ratio(num: float | None, den: float | None) -> float | None:
    return num / den if num and den else None


def device_slug(name: str) -> str:
    """``NVIDIA H100 80GB HBM3`` -> ``nvidia-h100-80gb-hbm3``."""
    return re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-")[:48].strip("-") or "cuda"


def gpu_info() -> dict[str, Any]:
    """Name, slug, compute capability, SMs, memory and driver of CUDA device 0."""
    import torch

    p = torch.cuda.get_device_properties(0)
    info: dict[str, Any] = {
        "name": p.name, "slug": device_slug(p.name), "capability": f"{p.major}.{p.minor}",
        "sm_count": p.multi_processor_count, "total_memory_bytes": p.total_memory,
        "l2_cache_bytes": getattr(p, "L2_cache_size", None), "driver": None,
    }  # fmt: skip
    q = ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader", "-i", "0"]
    with contextlib.suppress(OSError, subprocess.SubprocessError):
        info["driver"] = subprocess.run(
            q, capture_output=True, text=True, timeout=20
        ).stdout.strip()
    return info


def gpu_versions() -> dict[str, Any]:
    import torch

    out: dict[str, Any] = {**system.versions(), "cuda": torch.version.cuda}
    out["cudnn"] = torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None
    try:
        import triton

        out["triton"] = triton.__version__
    except ImportError:
        out["triton"] = None
    return out


def worker_env(cache_root: Path) -> dict[str, str]:
    """A worker's environment: fresh inductor / Triton / kiln caches (cold compiles), offline
    hubs, the repo on the path, never Triton's interpreter."""
    env = offline_env(dict(os.environ))
    env.pop("TRITON_INTERPRET", None)
    for var, sub in (("TORCHINDUCTOR_CACHE_DIR", "inductor"), ("TRITON_CACHE_DIR", "triton"),
                     ("KILN_CACHE_DIR", "kiln")):  # fmt: skip
        (cache_root / sub).mkdir(parents=True, exist_ok=True)
        env[var] = str(cache_root / sub)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH", "")) if p)
    return env


def bench_model(
    name: str, contenders: list[str], workdir: Path, opts: dict[str, Any], deadline: float,
    emit: Emit,
) -> dict[str, dict[str, Any]]:  # fmt: skip
    """Prepare each contender's worker in turn, run the interleaved rounds, collect outputs.
    (``opts["device"]`` is ``cuda`` unless a test drives the same protocol on the CPU.)"""
    base = ["--model", name, "--workdir", str(workdir), "--device", opts.get("device", "cuda"), "--warmup-s",
            str(opts["warmup_s"]), "--rep-ms", str(opts["rep_ms"]), "--matmul-precision",
            opts["matmul_precision"]]  # fmt: skip
    left = lambda cap: max(5.0, min(cap, deadline - time.monotonic()))  # noqa: E731
    res: dict[str, dict[str, Any]] = {c: {} for c in contenders}
    workers: dict[str, Worker] = {}
    for c in contenders:
        if deadline - time.monotonic() < 10:
            res[c]["error"] = "skipped: time budget spent"
            continue
        emit(f"  {name}: preparing {c} (cold compile)")
        w = Worker([*base, "--contender", c], worker_env(workdir / f"cache-{c}"), workdir / f"{c}.log")  # fmt: skip
        msg = w.recv(left(opts["prepare_timeout_s"]))
        if "error" in msg:
            w.close()
            tail = w.log.read_text(errors="replace")[-600:] if w.log.exists() else ""
            res[c]["error"] = msg["error"] + ("" if tail in msg["error"] else f"; log: {tail}")
            emit(f"  {name}: {c} failed: {msg['error'][:300]}")
        else:
            res[c].update({k: v for k, v in msg.items() if k != "ready"})
            workers[c] = w
            emit(f"  {name}: {c} ready, compile {msg.get('compile_s', 0):.1f} s")
    medians: dict[str, list[float]] = {c: [] for c in workers}
    for r in range(opts["rounds"]):
        order = list(workers)
        order = order[r % len(order) :] + order[: r % len(order)] if order else order
        for c in order:
            workers[c].send(f"round {opts['reps']}")
            msg = workers[c].recv(left(opts["round_timeout_s"]))
            if "error" in msg:
                res[c]["error"] = f"round {r}: {msg['error']}"
                workers.pop(c).close()
                continue
            medians[c].append(statistics.median(msg["times_s"]))
    for c, w in workers.items():
        w.send("finish")
        msg = w.recv(left(opts["round_timeout_s"]))
        if "error" in msg:
            res[c]["error"] = f"finish: {msg['error']}"
        res[c].update({k: v for k, v in msg.items() if k not in ("ok", "error")})
        w.close()
    for c, meds in medians.items():
        if meds and "error" not in res[c]:
            res[c]["round_medians_ms"] = [m * 1e3 for m in meds]
            res[c]["ms"] = min(meds) * 1e3
    return res


def model_ratios(results: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """Per model: speed-up over eager, kiln over each contender, and kiln over the fastest
    torch.compile mode (which one is named)."""
    ms = {c: r.get("ms") for c, r in results.items()}
    timed = {c: v for c, v in ms.items() if c in TORCH_COMPILE and v}
    best = min(timed, key=lambda c: timed[c]) if timed else None
    kiln = ms.get("kiln")
    return {
        "speedup_vs_eager": {c: _ratio(ms.get("eager"), v) for c, v in ms.items()},
        "kiln_vs": {c: _ratio(v, kiln) for c, v in ms.items() if c != "kiln"},
        "best_torch_compile": best,
        "kiln_vs_best_torch_compile": _ratio(ms.get(best), kiln) if best else None,
    }


def summarise(models: dict[str, dict[str, Any]], contenders: list[str]) -> dict[str, Any]:
    """Geomeans over models (each ratio over the models where both sides have a time)."""

    def gm(vals: list[float | None]) -> tuple[float | None, int]:
        ok = [v for v in vals if v]
        return geomean(ok), len(ok)

    out: dict[str, Any] = {"geomean_speedup_vs_eager": {}, "n_models_vs_eager": {},
                           "geomean_kiln_vs": {}, "n_models_kiln_vs": {}}  # fmt: skip
    for c in contenders:
        g, n = gm([m["speedup_vs_eager"].get(c) for m in models.values()])
        out["geomean_speedup_vs_eager"][c], out["n_models_vs_eager"][c] = g, n
        if c != "kiln":
            g, n = gm([m["kiln_vs"].get(c) for m in models.values()])
            out["geomean_kiln_vs"][c], out["n_models_kiln_vs"][c] = g, n
    g, n = gm([m["kiln_vs_best_torch_compile"] for m in models.values()])
    out["geomean_kiln_vs_best_torch_compile"], out["n_models_kiln_vs_best_torch_compile"] = g, n
    return out


def _x(v: float | None) -> str:
    return f"{v:.2f}x" if v else "-"


def _mib(b: int | None) -> str:
    return f"{b / 2**20:.0f}" if b is not None else "-"


def _note(r: dict[str, Any]) -> str:
    """An error, else what kiln's report says (executor, CUDA graph, fallbacks)."""
    if r.get("error") or r.get("check_error"):
        note = str(r.get("error") or r.get("check_error"))
    elif "executor" in r:
        note = (f"executor={r['executor']}, graph_captured={r.get('graph_captured')}, "
                f"{len(r.get('fallbacks', []))} fallbacks")  # fmt: skip
    else:
        note = ""
    return note[:160].replace("|", "/").replace("\n", " ")


def render_markdown(result: dict[str, Any]) -> str:
    """Latency table (ms and speed-up over eager), then compile / memory / error per contender."""
    cons, dev, s = result["contenders"], result["device"], result.get("summary", {})
    lines = [f"# GPU suite: {dev['name']} ({result['date']})", "",
             f"torch {result['versions'].get('torch')}, triton {result['versions'].get('triton')}, "
             f"CUDA {result['versions'].get('cuda')}; fp32 matmul precision "
             f"{result['matmul_precision']}; best round's median ms per call (speed-up over eager).",
             "", "| model | batch | " + " | ".join(cons) + " | kiln vs best torch.compile |",
             "|---|---|" + "---|" * (len(cons) + 1)]  # fmt: skip
    for name, m in result["models"].items():
        cells = []
        for c in cons:
            r = m["results"].get(c, {})
            cells.append(f"{r['ms']:.3f} ({_x(m['speedup_vs_eager'].get(c))})" if r.get("ms") else "error" if r.get("error") else "-")  # fmt: skip
        best = m.get("best_torch_compile") or "-"
        lines.append(f"| {name} | {m['batch']} | " + " | ".join(cells) + f" | {_x(m['kiln_vs_best_torch_compile'])} ({best}) |")  # fmt: skip
    geo = [_x(s.get("geomean_speedup_vs_eager", {}).get(c)) for c in cons]
    lines += [f"| geomean | | {' | '.join(geo)} | {_x(s.get('geomean_kiln_vs_best_torch_compile'))} |", "",  # fmt: skip
              "| model | contender | cold compile s | peak alloc MiB | reserved MiB | max rel err | note |",
              "|---|---|---|---|---|---|---|"]  # fmt: skip
    for name, m in result["models"].items():
        for c in cons:
            r = m["results"].get(c, {})
            err = f"{r['max_rel_err']:.1e}" if "max_rel_err" in r else "-"
            comp = f"{r['compile_s']:.1f}" if "compile_s" in r else "-"
            mem = f"{_mib(r.get('peak_allocated_bytes'))} | {_mib(r.get('reserved_bytes'))}"
            lines.append(f"| {name} | {c} | {comp} | {mem} | {err} | {_note(r)} |")
    return "\n".join(lines) + "\n"


def _fp64_floor(name: str) -> float | None:
    """Eager fp32 vs fp64 on the GPU (the error noise floor), or None."""
    import torch

    from kiln.bench.suite_worker import to_device

    try:
        module, inputs = to_device(*get(name).build("gpu"), "cuda")
        return errors.fp64_error(module, inputs)
    except Exception:  # noqa: BLE001 - out of memory, say: then no noise floor
        return None
    finally:
        torch.cuda.empty_cache()


def run_gpu_suite(models: list[str], contenders: list[str], out_dir: str | Path = RESULTS_DIR, *,
                  rounds: int = 5, reps: int = 20, warmup_s: float = 1.0, rep_ms: float = 10.0,
                  matmul_precision: str = "highest", budget_s: float | None = None,
                  prepare_timeout_s: float = 600.0, round_timeout_s: float = 120.0,
                  emit: Emit = print) -> dict[str, Any]:  # fmt: skip
    """Benchmark ``models`` x ``contenders`` side by side on GPU 0; write and return the result
    (its path in ``result["path"]``). Eager always runs first, as the reference."""
    t_start = time.monotonic()
    deadline = t_start + (budget_s if budget_s else 1e9)
    cons = ["eager"] + [c for c in dict.fromkeys(canonical(c, "cuda") for c in contenders) if c != "eager"]  # fmt: skip
    names = [get(m).name for m in models]
    now = dt.datetime.now(dt.timezone.utc)
    opts = {"rounds": rounds, "reps": reps, "warmup_s": warmup_s, "rep_ms": rep_ms,
            "matmul_precision": matmul_precision, "prepare_timeout_s": prepare_timeout_s,
            "round_timeout_s": round_timeout_s}  # fmt: skip
    dev = gpu_info()
    result: dict[str, Any] = {
        "schema": 1, "benchmark": "gpu_suite", "date": now.isoformat(timespec="seconds"),
        "device": dev, "host_cpu": system.cpu_info(), "versions": gpu_versions(),
        "matmul_precision": matmul_precision, "dtype": "float32",
        "protocol": {**opts, "budget_s": budget_s, "statistic": "best round's median",
                     "timer": "perf_counter around synchronised repetitions"},
        "contenders": cons, "models": {}, "skipped_models": [], "complete": False,
    }  # fmt: skip
    fname = f"gpu-suite-{dev['slug']}-{now:%Y%m%d}.json"
    with tempfile.TemporaryDirectory(prefix="kiln-gpu-bench-") as tmp:
        for i, name in enumerate(names):
            if deadline - time.monotonic() < 30:
                result["skipped_models"] = names[i:]
                emit(f"time budget spent: skipping {', '.join(names[i:])}")
                break
            emit(f"[{i + 1}/{len(names)}] {name} (batch {get(name).gpu_batch})")
            workdir = Path(tmp) / name
            workdir.mkdir()
            res = bench_model(name, cons, workdir, opts, deadline, emit)
            errors.attach_errors(res, workdir)
            _, inputs = get(name).build("gpu")
            entry = {"kind": get(name).kind, "config": get(name).config, "batch": get(name).gpu_batch,
                     "input_shapes": [list(t.shape) for t in inputs],
                     "input_dtypes": [str(t.dtype).removeprefix("torch.") for t in inputs],
                     "fp32_vs_fp64_rel_err": _fp64_floor(name), "results": res, **model_ratios(res)}  # fmt: skip
            result["models"][name] = entry
            emit(f"  {name}: " + ", ".join(f"{c} {r['ms']:.3f} ms" if r.get("ms") else f"{c} error" for c, r in res.items()))  # fmt: skip
            result["summary"] = summarise(result["models"], cons)
            result["wall_s"] = time.monotonic() - t_start
            system.write_result(result, out_dir, fname, render_markdown(result))
        cut = [m for m, e in result["models"].items() for r in e["results"].values()
               if str(r.get("error", "")).startswith("skipped")]  # fmt: skip
        result["complete"] = not result["skipped_models"] and not cut
    result["summary"] = summarise(result["models"], cons)
    result["wall_s"] = time.monotonic() - t_start
    return system.write_result(result, out_dir, fname, render_markdown(result))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m kiln.bench.gpu_suite", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    p.add_argument("--models", default=",".join(MODELS), help="comma-separated (default: all)")
    p.add_argument("--contenders", default=",".join(GPU_NAMES), help="eager always runs")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--reps", type=int, default=20, help="repetitions per round")
    p.add_argument("--rep-ms", type=float, default=10.0, help="target length of a repetition")
    p.add_argument("--warmup-s", type=float, default=1.0)
    p.add_argument("--matmul-precision", choices=("highest", "high", "medium"), default="highest")
    p.add_argument("--budget-s", type=float, default=None, help="stop starting work after this")
    p.add_argument("--prepare-timeout-s", type=float, default=600.0)
    p.add_argument("--out", default=str(RESULTS_DIR), help="output folder")
    args = p.parse_args(argv)
    import torch

    if not torch.cuda.is_available():
        print("gpu_suite: no CUDA GPU found (torch.cuda.is_available() is False; torch "
              f"{torch.__version__}, CUDA build {torch.version.cuda}); this benchmark needs one.",
              file=sys.stderr)  # fmt: skip
        return 2
    split = lambda s: [x for x in s.split(",") if x.strip()]  # noqa: E731
    try:
        models, cons = [get(m).name for m in split(args.models)], split(args.contenders)
        for c in cons:
            canonical(c, "cuda")
    except KeyError as e:
        print(f"gpu_suite: {e.args[0]}", file=sys.stderr)
        return 2
    result = run_gpu_suite(models, cons, args.out, rounds=args.rounds, reps=args.reps,
                           warmup_s=args.warmup_s, rep_ms=args.rep_ms,
                           matmul_precision=args.matmul_precision, budget_s=args.budget_s,
                           prepare_timeout_s=args.prepare_timeout_s,
                           emit=lambda s: print(s, flush=True))  # fmt: skip
    print(render_markdown(result))
    print(f"wrote {result['path']} and {result.get('markdown_path')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
