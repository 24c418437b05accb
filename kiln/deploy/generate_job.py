"""Generating text with a loaded checkpoint: the library behind ``kiln generate``/``kiln run``.

One request names the checkpoint, the prompt and how to run it; ``generate_text`` picks
the path and reports what it did:
  - ``tp * pp > 1``: ranks started by ``kiln.parallel.launch`` (gloo on CPU, NCCL on GPUs),
    tensor-parallel shards inside pipeline stages, greedy or sampled as in one process;
    each rank reads only its part of the checkpoint (``load_rank_part``) and this process
    only the config and tokenizer, so no process ever holds the whole model;
  - ``offload="disk"``: every block's weights streamed from a file one block ahead
    (``kiln.llm.offload``), run by the eager model; the blocks go into that file as they
    are loaded, so they are never all in memory;
  - ``speculate=k``: the fast step verifying k guesses a round of an INT8 copy of the model
    (``kiln.llm.speculative``): the same greedy text (sampled: the same distribution),
    fewer full weight reads;
  - otherwise the fast C++ decode step (``kiln.llm.fast_decoder.FastDecoder``) when it can run
    the model, else the eager model — the reason is reported, never hidden.
A packed GGUF (4-bit linear layers) gets an INT8 head by default: the tied fp32 head alone
would be read whole every step (113 MB on SmolLM2, more than all 4-bit layers together) —
unless the file stores the head (or the tied table) quantized, as SmolLM2's Q8_0 table: the
packed load then has that as the head, exactly as stored, and it is kept.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from typing import TYPE_CHECKING, Any

import torch

from kiln.compress.configs import Int8WeightOnly
from kiln.compress.gguf_linear import ACTIVATIONS, DEFAULT_ACTIVATIONS, GgufLinear, set_activations_
from kiln.compress.modules import CompressedLinear
from kiln.llm.generate import Decoder, EagerDecoder, Generation, Sampling, generate
from kiln.models.load import LoadedModel, load_model, open_checkpoint
from kiln.models.parts import BlockHook, chain
from kiln.models.transformer import Transformer

if TYPE_CHECKING:
    from kiln.parallel.mesh import PartOf, RankReport

ENGINES = ("auto", "fast", "eager")
HEADS = ("auto", "fp32", "int8")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(frozen=True, kw_only=True)
class GenerateRequest:
    """What to generate and how to run it."""

    checkpoint: str  # an HF folder, a .gguf file, or "smollm2"
    prompt: str
    max_new_tokens: int = 64
    sampling: Sampling = Sampling()
    dtype: str = "float32"
    packed: bool = True  # keep a GGUF's quantized layers packed (kiln's block kernels)
    # packed GGUF layers: "int8" activation blocks (llama.cpp's arithmetic, the
    # faster) or "fp32" (exact: the dequantized model's results); GgufLinear's module doc
    gguf_activations: str = DEFAULT_ACTIVATIONS
    head: str = "auto"  # HEADS; auto: INT8 head when the linear layers are compressed (a
    # GGUF head kept as stored stays); fp32: a float head (a GGUF's: its values dequantized)
    engine: str = "auto"  # ENGINES
    tp: int = 1
    pp: int = 1
    split: tuple[int, ...] | None = None  # layers per pipeline stage (default: even)
    microbatches: int = 1
    offload: str | None = None  # a folder: stream block weights from disk through it
    chat: bool = False  # wrap the prompt in the tokenizer's chat template
    timeout_s: float = 120.0  # parallel: longest stretch without progress on any rank
    speculate: int = 0  # > 0: guesses per round of an INT8 draft (float weights)
    weights: str | None = None  # a plan's weight format (``weights.store_in_format``)
    device: str = "cpu"  # where the model runs: "cpu", or "cuda" (a GPU plan: one device)

    def __post_init__(self) -> None:
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {self.dtype!r}")
        if self.head not in HEADS or self.engine not in ENGINES:
            raise ValueError(
                f"head must be one of {HEADS} and engine one of {ENGINES}, got "
                f"{self.head!r}, {self.engine!r}"
            )
        if self.gguf_activations not in ACTIVATIONS:
            raise ValueError(f"gguf_activations must be one of {ACTIVATIONS}, got "
                             f"{self.gguf_activations!r}")  # fmt: skip
        if self.tp < 1 or self.pp < 1:
            raise ValueError(f"tp and pp must be >= 1, got tp={self.tp}, pp={self.pp}")
        if self.parallel and self.offload:
            raise ValueError("offloading runs in one process: drop --offload or --tp/--pp")
        if self.device != "cpu" and (self.offload or self.speculate or self.parallel):
            raise ValueError(f"on {self.device} kiln runs one process with the weights in "
                             "device memory: no --offload, --speculate, --tp or --pp")  # fmt: skip
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if self.speculate < 0:
            raise ValueError(f"speculate must be >= 0 guesses, got {self.speculate}")
        if self.speculate and (self.parallel or self.offload or self.engine == "eager"):
            raise ValueError("speculative decoding runs the fast step in one process: drop "
                             "--speculate or --tp/--pp/--offload/--engine eager")  # fmt: skip

    @property
    def parallel(self) -> bool:
        return self.tp * self.pp > 1


@dataclass
class GenerateResult:
    """The text, the tokens and timings, and how they were produced."""

    text: str
    generation: Generation
    engine: str  # what ran, in words ("fast C++ decode step", "eager (reason)", ...)
    load_s: float
    weight_bytes: int  # bytes of weights one decode step reads (the tied head once more)
    notes: list[str] = field(default_factory=list)
    ranks: list[RankReport] = field(default_factory=list)  # parallel: each rank's report


def weight_bytes_per_token(model: Transformer) -> int:
    """Bytes of weights a decode step reads: every block and the head (a tied head is the
    embedding table, read whole again); the embedding lookup reads one row only."""
    blocks = sum(_tensor_bytes(layer) for layer in model.layers)
    norm = sum(p.numel() * p.element_size() for p in model.final_norm.parameters())
    return blocks + norm + _tensor_bytes(model.lm_head)


def _tensor_bytes(module: torch.nn.Module) -> int:
    tensors = [*module.parameters(), *module.buffers()]
    return sum(t.numel() * t.element_size() for t in tensors)


def prepare(loaded: LoadedModel, request: GenerateRequest) -> list[str]:
    """Apply the GGUF activations, the plan's weight format and the head option in place;
    return notes saying what changed."""
    model = loaded.model
    set_activations_(model, request.gguf_activations)
    if request.weights is not None:
        from kiln.deploy.mixed import shown
        from kiln.deploy.weights import store_in_format

        store_in_format(model, request.weights)
        return [f"block weights stored as {shown(request.weights)} (the plan's format)"]
    if request.head == "fp32" and isinstance(model.lm_head, GgufLinear):
        return [_float_head(model)]
    int8_head = request.head == "int8" or (request.head == "auto" and _compressed(model))
    if not int8_head or isinstance(model.lm_head, CompressedLinear):
        return []
    from kiln.llm.fast_decoder import quantize_head_

    quantize_head_(model, Int8WeightOnly())
    return ["head quantized to INT8 per channel (untied from the fp32 embedding table)"]


def _float_head(model: Transformer) -> str:
    """Replace a head kept as a GGUF's blocks by a float one of the same values: the fp32
    embedding table when tied (no new memory), else the dequantized weight."""
    head = model.lm_head
    assert isinstance(head, GgufLinear)
    dense = torch.nn.Linear(head.in_features, head.out_features, bias=False, device="meta")
    if model.cfg.tie_embeddings:
        dense.weight = model.embed.weight
        note = "head: the fp32 embedding table (tied), not the file's {} table"
    else:
        dense.weight = torch.nn.Parameter(head.dense_weight(), requires_grad=False)
        note = "head: the file's {} weight dequantized to fp32"
    model.lm_head = dense
    return note.format(head.type_name)


def _compressed(model: Transformer) -> bool:
    """Whether any block's linear layer is compressed (a packed GGUF, a kiln checkpoint)."""
    return any(isinstance(m, CompressedLinear) for m in model.layers.modules())


