"""GraphDecoder: the static, CUDA-graph-capturable decode step against the eager model.

On the CPU the static step runs without a graph: every cache slot read behind a mask,
positions as a tensor, keys and values written with ``index_copy_``. It must give the
eager model's logits and greedy tokens for every feature the Transformer has (GQA, biases,
sliding windows, soft-capping, q/k norms, learned positions). On a GPU the same step is
captured once and replayed, and must agree with the eager model too.
"""

from __future__ import annotations

import pytest
import torch

from kiln.llm.graph_decoder import GraphDecoder
from kiln.models.transformer import Transformer
from tests.support.compare import assert_close_to_reference
from tests.support.models import DECODE_CONFIGS, tiny_transformer

STEPS = 12
TOL = 1e-4  # fp32: masked attention over all slots sums in another order than the prefix

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def check_against_eager(model: Transformer, batch: int, graphs: bool) -> None:
    torch.manual_seed(1)
    dev = next(model.parameters()).device
    prompt = torch.randint(0, model.cfg.vocab_size, (batch, 5), device=dev)
    max_len = 5 + STEPS + 3  # unwritten slots stay masked
    dec = GraphDecoder(model, batch, max_len, graphs=graphs)
    ref_cache = model.new_cache(batch, max_len)
    with torch.no_grad():
        expected = model(prompt, 0, ref_cache)
        got = dec.prefill(prompt)
        assert_close_to_reference(got, expected[:, -1:])
        tok = expected[:, -1].argmax(-1)
        for pos in range(5, 5 + STEPS):
            ref = model(tok[:, None], pos, ref_cache)[:, 0]  # (B, V)
            out = dec.step(tok, pos)
            assert_close_to_reference(out, ref, rtol_to_max=TOL)
            assert torch.equal(out.argmax(-1), ref.argmax(-1)), f"greedy token differs at {pos}"
            tok = ref.argmax(-1)


@pytest.mark.parametrize("name", sorted(DECODE_CONFIGS))
@pytest.mark.parametrize("batch", [1, 2])
def test_static_step_matches_eager(name: str, batch: int) -> None:
    check_against_eager(tiny_transformer(DECODE_CONFIGS[name]), batch, graphs=False)


def test_step_past_the_cache_is_refused() -> None:
    dec = GraphDecoder(tiny_transformer(DECODE_CONFIGS["llama_gqa"]), 1, 4, graphs=False)
    with pytest.raises(ValueError, match="past the cache"):
        dec.step(torch.tensor([1]), 4)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("name", sorted(DECODE_CONFIGS))
def test_cuda_graph_step_matches_eager(name: str) -> None:
    model = tiny_transformer(DECODE_CONFIGS[name]).cuda()
    check_against_eager(model, 2, graphs=True)
