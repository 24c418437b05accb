"""kiln generate and kiln run: generate text with a language model checkpoint, timed.

The two commands share their options (declared once below as annotated types) and their
rendering; run is generate on tensor- and pipeline-parallel ranks (eager stages).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Annotated, Any

import typer

from kiln.cli._console import console, refused

if TYPE_CHECKING:
    from kiln.deploy.generate_job import GenerateRequest

Checkpoint = Annotated[str, typer.Argument(help="smollm2 | a .gguf file | a Hugging Face folder")]
Prompt = Annotated[str, typer.Option(help="text to continue")]
MaxNewTokens = Annotated[int, typer.Option("--max-new-tokens", "-n", help="tokens to generate")]
Temperature = Annotated[float, typer.Option(help="0 = greedy; > 0 samples")]
TopK = Annotated[int | None, typer.Option(help="sample among the k likeliest tokens")]
TopP = Annotated[float | None, typer.Option(help="sample within this much probability mass")]
Seed = Annotated[int | None, typer.Option(help="seed for sampling")]
Dtype = Annotated[str, typer.Option(help="float32 | bfloat16 | float16")]
Engine = Annotated[str, typer.Option(help="auto | fast (C++ decode step) | eager")]
Unpacked = Annotated[bool, typer.Option(help="dequantize a GGUF's quantized layers to float")]
GgufActivations = Annotated[str, typer.Option(
    "--gguf-activations",
    help="packed GGUF layers: int8 (default: activations quantized to 8-bit blocks of 32 "
    "and integer dot products, llama.cpp's arithmetic, at decode (~2x faster) and in prefill "
    "where the CPU has AVX-512 VNNI (2-2.8x faster GEMMs); logits move by ~1% of their "
    "range) | fp32 (exact: the dequantized model's results)",
)]  # fmt: skip
Head = Annotated[str, typer.Option(
    help="auto (INT8 when layers are compressed; a GGUF's quantized head as stored) | fp32 | int8"
)]  # fmt: skip
Tp = Annotated[int, typer.Option(help="tensor-parallel ranks")]
Pp = Annotated[int, typer.Option(help="pipeline stages")]
Split = Annotated[str, typer.Option(help="layers per pipeline stage, e.g. 16,14 (default: even)")]
Microbatches = Annotated[int, typer.Option(help="pipeline micro-batches")]
Offload = Annotated[
    str | None, typer.Option(help="folder: stream block weights from disk through it")
]
Chat = Annotated[bool, typer.Option(help="wrap the prompt in the tokenizer's chat template")]
Speculate = Annotated[
    int,
    typer.Option(
        help="K > 0: an INT8 copy guesses K tokens a round, the model checks them in one step "
        "(same greedy text, or the same distribution when sampling; float weights: --unpacked "
        "for a GGUF)"
    ),
]
Nnodes = Annotated[int, typer.Option(help="machines (> 1: print the torchrun line to run)")]
RdzvEndpoint = Annotated[str, typer.Option(help="HOST:PORT every machine reaches")]


def generate(
    checkpoint: Checkpoint = "smollm2", prompt: Prompt = "Once upon a time",
    max_new_tokens: MaxNewTokens = 64, temperature: Temperature = 0.0, top_k: TopK = None,
    top_p: TopP = None, seed: Seed = None, dtype: Dtype = "float32", engine: Engine = "auto",
    unpacked: Unpacked = False, head: Head = "auto", tp: Tp = 1, pp: Pp = 1, split: Split = "",
    microbatches: Microbatches = 1, offload: Offload = None, chat: Chat = False,
    speculate: Speculate = 0, gguf_activations: GgufActivations = "int8",
) -> None:  # fmt: skip
    """Generate text from CHECKPOINT and print it with its timing: load time, time to first
    token, per-token latency, tokens/s and the share of memory bandwidth the weights took.

    One process runs kiln's fast C++ decode step when it can (else the eager model, saying
    why); --speculate K decodes with an INT8 draft whose guesses are checked K at a time;
    --offload streams each block's weights from disk; --tp/--pp start ranks as kiln run
    does. A GGUF's quantized layers (and a tied table stored quantized, as the head) stay
    packed unless --unpacked; they multiply 8-bit activation blocks unless
    --gguf-activations fp32."""
    from kiln.deploy import parse
    from kiln.deploy.generate_job import GenerateRequest
    from kiln.llm.generate import Sampling

    with refused():
        request = GenerateRequest(
            checkpoint=checkpoint, prompt=prompt, max_new_tokens=max_new_tokens,
            sampling=Sampling(temperature=temperature, top_k=top_k, top_p=top_p, seed=seed),
            dtype=dtype, packed=not unpacked, head=head, engine=engine, tp=tp, pp=pp,
            split=parse.layer_split(split), microbatches=microbatches, offload=offload,
            chat=chat, speculate=speculate, gguf_activations=gguf_activations,
        )  # fmt: skip
    _show_generation(request)


def run(
    checkpoint: Checkpoint = "smollm2", prompt: Prompt = "Once upon a time",
    max_new_tokens: MaxNewTokens = 64, temperature: Temperature = 0.0, top_k: TopK = None,
    top_p: TopP = None, seed: Seed = None, dtype: Dtype = "float32", unpacked: Unpacked = False,
    head: Head = "auto", tp: Tp = 2, pp: Pp = 1, split: Split = "",
    microbatches: Microbatches = 1, chat: Chat = False, nnodes: Nnodes = 1,
    rdzv_endpoint: RdzvEndpoint = "", gguf_activations: GgufActivations = "int8",
) -> None:  # fmt: skip
    """Generation on tp x pp ranks through torch.distributed (gloo on CPU, NCCL on GPUs):
    tensor-parallel shards inside pipeline stages, greedy or sampled exactly as one process
    would (every rank draws from the same seeded stream). On one machine kiln starts the
    ranks itself and stops the whole job, naming the rank, if one dies or hangs.

    CHECKPOINT may be a plan written by `kiln plan --out plan.json`: the plan is executed as
    it says (its checkpoint, weight format, ranks and stage split, disk offload through a
    temporary store); --tp/--pp/--split/--dtype are then the plan's.

    Several machines: with --nnodes N --rdzv-endpoint HOST:PORT this prints the torchrun
    line to start on every machine; under torchrun kiln uses its ranks instead of starting
    its own."""
    if nnodes > 1:
        from kiln.deploy.multinode import torchrun_line

        with refused():
            line = torchrun_line(
                checkpoint=checkpoint, prompt=prompt, max_new_tokens=max_new_tokens, tp=tp,
                pp=pp, nnodes=nnodes, rdzv_endpoint=rdzv_endpoint,
            )  # fmt: skip
        console.print(" ".join(repr(a) if " " in a else a for a in line), markup=False)
        return
    from kiln.deploy import parse
    from kiln.deploy.generate_job import GenerateRequest
    from kiln.llm.generate import Sampling

    sampling = Sampling(temperature=temperature, top_k=top_k, top_p=top_p, seed=seed)
    if checkpoint.endswith(".json"):
        _run_plan(checkpoint, prompt, max_new_tokens, sampling, chat)
        return
    with refused():
        request = GenerateRequest(
            checkpoint=checkpoint, prompt=prompt, max_new_tokens=max_new_tokens, dtype=dtype,
            sampling=sampling, packed=not unpacked, head=head, engine="eager", tp=tp, pp=pp,
            split=parse.layer_split(split), microbatches=microbatches, chat=chat,
            gguf_activations=gguf_activations,
        )  # fmt: skip
    _show_generation(request)


def _run_plan(path: str, prompt: str, max_new_tokens: int, sampling: Any, chat: bool) -> None:
    """Execute the plan file at ``path`` (``kiln plan --out``)."""
    import tempfile

    from kiln.deploy.mixed import shown
    from kiln.deploy.plan_job import request_from_plan
    from kiln.deploy.plan_schema import load_plan

    with tempfile.TemporaryDirectory(prefix="kiln-run-offload-") as store, refused():
        request = request_from_plan(load_plan(path), prompt, max_new_tokens, store,
                                    sampling=sampling, chat=chat)  # fmt: skip
        lay = (request.tp, request.pp, shown(request.weights or ""), request.offload is not None)
        console.print(f"[dim]plan {path}: tp {lay[0]}, pp {lay[1]}, weights {lay[2]}"
                      f"{', blocks streamed from disk' if lay[3] else ''}[/dim]")  # fmt: skip
        _show_generation(request)


def _show_generation(request: GenerateRequest) -> None:
    """Run ``request`` under a status line and print the text, notes and timings."""
    from kiln.deploy.bandwidth import weight_bandwidth
    from kiln.deploy.generate_job import generate_text

    try:
        with console.status("loading") as status:
            result = generate_text(request, progress=lambda text: status.update(text))
    except ValueError as err:  # a checkpoint or request kiln cannot run: say what, no trace
        console.print(f"[red]error:[/red] {err}", highlight=False)
        raise typer.Exit(2) from None
    gen = result.generation
    console.print(f"[bold]{request.prompt}[/bold]{result.text}", highlight=False)
    for note in result.notes:
        console.print(f"[dim]note: {note}[/dim]")
    bw = weight_bandwidth(result)
    console.print(
        f"[dim]{result.engine} · load {result.load_s:.1f} s · time to first token "
        f"{gen.ttft_s * 1e3:.0f} ms · {gen.per_token_s * 1e3:.1f} ms/token · "
        f"{gen.tokens_per_s:.1f} tokens/s · {gen.new_tokens} new tokens · weights "
        f"{result.weight_bytes / 1e6:.0f} MB/token = {bw.weights_gbs:.1f} GB/s, "
        f"{bw.share:.0%} of {bw.measured_gbs:.0f} GB/s measured[/dim]",
        highlight=False,
    )