def encode_prompt(tokenizer: Any, prompt: str, chat: bool) -> torch.Tensor:
    """Prompt text -> token ids (1, T)."""
    if tokenizer is None:
        raise ValueError("this checkpoint has no tokenizer: kiln cannot encode a text prompt")
    if chat:
        messages = [{"role": "user", "content": prompt}]
        ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
        if not isinstance(ids, list):  # transformers 5 returns a BatchEncoding
            ids = ids["input_ids"]
    else:
        ids = tokenizer(prompt)["input_ids"]
    return torch.tensor([ids], dtype=torch.long)


def choose_decoder(
    model: Transformer, request: GenerateRequest, batch: int, max_len: int
) -> tuple[Decoder, str]:
    """A model on a GPU: its step as one CUDA graph. Else the fast C++ step when asked for
    (or ``auto`` and it can run the model), else eager."""
    if request.engine == "eager":
        return EagerDecoder(model, batch, max_len), "eager (asked for)"
    if next(model.parameters()).device.type == "cuda":
        from kiln.llm.graph_decoder import GraphDecoder

        return GraphDecoder(model, batch, max_len), "decode step as one CUDA graph"
    from kiln.llm.fast_decoder import DecodeUnsupported, FastDecoder

    try:
        return FastDecoder(model, batch, max_len), "fast C++ decode step"
    except DecodeUnsupported as err:
        if request.engine == "fast":
            raise
        return EagerDecoder(model, batch, max_len), f"eager (fast step unavailable: {err})"


