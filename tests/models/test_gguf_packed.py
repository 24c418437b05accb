"""A GGUF file mixing quantized types per tensor (as a Q4_K_M file does), written here with
the gguf package: with ``packed=True`` each linear weight is its own kernel's layer
(``GgufLinear`` of its type), a type kiln has no kernel for is dequantized with a logged
note, the tied Q8_0 embedding is also the head exactly as stored. On the exact path
(``activations="fp32"``) the logits match the dequantized-float load, eager and in the C++
decode step; on the default 8-bit activations they stay within a stated share of the
logits' range and keep the greedy tokens wherever the reference's top-2 margin exceeds
twice that."""

from __future__ import annotations

import logging
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from torch import nn
from typer.testing import CliRunner

from kiln.cli import app
from kiln.compress.gguf_linear import GgufLinear, set_activations_
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
            if kinds[i] == Q.TQ2_0:
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
    assert set_activations_(packed, "fp32") == 14  # every block linear but TQ2_0, the head
    floats = load_model(mixed, packed=False, with_tokenizer=False).model
    prompt = torch.randint(0, VOCAB, (1, 20), generator=torch.Generator().manual_seed(1))
    logits, tokens = kiln_greedy(packed, prompt, STEPS)  # prefill: GEMM; steps: kernels
    want, want_tokens = kiln_greedy(floats, prompt, STEPS)
    assert_close_to_reference(logits, want, rtol_to_max=1e-5)
    assert torch.equal(tokens, want_tokens)


@torch.inference_mode()
def _teacher_forced(model: nn.Module, seq: torch.Tensor, prompt: int) -> torch.Tensor:
    """Logits (T, V) of ``seq`` (T,): the first ``prompt`` tokens as one prefill (<= 15
    rows: the decode kernels), then one token per step."""
    cache = model.new_cache(1, len(seq))
    out = [model(seq[None, :prompt], 0, cache)[0]]
    out += [model(seq[None, t : t + 1], t, cache)[0] for t in range(prompt, len(seq))]
    return torch.cat(out)


GREEDY_STEPS = 24  # 8-bit activations: steps checked for the same greedy tokens
INT8_RTOL = 0.03  # max |logit error| / max |logit| on the 8-bit path (measured 0.010-0.017)


def test_8bit_activations_stay_close_to_the_dequantized_model(mixed: Path) -> None:
    """The default arithmetic quantizes each layer's input to int8 per block of 32 (d =
    max|x| / 127): an error of at most d / 2 per activation, carried through 2 layers and
    the head. Teacher-forced on the reference's own greedy sequence (both see the same
    tokens; a 12-token prompt, so the prefill runs the decode kernels too), every logit
    stays within ``INT8_RTOL`` of the logits' largest magnitude (measured 0.010 to 0.017 on
    12 prompts). Greedy decoding can only flip a token where the reference's top-1 leads
    its top-2 by less than about that error: on these random weights most prompts have such
    near-ties (10 of 12 had a smallest margin below 0.7x the max error, and 4 diverged
    there, as any change of arithmetic would). This prompt's smallest margin is 1.5x the
    max error, and all ``GREEDY_STEPS`` tokens agree."""
    packed = load_model(mixed, with_tokenizer=False).model
    floats = load_model(mixed, packed=False, with_tokenizer=False).model
    prompt = torch.randint(0, VOCAB, (1, 12), generator=torch.Generator().manual_seed(5))
    want_logits, want_tokens = kiln_greedy(floats, prompt, GREEDY_STEPS)
    seq = torch.cat((prompt[0], want_tokens[:-1]))
    got, want = _teacher_forced(packed, seq, 12), _teacher_forced(floats, seq, 12)
    err = float((got - want).abs().max())
    assert 0 < err <= INT8_RTOL * float(want.abs().max())  # not the exact path, close to it
    top2 = want_logits[11:].topk(2, dim=-1).values  # the greedy steps' top-2 logits
    assert float((top2[:, 0] - top2[:, 1]).min()) > err  # no near-tie on this prompt
    _, tokens = kiln_greedy(packed, prompt, GREEDY_STEPS)
    assert torch.equal(tokens, want_tokens)


@pytest.mark.parametrize("activations", ["fp32", "int8"])
def test_fast_decode_step_runs_the_blocks(mixed: Path, activations: str) -> None:
    """The C++ step against the eager model of the same arithmetic. fp32: the same results
    up to summation order (measured 4e-7 of the range). int8: each layer gives the eager
    layer's bits for the same input, but attention and norms sum in another order, so an
    activation can round to the neighbouring int8 step and the layers after it see another
    rounding error: the two differ by up to the 8-bit error itself (measured 0.007 of the
    range over 6 prompts), within ``INT8_RTOL``."""
    model = load_model(mixed, with_tokenizer=False).model
    model.layers[1].mlp.down = GgufLinear(  # TQ2_0 was dequantized: give the step all kinds
        torch.from_numpy(quantize(model.layers[1].mlp.down.weight.numpy(), Q.Q5_K)),
        int(Q.Q5_K), HIDDEN, None,
    )  # fmt: skip
    set_activations_(model, activations)
    dec = FastDecoder(model, batch=2, max_len=32, huge_pages=False)
    prompt = torch.randint(0, VOCAB, (2, 5), generator=torch.Generator().manual_seed(2))
    cache = model.new_cache(2, 32)
    tol = 1e-5 if activations == "fp32" else INT8_RTOL
    with torch.inference_mode():
        assert_close_to_reference(dec.prefill(prompt), model(prompt, 0, cache), rtol_to_max=tol)
        tok = prompt[:, -1]
        for pos in range(5, 9):
            want = model(tok.view(2, 1), pos, cache)[:, -1]
            assert_close_to_reference(dec.step(tok, pos), want, rtol_to_max=tol)
            tok = want.argmax(-1)


def test_activations_follow_slices_and_rebuild_the_kernel() -> None:
    raw = torch.from_numpy(quantize(np.random.default_rng(3).normal(size=(64, 256)), Q.Q4_K))
    layer = GgufLinear(raw, int(Q.Q4_K), 256, None)
    x = torch.randn(2, 256)
    assert layer.activations == "int8"
    fast = layer(x)
    layer.activations = "fp32"
    exact = torch.nn.functional.linear(x, layer.dense_weight())
    assert_close_to_reference(layer(x), exact, rtol_to_max=1e-5)  # the kernel was rebuilt
    assert not torch.equal(fast, layer(x))
    assert layer.slice_rows(0, 32).activations == layer.slice_cols(0, 256).activations == "fp32"
    with pytest.raises(ValueError, match="activations must be one of"):
        layer.activations = "int4"


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


def test_generate_request_picks_the_gguf_arithmetic(mixed: Path) -> None:
    """``kiln generate --gguf-activations``: the request sets every GGUF layer's arithmetic
    (int8 by default, said so in --help); another value is refused."""
    loaded = load_model(mixed, with_tokenizer=False)
    layers = [m for m in loaded.model.modules() if isinstance(m, GgufLinear)]
    assert {m.activations for m in layers} == {"int8"}
    prepare(loaded, GenerateRequest(checkpoint=str(mixed), prompt="", gguf_activations="fp32"))
    assert {m.activations for m in layers} == {"fp32"}
    with pytest.raises(ValueError, match="gguf_activations must be one of"):
        GenerateRequest(checkpoint=str(mixed), prompt="", gguf_activations="bf16")
    text = CliRunner().invoke(app, ["generate", "--help"], env={"COLUMNS": "200"}).output
    assert "--gguf-activations" in text and "int8 (default" in text
