"""Compressed layers through a model's casts and moves (``.half()``, ``.float()``,
``.to(device, dtype)``, ...): the buffers keep their format's dtypes (nothing is rounded, the
kernels still take them), the output follows the input's dtype, and whole compressed models,
built or loaded, still generate."""

from __future__ import annotations

import copy
import itertools
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from kiln.compress import Int4WeightOnly, Int8WeightOnly, quantize_
from kiln.compress.checkpoint import load_compressed, save_compressed
from kiln.compress.configs import CompressionConfig, LowRank, SemiStructured24
from kiln.compress.layer import compress_linear
from kiln.compress.modules import CompressedLinear, Int4Linear, Int8Linear
from kiln.llm.generate import EagerDecoder, Generation, generate
from kiln.models.load import load_model
from kiln.models.transformer import Transformer
from tests.support.compare import assert_close_to_reference, assert_equal
from tests.support.models import DECODE_LLAMA, tiny_transformer

CONFIGS = [
    Int8WeightOnly(),
    Int4WeightOnly(group_size=64),
    Int4WeightOnly(group_size=32, symmetric=False),
    SemiStructured24(),
    LowRank(rank=8),
]

# max error / max |reference| for the layer against its dequantized weight in plain torch.
# The reference rounds the weight to the dtype (about 2x below these bounds, measured); in
# fp64 the INT8 / INT4 kernels still compute in fp32.
TOLERANCE = {
    torch.float32: 2e-5,
    torch.float64: 2e-5,
    torch.float16: 2e-3,
    torch.bfloat16: 2e-2,
}

Call = Callable[[nn.Module], nn.Module]
M = TypeVar("M", bound=nn.Module)
# A module-wide call and the dtype its model then computes in.
CALLS: dict[str, tuple[Call, torch.dtype]] = {
    "float": (lambda m: m.float(), torch.float32),
    "half": (lambda m: m.half(), torch.float16),
    "bfloat16": (lambda m: m.bfloat16(), torch.bfloat16),
    "double": (lambda m: m.double(), torch.float64),
    "to-fp16": (lambda m: m.to(torch.float16), torch.float16),
    "to-cpu": (lambda m: m.to("cpu"), torch.float32),
    "to-cpu-bf16": (lambda m: m.to("cpu", torch.bfloat16), torch.bfloat16),
    "half-then-float": (lambda m: m.half().float(), torch.float32),
    "bf16-then-double": (lambda m: m.bfloat16().double(), torch.float64),
}


def layer(config: CompressionConfig, seed: int = 0) -> CompressedLinear:
    """A compressed (128 -> 96) linear layer with a bias."""
    torch.manual_seed(seed)
    return compress_linear(nn.Linear(128, 96), config)


def stored(module: nn.Module) -> dict[str, Tensor]:
    """Copies of the module's stored tensors (what a checkpoint holds)."""
    return {name: t.detach().clone() for name, t in module.state_dict().items()}


def assert_stored_equal(module: nn.Module, before: dict[str, Tensor]) -> None:
    """Every stored tensor of ``module`` is bitwise ``before``'s: same dtype, same values."""
    now = module.state_dict()
    assert list(now) == list(before)
    for name, t in before.items():
        assert_equal(now[name].cpu(), t.cpu())


def dequantized_reference(q: CompressedLinear, x: Tensor) -> Tensor:
    """The layer's dequantized weight and bias applied with plain torch in x's dtype."""
    bias = None if q.bias is None else q.bias.to(x.dtype)
    return F.linear(x, q.dense_weight().to(x.device, x.dtype), bias)


@pytest.mark.parametrize("call", list(CALLS))
@pytest.mark.parametrize("config", CONFIGS, ids=lambda c: c.name)
def test_cast_keeps_buffers_and_output_follows_dtype(config: CompressionConfig, call: str) -> None:
    apply, dtype = CALLS[call]
    q = layer(config)
    before, nbytes = stored(q), q.nbytes()
    assert apply(q) is q  # in place, as nn.Module's calls are
    assert_stored_equal(q, before)
    assert q.nbytes() == nbytes
    assert q.compute_dtype == dtype
    for rows in (1, 5):
        x = torch.randn(rows, 128, dtype=dtype)
        with torch.no_grad():
            y = q(x)
        assert y.dtype == dtype
        assert_close_to_reference(y, dequantized_reference(q, x), TOLERANCE[dtype])


