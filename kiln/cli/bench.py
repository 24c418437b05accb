"""kiln bench: the side-by-side benchmark suite."""

from __future__ import annotations

from typing import Annotated

import typer

from kiln.cli._console import ALL_CONTENDERS


def bench(
    models: Annotated[str, typer.Option(help="comma list of suite models, or 'all'")] = "all",
    contenders: Annotated[str, typer.Option(help="comma list of contenders")] = ALL_CONTENDERS,
    rounds: Annotated[int, typer.Option(help="interleaved timing rounds")] = 3,
    readme: Annotated[str, typer.Option(help="README whose benchmark table to update")] = "",
    tag: Annotated[
        str, typer.Option(help="result file name suffix (results/DEVICE-DATE-TAG.json)")
    ] = "",
    list_models: Annotated[
        bool, typer.Option("--list", help="list the suite models and exit")
    ] = False,
) -> None:
    """Run the small-model suite side by side (docs/benchmarks.md protocol) and write
    results/<device>-<date>[-<tag>].json plus the markdown table (a same-day run with the
    same tag overwrites it)."""
    from kiln.bench.__main__ import main as bench_main

    argv = ["--models", models, "--contenders", contenders, "--rounds", str(rounds)]
    if readme:
        argv += ["--readme", readme]
    if tag:
        argv += ["--tag", tag]
    if list_models:
        argv = ["--list"]
    raise typer.Exit(bench_main(argv))