def load_options(request: GenerateRequest) -> tuple[torch.dtype, BlockHook | None]:
    """The dtype to load in, and the per-block hook storing each block in the plan's
    weight format as soon as it is read (``weights.load_format``; None without a format):
    a quantized plan never holds its float blocks all at once. ``prepare`` then does the
    head."""
    if request.weights is None:
        return DTYPES[request.dtype], None
    from kiln.deploy.weights import load_format

    return load_format(request.weights, request.device)


def load_rank_part(request: GenerateRequest, part_of: PartOf) -> Transformer:
    """A rank's part of the model (what ``kiln.parallel.PartLoader`` calls; module-level,
    so picklable): only its stage's blocks and its tensor-parallel slices are read, straight
    to its device; the last stage, which holds the head, applies the head option."""
    checkpoint = open_checkpoint(request.checkpoint, request.packed)
    part = part_of(checkpoint.config)
    dtype, in_format = load_options(request)
    model = checkpoint.load(
        dtype, part.device, layers=part.layers, shard=part.shard,
        on_block=chain(part.on_block, in_format),
    )  # fmt: skip
    if part.last:
        prepare(LoadedModel(model, checkpoint.config, None, str(checkpoint.source)), request)
    return model


def generate_text(
    request: GenerateRequest, progress: Callable[[str], None] = lambda _: None
) -> GenerateResult:
    """Load, generate and time one request (see the module doc for the paths)."""
    t0 = time.perf_counter()
    progress(f"loading {request.checkpoint}")
    if request.parallel:
        return _generate_parallel(request, progress)
    dtype, in_format = load_options(request)
    if request.offload:
        from kiln.llm.offload import load_offloaded

        progress(f"loading {request.checkpoint} block by block into {request.offload}")
        loaded, _ = load_offloaded(
            request.checkpoint, request.offload, dtype, request.packed, on_block=in_format
        )
    else:
        loaded = load_model(request.checkpoint, dtype, request.packed, request.device,
                            on_block=in_format)  # fmt: skip
    notes = prepare(loaded, request)
    load_s = time.perf_counter() - t0
    prompt = encode_prompt(loaded.tokenizer, request.prompt, request.chat)
    max_len = prompt.shape[1] + request.max_new_tokens
    stops = loaded.config.eos_token_ids
    nbytes = weight_bytes_per_token(loaded.model)
    if request.speculate:
        gen, engine = _generate_speculative(loaded.model, request, prompt, stops, progress)
        notes.append("tokens/s and GB/s count emitted tokens: a round reads the INT8 draft "
                     "k times and the model once")  # fmt: skip
    else:
        if request.offload:
            decoder: Decoder = EagerDecoder(loaded.model, 1, max_len)
            engine = f"eager, block weights streamed from {request.offload}"
        else:
            decoder, engine = choose_decoder(loaded.model, request, 1, max_len)
        progress(f"generating with the {engine}")
        gen = generate(decoder, prompt, request.max_new_tokens, request.sampling, stops)
    tokenizer = loaded.tokenizer  # encode_prompt refused a checkpoint without one
    text = tokenizer.decode(gen.tokens[0].tolist(), skip_special_tokens=True) if tokenizer else ""
    return GenerateResult(text, gen, engine, load_s, nbytes, notes)


