"""Save/load round trips of compressed models (bit-exact) and loader errors."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from kiln.compress import (
    Int4WeightOnly,
    Int8WeightOnly,
    LowRank,
    SemiStructured24,
    load_into,
    lowrank_,
    quantize_,
    save_compressed,
    sparsify_,
)
from kiln.compress.checkpoint import MANIFEST, compressed_layers
from tests.compress.toy import toy_mlp


def mixed_model() -> torch.nn.Module:
    model = toy_mlp(seed=7)
    quantize_(
        model, Int4WeightOnly(group_size=32, symmetric=False), filter_fn=lambda m, n: n == "0"
    )
    quantize_(model, Int8WeightOnly(), filter_fn=lambda m, n: n == "2")
    sparsify_(model, SemiStructured24(), filter_fn=lambda m, n: n == "4")
    return model


def test_roundtrip_is_bit_exact(tmp_path: Path) -> None:
    model = mixed_model()
    save_compressed(model, tmp_path, info={"note": "test"})
    loaded = load_into(toy_mlp(seed=99), tmp_path)
    assert {n: m.kind for n, m in compressed_layers(loaded).items()} == {
        "0": "int4", "2": "int8", "4": "2:4"
    }  # fmt: skip
    want, got = model.state_dict(), loaded.state_dict()
    assert want.keys() == got.keys()
    for key in want:
        assert want[key].dtype == got[key].dtype and torch.equal(want[key], got[key]), key
    x = torch.randn(5, 64)
    with torch.no_grad():
        assert torch.equal(model(x), loaded(x))


def test_lowrank_roundtrip(tmp_path: Path) -> None:
    model = toy_mlp()
    done = lowrank_(model, LowRank(rank=8))
    assert done == ["0", "2", "4"]
    save_compressed(model, tmp_path)
    loaded = load_into(toy_mlp(seed=3), tmp_path)
    assert torch.equal(loaded.state_dict()["2.u"], model.state_dict()["2.u"])


def test_unknown_kind_is_refused(tmp_path: Path) -> None:
    save_compressed(mixed_model(), tmp_path)
    manifest = json.loads((tmp_path / MANIFEST).read_text())
    manifest["layers"]["0"]["kind"] = "int3"
    (tmp_path / MANIFEST).write_text(json.dumps(manifest))
    with pytest.raises(ValueError, match="unknown compressed layer kind 'int3'"):
        load_into(toy_mlp(), tmp_path)


def test_wrong_architecture_is_refused(tmp_path: Path) -> None:
    save_compressed(mixed_model(), tmp_path)
    other = torch.nn.Sequential(torch.nn.Linear(64, 128))
    with pytest.raises(ValueError, match="does not exist"):
        load_into(other, tmp_path)


def test_not_a_checkpoint(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="not a kiln compressed checkpoint"):
        load_into(toy_mlp(), tmp_path)
