"""A GGUF file mixing quantized types per tensor (as a Q4_K_M file does), written here with
the gguf package: with ``packed=True`` each linear weight is its own kernel's layer
(``GgufLinear`` of its type, ``Int4Linear`` for Q4_0 / Q4_1), a type kiln has no kernel for
is dequantized with a logged note, the tied Q8_0 embedding is also the head exactly as
stored; the logits match the dequantized-float load, eager and in the C++ decode step."""

from __future__ import annotations

import logging
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from torch import nn

from kiln.compress.gguf_linear import GgufLinear
from kiln.compress.modules import Int4Linear
from kiln.deploy.generate_job import GenerateRequest, prepare
from kiln.llm.fast_decoder import FastDecoder
from kiln.models.load import load_model, open_checkpoint
from kiln.models.parts import LinearSlice
from tests.models.families import (
    kiln_greedy,
    llama_cpp_permute,
    one_thread,  # noqa: F401  (the fixture, used by name)
    tf,
)
from tests.support.compare import assert_close_to_reference
from tests.support.gguf_quants import quantize

Q = gguf.GGMLQuantizationType
pytestmark = pytest.mark.usefixtures("one_thread")
VOCAB, HIDDEN, STEPS = 256, 256, 6  # K-quant rows hold whole super-blocks of 256
# blk.{i}.<tensor>: its type in layer 0 and layer 1 (TQ2_0: no kiln kernel)
TYPES = {
    "attn_q": (Q.Q4_K, Q.Q6_K), "attn_k": (Q.Q5_K, Q.Q4_0), "attn_v": (Q.Q6_K, Q.Q8_0),
    "attn_output": (Q.Q8_0, Q.Q4_K), "ffn_gate": (Q.Q5_0, Q.Q4_1),
    "ffn_up": (Q.Q5_1, Q.Q5_K), "ffn_down": (Q.Q6_K, Q.TQ2_0),
}  # fmt: skip
HF_NAMES = {"attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj",
            "attn_v": "self_attn.v_proj", "attn_output": "self_attn.o_proj",
            "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj"}  # fmt: skip
KILN_NAMES = {"attn_q": "attn.q", "attn_k": "attn.k", "attn_v": "attn.v", "attn_output": "attn.o",
              "ffn_gate": "mlp.gate", "ffn_up": "mlp.up", "ffn_down": "mlp.down"}  # fmt: skip


def write_mixed_gguf(path: Path) -> Path:
    """A random 2-layer Llama (hidden 256, tied head) as llama.cpp writes one, each linear
    weight in its ``TYPES`` type, the embedding in Q8_0, norms in F32."""
    torch.manual_seed(0)
    cfg = tf.LlamaConfig(
        vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=HIDDEN, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
        tie_word_embeddings=True, rms_norm_eps=1e-5,
        rope_parameters={"rope_type": "default", "rope_theta": 50000.0},
    )  # fmt: skip
    model = tf.LlamaForCausalLM(cfg)
    sd = {k: v.detach().normal_(0.0, 0.1).numpy() for k, v in model.state_dict().items()}
    w = gguf.GGUFWriter(str(path), arch="llama")
    for add, value in ((w.add_context_length, 64), (w.add_embedding_length, HIDDEN),
                       (w.add_block_count, 2), (w.add_feed_forward_length, HIDDEN),
                       (w.add_head_count, 4), (w.add_head_count_kv, 2),
                       (w.add_rope_dimension_count, 64), (w.add_vocab_size, VOCAB)):  # fmt: skip
        add(value)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_rope_freq_base(50000.0)
    w.add_tensor("token_embd.weight", quantize(sd["model.embed_tokens.weight"], Q.Q8_0),
                 raw_dtype=Q.Q8_0)  # fmt: skip
    w.add_tensor("output_norm.weight", sd["model.norm.weight"])
    for i in range(2):
        p = f"model.layers.{i}."
        w.add_tensor(f"blk.{i}.attn_norm.weight", sd[p + "input_layernorm.weight"])
        w.add_tensor(f"blk.{i}.ffn_norm.weight", sd[p + "post_attention_layernorm.weight"])
        for name, kinds in TYPES.items():
            value = torch.from_numpy(sd[p + HF_NAMES[name] + ".weight"])
            if name in ("attn_q", "attn_k"):  # llama.cpp's row order for its rotary
                value = llama_cpp_permute(value, 4 if name == "attn_q" else 2)
            blocks = quantize(value.numpy(), kinds[i])
            w.add_tensor(f"blk.{i}.{name}.weight", blocks, raw_dtype=kinds[i])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.fixture(scope="module")
