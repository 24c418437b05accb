"""Checkpoints kiln cannot run are refused with kiln's own error naming the culprit."""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from kiln.models.config import ConfigError
from kiln.models.load import load_model
from kiln.models.readers import LoadError
from tests.models.families import write_checkpoint, write_tiny_gguf


def _raises(kind: type[Exception], *fragments: str) -> Any:
    """pytest.raises matching every fragment (literally) somewhere in the message."""
    return pytest.raises(kind, match="".join(f"(?=[\\s\\S]*{re.escape(f)})" for f in fragments))


def _edit_config(folder: Path, **changes: Any) -> Path:
    path = folder / "config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), **changes}))
    return folder


def _edit_weights(folder: Path, edit: Callable[[dict[str, torch.Tensor]], None]) -> Path:
    tensors = load_file(folder / "model.safetensors")
    edit(tensors)
    save_file(tensors, folder / "model.safetensors")
    return folder


@pytest.fixture
def llama(tmp_path: Path) -> Path:
    return write_checkpoint("llama", tmp_path / "llama")


def test_missing_path(tmp_path: Path) -> None:
    with _raises(LoadError, str(tmp_path / "nowhere"), "no such file"):
        load_model(tmp_path / "nowhere")
    with _raises(LoadError, "smollm3", "smollm2"):  # not a catalog name either
        load_model("smollm3")


def test_not_a_checkpoint(tmp_path: Path) -> None:
    (tmp_path / "weights.bin").write_bytes(b"\0" * 16)
    with _raises(LoadError, "weights.bin", ".gguf"):
        load_model(tmp_path / "weights.bin")
    with _raises(LoadError, "no config.json"):
        load_model(tmp_path)


def test_unknown_architecture(llama: Path) -> None:
    with _raises(ConfigError, "config.json", "model_type 'mamba'"):
        load_model(_edit_config(llama, model_type="mamba"))


@pytest.mark.parametrize("kind", ["yarn", "llama3", "dynamic"])
def test_unsupported_rope_scaling(llama: Path, kind: str) -> None:
    rope = {"rope_type": kind, "factor": 4.0, "rope_theta": 10000.0}
    with _raises(ConfigError, f"rope scaling type {kind!r}"):
        load_model(_edit_config(llama, rope_parameters=rope))


@pytest.mark.parametrize(
    ("family", "change", "culprit"),
    [
        ("opt", {"do_layer_norm_before": False}, "do_layer_norm_before"),
        ("opt", {"word_embed_proj_dim": 32}, "word_embed_proj_dim"),
        ("gpt2", {"scale_attn_by_inverse_layer_idx": True}, "scale_attn_by_inverse_layer_idx"),
        ("llama", {"hidden_act": "gelu_10"}, "activation 'gelu_10'"),
        ("gemma3", {"layer_types": ["chunked_attention"] * 3}, "'chunked_attention'"),
        ("llama", {"num_hidden_layers": None}, "'num_hidden_layers' is missing"),
        ("llama", {"quantization_config": {"quant_method": "bitsandbytes"}}, "bitsandbytes"),
    ],
)
def test_unsupported_switch(
    family: str, change: dict[str, Any], culprit: str, tmp_path: Path
) -> None:
    folder = _edit_config(write_checkpoint(family, tmp_path / family), **change)
    with _raises(ConfigError, str(folder / "config.json"), culprit):
        load_model(folder)


def test_missing_tensor(llama: Path) -> None:
    def drop(t: dict[str, torch.Tensor]) -> None:
        del t["model.layers.1.mlp.down_proj.weight"]

    _edit_weights(llama, drop)
    with _raises(LoadError, str(llama), "missing tensor layers.1.mlp.down.weight"):
        load_model(llama)


def test_misshaped_tensor(llama: Path) -> None:
    def widen(t: dict[str, torch.Tensor]) -> None:
        t["model.layers.0.self_attn.k_proj.weight"] = torch.zeros(48, 64)

    _edit_weights(llama, widen)
    with _raises(LoadError, "model.layers.0.self_attn.k_proj.weight", "(48, 64)", "(32, 64)"):
        load_model(llama)


def test_unexpected_tensors(llama: Path, tmp_path: Path) -> None:
    def unknown(t: dict[str, torch.Tensor]) -> None:
        t["model.layers.0.self_attn.rel_pos.weight"] = torch.zeros(4)

    _edit_weights(llama, unknown)
    with _raises(LoadError, "model.safetensors", "unexpected tensor", "rel_pos"):
        load_model(llama)
    mistral = write_checkpoint("mistral", tmp_path / "mistral")  # known name, no such bias

    def bias(t: dict[str, torch.Tensor]) -> None:
        t["model.layers.0.self_attn.q_proj.bias"] = torch.zeros(64)

    _edit_weights(mistral, bias)
    with _raises(LoadError, "unexpected tensor model.layers.0.self_attn.q_proj.bias"):
        load_model(mistral)


def test_integer_tensor(llama: Path) -> None:
    def int8(t: dict[str, torch.Tensor]) -> None:
        t["model.norm.weight"] = torch.zeros(64, dtype=torch.int8)

    _edit_weights(llama, int8)
    with _raises(LoadError, "model.norm.weight", "I8"):
        load_model(llama)


def test_truncated_safetensors(llama: Path) -> None:
    path = llama / "model.safetensors"
    data = path.read_bytes()
    path.write_bytes(data[: len(data) - 1000])
    with _raises(LoadError, str(path), "unreadable"):
        load_model(llama)


def test_missing_shard(tmp_path: Path) -> None:
    folder = write_checkpoint("llama", tmp_path / "sharded", max_shard_size="60KB")
    shard = sorted(folder.glob("model-*.safetensors"))[-1]
    shard.unlink()
    with _raises(LoadError, shard.name, "missing"):
        load_model(folder)


def test_truncated_gguf(tmp_path: Path) -> None:
    path = write_tiny_gguf(tmp_path / "tiny.gguf")
    data = path.read_bytes()
    for cut in (100, len(data) // 2, len(data) - 10):
        path.write_bytes(data[:cut])
        with _raises(LoadError, str(path), "truncated"):
            load_model(path)


def test_gguf_unknown_architecture(tmp_path: Path) -> None:
    path = write_tiny_gguf(tmp_path / "mamba.gguf", arch="mamba")
    with _raises(ConfigError, str(path), "architecture 'mamba'"):
        load_model(path)


def test_gguf_unexpected_tensor(tmp_path: Path) -> None:
    extra = {"blk.0.attn_sinks.weight": np.zeros(4, np.float32)}
    path = write_tiny_gguf(tmp_path / "sinks.gguf", extra=extra)
    with _raises(LoadError, "unexpected tensor 'blk.0.attn_sinks.weight'"):
        load_model(path)


def test_bad_dtype(llama: Path) -> None:
    with pytest.raises(ValueError, match="dtype"):
        load_model(llama, dtype=torch.int8)
