"""The worker process: one contender on one model, driven over stdin/stdout.

``python -m kiln.bench.suite_worker --model M --contender C --workdir D`` rebuilds the
model and inputs from the registry (fixed seed), prepares the contender (timed:
compile time, cold), warms up (which also sizes a repetition), then answers
commands, one per line on stdin, each with one JSON line on its stdout:

* ``round N``  -- time N repetitions; reply ``{"times_s": [per-call seconds, ...]}``
* ``finish``   -- save the outputs to ``D/<contender>.pt``; reply ``{"ok": true}``, exit

The first reply is ``{"ready": true, "compile_s": ..., ...}`` or ``{"error": "..."}``.
Anything a library prints goes to stderr: file descriptor 1 is redirected there and
the replies use a private duplicate of the original stdout.
"""

from __future__ import annotations

import argparse
import gc
import math
import sys
import time
import traceback
from pathlib import Path
from typing import IO

import torch

from kiln.bench.channel import reply_channel, send
from kiln.bench.contenders import Contender, canonical, load
from kiln.bench.suite import get

THREADS = 2


def warm_up(c: Contender, seconds: float, rep_s: float) -> tuple[int, float, int]:
    """Call ``run`` for at least ``seconds`` (and 5 calls); return
    ``(calls per repetition, estimated seconds per call, warm-up calls)``.
    A repetition is sized to last about ``rep_s`` so timer resolution and
    loop overhead vanish."""
    best = math.inf
    calls = 0
    t_end = time.perf_counter() + seconds
    while calls < 5 or time.perf_counter() < t_end:
        t0 = time.perf_counter_ns()
        c.run()
        best = min(best, (time.perf_counter_ns() - t0) * 1e-9)
        calls += 1
    inner = max(1, min(100_000, math.ceil(rep_s / max(best, 1e-7))))
    return inner, best, calls


def time_round(c: Contender, reps: int, inner: int) -> list[float]:
    """``reps`` repetitions of ``inner`` back-to-back calls; per-call seconds each."""
    gc.collect()
    gc.disable()
    try:
        out = []
        for _ in range(reps):
            t0 = time.perf_counter_ns()
            for _ in range(inner):
                c.run()
            out.append((time.perf_counter_ns() - t0) * 1e-9 / inner)
        return out
    finally:
        gc.enable()


def serve(args: argparse.Namespace, chan: IO[str]) -> int:
    """Prepare, warm up, then answer commands until ``finish`` or end of input."""
    torch.set_num_threads(THREADS)
    name = canonical(args.contender)
    workdir = Path(args.workdir)
    try:
        model, inputs = get(args.model).build(seed=args.seed)
        contender = load(name)
        t0 = time.perf_counter()
        facts = contender.prepare(model, inputs, workdir)
        compile_s = time.perf_counter() - t0
        if args.compile_only:
            send(chan, {"ready": True, "compile_s": compile_s, **facts})
            return 0
        inner, est, warm_calls = warm_up(contender, args.warmup_s, args.rep_ms * 1e-3)
    except Exception as e:  # noqa: BLE001 - every failure becomes a recorded error
        traceback.print_exc()
        send(chan, {"error": f"{type(e).__name__}: {e}"[:2000]})
        return 1
    send(
        chan,
        {
            "ready": True,
            "compile_s": compile_s,
            "inner": inner,
            "warmup_calls": warm_calls,
            "est_s": est,
            **facts,
        },
    )
    for line in sys.stdin:
        cmd = line.split()
        try:
            if cmd and cmd[0] == "round":
                send(chan, {"times_s": time_round(contender, int(cmd[1]), inner)})
            elif cmd and cmd[0] == "finish":
                contender.run()
                torch.save(contender.outputs(), workdir / f"{name}.pt")
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
    p.add_argument("--model", required=True)
    p.add_argument("--contender", required=True)
    p.add_argument("--workdir", required=True)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--warmup-s", type=float, default=0.3)
    p.add_argument("--rep-ms", type=float, default=2.0, help="target length of one repetition")
    p.add_argument("--compile-only", action="store_true", help="prepare, report, exit")
    args = p.parse_args(argv)
    chan = reply_channel()
    return serve(args, chan)


if __name__ == "__main__":
    sys.exit(main())
