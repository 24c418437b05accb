"""The GEMM contenders: one prepare function per runtime, each importing only
its own runtime when called (a worker process calls exactly one of them).

``prepare(case, data_dir, work_dir)`` loads ``X``, ``W``, ``b`` for the case's
shape from ``data_dir/<shape>/{x,w,b}.npy`` (written by the runner), does the
one-off work (compiling, packing ``W``, building a session) and returns a
``Prepared``: ``run()`` is the timed call, ``output()`` the last result.

* ``kiln``   -- ``kiln.compile`` of ``Sequential(Linear(K, N), GELU())`` (the public API).
* ``onednn`` -- oneDNN through torch: ``W`` pre-packed once with
  ``mkldnn._reorder_linear_weight``; ``mkldnn._linear_pointwise`` with the GELU
  post-op (fused) or none.
* ``mkl``    -- ``F.gelu(F.linear(x, W, b))`` in eager torch (MKL sgemm; GELU unfused).
* ``ort``    -- ONNX Runtime on the exported Sequential, 2 intra-op threads,
  input and output bound once (IOBinding).
* ``numpy``  -- ``x @ Wt + b`` (OpenBLAS) then GELU with ``scipy.special.erf``,
  into preallocated buffers (unfused: three passes over ``Y`` after the GEMM).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kiln.bench.gemm.shapes import Case

THREADS = 2  # every contender, as the protocol says
LIBRARIES: tuple[str, ...] = ("onednn", "mkl", "ort", "numpy")  # the routines kiln must match
NAMES: tuple[str, ...] = ("kiln", *LIBRARIES)
LABELS: dict[str, str] = {
    "kiln": "kiln",
    "onednn": "oneDNN pre-packed",
    "mkl": "torch MKL",
    "ort": "ONNX Runtime",
    "numpy": "numpy/OpenBLAS",
}
UNFUSED: tuple[str, ...] = ("mkl", "numpy")  # GELU runs as separate passes after the GEMM


@dataclass
class Prepared:
    """A ready contender for one case."""

    run: Callable[[], None]
    output: Callable[[], Any]  # the last result as a numpy array (M, N)
    facts: dict[str, Any] = field(default_factory=dict)


def _arrays(case: Case, data_dir: Path) -> tuple[Any, Any, Any]:
    """``(x (M, K), w (N, K), b (N,))`` as float32 numpy arrays."""
    import numpy as np

    d = data_dir / case.shape
    return tuple(np.load(d / f"{n}.npy") for n in ("x", "w", "b"))  # type: ignore[return-value]


def _tensors(case: Case, data_dir: Path) -> tuple[Any, Any, Any]:
    """``_arrays`` as torch tensors (sharing memory); sets torch's thread count and
    turns autograd off for this worker process (once, so that no contender pays a
    grad-mode context per call: numpy and ONNX Runtime pay nothing of the kind)."""
    import torch

    torch.set_num_threads(THREADS)
    torch.set_grad_enabled(False)
    return tuple(torch.from_numpy(a) for a in _arrays(case, data_dir))  # type: ignore[return-value]


def build_module(case: Case, w: Any, b: Any) -> Any:
    """``Sequential(Linear(K, N)[, GELU()])`` holding ``w`` (N, K) and ``b`` (N,)."""
    import torch

    lin = torch.nn.Linear(case.k, case.n)
    with torch.no_grad():
        lin.weight.copy_(w)
        lin.bias.copy_(b)
    layers = [lin, torch.nn.GELU()] if case.epilogue == "gelu" else [lin]
    return torch.nn.Sequential(*layers).eval()


def _torch_prepared(fn: Callable[[], Any], facts: dict[str, Any]) -> Prepared:
    """Wrap a torch call (autograd is off process-wide); keep its last output."""
    last: list[Any] = [None]

    def run() -> None:
        last[0] = fn()

    run()
    return Prepared(run, lambda: last[0].detach().numpy().copy(), facts)


def prepare_kiln(case: Case, data_dir: Path, work_dir: Path) -> Prepared:
    import kiln

    x, w, b = _tensors(case, data_dir)
    compiled = kiln.compile(build_module(case, w, b), (x,))
    report = compiled.report
    facts = {
        "kernel_table": report.kernel_table(),
        "kernels": [
            {"template": k.template, "executor": k.executor, "primitives": k.primitives}
            for k in report.kernels
        ],
        "isa": report.isa,
        "fallbacks": [f"{f.op}: {f.reason}" for f in report.fallbacks],
    }
    return _torch_prepared(lambda: compiled(x), facts)


def prepare_onednn(case: Case, data_dir: Path, work_dir: Path) -> Prepared:
    import torch

    x, w, b = _tensors(case, data_dir)
    packed = torch.ops.mkldnn._reorder_linear_weight(w, case.m)  # pre-packed once
    op = torch.ops.mkldnn._linear_pointwise.default
    # schema: (Tensor X, Tensor W, Tensor? B, str attr, Scalar?[] scalars, str? algorithm);
    # GELU's algorithm "none" is the exact erf form ("tanh" the approximation)
    attr, alg = ("gelu", "none") if case.epilogue == "gelu" else ("none", "")
    return _torch_prepared(
        lambda: op(x, packed, b, attr, [], alg), {"post_op": attr, "schema": str(op._schema)}
    )


def prepare_mkl(case: Case, data_dir: Path, work_dir: Path) -> Prepared:
    import torch
    import torch.nn.functional as F

    x, w, b = _tensors(case, data_dir)
    if case.epilogue == "gelu":
        return _torch_prepared(lambda: F.gelu(F.linear(x, w, b)), {"fused": False})
    return _torch_prepared(lambda: F.linear(x, w, b), {"mkl": torch.backends.mkl.is_available()})


def prepare_ort(case: Case, data_dir: Path, work_dir: Path) -> Prepared:
    import numpy as np
    import onnxruntime as ort

    path = work_dir / case.name / "model.onnx"
    if not path.exists():
        raise RuntimeError(f"no ONNX file for {case.name} (export failed?)")
    so = ort.SessionOptions()
    so.intra_op_num_threads = THREADS
    so.inter_op_num_threads = 1
    so.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    sess = ort.InferenceSession(str(path), so, providers=["CPUExecutionProvider"])
    x = np.ascontiguousarray(_arrays(case, data_dir)[0])
    (inp,), (outp,) = sess.get_inputs(), sess.get_outputs()
    y = np.empty((case.m, case.n), dtype=np.float32)
    binding = sess.io_binding()
    binding.bind_cpu_input(inp.name, x)
    binding.bind_output(outp.name, "cpu", 0, np.float32, list(y.shape), y.ctypes.data)

    def run() -> None:
        sess.run_with_iobinding(binding)

    run()
    ops = sorted({n.op_type for n in _onnx_nodes(path)})
    return Prepared(run, y.copy, {"onnx_ops": ops, "iobinding": True})


def _onnx_nodes(path: Path) -> list[Any]:
    """The exported graph's nodes (to record what ORT was given), or [] without onnx."""
    try:
        import onnx
    except ImportError:
        return []
    return list(onnx.load(str(path), load_external_data=False).graph.node)


