"""What ``kiln.compile`` did: kernels, solver statistics, fallbacks, timings."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class KernelReport:
    index: int
    template: str
    primitives: list[str]  # primitive ops, in order
    executor: str  # native | extern | fallback
    predicted_us: float
    measured_us: float | None = None
    note: str = ""


@dataclass
class SolverReport:
    method: str  # blp | greedy | none
    status: str
    objective_us: float
    bound_us: float
    gap: float
    time_s: float
    candidates: int
    cuts: int = 0
    greedy_objective_us: float | None = None  # the greedy baseline under the same costs


@dataclass
class Fallback:
    op: str  # the ATen op or primitive kernel that runs through PyTorch
    reason: str


@dataclass
class CompileReport:
    model: str
    nodes: int
    kernels: list[KernelReport] = field(default_factory=list)
    solver: SolverReport | None = None
    fallbacks: list[Fallback] = field(default_factory=list)
    timings_s: dict[str, float] = field(default_factory=dict)
    cache_hit: bool = False
    executor: str = "native"
    verification: str = "not run"
    isa: str = ""  # the CPU's instruction set, or the device a GPU program runs on
    graph_captured: bool = False  # GPU: the program replays as one CUDA graph
    arena_bytes: int = 0  # static memory plan: bytes of intermediates
    notes: list[str] = field(default_factory=list)  # decisions made before orchestration

    def summary(self) -> str:
        s = self.solver
        lines = [
            f"kiln: {self.model}: {self.nodes} primitives -> {len(self.kernels)} kernels "
            f"({sum(k.executor == 'native' for k in self.kernels)} native), executor={self.executor}, "
            f"isa={self.isa}",
        ]
        if s is not None:
            lines.append(
                f"  solver {s.method}: {s.status}, objective {s.objective_us:.1f} us, bound "
                f"{s.bound_us:.1f} us, gap {s.gap:.2%}, {s.candidates} candidates, {s.time_s:.2f} s"
                + (f", greedy {s.greedy_objective_us:.1f} us" if s.greedy_objective_us else "")
            )
        lines.append("  time: " + ", ".join(f"{k} {v:.2f}s" for k, v in self.timings_s.items()))
        lines.append(f"  verification: {self.verification}")
        lines += [f"  {note}" for note in self.notes]
        for f in self.fallbacks:
            lines.append(f"  fallback: {f.op}: {f.reason}")
        return "\n".join(lines)

    def kernel_table(self) -> str:
        rows = [f"{'#':>3} {'template':<10} {'exec':<8} {'pred us':>8} {'meas us':>8}  primitives"]
        for k in self.kernels:
            meas = f"{k.measured_us:>8.2f}" if k.measured_us is not None else f"{'-':>8}"
            rows.append(
                f"{k.index:>3} {k.template:<10} {k.executor:<8} {k.predicted_us:>8.2f} {meas}  "
                + " ".join(k.primitives)
                + (f"  ({k.note})" if k.note else "")
            )
        return "\n".join(rows)

    def __str__(self) -> str:
        return self.summary()
