"""Greedy pairwise fusion: valid programs, and never better than the BLP."""

from __future__ import annotations

import random

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kiln.compiler.fusion.candidates import enumerate_candidates
from kiln.compiler.fusion.chains import chain_candidates
from kiln.compiler.fusion.cost import CostModel
from kiln.compiler.fusion.greedy import greedy_fusion
from kiln.compiler.fusion.orchestrate import orchestrate
from kiln.compiler.ir.graph import Graph
from kiln.core.hardware import reference_cpu_profile
from tests.compiler.fusion.orch_graphs import (
    mm_bias_relu_graph,
    random_graphs,
    softmax_graph,
    vit_like,
)
from tests.compiler.fusion.test_orchestrate import assert_program_ok

PROFILE = reference_cpu_profile()


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(random_graphs(max_nodes=8), st.randoms(use_true_random=False), st.booleans())
def test_greedy_is_never_better_than_the_blp(
    g: Graph, rnd: random.Random, use_roofline: bool
) -> None:
    cands = enumerate_candidates(g, max_nodes=4)
    if use_roofline:
        costs = CostModel(PROFILE).costs(cands, g)
    else:
        costs = {c: rnd.uniform(0.1, 10.0) for c in cands}
    greedy = greedy_fusion(g, costs, max_nodes=4)
    blp = orchestrate(g, cands, costs)
    assert blp.objective <= greedy.objective + 1e-6  # HiGHS' absolute gap
    assert greedy.status == "greedy" and greedy.objective == pytest.approx(sum(greedy.costs))
    assert_program_ok(g, greedy.kernels)
    names = [n for k in greedy.kernels for n in k.nodes]
    assert len(names) == len(set(names))  # a partition: greedy never recomputes


def test_greedy_fuses_softmax_and_gemm_epilogue() -> None:
    for g, template in ((softmax_graph(), "reduction"), (mm_bias_relu_graph(), "gemm")):
        cands = enumerate_candidates(g)
        greedy = greedy_fusion(g, CostModel(PROFILE).costs(cands, g))
        assert [k.template for k in greedy.kernels] == [template]


def test_greedy_with_a_cost_function_on_a_vit() -> None:
    g = vit_like(layers=2)
    model = CostModel(PROFILE)
    greedy = greedy_fusion(g, lambda c: model.estimate(c, g), max_nodes=16)
    cands = enumerate_candidates(g, max_nodes=16) + chain_candidates(g)  # as compile does
    blp = orchestrate(g, cands, model.costs(cands, g))
    assert_program_ok(g, greedy.kernels)
    assert blp.objective <= greedy.objective + 1e-6
    assert len(greedy.kernels) < sum(1 for n in g.nodes if n.op not in ("view", "permute", "slice"))
