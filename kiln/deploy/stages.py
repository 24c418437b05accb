"""Where a pipeline cuts the model: contiguous stages whose largest is as small as it can be.

A stage holds and reads its layers' weights and KV cache; the first stage also holds the
embedding, the last the head (Qwen2-0.5B's head holds as many weights as six of its
blocks). An even split by layer count
leaves the last stage the heaviest, and it decides both whether the plan fits and how fast
the pipeline runs. ``balanced_stages`` minimises the largest stage's cost exactly:

* ``_pack(limit)`` packs layers into stages from the first, starting a new stage when the
  next layer would push the current one past ``limit``; for contiguous parts of positive
  costs this greedy packing uses the fewest stages any split can (an exchange argument), so
  ``limit`` is achievable with ``pp`` stages exactly when it uses at most ``pp``;
* the smallest achievable limit is found by bisection between the largest single layer
  and the whole model, and stages it leaves unused are made by splitting the stage with
  the most layers (splitting never raises the largest cost).

The cost of a layer varies with its KV cache (sliding-window layers hold fewer positions),
so the cut points are the model's own, not ``n / pp``.
"""

from __future__ import annotations

from collections.abc import Sequence


def even_stages(n_layers: int, pp: int) -> list[int]:
    """Layers per stage by count only (earlier stages take the remainder)."""
    base, extra = divmod(n_layers, pp)
    return [base + (1 if s < extra else 0) for s in range(pp)]


def balanced_stages(
    layer_cost: Sequence[float], pp: int, first_extra: float = 0.0, last_extra: float = 0.0
) -> list[int]:
    """Layers per stage (``pp`` non-empty contiguous stages) minimising the largest stage
    cost, a stage's cost being its layers' costs plus ``first_extra`` on the first and
    ``last_extra`` on the last stage. Layer 0 always lies in the first stage and the last
    layer in the last, so the extras are simply added to those two layers' costs."""
    n = len(layer_cost)
    if not 1 <= pp <= n:
        raise ValueError(f"{n} layers cannot make {pp} non-empty pipeline stages")
    if min(layer_cost) <= 0:
        raise ValueError("layer costs must be positive")
    cost = list(layer_cost)
    cost[0] += first_extra
    cost[-1] += last_extra
    if pp == 1:
        return [n]
    lo, hi = max(cost), sum(cost)
    if len(_pack(cost, lo)) <= pp:
        hi = lo
    for _ in range(200):  # bisection until the limit is known to a relative 1e-12
        if hi - lo <= 1e-12 * hi:
            break
        mid = (lo + hi) / 2
        if len(_pack(cost, mid)) <= pp:
            hi = mid
        else:
            lo = mid
    stages = _pack(cost, hi)
    while len(stages) < pp:  # stages left unused: split the one with the most layers
        i = max(range(len(stages)), key=lambda s: stages[s])
        stages[i : i + 1] = [stages[i] - stages[i] // 2, stages[i] // 2]
    return stages


def _pack(cost: Sequence[float], limit: float) -> list[int]:
    """Greedy contiguous packing: layers per stage, a new stage whenever the next layer
    would take the current one past ``limit`` (a layer over ``limit`` alone is a stage)."""
    stages: list[int] = []
    load, count = 0.0, 0
    for c in cost:
        if count and load + c > limit:
            stages.append(count)
            load, count = 0.0, 0
        load += c
        count += 1
    stages.append(count)
    return stages
