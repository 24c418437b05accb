"""``kiln.compile``: capture -> fission -> candidates -> BLP -> program -> C++ -> verify."""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Literal

import torch

from kiln.compiler.capture import CaptureResult, capture, capture_cache, fallback_report
from kiln.compiler.capture.passes import for_cpu_backend
from kiln.compiler.codegen.cpu import build
from kiln.compiler.codegen.cpu.codegen import CppProgram, Unsupported, generate
from kiln.compiler.codegen.cpu.pack import nr as panel_width
from kiln.compiler.exec import gpu_backend
from kiln.compiler.exec.compiled import CompiledModule
from kiln.compiler.exec.executors import NativeExecutor, ReferenceExecutor
from kiln.compiler.exec.measure import measurer
from kiln.compiler.exec.report import CompileReport, Fallback, KernelReport, SolverReport
from kiln.compiler.exec.verify import compare_all
from kiln.compiler.fusion.attention import attention_candidates
from kiln.compiler.fusion.candidates import (
    CPU_TARGET,
    GPU_TARGET,
    Candidate,
    FusionTarget,
    enumerate_candidates,
)
from kiln.compiler.fusion.chains import chain_candidates
from kiln.compiler.fusion.cost import CostModel, CostModelBase
from kiln.compiler.fusion.gpu_cost import GpuCostModel
from kiln.compiler.fusion.greedy import greedy_fusion
from kiln.compiler.fusion.layouts import LayoutMode, choose_layouts
from kiln.compiler.fusion.orchestrate import orchestrate
from kiln.compiler.fusion.program import Kernel, Program, build_program, is_extern
from kiln.compiler.fusion.schedule import Orchestration
from kiln.compiler.ir.graph import Graph
from kiln.core.cache import cache_dir
from kiln.core.calibrate import load_profile
from kiln.core.gpu_profile import gpu_profile, load_gpu_profile

Tensor = torch.Tensor


class VerificationError(RuntimeError):
    """The compiled program's outputs differ from eager PyTorch beyond tolerance."""


@dataclass(frozen=True)
class CompileOptions:
    """How ``kiln.compile`` works. The defaults are what a deployment wants."""

    verify: bool = True  # compare with eager on the example inputs at compile time
    on_mismatch: Literal["raise", "eager"] = "raise"  # what a failed verification does
    executor: Literal["native", "reference"] = "native"
    solver: Literal["blp", "greedy"] = "blp"
    max_kernel_nodes: int = 16  # candidate size bound (keeps enumeration polynomial)
    measure: bool = False  # time candidates on this machine instead of the roofline model
    cache: bool = True  # reuse a cached capture of the same model code, weights and shapes
    # cpp: one C++ program (CPU); triton: Triton kernels + one CUDA graph (GPU, or the CPU
    # under TRITON_INTERPRET=1); auto: triton when the example inputs are on a GPU
    backend: Literal["auto", "cpp", "triton"] = "auto"
    cuda_graphs: bool = True  # triton on a GPU: replay the program as one CUDA graph
    device: str = "cpu"  # where the program runs (set from the example inputs)
    max_shapes: int = 8  # triton: programs (CUDA graphs) kept for new input shapes, at most
    # cpp: which conv regions compute channels-last (NHWC): decided on the predicted
    # program time ("auto"), none ("nchw": the graph as captured) or all ("nhwc")
    layouts: LayoutMode = "auto"

    def __post_init__(self) -> None:
        if self.on_mismatch not in ("raise", "eager"):
            raise ValueError(f"on_mismatch must be 'raise' or 'eager', not {self.on_mismatch!r}")
        if self.executor not in ("native", "reference"):
            raise ValueError(f"executor must be 'native' or 'reference', not {self.executor!r}")
        if self.solver not in ("blp", "greedy"):
            raise ValueError(f"solver must be 'blp' or 'greedy', not {self.solver!r}")
        if self.max_kernel_nodes < 1:
            raise ValueError("max_kernel_nodes must be >= 1")
        if self.max_shapes < 1:
            raise ValueError("max_shapes must be >= 1")
        if self.backend not in ("auto", "cpp", "triton"):
            raise ValueError(f"backend must be 'auto', 'cpp' or 'triton', not {self.backend!r}")
        if self.layouts not in ("auto", "nchw", "nhwc"):
            raise ValueError(f"layouts must be 'auto', 'nchw' or 'nhwc', not {self.layouts!r}")

    @property
    def target(self) -> FusionTarget:
        return GPU_TARGET if self.resolved_backend == "triton" else CPU_TARGET

    @property
    def resolved_backend(self) -> str:
        if self.backend != "auto":
            return self.backend
        return "triton" if torch.device(self.device).type == "cuda" else "cpp"


