"""Pipeline stage splits: the balanced split against brute force over every split."""

from __future__ import annotations

import itertools
import random

import pytest

from kiln.deploy.stages import balanced_stages, even_stages


def _largest(cost: list[float], stages: list[int], first: float, last: float) -> float:
    out, i = [], 0
    for n in stages:
        out.append(sum(cost[i : i + n]))
        i += n
    out[0] += first
    out[-1] += last
    return max(out)


def _brute(cost: list[float], pp: int, first: float, last: float) -> float:
    n = len(cost)
    best = float("inf")
    for cuts in itertools.combinations(range(1, n), pp - 1):
        bounds = [0, *cuts, n]
        stages = [b - a for a, b in itertools.pairwise(bounds)]
        best = min(best, _largest(cost, stages, first, last))
    return best


@pytest.mark.parametrize("seed", range(40))
def test_balanced_split_is_optimal(seed: int) -> None:
    rng = random.Random(seed)
    n, pp = rng.randint(2, 11), 0
    pp = rng.randint(1, n)
    cost = [rng.uniform(0.2, 3.0) for _ in range(n)]
    first, last = rng.choice([0.0, rng.uniform(0, 8)]), rng.choice([0.0, rng.uniform(0, 8)])
    stages = balanced_stages(cost, pp, first, last)
    assert len(stages) == pp and min(stages) >= 1 and sum(stages) == n
    assert _largest(cost, stages, first, last) == pytest.approx(_brute(cost, pp, first, last))


def test_a_heavy_head_moves_layers_off_the_last_stage() -> None:
    # 24 equal blocks, a head worth six of them (Qwen2-0.5B's proportions)
    assert even_stages(24, 2) == [12, 12]
    assert balanced_stages([1.0] * 24, 2, last_extra=6.0) == [15, 9]


def test_impossible_splits_are_refused() -> None:
    with pytest.raises(ValueError, match="non-empty"):
        balanced_stages([1.0, 1.0], 3)
