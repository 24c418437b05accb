"""Allocation: one compression option per layer, the cheapest plan within a loss budget.

Each layer (a *group*) offers options (dense, INT8, INT4 g128, ...) with a cost (bytes or
predicted latency) and a predicted loss increase. Least summed cost with summed loss within
a budget is a multiple-choice knapsack, solved exactly by

* ``"milp"``: ``scipy.optimize.milp`` (HiGHS), one binary per (layer, option), one equality
  per layer, one loss row, after reduced-cost fixing (``_Milp``). The loss row is scaled per
  budget by the room above the least-loss plan (options that alone exceed it are dropped),
  so HiGHS's ~1e-6 absolute row tolerance is 1e-6 *of the budget*: scaled by the largest
  loss instead, a 1e2 loss next to a 1e-6 budget let thousands of plans over budget pass
  as feasible. Answers are still re-checked exactly; one over budget is cut off (no-good
  cut) and the problem re-solved. A second solve takes the least loss among the cheapest.
  Presolve is off: with a plan just over the row (within tolerance), HiGHS 1.12's restart
  presolve was seen to return a worse plan as optimal; without it, none in 40 frontiers.
* ``"dp"``: a dynamic program over integer costs (steps over a unit dividing all of them:
  the gcd of byte steps, or ``cost_unit``); one table answers every budget and holds the
  whole frontier. ``"auto"`` uses it when the table is small.

If HiGHS still ends without a plan (infeasible, a limit hit, cuts exhausted), the answer
comes from the DP (exact when its table is small, else on costs rounded to a coarser unit),
or, at worst, is the least-loss plan; ``Allocation.status`` names which (``FALLBACKS``).

Dominated options are removed first. Negative predicted losses (noise) are clipped to 0, so
noise cannot pay for other layers' damage; reported losses are sums of clipped losses. A
plan fits when its loss <= ``budget * (1 + LOSS_RTOL) + LOSS_ATOL``.
"""

from __future__ import annotations

import ctypes
import heapq
import itertools
import math
import os
import sys
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Literal

import numpy as np
from scipy.optimize import Bounds, LinearConstraint, milp
from scipy.sparse import csr_array

Objective = Literal["bytes", "latency"]
Method = Literal["auto", "milp", "dp"]
LOSS_RTOL = 1e-9  # relative slack when comparing a plan's summed loss with the budget
LOSS_ATOL = 1e-12  # absolute slack, for budgets at or near zero
_MAX_CUTS = 32  # no-good cuts tried before the loss row is tightened instead
_DP_MAX_WORK = 30_000_000  # auto picks the DP when groups * options * table length is below
# Allocation.status of a plan not from the requested solver's normal path:
FALLBACKS = (
    "dp_fallback",  # HiGHS failed; the exact DP answered (optimal)
    "approx_dp_fallback",  # HiGHS failed; the DP on rounded costs answered (within budget)
    "least_loss",  # nothing else answered; the least-loss plan (within budget)
)


@dataclass(frozen=True)
class Option:
    """One compression choice for one layer: its size, predicted loss increase, latency."""

    name: str
    nbytes: int
    loss: float
    latency: float = 0.0

    def __post_init__(self) -> None:
        integer = isinstance(self.nbytes, int | np.integer) and not isinstance(self.nbytes, bool)
        if not integer or self.nbytes < 0:
            raise ValueError(f"Option {self.name!r}: nbytes must be an int >= 0: {self.nbytes!r}")
        if not math.isfinite(self.loss):
            raise ValueError(f"Option {self.name!r}: loss must be finite, got {self.loss}")
        if not math.isfinite(self.latency) or self.latency < 0:
            raise ValueError(f"Option {self.name!r}: latency must be finite >= 0")


@dataclass(frozen=True)
class Allocation:
    """The chosen option index per layer, the plan's total cost and loss, how it was solved."""

    choice: tuple[int, ...]
    cost: float
    loss: float
    # "optimal"; "near_optimal" when the MILP's loss row had to be tightened; or one of
    # FALLBACKS when HiGHS gave no plan and another method produced this one
    status: str


@dataclass(frozen=True)
class FrontierPoint:
    """One non-dominated plan: no other plan is both cheaper and loses no more."""

    cost: float
    loss: float
    choice: tuple[int, ...]


