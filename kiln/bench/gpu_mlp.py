"""A 64-wide MLP at large batch on a CUDA GPU: ``python -m kiln.bench.gpu_mlp [--out DIR]``.

The tiny-cuda-nn "fully fused MLP" case: 4 layers 64 -> 64 (Linear + ReLU three times, then
Linear; no bias unless ``--bias``) over 2^16 and 2^18 rows, fp16 and fp32. Such layers are
memory-bound: a chain of library GEMMs writes and re-reads every activation, a fused program
reads the input once and writes the output once. Three ways, same weights:

* ``cublas``: eager PyTorch, ``F.linear`` (cuBLAS) and ``relu`` per layer;
* ``inductor-max-autotune``: ``torch.compile(mode="max-autotune-no-cudagraphs")`` (the
  graph is ours, below);
* ``kiln``: ``kiln.compile(model, (x,))``, its CUDA backend.

Timing: each way's call is captured in a CUDA graph (after warm-up calls on a side stream)
and replayed under ``triton.testing.do_bench``: CUDA events around every replay, median,
``--warmup-ms`` of replays first, and before every replay a 256 MB buffer is overwritten
(several times any L2: H100 50 MB), so inputs come from HBM. For kiln also
``program_ms``: the replay of kiln's own CUDA graph (the program without the call's input
copy and output clone), when the compiled module holds one; and for all ``call_ms``: direct
back-to-back calls between two CUDA events (what a Python caller sees, L2 warm). Errors:
normwise relative and max absolute error against the fp32 model in eager.

The headline, per case, is ``kiln_vs_cublas`` = cuBLAS ms / kiln ms (the target is >= 2):
kiln's program replay when found, else its captured call, else direct calls
(``kiln_basis`` says which). Exit status: 2 without CUDA, 1 if kiln failed in some case.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as dt
import math
import sys
import time
from collections.abc import Callable
from functools import partial
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from kiln.bench import RESULTS_DIR, system

WIDTH, LAYERS, TARGET = 64, 4, 2.0
Fn = Callable[[Tensor], Any]


class MLP64(nn.Module):
    """``LAYERS`` Linear(64, 64) layers with ReLU between them (none after the last)."""

    def __init__(self, bias: bool = False) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(WIDTH, WIDTH, bias=bias) for _ in range(LAYERS))

    def forward(self, x: Tensor) -> Tensor:  # x (rows, 64)
        for i, layer in enumerate(self.layers):
            x = layer(x)
            x = torch.relu(x) if i < LAYERS - 1 else x
        return x  # (rows, 64)


def cublas_chain(model: MLP64) -> Fn:
    """The same MLP as a plain chain of ``F.linear`` calls (cuBLAS) and ReLUs."""
    linears = [m for m in model.layers if isinstance(m, nn.Linear)]
    params = [(m.weight, m.bias) for m in linears]

    def run(x: Tensor) -> Tensor:
        for i, (w, b) in enumerate(params):
            x = F.linear(x, w, b)
            x = torch.relu(x) if i < LAYERS - 1 else x
        return x

    return run


def find_cuda_graph(obj: Any, depth: int = 3) -> torch.cuda.CUDAGraph | None:
    """A ``torch.cuda.CUDAGraph`` held by ``obj`` (attributes, bound methods, closures), if any."""
    if isinstance(obj, torch.cuda.CUDAGraph):
        return obj
    if depth == 0 or obj is None:
        return None
    kids: list[Any] = [getattr(obj, "__self__", None)]
    for cell in getattr(obj, "__closure__", None) or ():
        with contextlib.suppress(ValueError):  # an empty cell
            kids.append(cell.cell_contents)
    if hasattr(obj, "__dict__") and not isinstance(obj, type | nn.Module):
        kids += list(vars(obj).values())
    for kid in kids:
        if not isinstance(kid, str | int | float | Tensor) and (
            g := find_cuda_graph(kid, depth - 1)
        ):
            return g
    return None


def graph_ms(fn: Callable[[], Any], warmup_ms: float, rep_ms: float) -> float:
    """Median ms of one CUDA-graph replay of ``fn`` (captured here), L2 flushed before each."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return replay_ms(graph, warmup_ms, rep_ms)


