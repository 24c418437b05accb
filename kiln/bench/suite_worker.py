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

``--device cuda`` (the GPU suite, kiln/bench/gpu_suite.py): the model is built at its GPU
batch and moved with its inputs to the GPU, the contender comes from the GPU registry,
compile time ends with ``torch.cuda.synchronize()``, and every timed repetition is
synchronised before and after (so a figure is wall-clock time per call, host overhead and
GPU work together). The peak-memory counters are reset after warm-up, and ``finish`` replies
with the steady-state ``max_memory_allocated`` and ``memory_reserved`` (bytes). Without a
usable CUDA device the first reply is an error and the exit status 2.
"""

from __future__ import annotations

import argparse
import gc
import math
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import IO, Any

import torch

from kiln.bench.channel import reply_channel, send
from kiln.bench.contenders import Contender, canonical, load
from kiln.bench.suite import get

THREADS = 2


def _no_sync() -> None:
    pass


def no_cuda_reason() -> str | None:
    """Why no CUDA device can be used here (None when one can)."""
    if not torch.cuda.is_available():
        built = torch.version.cuda or "none (a CPU-only build)"
        return f"torch.cuda.is_available() is False (torch {torch.__version__}, CUDA {built})"
    return None


def sync_for(device: str) -> Callable[[], None]:
    """What waits for ``device`` to finish queued work (nothing on the CPU)."""
    return torch.cuda.synchronize if device == "cuda" else _no_sync


def to_device(
    model: torch.nn.Module, inputs: tuple[Any, ...], device: str
) -> tuple[torch.nn.Module, tuple[Any, ...]]:
    """The model and every tensor among the inputs moved to ``device``."""
    moved = torch.utils._pytree.tree_map(
        lambda t: t.to(device) if isinstance(t, torch.Tensor) else t, inputs
    )
    return model.to(device), tuple(moved)


def warm_up(
    c: Contender, seconds: float, rep_s: float, sync: Callable[[], None] = _no_sync
) -> tuple[int, float, int]:
    """Call ``run`` for at least ``seconds`` (and 5 calls); return
    ``(calls per repetition, estimated seconds per call, warm-up calls)``.
    A repetition is sized to last about ``rep_s`` so timer resolution and
    loop overhead vanish. ``sync`` waits for the device after each call."""
    best = math.inf
    calls = 0
    t_end = time.perf_counter() + seconds
    while calls < 5 or time.perf_counter() < t_end:
        sync()
        t0 = time.perf_counter_ns()
        c.run()
        sync()
        best = min(best, (time.perf_counter_ns() - t0) * 1e-9)
        calls += 1
    inner = max(1, min(100_000, math.ceil(rep_s / max(best, 1e-7))))
    return inner, best, calls


def time_round(
    c: Contender, reps: int, inner: int, sync: Callable[[], None] = _no_sync
) -> list[float]:
    """``reps`` repetitions of ``inner`` back-to-back calls; per-call seconds each
    (``sync`` before the clock starts and before it stops)."""
    gc.collect()
    gc.disable()
    try:
        out = []
        for _ in range(reps):
            sync()
            t0 = time.perf_counter_ns()
            for _ in range(inner):
                c.run()
            sync()
            out.append((time.perf_counter_ns() - t0) * 1e-9 / inner)
        return out
    finally:
        gc.enable()


def serve(args: argparse.Namespace, chan: IO[str]) -> int:
    """Prepare, warm up, then answer commands until ``finish`` or end of input."""
    cuda = args.device == "cuda"
    if cuda and (reason := no_cuda_reason()):
        send(chan, {"error": f"no CUDA device: {reason}"})
        return 2
    if cuda:
        torch.set_float32_matmul_precision(args.matmul_precision)
    else:
        torch.set_num_threads(THREADS)
    sync = sync_for(args.device)
    workdir = Path(args.workdir)
    try:
        name = canonical(args.contender, args.device)
        model, inputs = get(args.model).build("gpu" if cuda else "cpu", seed=args.seed)
        if cuda:
            model, inputs = to_device(model, inputs, "cuda")
        contender = load(name, args.device)
        t0 = time.perf_counter()
        facts = contender.prepare(model, inputs, workdir)
        sync()
        compile_s = time.perf_counter() - t0
        profile = getattr(contender, "profile", None)
        if profile is not None and not cuda:  # after the compile was timed
            facts.update(profile())
        if args.compile_only:
            send(chan, {"ready": True, "compile_s": compile_s, **facts})
            return 0
        inner, est, warm_calls = warm_up(contender, args.warmup_s, args.rep_ms * 1e-3, sync)
        if cuda:
            facts["prepare_peak_allocated_bytes"] = torch.cuda.max_memory_allocated()
            torch.cuda.reset_peak_memory_stats()
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
                send(chan, {"times_s": time_round(contender, int(cmd[1]), inner, sync)})
            elif cmd and cmd[0] == "finish":
                contender.run()
                sync()
                mem: dict[str, int] = {}
                if cuda:
                    mem = {
                        "peak_allocated_bytes": torch.cuda.max_memory_allocated(),
                        "reserved_bytes": torch.cuda.memory_reserved(),
                    }
                torch.save([t.cpu() for t in contender.outputs()], workdir / f"{name}.pt")
                send(chan, {"ok": True, **mem})
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
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                   help="cuda: GPU batch, GPU contender registry, synchronised timing")  # fmt: skip
    p.add_argument("--matmul-precision", choices=("highest", "high", "medium"),
                   default="highest", help="torch.set_float32_matmul_precision (cuda only)")  # fmt: skip
    args = p.parse_args(argv)
    chan = reply_channel()
    return serve(args, chan)


if __name__ == "__main__":
    sys.exit(main())
