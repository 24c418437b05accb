"""The compression verbs: which layers they touch, their errors, their accuracy."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from kiln.compress import (
    Int4Linear,
    Int4WeightOnly,
    Int8WeightOnly,
    LowRank,
    SemiStructured24,
    lowrank_,
    quantize_,
    sparsify_,
)
from kiln.compress.moments import collect_stats, input_moments, linear_layers
from kiln.core.compare import sqnr_db
from tests.compress.toy import correlated_inputs, toy_mlp


class TiedLM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(50, 32)
        self.body = nn.Linear(32, 32)
        self.head = nn.Linear(32, 50, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(torch.relu(self.body(self.emb(ids))))


def test_tied_head_is_left_alone() -> None:
    model = TiedLM()
    assert quantize_(model, Int8WeightOnly()) == ["body"]
    assert isinstance(model.head, nn.Linear)


def test_filter_fn_and_unsupported_shapes() -> None:
    model = nn.Sequential(nn.Linear(48, 64), nn.Linear(64, 8))
    # 48 is not a multiple of 32: skipped by default, refused when asked for explicitly
    assert quantize_(model, Int4WeightOnly(group_size=32)) == ["1"]
    with pytest.raises(ValueError, match="cannot compress 0"):
        quantize_(nn.Sequential(nn.Linear(48, 64)), Int4WeightOnly(group_size=32),
                  filter_fn=lambda m, n: True)  # fmt: skip


def test_wrong_config_type_and_missing_calibration() -> None:
    with pytest.raises(TypeError):
        quantize_(toy_mlp(), SemiStructured24())  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="needs calibration data"):
        quantize_(toy_mlp(), Int4WeightOnly(method="gptq"))


def test_config_validation() -> None:
    with pytest.raises(ValueError):
        Int4WeightOnly(group_size=48)
    with pytest.raises(ValueError):
        LowRank()
    with pytest.raises(ValueError):
        LowRank(rank=4, max_error=0.1)


@pytest.mark.parametrize(
    "config, min_db",
    [
        (Int8WeightOnly(), 35.0),
        (Int8WeightOnly(method="gptq"), 35.0),
        (Int4WeightOnly(group_size=32), 18.0),
        (Int4WeightOnly(group_size=64, method="gptq"), 15.0),
        (SemiStructured24(method="sparsegpt"), 5.0),
    ],
)
def test_model_outputs_stay_close(config, min_db: float) -> None:
    model, ref = toy_mlp(), toy_mlp()
    x = correlated_inputs(512)
    stats = collect_stats(model, [x], linear_layers(model))
    verb = sparsify_ if isinstance(config, SemiStructured24) else quantize_
    assert verb(model, config, calibration=input_moments(stats)) == ["0", "2", "4"]
    with torch.no_grad():
        assert sqnr_db(ref(x), model(x)) > min_db


def test_int4_layer_bytes() -> None:
    model = nn.Sequential(nn.Linear(256, 64, bias=False))
    quantize_(model, Int4WeightOnly(group_size=64))
    layer = model[0]
    assert isinstance(layer, Int4Linear)
    assert layer.nbytes() == 64 * 256 // 2 + 2 * 64 * 4 * 2  # nibbles + fp16 scale, offset


def test_lowrank_skips_layers_without_savings() -> None:
    model = toy_mlp()
    # max_error 1e-6 needs (nearly) full rank: no layer saves bytes, none is replaced
    assert lowrank_(model, LowRank(max_error=1e-6)) == []


@pytest.mark.parametrize(
    "config",
    [Int8WeightOnly(), Int8WeightOnly(method="gptq"), Int4WeightOnly(group_size=64),
     Int4WeightOnly(group_size=32, symmetric=False, method="gptq"), SemiStructured24(),
     SemiStructured24(method="sparsegpt"), LowRank(rank=64), LowRank(max_error=0.3, activation_aware=True)],
    ids=lambda c: c.name,
)  # fmt: skip
def test_parse_config_inverts_name(config) -> None:
    from kiln.compress.configs import parse_config

    assert parse_config(config.name) == config


@pytest.mark.parametrize("bad", ["int3", "int4-g48", "int4", "lowrank", "int8-foo", "2:4-x"])
def test_parse_config_rejects(bad: str) -> None:
    from kiln.compress.configs import parse_config

    with pytest.raises(ValueError):
        parse_config(bad)
