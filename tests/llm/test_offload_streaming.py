"""Loading straight into an offload store: each block is written to the store as soon as
it is read and released, so the model computes what the resident load computes while its
blocks are never all in memory — peak resident memory, measured in a fresh process,
stays far below the full load's.

The reference is the same checkpoint loaded resident (``load_model``), optionally
quantized after loading; logits agree to float32 rounding (1e-6 of the largest: the
resident tensors are views of the mapped file, at other alignments than the store's).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from kiln.compress import Int8WeightOnly, quantize_
from kiln.llm.offload import StreamToStore, load_offloaded
from kiln.llm.offload_store import block_state, read_store
from kiln.models.load import load_model
from kiln.models.parts import quantize_blocks
from tests.models.families import kiln_greedy, write_checkpoint
from tests.support.compare import assert_close_to_reference

REPO = Path(__file__).resolve().parents[2]
PROMPT = torch.tensor([[3, 17, 200, 41, 9, 250, 77]])


@pytest.mark.parametrize("family", ["llama", "qwen2"])  # untied head; tied head
def test_streamed_offload_computes_what_the_resident_model_computes(
    family: str, tmp_path: Path
) -> None:
    path = write_checkpoint(family, tmp_path / "ckpt")
    resident = load_model(path, with_tokenizer=False).model
    loaded, handle = load_offloaded(path, tmp_path / "store", with_tokenizer=False)
    model = loaded.model
    for block in model.layers:  # nothing of a block stays in the model
        assert all(t.is_meta for t in block_state(block).values())
    assert len(read_store(tmp_path / "store")) == resident.cfg.n_layers
    logits, tokens = kiln_greedy(model, PROMPT, 4)
    ref_logits, ref_tokens = kiln_greedy(resident, PROMPT, 4)
    assert torch.equal(tokens, ref_tokens)
    assert_close_to_reference(logits, ref_logits, 1e-6)
    handle.close()


def test_blocks_quantized_while_loading_are_stored_quantized(tmp_path: Path) -> None:
    path = write_checkpoint("llama", tmp_path / "ckpt")
    resident = load_model(path, with_tokenizer=False).model
    quantize_(resident, Int8WeightOnly(), filter_fn=lambda _m, name: name.startswith("layers."))
    loaded, handle = load_offloaded(
        path, tmp_path / "store", with_tokenizer=False, on_block=quantize_blocks(Int8WeightOnly())
    )
    names = {t.name for t in read_store(tmp_path / "store")[0].tensors}
    assert {"attn.q.qweight", "attn.q.scale", "mlp.down.qweight"} <= names
    logits, _ = kiln_greedy(loaded.model, PROMPT, 4)
    assert_close_to_reference(logits, kiln_greedy(resident, PROMPT, 4)[0], 1e-6)
    handle.close()


def test_blocks_must_come_in_order(tmp_path: Path) -> None:
    model = load_model(write_checkpoint("llama", tmp_path / "ckpt"), with_tokenizer=False).model
    sink = StreamToStore(tmp_path / "store")
    with pytest.raises(ValueError, match="block 1 came after 0 blocks"):
        sink(1, model.layers[1])
    sink.close()
    with pytest.raises(FileNotFoundError, match="not a \\(completely written\\) store"):
        read_store(tmp_path / "store")  # no manifest: a half-written store is refused


# 24 blocks of 16.8 MB (hidden 512, MLP 2048), fp32: ~400 MB of block weights.
LAYERS, HIDDEN, MLP, VOCAB = 24, 512, 2048, 512
MEMORY_SCRIPT = """
import json, re, sys
from pathlib import Path
import torch
from kiln.llm.offload import load_offloaded
from kiln.models.load import load_model

def status(key):
    return int(re.search(key + r":\\s+(\\d+) kB", Path("/proc/self/status").read_text())[1]) * 1024

folder, mode, store = sys.argv[1:]
torch.set_num_threads(1)
before = status("VmRSS")
if mode == "full":
    model = load_model(folder, with_tokenizer=False).model
else:
    model = load_offloaded(folder, store, with_tokenizer=False)[0].model
with torch.no_grad():
    model(torch.tensor([[1, 2, 3]]), 0, model.new_cache(1, 4))  # every weight is used
print(json.dumps({"peak_increase": status("VmHWM") - before}))
"""


def write_large_llama(folder: Path) -> int:
    """A random fp32 Llama of LAYERS blocks in HF layout; returns its block bytes."""
    from safetensors.torch import save_file

    folder.mkdir()
    config = {
        "model_type": "llama", "hidden_size": HIDDEN, "num_hidden_layers": LAYERS,
        "num_attention_heads": 8, "num_key_value_heads": 8, "intermediate_size": MLP,
        "vocab_size": VOCAB, "max_position_embeddings": 64, "rms_norm_eps": 1e-5,
        "hidden_act": "silu", "tie_word_embeddings": False,
    }  # fmt: skip
    (folder / "config.json").write_text(json.dumps(config))
    g = torch.Generator().manual_seed(0)
    shapes = {"self_attn.q_proj": (HIDDEN, HIDDEN), "self_attn.k_proj": (HIDDEN, HIDDEN),
              "self_attn.v_proj": (HIDDEN, HIDDEN), "self_attn.o_proj": (HIDDEN, HIDDEN),
              "mlp.gate_proj": (MLP, HIDDEN), "mlp.up_proj": (MLP, HIDDEN),
              "mlp.down_proj": (HIDDEN, MLP)}  # fmt: skip
    tensors = {
        "model.embed_tokens.weight": torch.randn(VOCAB, HIDDEN, generator=g),
        "model.norm.weight": torch.ones(HIDDEN), "lm_head.weight": torch.randn(VOCAB, HIDDEN),
    }  # fmt: skip
    block_bytes = 0
    for i in range(LAYERS):
        p = f"model.layers.{i}."
        for name, shape in shapes.items():
            tensors[p + name + ".weight"] = torch.randn(shape, generator=g) * 0.02
            block_bytes += 4 * shape[0] * shape[1]
        tensors[p + "input_layernorm.weight"] = torch.ones(HIDDEN)
        tensors[p + "post_attention_layernorm.weight"] = torch.ones(HIDDEN)
    save_file(tensors, folder / "model.safetensors")
    return block_bytes


@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="needs Linux /proc")
def test_peak_memory_of_a_streamed_offloaded_load_stays_far_below_the_full_load(
    tmp_path: Path,
) -> None:
    """Each load and one forward in a fresh process: the full load's peak grows by all the
    block weights (its tensors are the mapped file's pages, all touched by the forward);
    the streamed offload's by one block being read, two staging buffers and the
    embedding and head (~2 MB here), not by the model."""
    block_bytes = write_large_llama(tmp_path / "ckpt")
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    peaks = {}
    for mode in ("full", "streamed"):
        proc = subprocess.run(
            [sys.executable, "-c", MEMORY_SCRIPT, str(tmp_path / "ckpt"), mode,
             str(tmp_path / "store")],
            cwd=REPO, env=env, capture_output=True, text=True, timeout=120,
        )  # fmt: skip
        assert proc.returncode == 0, proc.stderr
        peaks[mode] = json.loads(proc.stdout.strip().splitlines()[-1])["peak_increase"]
    print({"block_bytes": block_bytes, **peaks})
    assert peaks["full"] > 0.9 * block_bytes, peaks
    assert peaks["streamed"] < 0.2 * block_bytes, peaks
