"""Tensor- and pipeline-parallel greedy decoding on gloo gives the tokens of one process.

The reference is the unsharded model decoding in this process (``greedy_reference``).
Tokens must be identical; logits agree to float32 rounding: sharding only changes the
order of the sums (partial products added by the all-reduce), so the tolerance is 1e-5
of the largest logit.
"""

from __future__ import annotations

import pytest
import torch

from kiln.compress import Int4WeightOnly, Int8WeightOnly
from kiln.parallel import launch, run_parallel
from kiln.parallel.pp import GenerationOutput
from tests.helpers import assert_close_to_reference
from tests.parallel import models
from tests.parallel.models import LLAMA, factory, greedy_reference, prompts
from tests.parallel.ranks import Scenario, run_scenarios

NEW = 6
P2 = prompts(2, 5, 256)
P4 = prompts(4, 5, 256, seed=2)
SCENARIOS = [
    # name, model, compression, tp, pp, split, micro-batches, prompt
    Scenario("tp2", "LLAMA", None, 2, 1, None, 1, P2, NEW),
    Scenario("tp2_uneven_heads_biases", "UNEVEN", None, 2, 1, None, 1, P2, NEW),
    Scenario("tp2_replicated_kv", "MQA", None, 2, 1, None, 1, P2, NEW),
    Scenario("tp2_int8", "LLAMA", Int8WeightOnly(), 2, 1, None, 1, P2, NEW),
    Scenario("tp2_int4_g32", "LLAMA", Int4WeightOnly(group_size=32), 2, 1, None, 1, P2, NEW),
    Scenario("pp2", "LLAMA", None, 1, 2, None, 1, P2, NEW),
    Scenario("pp2_split31", "LLAMA", None, 1, 2, (3, 1), 1, P4, NEW),
    Scenario("pp2_split31_mb3", "LLAMA", None, 1, 2, (3, 1), 3, P4, NEW),
]
BY_NAME = {sc.name: sc for sc in SCENARIOS}


@pytest.fixture(scope="module")
def two_ranks() -> dict[str, GenerationOutput]:
    """Every 2-rank scenario in one launch: the process start-up is paid once."""
    results = launch(run_scenarios, 2, args=(SCENARIOS,), timeout_s=60)
    last_stage = {name: results[1] if BY_NAME[name].pp == 2 else results[0] for name in BY_NAME}
    for name, rank in last_stage.items():
        assert isinstance(rank[name].tokens, torch.Tensor), name
    return {name: rank[name] for name, rank in last_stage.items()}


def reference(sc: Scenario) -> tuple[torch.Tensor, torch.Tensor]:
    model = factory(getattr(models, sc.cfg_name), 0, sc.compression)()  # type: ignore[arg-type]
    return greedy_reference(model, sc.prompt, sc.new)


@pytest.mark.parametrize("name", list(BY_NAME))
def test_same_tokens_and_logits_as_one_process(two_ranks, name: str) -> None:
    sc = BY_NAME[name]
    tokens, logits = reference(sc)  # the unsharded model (compressed the same way)
    out = two_ranks[name]
    assert out.tokens is not None and out.logits is not None
    assert torch.equal(out.tokens, tokens), f"{name}: {out.tokens} != {tokens}"
    assert_close_to_reference(out.logits, logits, rtol_to_max=1e-5)


def test_micro_batches_give_the_unbatched_tokens(two_ranks) -> None:
    one, three = two_ranks["pp2_split31"], two_ranks["pp2_split31_mb3"]
    assert one.tokens is not None and three.tokens is not None
    assert torch.equal(three.tokens, one.tokens)


def test_tp2_x_pp2_on_four_processes() -> None:
    tokens, logits = greedy_reference(factory(LLAMA)(), P4, NEW)
    out = run_parallel(factory(LLAMA), P4, NEW, tp=2, pp=2, microbatches=2, timeout_s=60)
    assert out.tokens is not None and out.logits is not None
    assert torch.equal(out.tokens, tokens)
    assert_close_to_reference(out.logits, logits, rtol_to_max=1e-5)
