"""Plot of the size-vs-loss Pareto frontier with uniform schemes and chosen plans, as a PNG.

The frontier is drawn as a step line: at any size the best predicted loss is that of the
largest frontier plan no bigger, so the curve holds its value until the next point.
Uniform schemes (one option for every layer) are labelled circles, chosen mixed plans are
labelled stars. Values are taken as given: the frontier's ``loss`` is usually a *predicted*
increase while uniform/chosen points are *measured*, so the caller converts them to one
unit (``y_scale`` multiplies the frontier's losses, ``x_scale`` every x value).

Rendering uses ``matplotlib.figure.Figure`` with its own Agg canvas, so neither pyplot's
global figure registry nor the process-wide backend is touched.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from pathlib import Path

from matplotlib.axes import Axes
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

from kiln.compress.allocate import FrontierPoint

Points = Mapping[str, tuple[float, float]]


def _check(name: str, points: Points) -> None:
    for label, (x, y) in points.items():
        if not (math.isfinite(x) and math.isfinite(y)):
            raise ValueError(f"{name}[{label!r}] must be finite, got {(x, y)}")


def _labelled(ax: Axes, points: Points, x_scale: float, **style: object) -> None:
    """Scatter ``points`` with one style and write each name next to its marker."""
    if not points:
        return
    xs = [x * x_scale for x, _ in points.values()]
    ys = [y for _, y in points.values()]
    ax.scatter(xs, ys, zorder=3, **style)  # type: ignore[arg-type]
    for name, x, y in zip(points, xs, ys):
        ax.annotate(name, (x, y), textcoords="offset points", xytext=(6, 4), fontsize=8)


def plot_frontier(
    frontier: Sequence[FrontierPoint],
    path: Path,
    *,
    uniform: Points,
    chosen: Points | None = None,
    x_label: str = "model size (MB)",
    y_label: str = "perplexity increase (%)",
    x_scale: float = 1e-6,
    y_scale: float = 1.0,
    title: str = "",
    frontier_label: str = "frontier (predicted)",
    y_log: bool = False,
) -> Path:
    """Write the frontier, uniform schemes and chosen plans to the PNG ``path``; return it.

    ``frontier`` points may come in any order (x = ``cost * x_scale``, y = ``loss *
    y_scale``); ``uniform`` and ``chosen`` map a name to ``(cost, y)`` with the cost in the
    frontier's unit (scaled by ``x_scale`` too) and y already in the plotted unit.
    ``y_log`` draws y on a symmetric-log axis (linear below 0.1), so schemes that lose
    thousands of percent do not flatten the ones within a budget of 1 %.
    """
    if not (math.isfinite(x_scale) and x_scale > 0 and math.isfinite(y_scale)):
        raise ValueError(f"x_scale must be finite > 0 and y_scale finite: {x_scale}, {y_scale}")
    chosen = chosen or {}
    _check("uniform", uniform)
    _check("chosen", chosen)
    pts = sorted(frontier, key=lambda p: p.cost)
    xs = [p.cost * x_scale for p in pts]  # rising size
    ys = [p.loss * y_scale for p in pts]  # falling loss
    if not all(math.isfinite(v) for v in xs + ys):
        raise ValueError("frontier costs and losses must be finite")

    fig = Figure(figsize=(7.5, 4.8), dpi=150)
    FigureCanvasAgg(fig)  # attaches itself as fig.canvas: savefig renders through Agg
    ax = fig.add_subplot()
    if pts:
        # Hold the last (least-loss) value out to the largest x on the plot.
        right = max([*xs, *(x * x_scale for x, _ in [*uniform.values(), *chosen.values()])])
        ax.step([*xs, right], [*ys, ys[-1]], where="post", color="tab:blue", linewidth=1.6,
                label=frontier_label, zorder=2)  # fmt: skip
        ax.plot(xs, ys, "o", color="tab:blue", markersize=2.5, zorder=2)
    _labelled(ax, uniform, x_scale, marker="o", s=36, color="tab:orange", label="uniform")
    _labelled(ax, chosen, x_scale, marker="*", s=180, color="tab:red", label="chosen plan")
    ax.axhline(0.0, color="0.6", linewidth=0.8, zorder=1)
    if y_log:
        ax.set_yscale("symlog", linthresh=0.1)
        lowest = min([*ys, *(y for _, y in [*uniform.values(), *chosen.values()])], default=0.0)
        if lowest >= 0:  # nothing below zero: do not spend half the axis on it
            ax.set_ylim(bottom=-0.02)
    ax.set_xlabel(x_label)
    ax.set_ylabel(y_label)
    if title:
        ax.set_title(title)
    ax.grid(True, alpha=0.3)
    if pts or uniform or chosen:
        ax.legend(loc="upper right", fontsize=8)
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, format="png")
    return path
