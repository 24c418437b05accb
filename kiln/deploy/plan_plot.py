"""The planner's latency / cost picture as a PNG: every layout that fits in memory, coloured
by its accuracy, the Pareto frontier through them, and the chosen plan.

x: predicted ms per token; y: predicted USD per million tokens (a machine already paid for
prices every plan at 0, and the y axis then only separates nothing: the x axis still
ranks them). Layouts that miss a latency or accuracy constraint are hollow. Rendering uses
``matplotlib.figure.Figure`` with its own Agg canvas (no pyplot global state).
"""

from __future__ import annotations

from pathlib import Path

from kiln.deploy.planner import Candidate, Plan


def _fits(c: Candidate) -> bool:
    return not any(v.constraint.endswith("memory (bytes)") for v in c.violations)


def plot_plan(plan: Plan, path: Path) -> Path:
    """Write ``plan``'s latency / cost / accuracy picture to ``path``; returns ``path``."""
    from matplotlib import colormaps
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.cm import ScalarMappable
    from matplotlib.colors import Normalize
    from matplotlib.figure import Figure

    fits = [c for c in plan.candidates if _fits(c)] or list(plan.candidates)
    fig = Figure(figsize=(7.5, 4.8), dpi=120)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    norm = Normalize(0.0, max([100 * c.ppl_increase for c in fits] + [1e-9]))
    cmap = colormaps["viridis"]
    for feasible in (True, False):
        group = [c for c in fits if c.feasible == feasible]
        if not group:
            continue
        colours = [cmap(norm(100 * c.ppl_increase)) for c in group]
        ax.scatter(
            [c.estimate.ms_per_token for c in group], [c.cost_per_1m_tokens for c in group],
            s=28, linewidths=1.2, edgecolors=colours, facecolors=colours if feasible else "none",
            label="meets every target" if feasible else "misses a latency or accuracy target",
        )  # fmt: skip
    front = plan.frontier
    ax.plot([c.estimate.ms_per_token for c in front], [c.cost_per_1m_tokens for c in front],
            color="0.4", lw=1, ls="--", label="latency / cost frontier")  # fmt: skip
    best = plan.best
    chosen = "chosen" if plan.feasible else "closest (infeasible)"
    ax.scatter([best.estimate.ms_per_token], [best.cost_per_1m_tokens], marker="*", s=220,
               color="crimson", zorder=5, label=f"{chosen}: {best.describe()}")  # fmt: skip
    fig.colorbar(ScalarMappable(norm, cmap), ax=ax, label="perplexity increase, % (prior)")
    ax.set_xscale("log")
    if min(c.cost_per_1m_tokens for c in fits) > 0:
        ax.set_yscale("log")
    ax.set_xlabel("predicted ms per token")
    ax.set_ylabel("predicted USD per 1M tokens")
    most = max(c.estimate.layout.devices for c in plan.candidates or [best])
    title = (
        f"{plan.arch.name} on up to {most} x {best.hardware.device.name}: every layout that fits"
    )
    ax.set_title(title, fontsize=10)
    ax.legend(fontsize=7, loc="best")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(str(path))
    return path
