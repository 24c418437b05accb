"""Compressed linear layers on a CUDA GPU: ``python -m kiln.bench.gpu_quant --out FILE``.

For each layer shape (K x N) and M activation rows it times ``y = x @ W.T`` (fp16 activations)
five ways and checks each against its reference:

* ``fp16``: ``F.linear`` on the dense fp16 weight (cuBLAS), the baseline;
* ``int8``: kiln's :func:`~kiln.kernels.gpu.woq_triton.int8_matmul` (per-channel INT8 weight);
* ``int4_g128`` / ``int4_g32``: :func:`~kiln.kernels.gpu.woq_triton.int4_matmul`, asymmetric groups;
* ``sparse24``: torch's 2:4 semi-structured fp16 kernel via
  :func:`~kiln.kernels.gpu.sparse24.sparse24_linear` (M padded to the backend's row multiple;
  the padding and slicing are timed too).

Shapes: SmolLM2-135M's projections (576x576 q/o, 576x192 k/v, 576x1536 gate/up, 1536x576
down) and two 7B-class ones (4096x4096, 4096x11008) where the weight stream dwarfs launch
costs. M in {1, 4, 16} (decode).

Timing (see :class:`Timer`): ``--copies`` calls, each on its own copy of the weights, are
captured in one CUDA graph and replayed under ``triton.testing.do_bench`` (median, warm-up,
L2 flushed before every replay): the per-call time a served model replaying a graph would
see, every weight read from HBM, no Python or launch overhead. That overhead is reported
apart as ``host_us`` (eager host time per call). The JSON holds the device name,
torch/triton/CUDA versions, the measured copy bandwidth, and per case the time, speed-up over
fp16 (``fp16 ms / ms``), weight bytes, effective bandwidth and the relative error
``||y - ref|| / ||ref||`` against the method's reference (dequantize + matmul in fp32; dense
``F.linear`` on the pruned weight for 2:4).

``--smoke`` runs tiny shapes; without a GPU it runs them through Triton's interpreter on the
CPU (timings meaningless), which checks this script's logic end to end. Without ``--smoke``
and without a GPU it exits with status 2. A failed correctness check gives status 1.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

SHAPES = ((576, 576), (576, 192), (576, 1536), (1536, 576), (4096, 4096), (4096, 11008))  # (K, N)
ROWS = (1, 4, 16)
SMOKE_SHAPES = ((128, 32), (256, 48))
SMOKE_ROWS = (1, 3)
METHODS = ("fp16", "int8", "int4_g128", "int4_g32", "sparse24")
MAX_REL_ERR = 5e-3  # fp16 output rounding is ~3e-4 of the norm; orders of summation differ


def _parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m kiln.bench.gpu_quant", description=__doc__)
    p.add_argument("--out", required=True, help="path of the result JSON")
    p.add_argument("--smoke", action="store_true", help="tiny shapes; CPU interpreter if no GPU")
    p.add_argument("--warmup-ms", type=float, default=25.0, help="do_bench warm-up per case")
    p.add_argument("--rep-ms", type=float, default=100.0, help="do_bench timed span per case")
    p.add_argument("--copies", type=int, default=8,
                   help="distinct weight copies per timed graph (each call reads its own)")  # fmt: skip
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args(argv)


# ----------------------------------------------------------------------------------------------
# Round-to-nearest quantizers (the formats of kiln.kernels.gpu.woq_triton) and 2:4 pruning
# ----------------------------------------------------------------------------------------------


def quantize_int8(w: Tensor) -> tuple[Tensor, Tensor]:
    """(N, K) float -> int8 (N, K), float32 scale (N,): symmetric per output channel."""
    scale = (w.abs().amax(dim=1) / 127.0).clamp_min(1e-12)  # (N,)
    q = torch.round(w / scale[:, None]).clamp(-127, 127).to(torch.int8)
    return q, scale.to(torch.float32)


def quantize_int4(w: Tensor, group: int) -> tuple[Tensor, Tensor, Tensor]:
    """(N, K) float -> packed uint8 (N, K // 2), fp16 scale and offset (N, K // g): asymmetric."""
    n, k = w.shape
    wg = w.reshape(n, k // group, group)  # (N, G, g)
    lo, hi = wg.amin(dim=-1), wg.amax(dim=-1)  # (N, G)
    scale = ((hi - lo) / 15.0).clamp_min(1e-8).to(torch.float16)
    offset = lo.to(torch.float16)
    q = torch.round((wg - offset.float()[..., None]) / scale.float()[..., None]).clamp(0, 15)
    q = q.to(torch.uint8).reshape(n, k)  # (N, K)
    return q[:, 0::2] | (q[:, 1::2] << 4), scale, offset


def prune_24(w: Tensor) -> Tensor:
    """Keep the 2 largest-magnitude entries of each group of 4 along K: (N, K) -> (N, K)."""
    n, k = w.shape
    wg = w.reshape(n, k // 4, 4)
    keep = torch.zeros_like(wg, dtype=torch.bool).scatter_(
        -1, wg.abs().topk(2, dim=-1).indices, True
    )
    return (wg * keep).reshape(n, k)


# ----------------------------------------------------------------------------------------------
# Timing and checking
# ----------------------------------------------------------------------------------------------

Calls = list[Callable[[], Tensor]]  # one call per weight copy, same activations


@dataclass(frozen=True)
class Timer:
    """How cases are timed: GPU (graph replays under do_bench) or CPU (wall clock)."""

    cuda: bool
    warmup_ms: float
    rep_ms: float

    def per_call_ms(self, calls: Calls) -> float:
        """Milliseconds per call, each call reading its own weight copy.

        GPU: the calls are captured in one CUDA graph (after an eager warm-up that compiles
        kernels and builds cuSPARSELt plans); ``triton.testing.do_bench`` replays it, flushing
        the L2 before each replay, so every weight comes from HBM and no Python or launch
        overhead is counted (as in a served model replaying a graph). CPU: a wall-clock median.
        """
        if not self.cuda:
            for fn in calls:
                fn()
            times = []
            for _ in range(3):
                t0 = time.perf_counter()
                for fn in calls:
                    fn()
                times.append((time.perf_counter() - t0) * 1e3 / len(calls))
            return statistics.median(times)
        import triton.testing

        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for fn in calls:
                fn()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for fn in calls:
                fn()
        ms = triton.testing.do_bench(
            graph.replay, warmup=self.warmup_ms, rep=self.rep_ms, return_mode="median"
        )
        return float(ms) / len(calls)


def host_us(fn: Callable[[], Tensor], calls: int) -> float:
    """Host time per eager call (Python, checks, launch), the GPU left to run behind."""
    fn()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    spent = (time.perf_counter() - t0) * 1e6 / calls
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return spent


def copy_bandwidth_gbps(device: torch.device) -> float | None:
    """Measured HBM ceiling: a 1 GiB device-to-device copy, bytes read + written per second."""
    if device.type != "cuda":
        return None
    import triton.testing

    a = torch.empty(1 << 30, dtype=torch.uint8, device=device)
    b = torch.empty_like(a)
    ms = triton.testing.do_bench(lambda: b.copy_(a), warmup=25, rep=200, return_mode="median")
    return 2 * a.numel() / (float(ms) * 1e6)


def _rel_err(y: Tensor, ref: Tensor) -> float:
    diff = (y.double() - ref.double()).norm().item()
    return diff / max(ref.double().norm().item(), 1e-30)


def _nbytes(*tensors: Tensor | None) -> int:
    return sum(t.numel() * t.element_size() for t in tensors if t is not None)


def _weight_bytes_24(w: Tensor) -> int:
    """Bytes of a 2:4 weight as stored: kept values + metadata, or the dense tensor."""
    from torch.sparse import SparseSemiStructuredTensor

    if isinstance(w, SparseSemiStructuredTensor):
        return _nbytes(w.packed, w.meta)
    return _nbytes(w)


@dataclass(frozen=True)
class Method:
    """One way to run the layer: a call per weight copy, the reference for copy 0, its bytes."""

    calls: Calls
    reference: Tensor | None
    weight_bytes: int
    note: str = ""


@dataclass(frozen=True)
class Layer:
    """One random (N, K) layer in every format."""

    w16: Tensor  # (N, K) fp16
    q8: Tensor  # (N, K) int8
    s8: Tensor  # (N,) fp32
    int4: dict[int, tuple[Tensor, Tensor, Tensor]]  # g -> packed, scale, offset
    w24: Tensor  # (N, K) fp16, 2:4 pruned
    w24s: Tensor  # the same as to_sparse24 returns it

    @staticmethod
    def random(k: int, n: int, device: torch.device) -> Layer:
        from kiln.kernels.gpu import sparse24

        w = torch.randn(n, k, device=device) * 0.02  # (N, K) fp32
        w24 = prune_24(w.to(torch.float16))
        q8, s8 = quantize_int8(w)
        int4 = {g: quantize_int4(w, g) for g in (128, 32) if k % g == 0}
        return Layer(w.to(torch.float16), q8, s8, int4, w24, sparse24.to_sparse24(w24))


def _methods(x: Tensor, copies: list[Layer]) -> dict[str, Method]:
    """Every method's calls on activations x (M, K), in METHODS order (INT4 groups dividing K)."""
    from torch.sparse import SparseSemiStructuredTensor

    from kiln.kernels.gpu import sparse24
    from kiln.kernels.gpu import woq_triton as woq

    w0 = copies[0]
    out = {"fp16": Method([partial(F.linear, x, c.w16) for c in copies], None, _nbytes(w0.w16))}
    out["int8"] = Method(
        [partial(woq.int8_matmul, x, c.q8, c.s8) for c in copies],
        woq.int8_matmul_reference(x, w0.q8, w0.s8),
        _nbytes(w0.q8, w0.s8),
    )
    for g in (128, 32):
        if g in w0.int4:
            out[f"int4_g{g}"] = Method(
                [partial(woq.int4_matmul, x, *c.int4[g], g) for c in copies],
                woq.int4_matmul_reference(x, *w0.int4[g], g),
                _nbytes(*w0.int4[g]),
            )
    sparse = isinstance(w0.w24s, SparseSemiStructuredTensor)
    out["sparse24"] = Method(
        [partial(sparse24.sparse24_linear, x, c.w24s) for c in copies],
        F.linear(x, w0.w24),
        _weight_bytes_24(w0.w24s),
        "semi-structured" if sparse else "dense fallback",
    )
    return out


def run_shape(
    k: int, n: int, rows: tuple[int, ...], n_copies: int, device: torch.device, timer: Timer
) -> list[dict[str, Any]]:
    """Every method at every M for one (K, N) layer; one result dict per (M, method)."""
    copies = [Layer.random(k, n, device) for _ in range(n_copies)]
    results: list[dict[str, Any]] = []
    for m in rows:
        x = torch.randn(m, k, device=device, dtype=torch.float16)  # (M, K)
        base_ms = 0.0
        for name, method in _methods(x, copies).items():
            err = (
                None if method.reference is None else _rel_err(method.calls[0](), method.reference)
            )
            ms = timer.per_call_ms(method.calls)
            base_ms = ms if name == "fp16" else base_ms
            moved = method.weight_bytes + 2 * m * (k + n)  # weight + fp16 activations in and out
            results.append({
                "K": k, "N": n, "M": m, "method": name, "ms": ms,
                "speedup_vs_fp16": base_ms / ms, "weight_bytes": method.weight_bytes,
                "gbps": moved / (ms * 1e6), "host_us": host_us(method.calls[0], 20 if timer.cuda else 1),
                "rel_err": err, "ok": err is None or err <= MAX_REL_ERR, "note": method.note,
            })  # fmt: skip
    del copies
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return results


def _print_table(cases: list[dict[str, Any]]) -> None:
    print("| K x N | M | " + " | ".join(METHODS) + " |")
    print("|---|---|" + "---|" * len(METHODS))
    keys = sorted({(c["K"], c["N"], c["M"]) for c in cases}, key=lambda t: (t[0] * t[1], t[2]))
    for k, n, m in keys:
        row = {c["method"]: c for c in cases if (c["K"], c["N"], c["M"]) == (k, n, m)}
        cells = []
        for method in METHODS:
            c = row.get(method)
            if c is None:
                cells.append("-")
            else:
                bad = "" if c["ok"] else " FAIL"
                speed = f" ({c['speedup_vs_fp16']:.2f}x)" if method != "fp16" else ""
                cells.append(f"{c['ms'] * 1e3:.1f} us{speed}{bad}")
        print(f"| {k}x{n} | {m} | " + " | ".join(cells) + " |")


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark, write the JSON to --out; 0 ok, 1 a check failed, 2 no GPU."""
    args = _parse(argv)
    cuda = torch.cuda.is_available()
    if not cuda and not args.smoke:
        print("gpu_quant: no CUDA GPU found (torch.cuda.is_available() is False); this benchmark "
              "needs one. Use --smoke for a CPU dry run through Triton's interpreter.", file=sys.stderr)  # fmt: skip
        return 2
    if not cuda:
        os.environ["TRITON_INTERPRET"] = "1"  # before the kernels' module imports triton
    import triton

    torch.manual_seed(args.seed)
    device = torch.device("cuda" if cuda else "cpu")
    timer = Timer(cuda, args.warmup_ms, args.rep_ms)
    t0 = time.perf_counter()
    hbm = copy_bandwidth_gbps(device)
    cases: list[dict[str, Any]] = []
    for k, n in SMOKE_SHAPES if args.smoke else SHAPES:
        rows = SMOKE_ROWS if args.smoke else ROWS
        cases += run_shape(
            k, n, rows, min(args.copies, 2) if args.smoke else args.copies, device, timer
        )
        print(f"{k}x{n} done ({time.perf_counter() - t0:.1f} s)", file=sys.stderr, flush=True)
    result = {
        "benchmark": "gpu_quant",
        "device": torch.cuda.get_device_name(device) if cuda else "cpu (Triton interpreter)",
        "torch": torch.__version__,
        "triton": triton.__version__,
        "cuda": torch.version.cuda,
        "smoke": args.smoke,
        "activation_dtype": "float16",
        "timer": (
            f"ms per call: CUDA graph of {args.copies} calls on distinct weight copies, replayed "
            "under triton.testing.do_bench (median, L2 flushed before each replay)"
            if cuda
            else "wall-clock median (interpreter: not a speed measurement)"
        ),
        "hbm_copy_gbps": hbm,
        "wall_s": time.perf_counter() - t0,
        "all_ok": all(c["ok"] for c in cases),
        "cases": cases,
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1) + "\n")
    _print_table(cases)
    print(f"device: {result['device']}; wrote {out}")
    if not result["all_ok"]:
        bad = [f"{c['K']}x{c['N']} M={c['M']} {c['method']}" for c in cases if not c["ok"]]
        print(f"gpu_quant: correctness check failed for {', '.join(bad)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