def _generate_parallel(request: GenerateRequest, progress: Callable[[str], None]) -> GenerateResult:
    """Generation on tp x pp ranks, each loading only its part; this process reads the
    config and tokenizer only. ``load_s`` is the slowest rank's load, ``weight_bytes``
    what all ranks read a step (replicated norms and heads once per rank holding them)."""
    from kiln.parallel.mesh import PartLoader, run_parallel_job

    checkpoint = open_checkpoint(request.checkpoint, request.packed)  # no weight read
    tokenizer = checkpoint.tokenizer()
    prompt = encode_prompt(tokenizer, request.prompt, request.chat)
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    progress(f"starting {request.tp * request.pp} ranks ({backend})")
    run = run_parallel_job(
        PartLoader(partial(load_rank_part, request)), prompt, request.max_new_tokens,
        request.tp, request.pp, request.split, request.microbatches, request.timeout_s,
        backend, sampling=request.sampling, stop_ids=checkpoint.config.eos_token_ids,
    )  # fmt: skip
    assert tokenizer is not None  # encode_prompt refused a checkpoint without one
    text = tokenizer.decode(run.generation.tokens[0].tolist(), skip_special_tokens=True)
    peaks = [f"{r.peak_rss_bytes / 1e6:.0f}" for r in run.ranks if r.peak_rss_bytes is not None]
    notes = [f"each rank read only its part; peak resident memory by rank: {' / '.join(peaks)} MB"]
    engine = f"tp={request.tp} x pp={request.pp} ranks ({backend}), eager stages"
    return GenerateResult(
        text, run.generation, engine, max(r.load_s for r in run.ranks),
        sum(r.weight_bytes for r in run.ranks), notes, run.ranks,
    )  # fmt: skip


def _generate_speculative(
    model: Transformer, request: GenerateRequest, prompt: torch.Tensor,
    stops: tuple[int, ...], progress: Callable[[str], None],
) -> tuple[Generation, str]:  # fmt: skip
    """``model``'s text (greedy or sampled as the request says) by ``SpeculativeDecoder``,
    with an INT8 copy of it as the draft."""
    from kiln.llm.fast_decoder import FastDecoder
    from kiln.llm.speculative import SpeculativeDecoder, quantized_draft

    if _compressed(model) or isinstance(model.lm_head, CompressedLinear):
        raise ValueError("--speculate drafts with an INT8 copy of float weights; this model is "
                         "already compressed (a packed GGUF: add --unpacked)")  # fmt: skip
    k, max_len = request.speculate, prompt.shape[1] + request.max_new_tokens
    progress("quantizing the INT8 draft")
    draft = FastDecoder(quantized_draft(model), 1, max_len)
    spec = SpeculativeDecoder(FastDecoder(model, 1, max_len, max_chunk=k + 1), draft, k)
    progress(f"generating: fast C++ step verifying {k} INT8 guesses a round")
    gen = generate(spec, prompt, request.max_new_tokens, request.sampling, stops)
    st = gen.speculation
    assert st is not None  # a MultiTokenDecoder's generation counts its rounds
    engine = (f"fast C++ decode step, speculative: {k} INT8-draft guesses a round, "
              f"{st.acceptance:.0%} accepted, {st.tokens_per_round:.2f} tokens a round")  # fmt: skip
    return gen, engine
