"""kiln calibrate: measure this machine's hardware profile."""

from __future__ import annotations

from typing import Annotated

import typer

from kiln.cli._console import console


def calibrate(threads: Annotated[int, typer.Option(help="threads to calibrate for")] = 2) -> None:
    """Measure peak GFLOP/s, memory bandwidth and per-kernel fixed cost on this machine
    (cached; the cost model reads it)."""
    from kiln.core.calibrate import load_profile

    with console.status("calibrating"):
        profile = load_profile(threads=threads, refresh=True)
    console.print(profile)
