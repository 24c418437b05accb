"""kiln compile: compile one suite model and print what kiln chose."""

from __future__ import annotations

from typing import Annotated

import typer

from kiln.cli._console import console


def compile_model(
    name: Annotated[str, typer.Argument(help="suite model name (see: kiln bench --list)")],
    solver: Annotated[str, typer.Option(help="blp (the binary linear program) or greedy")] = "blp",
    executor: Annotated[
        str, typer.Option(help="native (generated C++) or reference (ATen)")
    ] = "native",
    profile: Annotated[bool, typer.Option(help="time every kernel (measured column)")] = False,
) -> None:
    """Compile one model of the benchmark suite and print the report and kernel table."""
    compile_and_show(name, solver=solver, executor=executor, profile=profile)


def compile_and_show(name: str, *, solver: str, executor: str, profile: bool) -> None:
    """Build suite model ``name``, compile it with kiln (timing every kernel when
    ``profile`` and the executor is native), print the report and the kernel table, then
    run the compiled model once."""
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
