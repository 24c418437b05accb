"""Tensor- and pipeline-parallel decoding on gloo gives the tokens of one process.

The reference is the unsharded model decoding in this process (``greedy_reference``, or
``generate`` over the eager model with the same ``Sampling`` for sampled runs). Tokens must
be identical; logits agree to float32 rounding: sharding only changes the order of the sums
(partial products added by the all-reduce), so the tolerance is 1e-5 of the largest logit.
"""

from __future__ import annotations

import pytest
import torch

from kiln.compress import Int4WeightOnly, Int8WeightOnly
from kiln.llm.generate import EagerDecoder, Generation, Sampling, generate
from kiln.parallel import launch, run_parallel
from tests.parallel import models
from tests.parallel.models import LLAMA, factory, greedy_reference, prompts
from tests.parallel.ranks import Scenario, run_scenarios
from tests.support.compare import assert_close_to_reference

NEW = 6
P2 = prompts(2, 5, 256)
P4 = prompts(4, 5, 256, seed=2)
HOT = Sampling(temperature=1.5, seed=3)  # hot enough that most tokens are not the argmax
NUCLEUS = Sampling(temperature=0.9, top_k=40, top_p=0.9, seed=5)
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
    Scenario("pp2_sampled", "LLAMA", None, 1, 2, None, 1, P2, NEW, HOT),
    Scenario("pp2_split31_mb2_nucleus", "LLAMA", None, 1, 2, (3, 1), 2, P4, NEW, NUCLEUS),
    Scenario("tp2_sampled", "UNEVEN", None, 2, 1, None, 1, P2, NEW, HOT),
]
SAMPLED = [sc.name for sc in SCENARIOS if not sc.sampling.greedy]
BY_NAME = {sc.name: sc for sc in SCENARIOS}


@pytest.fixture(scope="module")
def ranks() -> list[dict[str, Generation]]:
    """Every 2-rank scenario in one launch (the process start-up is paid once): each
    rank's generations by scenario name."""
    return launch(run_scenarios, 2, args=(SCENARIOS,), timeout_s=60)


@pytest.fixture(scope="module")
def two_ranks(ranks: list[dict[str, Generation]]) -> dict[str, Generation]:
    """The generation of each scenario's last stage (its first rank)."""
    return {name: ranks[1 if sc.pp == 2 else 0][name] for name, sc in BY_NAME.items()}


def reference(sc: Scenario) -> tuple[torch.Tensor, torch.Tensor]:
    """New tokens (B, new) and their logits (B, new, V) of the unsharded model."""
    model = factory(getattr(models, sc.cfg_name), 0, sc.compression)()  # type: ignore[arg-type]
    if sc.sampling.greedy:
        tokens, logits = greedy_reference(model, sc.prompt, sc.new)
        return tokens[:, sc.prompt.shape[1] :], logits
    b, t = sc.prompt.shape
    gen = generate(EagerDecoder(model, b, t + sc.new), sc.prompt, sc.new, sc.sampling,
                   keep_logits=True)  # fmt: skip
    assert gen.logits is not None
    return gen.tokens, gen.logits


@pytest.mark.parametrize("name", list(BY_NAME))
def test_same_tokens_and_logits_as_one_process(two_ranks, name: str) -> None:
    sc = BY_NAME[name]
    tokens, logits = reference(sc)  # the unsharded model (compressed the same way)
    out = two_ranks[name]
    assert out.logits is not None and out.prompt_len == sc.prompt.shape[1]
    assert torch.equal(out.tokens, tokens), f"{name}: {out.tokens} != {tokens}"
    assert_close_to_reference(out.logits, logits, rtol_to_max=1e-5)
    assert out.ttft_s > 0 and len(out.step_s) == sc.new - 1


@pytest.mark.parametrize("name", SAMPLED)
def test_sampling_on_ranks_is_seeded_and_every_rank_agrees(ranks, name: str) -> None:
    sc = BY_NAME[name]
    greedy, _ = greedy_reference(factory(getattr(models, sc.cfg_name))(), sc.prompt, sc.new)
    sampled = ranks[0][name].tokens
    assert torch.equal(ranks[1][name].tokens, sampled)  # both stages, both shards
    assert not torch.equal(sampled, greedy[:, sc.prompt.shape[1] :])  # really sampled


def test_micro_batches_give_the_unbatched_tokens(two_ranks) -> None:
    one, three = two_ranks["pp2_split31"], two_ranks["pp2_split31_mb3"]
    assert torch.equal(three.tokens, one.tokens)


def test_tp2_x_pp2_on_four_processes() -> None:
    model = factory(LLAMA)()
    ref = generate(EagerDecoder(model, 4, 5 + NEW), P4, NEW, NUCLEUS, keep_logits=True)
    out = run_parallel(factory(LLAMA), P4, NEW, tp=2, pp=2, microbatches=2, timeout_s=60,
                       sampling=NUCLEUS, keep_logits=True)  # fmt: skip
    assert out.logits is not None and ref.logits is not None
    assert torch.equal(out.tokens, ref.tokens)
    assert_close_to_reference(out.logits, ref.logits, rtol_to_max=1e-5)