def compile(
    model: torch.nn.Module,
    example_inputs: Sequence[Tensor],
    *,
    verify: bool = True,
    on_mismatch: Literal["raise", "eager"] = "raise",
    executor: Literal["native", "reference"] = "native",
    solver: Literal["blp", "greedy"] = "blp",
    max_kernel_nodes: int = 16,
    measure: bool = False,
    cache: bool = True,
    backend: Literal["auto", "cpp", "triton"] = "auto",
    cuda_graphs: bool = True,
    max_shapes: int = 8,
    layouts: LayoutMode = "auto",
) -> CompiledModule:
    """Compile ``model`` for the shapes of ``example_inputs``.

    The program runs where the example inputs are: on a CUDA device as Triton kernels
    replayed in one CUDA graph, on the CPU as one generated C++ program (``backend``
    overrides; ``"triton"`` on CPU tensors needs ``TRITON_INTERPRET=1``). Returns a
    callable with the model's signature. Raises ``VerificationError`` if the result
    differs from eager PyTorch (or falls back to eager with a warning when
    ``on_mismatch="eager"``). With the Triton backend a call with new input shapes compiles
    (and keeps) a program for them, up to ``max_shapes``; C++ programs keep one shape.
    ``layouts`` picks which convolution regions of a C++ program compute channels-last:
    ``"auto"`` those predicted to make the program faster, ``"nchw"`` none, ``"nhwc"`` all.
    """
    inputs = tuple(example_inputs)
    device = next((str(t.device) for t in inputs if t.device.type == "cuda"), "cpu")
    opts = CompileOptions(
        verify, on_mismatch, executor, solver, max_kernel_nodes, measure, cache,
        backend, cuda_graphs, device, max_shapes, layouts,
    )  # fmt: skip
    return compile_with(model, inputs, opts)


def compile_with(
    model: torch.nn.Module, example_inputs: tuple[Tensor, ...], opts: CompileOptions
) -> CompiledModule:
    t0 = time.perf_counter()
    cap = _capture(model, example_inputs, opts.cache)
    capture_s = time.perf_counter() - t0
    graph, notes, layout_s = cap.graph, list[str](), dict[str, float]()
    if opts.resolved_backend == "cpp":
        t0 = time.perf_counter()
        basis = "measured kernels" if opts.measure else "cost model"
        choice = choose_layouts(
            for_cpu_backend(cap.graph), lambda g: _objective(g, opts), opts.layouts, basis
        )
        graph, notes = choice.graph, choice.notes
        layout_s = {"layouts": time.perf_counter() - t0}
    compiled = compile_graph(graph, opts, name=type(model).__name__)
    compiled.report.notes[:0] = notes
    compiled.report.timings_s = {"capture": capture_s, **layout_s, **compiled.report.timings_s}
    fallbacks = [Fallback(f.aten_op, f.reason) for f in fallback_report(graph)]
    compiled.report.fallbacks[:0] = fallbacks
    compiled.set_output_spec(None if cap.out_spec.is_leaf() else cap.out_spec)
    if opts.verify:
        assert compiled.program is not None
        _verify(compiled, model, example_inputs, compiled.program, opts, compiled.report)
    if opts.resolved_backend == "triton" and opts.max_shapes > 1:
        one = replace(opts, max_shapes=1)
        compiled.compile_new_shapes(
            lambda inputs: compile_with(model, tuple(inputs), one), opts.max_shapes
        )
    return compiled


def _capture(model: torch.nn.Module, inputs: tuple[Tensor, ...], use_cache: bool) -> CaptureResult:
    if not use_cache:
        return capture(model, inputs)
    key = capture_cache.capture_key(model, inputs)
    cap = capture_cache.load(key)
    if cap is None:
        cap = capture(model, inputs)
        capture_cache.store(key, cap)
    return cap