@pytest.mark.parametrize("config", CONFIGS, ids=lambda c: c.name)
def test_round_trips_lose_nothing(config: CompressionConfig) -> None:
    """Through half and bf16 and back, the layer computes exactly what it did."""
    q = layer(config)
    fresh = copy.deepcopy(q)
    q.half().bfloat16().double().to(torch.float32)
    x = torch.randn(4, 128)
    with torch.no_grad():
        assert_equal(q(x), fresh(x))


@pytest.mark.parametrize("config", CONFIGS, ids=lambda c: c.name)
def test_moves_carry_every_buffer_with_its_dtype(config: CompressionConfig) -> None:
    q = layer(config)
    dtypes = {name: t.dtype for name, t in q.state_dict().items()}
    q.to("meta", torch.float16)
    assert {name: (t.device.type, t.dtype) for name, t in q.state_dict().items()} == {
        name: ("meta", d) for name, d in dtypes.items()
    }
    assert q.compute_dtype == torch.float16
    q.to_empty(device="cpu")  # and back: new (uninitialised) storage, the same dtypes
    assert {name: (t.device.type, t.dtype) for name, t in q.state_dict().items()} == {
        name: ("cpu", d) for name, d in dtypes.items()
    }
    assert q.compute_dtype == torch.float16


@pytest.mark.parametrize("config", CONFIGS, ids=lambda c: c.name)
def test_slices_compute_in_the_layers_dtype(config: CompressionConfig) -> None:
    q = layer(config).half()
    for part in (q.slice_rows(16, 48), q.slice_cols(0, 64)):
        assert part.compute_dtype == torch.float16
        x = torch.randn(3, part.in_features, dtype=torch.float16)
        with torch.no_grad():
            y = part(x)
        assert_close_to_reference(y, dequantized_reference(part, x), TOLERANCE[torch.float16])


@pytest.mark.filterwarnings("ignore:Complex modules are a new feature")
@pytest.mark.parametrize("cast", ["complex64", "int32"])
def test_non_floating_casts_are_refused(cast: str) -> None:
    q = layer(Int8WeightOnly())
    before = stored(q)
    with pytest.raises(TypeError, match="Int8Linear computes in one of"):
        if cast == "complex64":
            q.to(torch.complex64)
        else:
            q.type(torch.int32)
    assert_stored_equal(q, before)
    assert q.compute_dtype == torch.float32


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("config", CONFIGS, ids=lambda c: c.name)
def test_cuda_moves_with_a_cast(config: CompressionConfig) -> None:
    """``.to("cuda", fp16)`` moves every buffer, keeps its dtype, and the layer runs its
    CUDA kernel; back on the CPU in fp32 it computes exactly what it did before."""
    q = layer(config)
    fresh, before = copy.deepcopy(q), stored(q)
    q.to("cuda", torch.float16)
    assert all(t.is_cuda for t in q.state_dict().values())
    assert_stored_equal(q, before)
    for dtype in (torch.float16, torch.bfloat16, torch.float32):
        q.to(dtype)
        x = torch.randn(8, 128, dtype=dtype, device="cuda")
        with torch.no_grad():
            y = q(x)
        assert y.dtype == dtype and y.is_cuda
        # on a GPU the fp32 reference is TF32-free but the Triton kernels reorder sums
        tol = max(TOLERANCE[dtype], 1e-4)
        assert_close_to_reference(y, dequantized_reference(q, x), tol)
    q.to("cpu", torch.float32)
    x = torch.randn(4, 128)
    with torch.no_grad():
        assert_equal(q(x), fresh(x))


# ------------------------------------------------------------------ whole models
def rounded_through_fp16(model: M) -> M:
    """A copy of ``model`` whose floating tensors outside the compressed layers went through
    fp16 and back, as ``.half().float()`` does to an ordinary module (the reference for the
    same calls on ``model``: its compressed layers must come back untouched)."""
    reference = copy.deepcopy(model)
    with torch.no_grad():
        for module in reference.modules():
            if isinstance(module, CompressedLinear):
                continue
            own = itertools.chain(module.parameters(recurse=False), module.buffers(recurse=False))
            for t in own:
                if t.is_floating_point():
                    t.copy_(t.half().float())
    return reference


