"""kiln compile: compile a suite model or the user's own model and print what kiln chose."""

from __future__ import annotations

import json
from dataclasses import asdict
from typing import TYPE_CHECKING, Annotated, Any

import typer

from kiln.cli._console import console, refused

if TYPE_CHECKING:
    import torch


def compile_model(
    target: Annotated[
        str,
        typer.Argument(
            help="a suite model name (kiln bench --list), a torch.export.save file (model.pt2), "
            "or path/to/file.py:Name / package.module:Name",
            show_default=False,
        ),
    ],
    input_shape: Annotated[
        list[str] | None,
        typer.Option(
            "--input-shape",
            help="one per input, in order: 8,320 (8,128:int64 for an integer input)",
            show_default=False,
        ),
    ] = None,
    dtype: Annotated[
        str | None,
        typer.Option(
            help="module:Name targets: the model's and float inputs' dtype (default float32)"
        ),
    ] = None,
    backend: Annotated[str, typer.Option(help="auto, cpp (C++ on the CPU) or triton")] = "auto",
    device: Annotated[str, typer.Option(help="where the model and inputs live")] = "cpu",
    solver: Annotated[str, typer.Option(help="blp (the binary linear program) or greedy")] = "blp",
    executor: Annotated[
        str, typer.Option(help="native (generated code) or reference (ATen)")
    ] = "native",
    profile: Annotated[bool, typer.Option(help="time every kernel (measured column)")] = False,
    as_json: Annotated[
        bool, typer.Option("--json", help="print the report as one JSON object")
    ] = False,
) -> None:
    """Compile a model with kiln and print the report and kernel table.

    TARGET is a model of the benchmark suite; a file saved with torch.export.save (its saved
    example inputs are used, or random ones of the --input-shape sizes); or a model of your
    own as path/to/file.py:Name or package.module:Name, where Name is a class (or a function
    returning the model) called with no arguments and given random inputs of the
    --input-shape sizes, e.g. kiln compile net.py:Net --input-shape 8,320.

    A model whose Python control flow depends on tensor values cannot be captured whole:
    the error names the line; compile it with torch.compile(model, backend="kiln")."""
    from kiln.compiler.targets import is_user_target, load_target, parse_dtype

    if not is_user_target(target):
        if input_shape or dtype:
            raise typer.BadParameter("a suite model has its own inputs: drop --input-shape/--dtype")
        model, inputs, name = _suite_model(target)
        if device != "cpu":
            model, inputs = model.to(device), tuple(t.to(device) for t in inputs)
    else:
        with refused():
            dt = parse_dtype(dtype) if dtype else None
            t = load_target(target, input_shape or (), dt, device)
        model, inputs, name = t.model, t.inputs, t.name
    show_compiled(
        model, inputs, name, solver=solver, executor=executor, profile=profile,
        backend=backend, as_json=as_json,
    )  # fmt: skip


def _suite_model(name: str) -> tuple[Any, tuple[Any, ...], str]:
    from kiln.bench.suite import get

    try:
        bm = get(name)
    except KeyError as e:
        raise typer.BadParameter(
            f"{e.args[0]}; or give a torch.export.save file or path/to/file.py:Name"
        ) from None
    with console.status(f"building {name} ({bm.config})"):
        model, inputs = bm.build()
    return model, tuple(inputs), name


def compile_and_show(name: str, *, solver: str, executor: str, profile: bool) -> None:
    """Build suite model ``name``, compile and show it (``kiln demo``'s first step)."""
    model, inputs, name = _suite_model(name)
    show_compiled(model, inputs, name, solver=solver, executor=executor, profile=profile)


def show_compiled(
    model: torch.nn.Module,
    inputs: tuple[torch.Tensor, ...],
    name: str,
    *,
    solver: str,
    executor: str,
    profile: bool,
    backend: str = "auto",
    as_json: bool = False,
) -> None:
    """Compile ``model`` with kiln (timing every kernel when ``profile`` and the executor
    is native), print the report and the kernel table (or the report as JSON), then run
    the compiled model once. kiln's errors (a model it cannot capture, a verification
    failure) print as one message and exit 1."""
    import torch

    import kiln
    from kiln.compiler.api import CompileOptions
    from kiln.compiler.capture import CaptureError

    choices: dict[str, Any] = {"solver": solver, "executor": executor, "backend": backend}
    with refused():
        CompileOptions(**choices)  # a bad choice is a usage error, before any work
    with console.status(f"compiling {name} with kiln"):
        try:
            compiled = kiln.compile(model, inputs, **choices)
        except (CaptureError, kiln.VerificationError) as e:
            typer.echo(f"kiln compile: {e}", err=True)
            raise typer.Exit(1) from None
    compiled.report.model = name
    if profile and executor == "native":
        from kiln.compiler.exec.profile import profile_kernels

        with console.status("profiling kernels"):
            profile_kernels(compiled, inputs)
    with torch.no_grad():
        compiled(*inputs)
    if as_json:
        shapes = [{"shape": list(t.shape), "dtype": str(t.dtype)} for t in inputs]
        typer.echo(json.dumps({"inputs": shapes, **asdict(compiled.report)}))
        return
    console.print(compiled.report.summary(), markup=False, highlight=False, soft_wrap=True)
    console.print(compiled.report.kernel_table(), markup=False, highlight=False, soft_wrap=True)