def compile_graph(
    graph: Graph,
    opts: CompileOptions | None = None,
    name: str = "graph",
    kernels: list[Kernel] | None = None,
) -> CompiledModule:
    """Orchestrate and build a primitive graph (``kernels`` overrides the solver's choice).
    The result takes and returns flat tensor lists through ``run_flat``."""
    opts = opts or CompileOptions()
    times: dict[str, float] = {}
    t0 = time.perf_counter()
    measure = measurer(graph, _builder(opts)) if opts.measure else None
    costs = _cost_model(opts, measure)
    solver_report = None
    if kernels is None:
        orch, solver_report = _orchestrate(graph, costs, opts)
        kernels = [_kernel(graph, c, costs) for c in orch.kernels]
    prog = build_program(graph, kernels)
    times["orchestrate"] = time.perf_counter() - t0
    report = CompileReport(
        model=name,
        nodes=len(graph.nodes),
        solver=solver_report,
        executor=opts.executor,
        isa=build.isa() if opts.resolved_backend == "cpp" else opts.device,
    )
    if opts.resolved_backend == "triton" and opts.executor == "native":
        compiled = gpu_backend.build(prog, opts.device, opts.cuda_graphs, report)
        report.timings_s = {**times, **report.timings_s}
        return compiled
    run, cpp = _executor(prog, opts, times, report)
    _fill_kernels(report, prog, cpp)
    report.timings_s = times
    compiled = CompiledModule(run, graph, prog, report, out_spec=None)
    compiled.native_program = cpp
    return compiled


def _cost_model(
    opts: CompileOptions, measure: Callable[[Candidate], float] | None
) -> CostModelBase:
    """The costs the BLP decides on: this CPU's profile for the C++ backend; for Triton the
    GPU's calibrated (or detected) profile — under the interpreter, an H100's, the GPU
    the generated program is meant for."""
    if opts.resolved_backend == "cpp":
        return CostModel(load_profile(), measure=measure)
    dev = torch.device(opts.device)
    profile = load_gpu_profile(dev) if dev.type == "cuda" else gpu_profile("H100")
    return GpuCostModel(profile, measure=measure, cuda_graph=opts.cuda_graphs)


def _objective(graph: Graph, opts: CompileOptions) -> float:
    """Predicted time (µs) of the best program for ``graph``: what layouts are chosen on."""
    measure = measurer(graph, _builder(opts)) if opts.measure else None
    orch, _ = _orchestrate(graph, _cost_model(opts, measure), opts)
    return orch.objective


def _orchestrate(
    graph: Graph, costs: CostModelBase, opts: CompileOptions
) -> tuple[Orchestration, SolverReport]:
    target = opts.target
    cands = enumerate_candidates(graph, max_nodes=opts.max_kernel_nodes, target=target)
    cands += chain_candidates(graph, target=target)
    cands += attention_candidates(graph, target=target)
    cost_of = costs.costs(cands, graph)
    # a kernel the target cannot build (a chain too wide for the chip) is priced inf
    cost_of = {c: t for c, t in cost_of.items() if math.isfinite(t)}
    cands = list(cost_of)
    greedy = greedy_fusion(graph, cost_of, target=target)
    if opts.solver == "greedy":
        orch = greedy
    else:
        orch = orchestrate(graph, cands, cost_of, target=target)
    rep = SolverReport(
        method=opts.solver,
        status=orch.status,
        objective_us=orch.objective,
        bound_us=orch.bound,
        gap=orch.gap,
        time_s=orch.solve_time,
        candidates=len(cands),
        cuts=orch.cuts,
        greedy_objective_us=greedy.objective,
    )
    return orch, rep


def _kernel(graph: Graph, c: Candidate, costs: CostModelBase) -> Kernel:
    order = [n.name for n in graph.nodes if n.name in c.nodes]
    return Kernel(c.template, tuple(order), tuple(c.outputs), tuple(c.inputs), costs.cost(c, graph))