@contextmanager
def _native_stdout_quiet() -> Iterator[None]:
    """Native writes to stdout dropped while HiGHS runs: some builds print a debug line
    ("HighsMipSolverData::transformNewIntegerFeasibleSolution ...") whatever its options
    say, and it lands in the middle of kiln's reports. Python's own output is flushed
    first; C's buffered output is flushed before stdout comes back."""
    sys.stdout.flush()
    try:
        saved = os.dup(1)
    except OSError:  # no stdout to silence
        yield
        return
    devnull = os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(devnull, 1)
        yield
    finally:
        ctypes.CDLL(None).fflush(None)
        os.dup2(saved, 1)
        os.close(saved)
        os.close(devnull)


def _within(loss: float, budget: float) -> bool:
    return loss <= budget + LOSS_RTOL * abs(budget) + LOSS_ATOL


def prune_dominated(costs: Sequence[float], losses: Sequence[float]) -> list[int]:
    """Indices of the undominated options (none other costs <= and loses <=; of exact
    duplicates the first is kept), sorted by rising cost, hence falling loss."""
    order = sorted(range(len(costs)), key=lambda i: (costs[i], losses[i], i))
    kept: list[int] = []
    for i in order:
        if not kept or losses[i] < losses[kept[-1]]:  # equal costs sort by loss: first wins
            kept.append(i)
    return kept


class _Problem:
    """Pruned groups: per layer, costs rising and clipped losses falling, plus original ids."""

    def __init__(self, groups: Sequence[Sequence[Option]], objective: Objective) -> None:
        if objective not in ("bytes", "latency"):
            raise ValueError(f"objective must be 'bytes' or 'latency', got {objective!r}")
        if len(groups) == 0:
            raise ValueError("allocate needs at least one group (layer)")
        self.objective = objective
        self.costs: list[np.ndarray] = []  # per group (k_g,) float64, rising
        self.losses: list[np.ndarray] = []  # per group (k_g,) float64, falling, >= 0
        self.ids: list[np.ndarray] = []  # per group (k_g,) int64, original option index
        for g, group in enumerate(groups):
            if len(group) == 0 or not all(isinstance(o, Option) for o in group):
                raise ValueError(f"group {g} must be a non-empty sequence of Option")
            cost = [float(o.nbytes) if objective == "bytes" else o.latency for o in group]
            loss = [max(o.loss, 0.0) for o in group]
            keep = prune_dominated(cost, loss)
            self.costs.append(np.array([cost[i] for i in keep]))
            self.losses.append(np.array([loss[i] for i in keep]))
            self.ids.append(np.array(keep, dtype=np.int64))
        self.min_loss = math.fsum(float(lo[-1]) for lo in self.losses)

    def evaluate(self, sel: Sequence[int]) -> tuple[float, float, tuple[int, ...]]:
        """(cost, loss, original choice) of a plan given as positions in the pruned groups."""
        cost = math.fsum(float(c[j]) for c, j in zip(self.costs, sel))
        loss = math.fsum(float(lo[j]) for lo, j in zip(self.losses, sel))
        return cost, loss, tuple(int(ids[j]) for ids, j in zip(self.ids, sel))

    def dp_unit(self, cost_unit: float | None) -> float | None:
        """A unit dividing every cost difference (None when there is none to use)."""
        deltas = [d for c in self.costs for d in (c - c[0])[1:]]
        if cost_unit is not None:
            if not (math.isfinite(cost_unit) and cost_unit > 0):
                raise ValueError(f"cost_unit must be finite > 0, got {cost_unit}")
            steps = np.array(deltas) / cost_unit
            if np.any(np.abs(steps - np.round(steps)) > 1e-9 * np.maximum(steps, 1.0)):
                raise ValueError(f"cost_unit {cost_unit} does not divide every cost step")
            return cost_unit
        if self.objective != "bytes":
            return None  # float latencies have no natural unit
        return float(math.gcd(*(int(d) for d in deltas))) if deltas else 1.0