def replay_ms(graph: torch.cuda.CUDAGraph, warmup_ms: float, rep_ms: float) -> float:
    import triton.testing

    return float(triton.testing.do_bench(graph.replay, warmup=warmup_ms, rep=rep_ms, return_mode="median"))  # fmt: skip


def call_ms(fn: Callable[[], Any], calls: int = 50) -> float:
    """Per-call ms of ``calls`` direct back-to-back calls between two CUDA events."""
    fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    for _ in range(calls):
        fn()
    end.record()
    torch.cuda.synchronize()
    return float(start.elapsed_time(end)) / calls


def errors(y: Tensor, ref: Tensor) -> dict[str, float]:
    d = (y.double() - ref.double()).abs()
    return {"rel_err": (d.norm() / ref.double().norm().clamp_min(1e-30)).item(), "max_abs_err": d.max().item()}  # fmt: skip


def _contender(name: str, model: MLP64, x: Tensor) -> tuple[Fn, dict[str, Any]]:
    """Build one way of running ``model`` (compiled where it compiles); its facts."""
    t0 = time.perf_counter()
    facts: dict[str, Any] = {}
    if name == "cublas":
        fn: Fn = cublas_chain(model)
    elif name == "inductor-max-autotune":
        fn = torch.compile(model, mode="max-autotune-no-cudagraphs", dynamic=False)
    else:
        import kiln
        from kiln.bench.contenders.kiln_contender import report_facts

        fn = kiln.compile(model, (x,))
        facts.update(report_facts(getattr(fn, "report", None)))
        facts.pop("kiln_summary", None)
    with torch.inference_mode():
        fn(x)  # compiles lazily where it does
    torch.cuda.synchronize()
    facts["compile_s"] = time.perf_counter() - t0
    return fn, facts


