"""read_architecture: a model's shape from a JSON config, a folder, a GGUF file or a catalog name."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from kiln.deploy import architecture
from kiln.deploy.architecture import Architecture, ArchitectureError, Linear, read_architecture
from kiln.models import catalog, hf
from kiln.models.transformer import Transformer
from tests.quality.conftest import requires_smollm2

CONFIGS = architecture.CONFIGS

# Gemma-2-2B's published Hugging Face config (2.61B parameters): sliding layers alternate.
GEMMA2_2B: dict[str, Any] = {
    "architectures": ["Gemma2ForCausalLM"], "model_type": "gemma2", "num_hidden_layers": 26,
    "hidden_size": 2304, "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 256,
    "intermediate_size": 9216, "vocab_size": 256000, "max_position_embeddings": 8192,
    "sliding_window": 4096, "query_pre_attn_scalar": 256, "rms_norm_eps": 1e-6,
    "hidden_activation": "gelu_pytorch_tanh", "attn_logit_softcapping": 50.0,
    "final_logit_softcapping": 30.0, "rope_theta": 10000.0, "tie_word_embeddings": True,
}  # fmt: skip


def _write(tmp_path: Path, raw: dict[str, Any], name: str = "model.json") -> Path:
    path = tmp_path / name
    path.write_text(json.dumps(raw), encoding="utf-8")
    return path


def _near(value: int, published: float, tolerance: float) -> bool:
    return abs(value - published) <= tolerance * published


@pytest.mark.parametrize(
    ("file", "published", "tolerance"),
    [
        ("glm-130b.json", 130e9, 0.02),
        ("llama-2-70b.json", 68.98e9, 0.01),
        ("qwen2-0.5b.json", 494e6, 0.02),
        ("qwen2-1.5b.json", 1.54e9, 0.02),
    ],
)
def test_parameter_counts_match_the_published_ones(
    file: str, published: float, tolerance: float
) -> None:
    arch = read_architecture(str(CONFIGS / file))
    assert _near(arch.total_params, published, tolerance), arch.total_params
    assert arch.name == file.removesuffix(".json")
    assert arch.source == str(CONFIGS / file)


@requires_smollm2
def test_smollm2_from_the_installed_gguf() -> None:
    arch = read_architecture("smollm2")
    assert _near(arch.total_params, 134.5e6, 0.01), arch.total_params
    assert (arch.family, arch.n_layers, arch.hidden_size) == ("llama", 30, 576)
    assert (arch.n_heads, arch.n_kv_heads, arch.head_dim) == (9, 3, 64)
    assert arch.tied_embeddings and arch.head_params == 0
    assert arch.name.startswith("SmolLM2-135M") and "smollm2" in arch.source
    gguf = catalog.smollm2_gguf_path()  # the same file, named by path
    assert read_architecture(str(gguf)).total_params == arch.total_params


def test_glm_130b_block_as_its_release_has_it() -> None:
    arch = read_architecture(str(CONFIGS / "glm-130b.json"))
    assert (arch.family, arch.n_layers, arch.n_heads, arch.n_kv_heads) == ("glm", 70, 96, 96)
    assert arch.head_dim == 128 and arch.max_positions == 2048 and arch.tied_embeddings
    shapes = {lin.name: (lin.out_features, lin.in_features, lin.bias) for lin in arch.layer_linears}
    assert shapes == {
        "qkv": (3 * 12288, 12288, True), "o": (12288, 12288, True),
        "gate": (32768, 12288, True), "up": (32768, 12288, True), "down": (12288, 32768, True),
    }  # fmt: skip
    assert arch.norm_params_per_layer == 4 * 12288  # two LayerNorms, weight and bias
    assert arch.embedding_params == 150528 * 12288 and arch.head_params == 0
    assert arch.sliding_windows == (None,) * 70 and arch.kv_positions(69, 5000) == 5000


def test_llama_2_70b_grouped_query_attention() -> None:
    arch = read_architecture(str(CONFIGS / "llama-2-70b.json"))
    assert (arch.n_heads, arch.n_kv_heads, arch.head_dim) == (64, 8, 128)
    by_name = {lin.name: lin for lin in arch.layer_linears}
    assert by_name["q"] == Linear("q", 8192, 8192)
    assert by_name["k"] == Linear("k", 1024, 8192) == Linear("k", 1024, 8192, bias=False)
    assert by_name["v"].out_features == 8 * 128 and by_name["down"].in_features == 28672
    assert not arch.tied_embeddings and arch.head_params == 32000 * 8192
    assert arch.total_params == 68_976_648_192  # every tensor of the released checkpoint


def test_qwen2_has_qkv_biases() -> None:
    arch = read_architecture(str(CONFIGS / "qwen2-0.5b.json"))
    assert [lin.name for lin in arch.layer_linears if lin.bias] == ["q", "k", "v"]
    assert arch.tied_embeddings and arch.head_params == 0 and arch.max_positions == 32768


def test_gemma2_sliding_windows_per_layer(tmp_path: Path) -> None:
    arch = read_architecture(str(_write(tmp_path, GEMMA2_2B, "gemma-2-2b.json")))
    assert arch.family == "gemma2" and len(arch.sliding_windows) == 26
    assert arch.sliding_windows[:4] == (4096, None, 4096, None)
    assert arch.kv_positions(0, 8192) == 4096 and arch.kv_positions(0, 1000) == 1000
    assert arch.kv_positions(1, 8192) == 8192
    with pytest.raises(IndexError):
        arch.kv_positions(26, 10)
    assert arch.norm_params_per_layer == 4 * 2304  # Gemma's sandwich norms
    assert _near(arch.total_params, 2.61e9, 0.01), arch.total_params


def test_folder_with_config_json_and_class_only_config(tmp_path: Path) -> None:
    raw = json.loads((CONFIGS / "llama-2-70b.json").read_text())
    folder = tmp_path / "Llama-2-70b-hf"
    folder.mkdir()
    _write(folder, raw, "config.json")
    arch = read_architecture(str(folder))
    assert arch.name == "Llama-2-70b-hf" and arch.total_params == 68_976_648_192
    assert read_architecture(str(folder / "config.json")).name == "Llama-2-70b-hf"
    del raw["model_type"]  # the class name alone is enough
    assert read_architecture(str(_write(tmp_path, raw))).family == "llama"


_TINY = {"vocab_size": 96, "hidden_size": 32, "num_hidden_layers": 3, "num_attention_heads": 4,
         "num_key_value_heads": 2, "intermediate_size": 48, "max_position_embeddings": 64, "hidden_act": "silu"}  # fmt: skip


@pytest.mark.parametrize(
    "raw",
    [
        {**_TINY, "model_type": "llama", "attention_bias": True, "mlp_bias": True},
        {**_TINY, "model_type": "qwen2", "tie_word_embeddings": True},
        {**_TINY, "model_type": "mistral", "sliding_window": 16},
        {**_TINY, "model_type": "gemma3_text", "head_dim": 16, "hidden_activation": "gelu"},
        {
            "model_type": "gpt2",
            "vocab_size": 96,
            "n_embd": 32,
            "n_layer": 2,
            "n_head": 4,
            "n_positions": 64,
            "activation_function": "gelu_new",
        },
        {
            **_TINY,
            "model_type": "opt",
            "ffn_dim": 48,
            "activation_function": "relu",
            "num_key_value_heads": 4,
        },
    ],
    ids=lambda raw: raw["model_type"],
)
def test_counts_equal_kilns_own_model(raw: dict[str, Any]) -> None:
    cfg = hf.parse_config(raw, "tiny")
    arch = Architecture.from_model_config(cfg, "tiny", "tiny")
    with torch.device("meta"):
        model = Transformer(cfg)
    assert arch.total_params == sum(p.numel() for p in model.parameters())
    block = model.layers[0]
    for lin in arch.layer_linears:
        module = block.get_submodule(("attn." if lin.name in "qkvo" else "mlp.") + lin.name)
        assert isinstance(module, torch.nn.Linear)
        assert tuple(module.weight.shape) == (lin.out_features, lin.in_features)
        assert (module.bias is not None) == lin.bias
    assert arch.sliding_windows == tuple(cfg.window(i) for i in range(cfg.n_layers))


def test_missing_file_and_folder_without_config(tmp_path: Path) -> None:
    with pytest.raises(ArchitectureError, match="no such file"):
        read_architecture(str(tmp_path / "absent.json"))
    with pytest.raises(ArchitectureError, match="no config.json"):
        read_architecture(str(tmp_path))
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(ArchitectureError, match="bad.json"):
        read_architecture(str(bad))


def test_unknown_model_type(tmp_path: Path) -> None:
    path = _write(tmp_path, {**_TINY, "model_type": "mamba"})
    with pytest.raises(ArchitectureError, match=r"model\.json: model_type 'mamba'"):
        read_architecture(str(path))
    path = _write(tmp_path, {"architectures": ["MambaForCausalLM"]})
    with pytest.raises(ArchitectureError, match="model_type"):
        read_architecture(str(path))


@pytest.mark.parametrize(("file", "key"), [("llama-2-70b.json", "intermediate_size"),
                                           ("glm-130b.json", "num_layers"),
                                           ("glm-130b.json", "vocab_size")])  # fmt: skip
def test_missing_key_names_file_and_key(tmp_path: Path, file: str, key: str) -> None:
    raw = json.loads((CONFIGS / file).read_text())
    del raw[key]
    path = _write(tmp_path, raw, file)
    with pytest.raises(ArchitectureError, match=rf"{file}: required key '{key}' is missing"):
        read_architecture(str(path))


def test_bad_glm_values(tmp_path: Path) -> None:
    raw = json.loads((CONFIGS / "glm-130b.json").read_text())
    with pytest.raises(ArchitectureError, match="'num_layers' must be a positive integer"):
        read_architecture(str(_write(tmp_path, {**raw, "num_layers": "70"})))
    with pytest.raises(ArchitectureError, match="activation 'gelu'"):
        read_architecture(str(_write(tmp_path, {**raw, "activation": "gelu"})))


def test_published_configs_are_read_by_name(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    by_name = read_architecture("qwen2-1.5b")
    by_file = read_architecture(str(CONFIGS / "qwen2-1.5b.json"))
    assert (by_name.n_layers, by_name.hidden_size, by_name.total_params) == (
        by_file.n_layers, by_file.hidden_size, by_file.total_params,
    )  # fmt: skip
    assert set(architecture.PUBLISHED) >= {"glm-130b", "llama-2-70b", "qwen2-0.5b"}
    own = tmp_path / "qwen2-1.5b"  # a user's own folder of that name wins over the shipped file
    own.mkdir()
    (own / "config.json").write_text((CONFIGS / "qwen2-0.5b.json").read_text())
    monkeypatch.chdir(tmp_path)
    assert read_architecture("qwen2-1.5b").n_layers == 24