class _Milp:
    """The one-hot MILP, shrunk per budget by Lagrangian reduced-cost fixing, solved by HiGHS.

    For a multiplier lam >= 0 on the loss row, every plan within budget costs at least
    sum_g min_j (c + lam l) - lam rhs, plus the reduced cost rc = c + lam l - min_j(...) of
    each option it uses. An option whose bound exceeds an incumbent's cost is in no optimal
    (or tied) plan and is dropped; at the best lam (the LP dual, by bisection) most go.
    """

    def __init__(self, prob: _Problem) -> None:
        self.prob = prob
        n_groups, width = len(prob.costs), max(len(c) for c in prob.costs)
        cost = np.full((n_groups, width), np.inf)  # (G, K) cost above the layer's cheapest
        loss = np.zeros((n_groups, width))  # (G, K) loss above the layer's least
        for g, (c, lo) in enumerate(zip(prob.costs, prob.losses)):
            cost[g, : len(c)], loss[g, : len(lo)] = c - c[0], lo - lo[-1]
        self.integral = prob.objective == "bytes"
        if self.integral:  # exact integers: HiGHS's absolute gap of 1e-6 is then exact
            self.cost = np.round(cost / (prob.dp_unit(None) or 1.0))
        else:  # top step -> 1e6: the absolute gap of 1e-6 is 1e-12 relative
            top = float(cost[np.isfinite(cost)].max())
            self.cost = cost * (1e6 / top) if top > 0 else cost
        self.extra = loss  # (G, K) real loss above the layer's least
        self.full_cost = self.cost  # (G, K) before options too lossy for a budget are dropped
        self.loss_scale = float(loss.max()) or 1.0
        self.scale = self.loss_scale
        self.loss = loss / self.scale  # (G, K) in [0, 1]; rescaled per budget by solve
        self.rows = np.arange(n_groups)

    def _descend(self, sel: np.ndarray, rhs: float) -> np.ndarray:
        """Greedy: while the loss row has room, make the single switch that saves most cost."""
        sel = sel.copy()
        while True:
            room = rhs - float(self.loss[self.rows, sel].sum())
            save = self.cost[self.rows, sel][:, None] - self.cost  # (G, K), -inf at padding
            save[self.loss - self.loss[self.rows, sel][:, None] > room] = 0.0
            g, k = np.unravel_index(int(save.argmax()), save.shape)
            if save[g, k] <= 0:
                return sel
            sel[g] = k

    def _bounds(self, rhs: float, budget: float) -> tuple[np.ndarray, float, float]:
        """(G, K) least cost of a within-budget plan using each option, incumbent cost, slack."""

        def at(lam: float) -> tuple[np.ndarray, np.ndarray, float]:
            v = self.cost + lam * self.loss  # (G, K), inf where a layer has fewer options
            j = v.argmin(axis=1)  # (G,)
            return v, j, float(v.min(axis=1).sum()) - lam * rhs

        def over(lam: float) -> bool:  # the subgradient's sign: loss of lam's plan > rhs
            return float(self.loss[self.rows, at(lam)[1]].sum()) > rhs

        lo, hi = 0.0, 1.0
        while over(hi) and hi < 1e30:
            hi *= 2.0
        for _ in range(100):  # bisection for the best multiplier (the LP dual)
            mid = 0.5 * (lo + hi)
            lo, hi = (mid, hi) if over(mid) else (lo, mid)
        incumbent = self._descend(at(hi)[1], rhs)
        ok = _within(self.prob.evaluate(incumbent.tolist())[1], budget)  # else drop nothing
        upper = float(self.cost[self.rows, incumbent].sum()) if ok else np.inf
        v, _, lower = max(at(lo), at(hi), key=lambda t: t[2])
        floor = v.min(axis=1, keepdims=True)  # (G, 1)
        slack = 1e-8 * (float(np.abs(floor).sum()) + abs(lower) + abs(upper)) + 1e-6
        return lower + (v - floor), upper, slack

    def _scale_to(self, budget: float) -> float | None:
        """Scale the loss row to ``budget``'s room above the least loss: returns the row's
        right-hand side, None when no option with extra loss fits (the least-loss plan is
        then the answer). Options whose extra loss alone exceeds the room are dropped."""
        room = budget + LOSS_RTOL * abs(budget) + LOSS_ATOL - self.prob.min_loss
        lossy = (self.extra > 0) & (self.extra <= room) & np.isfinite(self.full_cost)
        if not room > 0 or not bool(lossy.any()):
            return None
        self.scale = scale = min(self.loss_scale, room)
        self.loss = self.extra / scale  # (G, K); <= 1 for every option kept
        self.cost = np.where(self.extra <= room, self.full_cost, np.inf)
        return min(room / scale, len(self.rows) + 1.0)  # the loss is <= G always

    def solve(self, budget: float) -> tuple[list[int], str] | None:
        """Cheapest plan with loss within ``budget``, least loss among those; None when
        HiGHS ends without one (the caller falls back: ``_solve``)."""
        prob, n_groups = self.prob, len(self.rows)
        scaled = self._scale_to(budget)
        if scaled is None:  # only each layer's least-loss option fits: one plan
            return [len(c) - 1 for c in prob.costs], "optimal"
        rhs = scaled
        bound, upper, slack = self._bounds(rhs, budget)
        gi, ji = np.nonzero((bound <= upper + slack) & np.isfinite(self.cost))  # (n,) each
        cost, loss, n = self.cost[gi, ji], self.loss[gi, ji], len(gi)
        one_hot = csr_array((np.ones(n), (gi, np.arange(n))), shape=(n_groups, n))

        def row(coef: np.ndarray, upper: float) -> LinearConstraint:
            return LinearConstraint(coef[None, :], -np.inf, upper)

        def run(objective: np.ndarray, rows: list[LinearConstraint], ub: Bounds) -> list[int]:
            rows = [LinearConstraint(one_hot, 1.0, 1.0), *rows]
            opts = {"mip_rel_gap": 0.0, "presolve": False}  # see the module docstring
            with _native_stdout_quiet():
                res = milp(objective, integrality=np.ones(n), bounds=ub, constraints=rows,
                           options=opts)  # fmt: skip
            if res.x is None or res.status != 0:  # infeasible, a limit hit, or an error
                return []
            sel, on = np.zeros(n_groups, dtype=np.int64), res.x > 0.5
            sel[gi[on]] = ji[on]
            return sel.tolist()

        loss_row, status = [row(loss, rhs)], "optimal"
        cuts: list[LinearConstraint] = []
        while sel := run(cost, loss_row + cuts, Bounds(0.0, 1.0)):
            loss_sel = prob.evaluate(sel)[1]
            if _within(loss_sel, budget):
                break
            if len(cuts) < _MAX_CUTS:  # exclude exactly this plan: one layer must differ
                cuts.append(row((ji == np.array(sel)[gi]).astype(float), n_groups - 1.0))
            else:  # many plans just over budget: tighten the row below HiGHS's tolerance
                rhs -= (loss_sel - budget) / self.scale + 2e-6
                if rhs < 0:  # no room left: the row now excludes even the least-loss plan
                    return None
                loss_row, status = [row(loss, rhs)], "near_optimal"
        if not sel:  # HiGHS ended without a plan
            return None
        # Second stage: the least loss among plans no dearer than `sel` (x1e6: HiGHS stops at
        # an absolute gap of 1e-6); `sel` is now the incumbent, so fewer options survive.
        cap = float(self.cost[self.rows, sel].sum())
        cap_row = row(cost, cap + 0.5 if self.integral else cap * (1 + 1e-12))
        live = Bounds(0.0, (bound[gi, ji] <= cap + slack).astype(float))
        best = run(loss * 1e6, loss_row + cuts + [cap_row], live)
        if best:
            (cost0, loss0, _), (cost1, loss1, _) = prob.evaluate(sel), prob.evaluate(best)
            if loss1 < loss0 and _within(loss1, budget) and cost1 <= cost0 * (1 + 1e-12):
                sel = best
        return sel, status


