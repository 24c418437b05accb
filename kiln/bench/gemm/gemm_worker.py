"""The GEMM worker: one contender, every case, driven over stdin/stdout.

``python -m kiln.bench.gemm.gemm_worker --contender C --data D --workdir W --cases a,b``
imports only C's runtime, prepares every case (each timed: compile / pack /
session time), warms each up, replies
``{"ready": true, "cases": {case: facts or {"error": ...}}}`` and then answers
one JSON line per command line:

* ``time CASE N`` -- a short untimed warm-up of CASE (its data was evicted by the
  other cases) that sizes a repetition, then N repetitions; reply
  ``{"times_s": [per-call seconds, ...], "inner": calls per repetition}``
* ``save``        -- write each case's output to ``W/out/<case>/<contender>.npy``
* ``finish``      -- reply ``{"ok": true}`` and exit (end of input exits too)

``--export`` instead writes each case's ONNX file (torch) and exits after one reply.

The benchmark suite's worker (``kiln.bench.suite_worker``) serves one model per process
and imports torch and the model registry; this one holds all cases of one
runtime in one process (fewer process starts) and stays free of torch unless its
contender needs it, so the ONNX Runtime and numpy workers load no second thread pool.
Anything a library prints goes to stderr; replies use a private copy of stdout.
"""

from __future__ import annotations

import argparse
import gc
import math
import sys
import time
import traceback
from pathlib import Path
from typing import IO, Any

from kiln.bench.channel import reply_channel, send
from kiln.bench.gemm.gemm_contenders import PREPARE, Prepared, export_onnx
from kiln.bench.gemm.shapes import case_from_name


def warm(p: Prepared, seconds: float, min_calls: int) -> tuple[float, int]:
    """Call ``run`` for at least ``seconds`` and ``min_calls`` calls; return
    ``(fastest call in seconds, calls made)``."""
    best, calls = math.inf, 0
    t_end = time.perf_counter() + seconds
    while calls < min_calls or time.perf_counter() < t_end:
        t0 = time.perf_counter_ns()
        p.run()
        best = min(best, (time.perf_counter_ns() - t0) * 1e-9)
        calls += 1
    return best, calls


def time_case(p: Prepared, reps: int, rep_s: float) -> tuple[list[float], int]:
    """Warm up for one repetition's length (caches were evicted by the other cases,
    the thread pool may sleep) and size a repetition from the fastest warm-up call
    (sized here, not once at start-up, so a start-up disturbed by co-tenants cannot
    leave single-call repetitions); then ``reps`` repetitions of ``inner``
    back-to-back calls. Returns ``(per-call seconds of each repetition, inner)``."""
    gc.collect()
    gc.disable()
    try:
        best, _ = warm(p, rep_s, 3)
        inner = max(1, min(100_000, math.ceil(rep_s / max(best, 1e-7))))
        out = []
        for _ in range(reps):
            t0 = time.perf_counter_ns()
            for _ in range(inner):
                p.run()
            out.append((time.perf_counter_ns() - t0) * 1e-9 / inner)
        return out, inner
    finally:
        gc.enable()


def _prepare_all(
    args: argparse.Namespace, data: Path, work: Path
) -> tuple[dict[str, Prepared], dict[str, Any]]:
    """Prepare and warm every case; a failing case is recorded, the others go on."""
    prepare = PREPARE[args.contender]
    ready: dict[str, Prepared] = {}
    facts: dict[str, Any] = {}
    for name in args.cases.split(","):
        try:
            t0 = time.perf_counter()
            p = prepare(case_from_name(name), data, work)
            prep_s = time.perf_counter() - t0
            best, calls = warm(p, args.warmup_s, 5)
        except Exception as e:  # noqa: BLE001 - every failure becomes a recorded error
            traceback.print_exc()
            facts[name] = {"error": f"{type(e).__name__}: {e}"[:2000]}
            continue
        ready[name] = p
        facts[name] = {"prepare_s": prep_s, "warmup_best_us": best * 1e6,
                       "warmup_calls": calls, **p.facts}  # fmt: skip
    return ready, facts


def serve(args: argparse.Namespace, chan: IO[str]) -> int:
    """Prepare, then answer commands until ``finish`` or end of input."""
    data, work = Path(args.data), Path(args.workdir)
    if args.export:
        cases = [case_from_name(n) for n in args.cases.split(",")]
        send(chan, {"ready": True, "cases": export_onnx(cases, data, work)})
        return 0
    ready, facts = _prepare_all(args, data, work)
    send(chan, {"ready": True, "cases": facts})
    for line in sys.stdin:
        cmd = line.split()
        try:
            if len(cmd) == 3 and cmd[0] == "time":
                times, inner = time_case(ready[cmd[1]], int(cmd[2]), args.rep_ms * 1e-3)
                send(chan, {"times_s": times, "inner": inner})
            elif cmd == ["save"]:
                import numpy as np

                for name, p in ready.items():
                    (work / "out" / name).mkdir(parents=True, exist_ok=True)
                    np.save(work / "out" / name / f"{args.contender}.npy", p.output())
                send(chan, {"ok": True})
            elif cmd == ["finish"]:
                send(chan, {"ok": True})
                return 0
            else:
                send(chan, {"error": f"unknown command {line.strip()!r}"})
        except Exception as e:  # noqa: BLE001
            traceback.print_exc()
            send(chan, {"error": f"{type(e).__name__}: {e}"[:2000]})
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--contender", default="", choices=["", *PREPARE])
    p.add_argument("--export", action="store_true", help="write the ONNX files and exit")
    p.add_argument("--data", required=True, help="folder with <shape>/{x,w,b}.npy")
    p.add_argument("--workdir", required=True)
    p.add_argument("--cases", required=True, help="comma list of case names (8x256x688-gelu)")
    p.add_argument("--warmup-s", type=float, default=0.2)
    p.add_argument("--rep-ms", type=float, default=5.0, help="target length of one repetition")
    args = p.parse_args(argv)
    if not args.export and not args.contender:
        p.error("--contender is required unless --export")
    chan = reply_channel()
    try:
        return serve(args, chan)
    except Exception as e:  # noqa: BLE001 - report instead of dying silently
        traceback.print_exc()
        send(chan, {"error": f"{type(e).__name__}: {e}"[:2000]})
        return 1


if __name__ == "__main__":
    sys.exit(main())