def mixed(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_mixed_gguf(tmp_path_factory.mktemp("gguf") / "mixed.gguf")


def test_each_tensor_keeps_its_type(mixed: Path, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="kiln.models.gguf"):
        model = load_model(mixed, with_tokenizer=False).model
    notes = [r.getMessage() for r in caplog.records]
    assert len(notes) == 1 and "1 linear weight(s) stored as TQ2_0" in notes[0]
    floats = load_model(mixed, packed=False, with_tokenizer=False).model
    for i in range(2):
        for name, kinds in TYPES.items():
            target = f"layers.{i}.{KILN_NAMES[name]}"
            layer, dense = model.get_submodule(target), floats.get_parameter(target + ".weight")
            if kinds[i] in (Q.Q4_0, Q.Q4_1):
                assert isinstance(layer, Int4Linear)
            elif kinds[i] == Q.TQ2_0:
                assert type(layer) is nn.Linear
                continue
            else:
                assert isinstance(layer, GgufLinear) and layer.ggml_type == kinds[i]
            assert torch.equal(layer.dense_weight(), dense)  # the file's values, rows in order
    head = model.lm_head
    assert isinstance(head, GgufLinear) and head.type_name == "Q8_0"
    reader = gguf.GGUFReader(mixed)
    stored = next(t for t in reader.tensors if t.name == "token_embd.weight")
    assert torch.equal(head.blocks, torch.from_numpy(np.array(stored.data)))  # as stored
    assert torch.equal(head.dense_weight(), model.embed.weight)  # the lookup: the same values
    assert floats.lm_head.weight is floats.embed.weight  # unpacked: tied as before


def test_logits_match_the_dequantized_model(mixed: Path) -> None:
    packed = load_model(mixed, with_tokenizer=False).model
    floats = load_model(mixed, packed=False, with_tokenizer=False).model
    prompt = torch.randint(0, VOCAB, (1, 20), generator=torch.Generator().manual_seed(1))
    logits, tokens = kiln_greedy(packed, prompt, STEPS)  # prefill: tiles; steps: kernels
    want, want_tokens = kiln_greedy(floats, prompt, STEPS)
    assert_close_to_reference(logits, want, rtol_to_max=1e-5)
    assert torch.equal(tokens, want_tokens)


def test_fast_decode_step_runs_the_blocks(mixed: Path) -> None:
    model = load_model(mixed, with_tokenizer=False).model
    model.layers[1].mlp.down = GgufLinear(  # TQ2_0 was dequantized: give the step all kinds
        torch.from_numpy(quantize(model.layers[1].mlp.down.weight.numpy(), Q.Q5_K)),
        int(Q.Q5_K), HIDDEN, None,
    )  # fmt: skip
    dec = FastDecoder(model, batch=2, max_len=32, huge_pages=False)
    prompt = torch.randint(0, VOCAB, (2, 5), generator=torch.Generator().manual_seed(2))
    cache = model.new_cache(2, 32)
    with torch.inference_mode():
        assert_close_to_reference(dec.prefill(prompt), model(prompt, 0, cache), rtol_to_max=1e-5)
        tok = prompt[:, -1]
        for pos in range(5, 9):
            want = model(tok.view(2, 1), pos, cache)[:, -1]
            assert_close_to_reference(dec.step(tok, pos), want, rtol_to_max=1e-5)
            tok = want.argmax(-1)


def test_shard_slices_blocks_or_falls_back_to_float_columns(mixed: Path) -> None:
    """A tensor-parallel part: row slices of packed layers stay packed; a column slice on
    block boundaries stays packed, one cutting K-quant super-blocks reads float columns."""
    shard = {"attn.q": LinearSlice("rows", 64, 192), "attn.o": LinearSlice("cols", 0, 128),
             "mlp.down": LinearSlice("cols", 0, 128)}  # fmt: skip
    part = open_checkpoint(mixed).load(layers=range(0, 1), shard=shard)
    full = load_model(mixed, packed=False, with_tokenizer=False).model
    q, o, down = (part.get_submodule(f"layers.0.{n}") for n in ("attn.q", "attn.o", "mlp.down"))
    assert isinstance(q, GgufLinear) and isinstance(o, GgufLinear)  # Q4_K rows, Q8_0 columns
    assert type(down) is nn.Linear  # Q6_K's super-blocks are 256 columns wide
    for layer, name, cut in ((q, "attn.q", (slice(64, 192),)), (o, "attn.o", (..., slice(0, 128))),
                             (down, "mlp.down", (..., slice(0, 128)))):  # fmt: skip
        want = full.get_parameter(f"layers.0.{name}.weight")[cut]
        got = layer.weight if isinstance(layer, nn.Linear) else layer.dense_weight()
        assert torch.equal(got, want)


@pytest.mark.parametrize("head", ["auto", "int8", "fp32"])
def test_generate_keeps_the_stored_head_unless_fp32_is_asked(mixed: Path, head: str) -> None:
    loaded = load_model(mixed, with_tokenizer=False)
    stored = loaded.model.lm_head
    notes = prepare(loaded, GenerateRequest(checkpoint=str(mixed), prompt="", head=head))
    if head != "fp32":  # the file's Q8_0 table is already an 8-bit head: kept
        assert loaded.model.lm_head is stored and notes == []
        return
    assert type(loaded.model.lm_head) is nn.Linear and "Q8_0" in notes[0]
    assert loaded.model.lm_head.weight is loaded.model.embed.weight  # tied again, same values
