"""kiln calibrate: measure this machine's hardware profile and kiln's decode rates."""

from __future__ import annotations

from typing import Annotated

import typer
from rich.table import Table

from kiln.cli._console import console


def calibrate(threads: Annotated[int, typer.Option(help="threads to calibrate for")] = 2) -> None:
    """Measure peak GFLOP/s, memory bandwidth and per-kernel fixed cost on this machine (the
    compiler's cost model reads them), and how fast kiln's decode step streams weights in
    each format at 1 and 4 rows (the planner reads those for --hardware cpu). Both are
    cached; this refreshes them."""
    from kiln.core.calibrate import load_profile
    from kiln.deploy.kernel_rates import load_rates

    with console.status("calibrating the hardware profile"):
        profile = load_profile(threads=threads, refresh=True)
    console.print(profile)
    with console.status("timing kiln's decode step in each weight format"):
        rates = load_rates(threads=threads, refresh=True)
    table = Table(
        "format",
        *(f"{rows} row{'s' if rows > 1 else ''} GB/s" for rows in next(iter(rates.values()))),
    )
    for fmt, by in rates.items():
        table.add_row(fmt, *(f"{v:.1f}" for v in by.values()))
    console.print(table)
