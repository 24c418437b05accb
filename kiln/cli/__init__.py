"""The ``kiln`` command: a thin map from sub-command to library function.

kiln demo       compile the default model and race it against the peers
kiln compile    compile one suite model and print what kiln chose
kiln bench      the side-by-side benchmark suite
kiln calibrate  measure this machine's hardware profile
kiln compress   compress a language model (or encoder) to an accuracy budget
kiln generate   generate text with a language model checkpoint, timed
kiln run        the same on tensor- and pipeline-parallel ranks (torch.distributed)
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import typer
from rich.console import Console

app = typer.Typer(add_completion=False, no_args_is_help=True, help=__doc__)
console = Console()

ALL_CONTENDERS = "eager,inductor,ort,openvino,kiln"


@app.command()
def demo(
    model: str = typer.Option("", help="suite model (default: the built-in default model)"),
    rounds: int = typer.Option(3, help="interleaved timing rounds"),
    contenders: str = typer.Option(ALL_CONTENDERS, help="comma list of contenders"),
) -> None:
    """Compile the built-in default model with kiln, show the chosen kernels, then time
    it side by side with eager PyTorch, torch.compile, ONNX Runtime and OpenVINO (each
    in its own process) and print the table."""
    from kiln.bench.__main__ import main as bench_main
    from kiln.bench.suite import DEFAULT_MODEL

    name = model or DEFAULT_MODEL
    _compile_and_show(name, "blp", "native", profile=True)
    console.rule(f"side by side: {name}")
    bench_main(["--models", name, "--contenders", contenders, "--rounds", str(rounds),
                "--out", str(_scratch_results())])  # fmt: skip


@app.command(name="compile")
def compile_model(
    name: str = typer.Argument(..., help="suite model name (see `kiln bench --list`)"),
    solver: str = typer.Option("blp", help="blp (the binary linear program) or greedy"),
    executor: str = typer.Option("native", help="native (generated C++) or reference (ATen)"),
    profile: bool = typer.Option(False, help="time every kernel (measured column)"),
) -> None:
    """Compile one model of the benchmark suite and print the report and kernel table."""
    _compile_and_show(name, solver, executor, profile)


def _compile_and_show(name: str, solver: str, executor: str, profile: bool) -> None:
    import torch

    import kiln
    from kiln.bench.suite import get

    bm = get(name)
    with console.status(f"building {name} ({bm.config})"):
        model, inputs = bm.build()
    with console.status(f"compiling {name} with kiln"):
        compiled = kiln.compile(model, inputs, solver=solver, executor=executor)  # type: ignore[arg-type]
    if profile and executor == "native":
        from kiln.compiler.exec.profile import profile_kernels

        with console.status("profiling kernels"):
            profile_kernels(compiled, inputs)
    console.print(compiled.report.summary(), markup=False, highlight=False)
    console.print(compiled.report.kernel_table(), markup=False, highlight=False)
    with torch.no_grad():
        compiled(*inputs)


@app.command()
def bench(
    models: str = typer.Option("all", help="comma list of suite models, or 'all'"),
    contenders: str = typer.Option(ALL_CONTENDERS, help="comma list of contenders"),
    rounds: int = typer.Option(3, help="interleaved timing rounds"),
    readme: str = typer.Option("", help="README whose benchmark table to update"),
    list_models: bool = typer.Option(False, "--list", help="list the suite models and exit"),
) -> None:
    """Run the small-model suite side by side (BENCHMARKS.md protocol) and write
    results/<device>-<date>.json plus the markdown table."""
    from kiln.bench.__main__ import main as bench_main

    argv = ["--models", models, "--contenders", contenders, "--rounds", str(rounds)]
    if readme:
        argv += ["--readme", readme]
    if list_models:
        argv = ["--list"]
    raise typer.Exit(bench_main(argv))


@app.command()
def calibrate(threads: int = typer.Option(2, help="threads to calibrate for")) -> None:
    """Measure peak GFLOP/s, memory bandwidth and per-kernel fixed cost on this machine
    (cached; the cost model reads it)."""
    from kiln.core.calibrate import load_profile

    with console.status("calibrating"):
        profile = load_profile(threads=threads, refresh=True)
    console.print(profile)


@app.command()
def compress(
    checkpoint: str = typer.Argument(
        "smollm2", help="smollm2 | minilm | a .gguf file | a Hugging Face directory"
    ),
    max_ppl_increase: str = typer.Option(
        "1%", help="largest allowed perplexity increase on held-out text, e.g. 1% or 0.01"
    ),
    min_cosine: float = typer.Option(
        0.99, help="encoders: smallest allowed mean embedding cosine to the original"
    ),
    objective: str = typer.Option("size", help="size (bytes) or latency (measured per layer)"),
    out: str = typer.Option("compressed", help="output directory"),
    calib_samples: int = typer.Option(16, help="calibration windows of 512 tokens (Emma)"),
    eval_tokens: int = typer.Option(
        4096, help="held-out tokens of Pride and Prejudice (sentences for an encoder)"
    ),
    uniform: bool = typer.Option(True, help="also measure every option applied uniformly"),
    options: str = typer.Option(
        "",
        help="comma list of options to choose among (default: int8-gptq, int4-g128-gptq, "
        "int4-g64-gptq, int4-g32-gptq, 2:4-sparsegpt, lowrank-e0.3-aa)",
    ),  # fmt: skip
) -> None:
    """Compress CHECKPOINT's linear layers to the smallest mix of INT8 / INT4 (g32-128) /
    2:4 sparsity / low rank whose measured accuracy loss is within the budget.

    Calibrates on Emma (forward + backward), predicts every (layer, option)'s loss increase,
    picks one option per layer with an exact grouped knapsack, measures the result on
    Pride and Prejudice and tightens until it is within budget. Writes a checkpoint that
    `kiln.compress.load_compressed` reads back, report.md and frontier.png to --out.
    Needs the text (`make data`)."""
    from kiln.compress.configs import parse_config
    from kiln.compress.workflow import DEFAULT_OPTIONS
    from kiln.deploy.compress_job import run

    if objective not in ("size", "latency"):
        raise typer.BadParameter("--objective must be size or latency")
    try:
        configs = [parse_config(o) for o in options.split(",")] if options else DEFAULT_OPTIONS
    except ValueError as err:
        raise typer.BadParameter(str(err)) from None
    if not 0 < min_cosine < 1:
        raise typer.BadParameter(f"--min-cosine must be in (0, 1), got {min_cosine}")
    with _RichReporter() as reporter:
        result = run(
            checkpoint, _fraction(max_ppl_increase), encoder_max_increase=1.0 - min_cosine,
            objective="bytes" if objective == "size" else "latency",
            out_dir=Path(out), calib_samples=calib_samples, eval_size=eval_tokens,
            uniform=uniform, options=configs, reporter=reporter,
        )  # fmt: skip
    assert result.report is not None
    console.print(result.report.read_text().split("## Per layer")[0], markup=False)
    met = result.outcome.result.met
    console.print(
        f"{'within' if met else 'NOT within'} budget; wrote {out}/ (report.md, frontier.png)"
    )
    if not met:
        raise typer.Exit(1)


def _generate_options(
    checkpoint: str, prompt: str, max_new_tokens: int, temperature: float, top_k: int | None,
    top_p: float | None, seed: int | None, dtype: str, engine: str, unpacked: bool, head: str,
    tp: int, pp: int, split: str, microbatches: int, offload: str | None, chat: bool,
    speculate: int = 0,
) -> Any:  # fmt: skip
    from kiln.deploy.generate_job import GenerateRequest
    from kiln.llm.generate import Sampling

    try:
        stages = tuple(int(n) for n in split.split(",")) if split else None
        return GenerateRequest(
            checkpoint, prompt, max_new_tokens, Sampling(temperature, top_k, top_p, seed),
            dtype, not unpacked, head, engine, tp, pp, stages, microbatches,
            offload, chat, speculate=speculate,
        )  # fmt: skip
    except ValueError as err:
        raise typer.BadParameter(str(err)) from None


def _show_generation(request: Any) -> None:
    from kiln.core.calibrate import load_profile
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
    gbs = result.weight_bytes * gen.tokens_per_s / 1e9
    bandwidth = load_profile(threads=torch_threads()).mem_bw_gbs
    console.print(
        f"[dim]{result.engine} · load {result.load_s:.1f} s · time to first token "
        f"{gen.ttft_s * 1e3:.0f} ms · {gen.per_token_s * 1e3:.1f} ms/token · "
        f"{gen.tokens_per_s:.1f} tokens/s · {gen.new_tokens} new tokens · weights "
        f"{result.weight_bytes / 1e6:.0f} MB/token = {gbs:.1f} GB/s, "
        f"{gbs / bandwidth:.0%} of {bandwidth:.0f} GB/s measured[/dim]",
        highlight=False,
    )


def torch_threads() -> int:
    import torch

    return torch.get_num_threads()


_CKPT = typer.Argument("smollm2", help="smollm2 | a .gguf file | a Hugging Face folder")
_PROMPT = typer.Option("Once upon a time", help="text to continue")
_N = typer.Option(64, "--max-new-tokens", "-n", help="tokens to generate")
_TEMP = typer.Option(0.0, help="0 = greedy; > 0 samples")
_TOPK = typer.Option(None, help="sample among the k likeliest tokens")
_TOPP = typer.Option(None, help="sample within this much probability mass")
_SEED = typer.Option(None, help="seed for sampling")
_DTYPE = typer.Option("float32", help="float32 | bfloat16 | float16")
_ENGINE = typer.Option("auto", help="auto | fast (C++ decode step) | eager")
_UNPACKED = typer.Option(False, help="dequantize a GGUF's 4-bit layers to float")
_HEAD = typer.Option("auto", help="auto (INT8 when layers are compressed) | fp32 | int8")
_TP = typer.Option(1, help="tensor-parallel ranks")
_PP = typer.Option(1, help="pipeline stages")
_SPLIT = typer.Option("", help="layers per pipeline stage, e.g. 16,14 (default: even)")
_MB = typer.Option(1, help="pipeline micro-batches")
_OFFLOAD = typer.Option(None, help="folder: stream block weights from disk through it")
_CHAT = typer.Option(False, help="wrap the prompt in the tokenizer's chat template")
_SPEC = typer.Option(
    0,
    help="K > 0: an INT8 copy guesses K tokens a round, the model checks them in one step "
    "(same greedy text, or the same distribution when sampling; float weights: --unpacked for "
    "a GGUF)",
)


@app.command()
def generate(
    checkpoint: str = _CKPT, prompt: str = _PROMPT, max_new_tokens: int = _N,
    temperature: float = _TEMP, top_k: int | None = _TOPK, top_p: float | None = _TOPP,
    seed: int | None = _SEED, dtype: str = _DTYPE, engine: str = _ENGINE,
    unpacked: bool = _UNPACKED, head: str = _HEAD, tp: int = _TP, pp: int = _PP,
    split: str = _SPLIT, microbatches: int = _MB, offload: str | None = _OFFLOAD,
    chat: bool = _CHAT, speculate: int = _SPEC,
) -> None:  # fmt: skip
    """Generate text from CHECKPOINT and print it with its timing: load time, time to first
    token, per-token latency, tokens/s and the share of memory bandwidth the weights took.

    One process runs kiln's fast C++ decode step when it can (else the eager model, saying
    why); --speculate K decodes with an INT8 draft whose guesses are checked K at a time;
    --offload streams each block's weights from disk; --tp/--pp start ranks as `kiln run`
    does. A GGUF's 4-bit layers stay packed unless --unpacked."""
    _show_generation(
        _generate_options(
            checkpoint,
            prompt,
            max_new_tokens,
            temperature,
            top_k,
            top_p,
            seed,
            dtype,
            engine,
            unpacked,
            head,
            tp,
            pp,
            split,
            microbatches,
            offload,
            chat,
            speculate,
        )  # fmt: skip
    )