def prepare_numpy(case: Case, data_dir: Path, work_dir: Path) -> Prepared:
    import numpy as np
    from scipy.special import erf

    x, w, b = _arrays(case, data_dir)
    wt = np.ascontiguousarray(w.T)  # (K, N), transposed once: W is constant
    y = np.empty((case.m, case.n), dtype=np.float32)  # (M, N)
    t = np.empty_like(y)
    inv_sqrt2, one, half = np.float32(0.5**0.5), np.float32(1.0), np.float32(0.5)
    gelu = case.epilogue == "gelu"

    def run() -> None:
        np.matmul(x, wt, out=y)
        np.add(y, b, out=y)
        if gelu:  # 0.5 * y * (1 + erf(y / sqrt 2)), each step a pass over Y
            np.multiply(y, inv_sqrt2, out=t)
            erf(t, out=t)
            np.add(t, one, out=t)
            np.multiply(y, t, out=y)
            np.multiply(y, half, out=y)

    run()
    blas = (np.show_config(mode="dicts") or {}).get("Build Dependencies", {}).get("blas", {})
    facts = {"fused": False, "blas": f"{blas.get('name')} {blas.get('version')}"}
    return Prepared(run, y.copy, facts)


PREPARE: dict[str, Callable[[Case, Path, Path], Prepared]] = {
    "kiln": prepare_kiln,
    "onednn": prepare_onednn,
    "mkl": prepare_mkl,
    "ort": prepare_ort,
    "numpy": prepare_numpy,
}


def export_onnx(cases: list[Case], data_dir: Path, work_dir: Path) -> dict[str, Any]:
    """Export each case's Sequential to ``work_dir/<case>/model.onnx`` (torch only;
    run in its own process before the ONNX Runtime worker starts). Returns per case
    the exporter facts or ``{"error": ...}``."""
    from kiln.bench.contenders._onnx import ensure_onnx

    out: dict[str, Any] = {}
    for case in cases:
        x, w, b = _tensors(case, data_dir)
        d = work_dir / case.name
        d.mkdir(parents=True, exist_ok=True)
        try:
            out[case.name] = ensure_onnx(build_module(case, w, b), (x,), d)[1]
        except RuntimeError as e:
            out[case.name] = {"error": str(e)[:1000]}
    return out
