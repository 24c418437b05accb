"""kiln demo: compile the default model and race it against the peers."""

from __future__ import annotations

import tempfile
from typing import Annotated

import typer

from kiln.cli._console import ALL_CONTENDERS, console
from kiln.cli.compile import compile_and_show


def demo(
    model: Annotated[
        str, typer.Option(help="suite model (default: the built-in default model)")
    ] = "",
    rounds: Annotated[int, typer.Option(help="interleaved timing rounds")] = 3,
    contenders: Annotated[str, typer.Option(help="comma list of contenders")] = ALL_CONTENDERS,
) -> None:
    """Compile the built-in default model with kiln, show the chosen kernels, then time it
    side by side with eager PyTorch, torch.compile, ONNX Runtime and OpenVINO (each in its
    own process) and print the table."""
    from kiln.bench.__main__ import main as bench_main
    from kiln.bench.suite import DEFAULT_MODEL

    name = model or DEFAULT_MODEL
    compile_and_show(name, solver="blp", executor="native", profile=True)
    console.rule(f"side by side: {name}")
    scratch = tempfile.mkdtemp(prefix="kiln-demo-")
    bench_main(["--models", name, "--contenders", contenders, "--rounds", str(rounds),
                "--out", scratch])  # fmt: skip