class _Dp:
    """The cost-indexed DP table: least loss of any plan at each integer cost above the cheapest."""

    def __init__(self, prob: _Problem, unit: float) -> None:
        self.prob = prob
        self.steps = [np.round((c - c[0]) / unit).astype(np.int64) for c in prob.costs]
        table = np.zeros(1)  # (span_so_far + 1,) least loss per cost offset
        self.args: list[np.ndarray] = []  # per group (span_g + 1,) option position used
        for steps, losses in zip(self.steps, prob.losses):
            new = np.full(len(table) + int(steps[-1]), np.inf)
            arg = np.zeros(len(new), dtype=np.uint16)
            for j, (step, loss) in enumerate(zip(steps, losses)):
                at, cand = slice(step, step + len(table)), table + loss
                better = cand < new[at]  # strict: of equal losses the cheaper option stays
                new[at][better], arg[at][better] = cand[better], j
            table = new
            self.args.append(arg)
        self.table = table

    def plan(self, offset: int) -> list[int]:
        sel = [0] * len(self.steps)
        for g in range(len(self.steps) - 1, -1, -1):
            sel[g] = int(self.args[g][offset])
            offset -= int(self.steps[g][sel[g]])
        return sel

    def solve(self, budget: float) -> tuple[list[int], str] | None:
        """The cheapest plan (in whole units) within ``budget``, least loss among those."""
        fits = self.table <= budget + LOSS_RTOL * abs(budget) + LOSS_ATOL
        return (self.plan(int(np.argmax(fits))), "optimal") if fits.any() else None

    def frontier(self) -> list[list[int]]:
        """All non-dominated plans, rising cost: offsets where the least loss drops."""
        best_before = np.concatenate([[np.inf], np.minimum.accumulate(self.table)[:-1]])
        return [self.plan(int(c)) for c in np.flatnonzero(self.table < best_before)]


