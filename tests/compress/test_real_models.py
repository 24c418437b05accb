"""Compression on the real models and text (skipped without `make data` / the packages).

Small on purpose (CI runs on 2 cores): a few calibration windows, 1,024 evaluation
tokens. The full table is kiln/bench/compression.py.
"""

from __future__ import annotations

import copy
import math

import pytest
import torch

from kiln.compress import Int4WeightOnly, Int8WeightOnly, quantize_
from kiln.compress.moments import collect_stats, input_moments, linear_layers
from kiln.compress.tasks import EncoderTask, LanguageModelTask
from kiln.compress.workflow import compress_to_budget, model_nbytes
from tests.quality.conftest import requires_corpus, requires_minilm, requires_smollm2
from tests.support.compare import assert_close_to_reference


@requires_corpus
@requires_smollm2
def test_gptq_beats_round_to_nearest_on_smollm2() -> None:
    """INT4-g32 on every MLP down projection: GPTQ's calibrated error compensation must
    lose less perplexity than round-to-nearest, and both stay near the original."""
    from kiln.models.catalog import load_smollm2

    model, tok = load_smollm2()
    task = LanguageModelTask(
        model, tok, calib_samples=2, seq_len=256, eval_tokens=1024, confirm_tokens=512
    )
    base = task.baseline()
    # SmolLM2 reads Austen at ppl ~20 (docs/benchmarks.md: 22.2 on 20k tokens)
    assert 10 < base < 40
    down = lambda m, name: name.endswith("mlp.down_proj")  # noqa: E731
    layers = linear_layers(model, down)
    moments = input_moments(collect_stats(model, task.calibration(), layers))
    increases = {}
    for method in ("rtn", "gptq"):
        model_q = copy.deepcopy(model)  # the same weights, without reading them again
        assert quantize_(model_q, Int4WeightOnly(group_size=32, method=method),
                         filter_fn=down, calibration=moments) == list(layers)  # fmt: skip
        increases[method] = math.log(task.ppl(model_q) / base)
    assert 0 < increases["gptq"] < increases["rtn"] < 0.1


@requires_corpus
@requires_minilm
def test_minilm_mixed_plan_keeps_cosine() -> None:
    """The mixed-plan procedure on the fp32 sentence encoder: the plan it reports as
    within budget keeps the mean embedding cosine >= 0.99 on the confirmation sentences
    (Sense and Sensibility), which its search (on Pride and Prejudice) never saw."""
    from kiln.models.catalog import load_minilm

    model, tok = load_minilm()
    original = model_nbytes(model)
    task = EncoderTask(
        model, tok, calib_sentences=64, eval_sentences=64, confirm_sentences=128, batch_size=32
    )
    options = (Int8WeightOnly(method="gptq"), Int4WeightOnly(group_size=32, method="gptq"))
    out = compress_to_budget(task, 0.01, options=options, check=False)
    assert out.met and out.confirmation is not None, out.verdict
    assert out.result.final.upper <= 0.01  # the search's figure plus its margin
    confirmed = 1.0 - task.measure_confirmation(model).mean  # the compressed model now
    assert confirmed >= 0.99
    assert confirmed == pytest.approx(1.0 - out.confirmation.increase, abs=1e-9)
    assert out.verdict.startswith("confirmed: 1 - cosine")
    assert "Sense and Sensibility (128 sentences)" in out.verdict
    assert model_nbytes(model) < original
    with torch.no_grad():  # the compressed model still runs on a fresh sentence
        enc = tok(["It is a truth universally acknowledged."], return_tensors="pt")
        assert torch.isfinite(model(**enc).last_hidden_state).all()


@pytest.mark.parametrize("rows", [1, 8])
@requires_smollm2
def test_quantized_layers_run_real_shapes(rows: int) -> None:
    """A real SmolLM2 layer quantized to INT8 / INT4 computes what its dense weight says."""
    from kiln.models.catalog import load_smollm2

    model, _ = load_smollm2()
    layer = model.model.layers[3].mlp.gate_proj
    x = torch.randn(rows, layer.in_features)
    for config in (Int8WeightOnly(), Int4WeightOnly(group_size=64)):
        holder = torch.nn.Sequential(layer)
        quantize_(holder, config)
        q = holder[0]
        assert_close_to_reference(q(x), x @ q.dense_weight().T, rtol_to_max=1e-5)