def generated(model: Transformer, prompt: Tensor, steps: int = 6) -> Generation:
    """``steps`` greedy tokens after ``prompt`` (1, T), with the logits they came from."""
    return generate(
        EagerDecoder(model, 1, prompt.shape[1] + steps), prompt, steps, keep_logits=True
    )


def assert_generates_through_half_and_back(model: Transformer, prompt: Tensor) -> None:
    """``model.half()`` generates what the fp32 model does (within fp16 accuracy), and after
    ``.float()`` exactly what the same model with only its plain tensors rounded does."""
    compressed = [m for m in model.modules() if isinstance(m, CompressedLinear)]
    assert compressed
    reference = rounded_through_fp16(model)  # (before a forward caches kernels: no deepcopy)
    kept, expected = [stored(m) for m in compressed], generated(model, prompt)

    model.half()
    assert all(m.compute_dtype == torch.float16 for m in compressed)
    for m, before in zip(compressed, kept, strict=True):
        assert_stored_equal(m, before)
    half = generated(model, prompt)
    assert half.tokens.shape == expected.tokens.shape
    assert half.logits is not None and expected.logits is not None
    assert_close_to_reference(half.logits, expected.logits, 1e-2)

    model.float()
    for m, before in zip(compressed, kept, strict=True):
        assert_stored_equal(m, before)
    back, rounded = generated(model, prompt), generated(reference, prompt)
    assert_equal(back.tokens, rounded.tokens)
    assert_close_to_reference(back.logits, rounded.logits, TOLERANCE[torch.float32])


@pytest.mark.parametrize(
    "config", [Int8WeightOnly(), Int4WeightOnly(group_size=32)], ids=lambda c: c.name
)
def test_compressed_transformer_generates_after_half_then_float(
    config: CompressionConfig,
) -> None:
    model = tiny_transformer(DECODE_LLAMA, init="varied", compression=config)
    prompt = torch.randint(0, DECODE_LLAMA.vocab_size, (1, 5))
    assert_generates_through_half_and_back(model, prompt)


def saved_checkpoint(folder: Path) -> None:
    """A random HF llama with INT4 MLPs and INT8 attention, written by save_compressed
    (as tests/models/test_compressed_load.py builds one)."""
    from tests.models.families import random_model

    model = random_model("llama")
    quantize_(model, Int4WeightOnly(group_size=32), filter_fn=lambda m, n: "mlp" in n)
    quantize_(model, Int8WeightOnly(), filter_fn=lambda m, n: "self_attn" in n)
    save_compressed(model, folder, auto_class="AutoModelForCausalLM")


def test_loaded_checkpoint_generates_after_half_then_float(tmp_path: Path) -> None:
    """kiln's Transformer read from a compressed checkpoint (``kiln.models.compressed``)."""
    saved_checkpoint(tmp_path)
    model = load_model(tmp_path, with_tokenizer=False).model
    assert isinstance(model.get_submodule("layers.0.mlp.up"), Int4Linear)
    assert isinstance(model.get_submodule("layers.0.attn.k"), Int8Linear)
    assert_generates_through_half_and_back(model, torch.randint(0, 256, (1, 5)))


def test_load_compressed_model_runs_after_half_then_float(tmp_path: Path) -> None:
    """The Hugging Face model ``load_compressed`` rebuilds, through the same calls."""
    saved_checkpoint(tmp_path)
    model, _ = load_compressed(tmp_path)
    reference = rounded_through_fp16(model)
    tokens = torch.randint(0, 256, (1, 7))
    with torch.no_grad():
        expected = model(tokens).logits
        half = model.half()(tokens).logits
        assert half.dtype == torch.float16
        assert_close_to_reference(half.float(), expected, 1e-2)
        back = model.float()(tokens).logits
        assert_close_to_reference(back, reference(tokens).logits, TOLERANCE[torch.float32])