def _fallback(prob: _Problem, budget: float, unit: float | None) -> tuple[list[int], str]:
    """A plan within ``budget`` when HiGHS gave none: the exact DP when its table is small
    (``unit`` divides every cost step), else the DP on costs rounded to a unit that keeps
    the table small (loss exact, cost within groups * unit / 2 of the optimum), else the
    least-loss plan (``budget`` must admit it)."""
    span = sum(float(c[-1] - c[0]) for c in prob.costs)
    n_opts = sum(len(c) for c in prob.costs)
    exact = unit is not None and (span / unit + 1) * n_opts <= _DP_MAX_WORK
    coarse = span * n_opts / _DP_MAX_WORK
    if exact or coarse > 0:
        solved = _Dp(prob, unit if exact and unit is not None else coarse).solve(budget)
        if solved is not None and _within(prob.evaluate(solved[0])[1], budget):
            return solved[0], "dp_fallback" if exact else "approx_dp_fallback"
    return [len(c) - 1 for c in prob.costs], "least_loss"


def _solve(
    prob: _Problem, budget: float, unit: float | None, solver: _Milp | _Dp | None = None
) -> tuple[list[int], str]:
    """The plan for ``budget`` (which the least-loss plan fits) by ``solver`` (the DP when
    ``unit`` is set, else the MILP), falling back (``_fallback``) when it finds none."""
    if solver is None:
        solver = _Milp(prob) if unit is None else _Dp(prob, unit)
    solved = solver.solve(budget)
    if solved is not None and _within(prob.evaluate(solved[0])[1], budget):
        return solved
    return _fallback(prob, budget, prob.dp_unit(None) if unit is None else unit)


def _pick_method(prob: _Problem, method: Method, cost_unit: float | None) -> float | None:
    """The DP unit when the DP is to be used, else None (use the MILP)."""
    if method not in ("auto", "milp", "dp"):
        raise ValueError(f"method must be 'auto', 'milp' or 'dp', got {method!r}")
    unit = None if method == "milp" else prob.dp_unit(cost_unit)
    span = math.inf if unit is None else sum(float(c[-1] - c[0]) for c in prob.costs) / unit
    work = (span + 1) * sum(len(c) for c in prob.costs)  # table length x options
    if method == "dp" and work > 20 * _DP_MAX_WORK:  # latency without cost_unit: inf
        raise ValueError(f"method='dp' needs a cost_unit giving a small table, got {unit}")
    return unit if method == "dp" or work <= _DP_MAX_WORK else None


def allocate(
    groups: Sequence[Sequence[Option]],
    loss_budget: float,
    objective: Objective = "bytes",
    *,
    method: Method = "auto",
    cost_unit: float | None = None,
) -> Allocation:
    """The cheapest choice of one option per group whose summed loss fits ``loss_budget``.

    ``objective`` picks the cost summed: ``Option.nbytes`` or ``Option.latency``; among equally
    cheap plans the least loss wins. ``method`` picks the exact solver (module docstring);
    ``cost_unit`` must divide every cost step (lets the DP run on latencies). Raises
    ValueError when even the least-loss plan exceeds the budget.
    """
    if math.isnan(loss_budget):
        raise ValueError("loss_budget must not be NaN")
    prob = _Problem(groups, objective)
    if not _within(prob.min_loss, loss_budget):
        msg = f"the least-loss plan already loses {prob.min_loss:.6g}"
        raise ValueError(f"loss budget {loss_budget:.6g} is infeasible: {msg}")
    unit = _pick_method(prob, method, cost_unit)
    sel, status = _solve(prob, loss_budget, unit)
    cost, loss, choice = prob.evaluate(sel)
    return Allocation(choice=choice, cost=cost, loss=loss, status=status)