def _executor(
    prog: Program, opts: CompileOptions, times: dict[str, float], report: CompileReport
) -> tuple:
    if opts.executor == "reference":
        return ReferenceExecutor(prog), None
    t0 = time.perf_counter()
    try:
        cpp = generate(prog, panel_width(build.isa()))
    except Unsupported as why:  # e.g. a half-precision output: no native program at all
        report.executor = "reference"
        report.fallbacks.append(Fallback("program", (
            f"no native program ({why}; kiln's generated C++ holds float32 and bool tensors): "
            "every kernel runs as ATen calls, verified at its dtype's tolerance"
        )))  # fmt: skip
        return ReferenceExecutor(prog), None
    times["codegen"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    runtime = build.load_runtime()
    report.cache_hit = (cache_dir("programs") / f"{build.program_key(cpp.source)}.so").exists()
    so_path = build.compile_program(cpp.source)
    times["build"] = time.perf_counter() - t0
    native = NativeExecutor(prog, cpp, str(so_path), runtime)
    return native.native.run, cpp  # the extension's run: no Python frame in between


def _fill_kernels(report: CompileReport, prog: Program, cpp: CppProgram | None) -> None:
    fallback = dict(cpp.fallbacks) if cpp else {}
    native = set(cpp.native_kernels) if cpp else set()
    g = prog.graph
    for i, k in enumerate(prog.kernels):
        if cpp is None:
            ex = "reference"
        elif i in native:
            ex = "native"
        elif i in fallback:
            ex = "fallback"
            report.fallbacks.append(Fallback("+".join(g.node(n).op for n in k.nodes), fallback[i]))
        else:
            ex = "extern" if is_extern(g, k) else "native"
        report.kernels.append(
            KernelReport(
                i,
                k.template,
                [g.node(n).op for n in k.nodes] or ["copy"],
                ex,
                k.cost_us,
                note=fallback.get(i, ""),
            )
        )


def _verify(
    compiled: CompiledModule,
    model: torch.nn.Module,
    inputs: tuple[Tensor, ...],
    prog: Program,
    opts: CompileOptions,
    report: CompileReport,
) -> None:
    import warnings

    from torch.utils._pytree import tree_flatten

    t0 = time.perf_counter()
    with torch.no_grad():
        expected, _ = tree_flatten(model(*inputs))
        actual = compiled.run_flat(list(inputs))
    results = compare_all(actual, [e.contiguous() for e in expected])
    report.timings_s["verify"] = time.perf_counter() - t0
    bad = [(i, r) for i, r in enumerate(results) if not r.ok]
    if not bad:
        worst = max((r.max_rel for r in results), default=0.0)
        report.verification = f"ok ({len(results)} outputs, max error rel-to-max {worst:.2e})"
        return
    where = _locate_divergence(prog, inputs, opts)
    msg = "; ".join(f"output {i}: {r.detail}" for i, r in bad) + (
        f"; first divergence: {where}" if where else ""
    )
    report.verification = f"FAILED: {msg}"
    if opts.on_mismatch == "raise":
        raise VerificationError(f"kiln output differs from eager: {msg}")
    warnings.warn(f"kiln: {msg}; falling back to eager PyTorch", RuntimeWarning, stacklevel=3)
    eager = model

    def run_eager(flat: Sequence[Tensor]) -> list[Tensor]:
        with torch.no_grad():
            return tree_flatten(eager(*flat))[0]

    compiled._run = run_eager
    report.executor = "eager (verification failed)"


def _locate_divergence(prog: Program, inputs: tuple[Tensor, ...], opts: CompileOptions) -> str:
    """Name the first kernel whose result differs from the reference, by recompiling a
    debug variant that also returns every kernel's outputs."""
    from kiln.core.compare import compare

    ref_outs, env = ReferenceExecutor(prog).run_all(list(inputs))
    del ref_outs
    g = prog.graph
    written = [o for k in prog.kernels for o in k.outputs]
    debug_graph = Graph(g.values, g.nodes, g.inputs, list(g.outputs) + written, g.constants)
    debug = build_program(debug_graph, prog.kernels)
    try:
        if opts.resolved_backend == "triton":
            report = CompileReport(model="debug", nodes=len(g.nodes))
            outs = gpu_backend.build(debug, opts.device, False, report).run_flat(list(inputs))
        else:
            cpp = generate(debug, panel_width(build.isa()))
            so = build.compile_program(cpp.source)
            outs = NativeExecutor(debug, cpp, str(so), build.load_runtime())(list(inputs))
    except Exception as e:  # noqa: BLE001 - diagnostics only; the mismatch is reported anyway
        return f"(could not build the debug program: {e})"
    extra = outs[len(g.outputs) :]
    for value, got in zip(written, extra):
        r = compare(got, env[value].contiguous())
        if not r.ok:
            k = next(i for i, kk in enumerate(prog.kernels) if value in kk.outputs)
            ops = "+".join(g.node(n).op for n in prog.kernels[k].nodes) or "copy"
            return f"kernel {k} ({prog.kernels[k].template}: {ops}) value {value}: {r.detail}"
    return ""


def _builder(opts: CompileOptions) -> Callable[[Graph, list[Kernel]], CompiledModule]:
    """How candidates are timed: ``graph`` built with exactly ``kernels``, unverified,
    on the backend and device being compiled for."""
    plain = replace(opts, verify=False, measure=False)

    def build_unverified(graph: Graph, kernels: list[Kernel]) -> CompiledModule:
        return compile_graph(graph, plain, kernels=kernels)

    return build_unverified
