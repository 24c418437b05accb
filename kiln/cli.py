"""The ``kiln`` command: a thin map from sub-command to library function.

kiln demo       compile the default model and race it against the peers
kiln compile    compile one suite model and print what kiln chose
kiln bench      the side-by-side benchmark suite
kiln calibrate  measure this machine's hardware profile
"""

from __future__ import annotations

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
    from benchmarks.__main__ import main as bench_main
    from benchmarks.models import DEFAULT_MODEL

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
    from benchmarks.models import get

    bm = get(name)
    with console.status(f"building {name} ({bm.config})"):
        model, inputs = bm.build()
    with console.status(f"compiling {name} with kiln"):
        compiled = kiln.compile(model, inputs, solver=solver, executor=executor)  # type: ignore[arg-type]
    if profile and executor == "native":
        from kiln.runtime.profile import profile_kernels

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
    benchmarks/results/<device>-<date>.json plus the markdown table."""
    from benchmarks.__main__ import main as bench_main

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
    from kiln.hardware import load_profile

    with console.status("calibrating"):
        profile = load_profile(threads=threads, refresh=True)
    console.print(profile)


def _scratch_results() -> str:
    import tempfile

    return tempfile.mkdtemp(prefix="kiln-demo-")


if __name__ == "__main__":
    app()