def _spread(points: list[FrontierPoint], max_points: int) -> list[FrontierPoint]:
    """At most ``max_points`` of ``points`` (rising cost), ends kept, evenly spaced in arc length."""
    if len(points) <= max_points:
        return points
    xy = np.array([[p.cost, p.loss] for p in points])  # (P, 2)
    xy = (xy - xy.min(0)) / np.maximum(np.ptp(xy, axis=0), 1e-300)
    arc = np.concatenate([[0.0], np.cumsum(np.hypot(*np.diff(xy, axis=0).T))])  # (P,)
    picks = np.searchsorted(arc, np.linspace(0.0, arc[-1], max_points))
    return [points[i] for i in sorted(set(np.minimum(picks, len(points) - 1).tolist()))]


def _milp_frontier(prob: _Problem, solver: _Milp, max_points: int) -> list[FrontierPoint]:
    """Adaptive epsilon-constraint: split the widest gap between known points until done."""

    def point(budget: float) -> FrontierPoint:  # budget >= min_loss: always a plan
        return FrontierPoint(*prob.evaluate(_solve(prob, budget, None, solver)[0]))

    cheap, rich = point(math.inf), point(prob.min_loss)
    if rich.cost <= cheap.cost:  # the cheapest plan already has the least loss
        return [cheap]
    found, tick = [rich, cheap], itertools.count()  # tick: FrontierPoints do not compare
    heap: list[tuple[float, int, FrontierPoint, FrontierPoint]] = []
    span_c, span_l = rich.cost - cheap.cost, max(cheap.loss - rich.loss, 1e-300)

    def push(a: FrontierPoint, b: FrontierPoint) -> None:
        """Queue the gap between a (less loss, dearer) and b (more loss, cheaper)."""
        size = ((a.cost - b.cost) / span_c) ** 2 + ((b.loss - a.loss) / span_l) ** 2
        heapq.heappush(heap, (-size, next(tick), a, b))

    push(rich, cheap)
    while heap and len(found) < max_points:
        _, _, a, b = heapq.heappop(heap)
        p: FrontierPoint | None = point(0.5 * (a.loss + b.loss))  # loss in (a.loss, mid], or a
        split = p is not None and b.cost < p.cost < a.cost
        if not split:  # none up to mid: b's next neighbour, with loss in (mid, b.loss), or a
            below_b = b.loss - 2.0 * (LOSS_RTOL * abs(b.loss) + LOSS_ATOL)
            p = point(below_b) if below_b >= a.loss else None
        if p is not None and b.cost < p.cost < a.cost:
            found.append(p)
            push(a, p)
            if split:  # else p is b's neighbour: nothing lies between them
                push(p, b)
    return found


def pareto_frontier(
    groups: Sequence[Sequence[Option]],
    objective: Objective = "bytes",
    max_points: int = 64,
    *,
    method: Method = "auto",
    cost_unit: float | None = None,
) -> list[FrontierPoint]:
    """Non-dominated (cost, loss) plans, sorted from the dearest/least-loss to the cheapest.

    Each point is exact: ``allocate(groups, point.loss)`` returns a plan of ``point.cost``.
    Of more than ``max_points`` (>= 2) such plans, both ends and points spread evenly along
    the curve between them are returned.
    """
    if max_points < 2:
        raise ValueError(f"max_points must be >= 2, got {max_points}")
    prob = _Problem(groups, objective)
    unit = _pick_method(prob, method, cost_unit)
    if unit is not None:
        points = [FrontierPoint(*prob.evaluate(s)) for s in _Dp(prob, unit).frontier()]
        points = _spread(points, max_points)
    else:
        points = _milp_frontier(prob, _Milp(prob), max_points)
    return sorted(points, key=lambda p: -p.cost)