def run_case(rows: int, dtype: torch.dtype, args: argparse.Namespace) -> dict[str, Any]:
    """Every way at one (rows, dtype); the ratios over cuBLAS."""
    torch.manual_seed(args.seed)
    model32 = MLP64(args.bias).cuda().eval().requires_grad_(False)
    x32 = torch.randn(rows, WIDTH, device="cuda")
    with torch.inference_mode():
        ref = model32(x32)
    model, x = MLP64(args.bias).cuda().eval().requires_grad_(False), x32.to(dtype)
    model.load_state_dict(model32.state_dict())
    model.to(dtype)
    case: dict[str, Any] = {"rows": rows, "dtype": str(dtype).removeprefix("torch."),
                            "input_bytes": x.numel() * x.element_size(), "contenders": {}}  # fmt: skip
    for name in ("cublas", "inductor-max-autotune", "kiln"):
        rec: dict[str, Any] = {}
        case["contenders"][name] = rec
        try:
            fn, facts = _contender(name, model, x)
            rec.update(facts)
            with torch.inference_mode():
                rec.update(errors(fn(x), ref))
                rec["call_ms"] = call_ms(partial(fn, x))
                own = find_cuda_graph(fn) if name == "kiln" else None
                if own is not None:  # kiln's program as its own graph; no nested capture
                    rec["program_ms"] = replay_ms(own, args.warmup_ms, args.rep_ms)
                else:
                    try:
                        rec["graph_ms"] = graph_ms(partial(fn, x), args.warmup_ms, args.rep_ms)
                    except Exception as e:  # noqa: BLE001 - a call that cannot be captured
                        rec["graph_error"] = f"{type(e).__name__}: {e}"[:500]
        except Exception as e:  # noqa: BLE001 - recorded; the other ways still run
            rec["error"] = f"{type(e).__name__}: {e}"[:1000]
        torch.cuda.synchronize()
    c, k = case["contenders"]["cublas"], case["contenders"]["kiln"]
    basis = next((b for b in ("program_ms", "graph_ms", "call_ms") if k.get(b)), None)
    case["kiln_basis"] = basis
    case["kiln_vs_cublas"] = c["graph_ms"] / k[basis] if basis and c.get("graph_ms") else None
    ind = case["contenders"]["inductor-max-autotune"].get("graph_ms")
    case["kiln_vs_inductor"] = ind / k[basis] if basis and ind else None
    case["inductor_vs_cublas"] = c["graph_ms"] / ind if ind and c.get("graph_ms") else None
    case["target_met"] = bool(case["kiln_vs_cublas"] and case["kiln_vs_cublas"] >= TARGET)
    return case


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m kiln.bench.gpu_mlp", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    p.add_argument("--out", default=str(RESULTS_DIR), help="output folder")
    p.add_argument("--rows", default="65536,262144", help="comma-separated batch sizes")
    p.add_argument("--dtypes", default="float16,float32")
    p.add_argument("--bias", action="store_true", help="layers with bias")
    p.add_argument("--warmup-ms", type=float, default=25.0)
    p.add_argument("--rep-ms", type=float, default=100.0)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("gpu_mlp: no CUDA GPU found (torch.cuda.is_available() is False; torch "
              f"{torch.__version__}, CUDA build {torch.version.cuda}); this benchmark needs one.",
              file=sys.stderr)  # fmt: skip
        return 2
    import triton

    from kiln.bench.gpu_suite import device_slug

    t0, now = time.perf_counter(), dt.datetime.now(dt.timezone.utc)
    name = torch.cuda.get_device_name(0)
    props = torch.cuda.get_device_properties(0)
    result: dict[str, Any] = {
        "schema": 1, "benchmark": "gpu_mlp", "date": now.isoformat(timespec="seconds"),
        "device": {"name": name, "slug": device_slug(name),
                   "l2_cache_bytes": getattr(props, "L2_cache_size", None)},
        "versions": {**system.versions(), "triton": triton.__version__, "cuda": torch.version.cuda},
        "fp32_matmul_precision": torch.get_float32_matmul_precision(),
        "model": {"width": WIDTH, "layers": LAYERS, "bias": args.bias, "activation": "relu"},
        "timer": "CUDA graph of one call replayed under triton.testing.do_bench (median, "
                 f"{args.warmup_ms} ms warm-up, {args.rep_ms} ms timed, 256 MB L2 flush per replay)",
        "target_kiln_vs_cublas": TARGET, "cases": [],
    }  # fmt: skip
    fname = f"gpu-mlp-{device_slug(name)}-{now:%Y%m%d}.json"
    for dtype in args.dtypes.split(","):
        for rows in [int(r) for r in args.rows.split(",")]:
            print(f"gpu_mlp: {rows} rows {dtype} ...", flush=True)
            try:
                case = run_case(rows, getattr(torch, dtype), args)
            except Exception as e:  # noqa: BLE001 - out of memory, say: recorded, go on
                case = {"rows": rows, "dtype": dtype, "error": f"{type(e).__name__}: {e}"[:1000],
                        "contenders": {}, "kiln_vs_cublas": None, "target_met": False}  # fmt: skip
            result["cases"].append(case)
            ms = {n: r.get("graph_ms") for n, r in case["contenders"].items()}
            print(f"  graph ms {ms}; kiln ({case.get('kiln_basis')}) vs cuBLAS "
                  f"{case['kiln_vs_cublas'] or 0:.2f}x", flush=True)  # fmt: skip
            ratios = [c["kiln_vs_cublas"] for c in result["cases"] if c["kiln_vs_cublas"]]
            result["geomean_kiln_vs_cublas"] = math.exp(sum(map(math.log, ratios)) / len(ratios)) if ratios else None  # fmt: skip
            result["all_targets_met"] = all(c["target_met"] for c in result["cases"])
            result["wall_s"] = time.perf_counter() - t0
            system.write_result(result, args.out, fname)  # after every case: a kill keeps them
    print(f"gpu_mlp: geomean kiln vs cuBLAS {result.get('geomean_kiln_vs_cublas')}; wrote {result.get('path')}")  # fmt: skip
    failed = [
        c for c in result["cases"] if "error" in c or "error" in c["contenders"].get("kiln", {})
    ]
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