@app.command()
def run(
    checkpoint: str = _CKPT, prompt: str = _PROMPT, max_new_tokens: int = _N,
    dtype: str = _DTYPE, unpacked: bool = _UNPACKED, head: str = _HEAD,
    tp: int = typer.Option(2, help="tensor-parallel ranks"), pp: int = _PP,
    split: str = _SPLIT, microbatches: int = _MB, chat: bool = _CHAT,
    nnodes: int = typer.Option(1, help="machines (> 1: print the torchrun line to run)"),
    rdzv_endpoint: str = typer.Option("", help="HOST:PORT every machine reaches"),
) -> None:  # fmt: skip
    """Greedy generation on tp x pp ranks through torch.distributed (gloo on CPU, NCCL on
    GPUs): tensor-parallel shards inside pipeline stages. On one machine kiln starts the
    ranks itself and stops the whole job, naming the rank, if one dies or hangs.

    Several machines: with --nnodes N --rdzv-endpoint HOST:PORT this prints the torchrun
    line to start on every machine; under torchrun kiln uses its ranks instead of
    starting its own."""
    if nnodes > 1:
        from kiln.parallel.launch import torchrun_command

        if tp * pp % nnodes:
            raise typer.BadParameter(
                f"tp x pp = {tp * pp} ranks do not split over {nnodes} machines"
            )
        program = ["-m", "kiln.cli", "run", checkpoint, "--tp", str(tp), "--pp", str(pp),
                   "--prompt", prompt, "-n", str(max_new_tokens)]  # fmt: skip
        try:
            line = torchrun_command(nnodes, tp * pp // nnodes, rdzv_endpoint, program)
        except ValueError as err:
            raise typer.BadParameter(str(err)) from None
        console.print(" ".join(repr(a) if " " in a else a for a in line), markup=False)
        return
    _show_generation(
        _generate_options(
            checkpoint,
            prompt,
            max_new_tokens,
            0.0,
            None,
            None,
            None,
            dtype,
            "eager",
            unpacked,
            head,
            tp,
            pp,
            split,
            microbatches,
            None,
            chat,
        )  # fmt: skip
    )


def _fraction(text: str) -> float:
    """'1%' -> 0.01, '0.01' -> 0.01."""
    try:
        value = float(text[:-1]) / 100 if text.endswith("%") else float(text)
    except ValueError:
        raise typer.BadParameter(f"not a fraction or percentage: {text!r}") from None
    if not 0 < value < 10:
        raise typer.BadParameter(f"budget must be positive (and below 1000%), got {text!r}")
    return value


class _RichReporter:
    """Progress for long compression runs: one bar per stage, notes printed above."""

    def __init__(self) -> None:
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TimeElapsedColumn

        self.progress = Progress(
            "[progress.description]{task.description}", BarColumn(), MofNCompleteColumn(),
            TimeElapsedColumn(), console=console,
        )  # fmt: skip
        self.task: Any = None

    def __enter__(self) -> _RichReporter:
        self.progress.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.progress.stop()

    def stage(self, name: str, total: int) -> None:
        if self.task is not None:
            self.progress.update(self.task, completed=self.progress.tasks[-1].total)
        self.task = self.progress.add_task(name, total=total)

    def advance(self, done: int, total: int) -> None:
        self.progress.update(self.task, completed=done, total=total)

    def note(self, text: str) -> None:
        self.progress.console.print(text, markup=False)


def _scratch_results() -> str:
    import tempfile

    return tempfile.mkdtemp(prefix="kiln-demo-")


if __name__ == "__main__":
    app()
