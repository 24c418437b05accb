"""kiln calibrate: measure this machine's hardware profile and kiln's decode rates."""

from __future__ import annotations

from typing import Annotated

import typer
from rich.table import Table

from kiln.cli._console import console


def calibrate(
    threads: Annotated[
        str,
        typer.Option(
            help="thread counts to time kiln's engines at, comma-separated "
            "(a CPU plan of R ranks runs each with cores // R threads)"
        ),
    ] = "2,1",
    kernels: Annotated[
        bool,
        typer.Option(
            help="also time kiln's own generated kernels (GEMMs, pointwise, rows, depthwise "
            "convs; about a minute) and fit the compiler's cost model to them"
        ),
    ] = True,
) -> None:
    """Measure peak GFLOP/s, memory bandwidth and per-kernel fixed cost on this machine (the
    compiler's cost model reads them), and the cost of each engine kiln decodes with, per
    weight format: a fixed time per block plus weight bytes (decode) or FLOPs (prefill) at
    a measured rate, for the C++ step, the eager module, the disk-streamed module and a
    gloo all-reduce between two ranks (the planner prices --hardware cpu plans with these).
    With --kernels, kiln's own kernels are timed on this machine and the cost model's
    rates (fixed costs, bandwidth per cache level, GEMM rates by shape, ...) fitted to them.
    All are cached; this refreshes them. With a CUDA GPU, its profile (HBM bandwidth,
    launch overheads, GEMM rates per dtype: the Triton backend's cost model) comes first."""
    import torch

    from kiln.core.calibrate import load_profile
    from kiln.deploy.rates_table import load_rates

    if torch.cuda.is_available():
        from kiln.core.gpu_profile import calibrate_gpu_profile

        with console.status(f"calibrating {torch.cuda.get_device_name()}"):
            console.print(calibrate_gpu_profile())

    counts = [int(t) for t in threads.split(",") if t.strip()]
    with console.status("calibrating the hardware profile"):
        profile = load_profile(threads=counts[0], refresh=True)
    if kernels:
        from kiln.compiler.exec.calibrate_kernels import calibrate_kernels
        from kiln.core.calibrate import store_profile

        with console.status("timing kiln's kernels") as status:
            profile = store_profile(calibrate_kernels(profile, lambda t: status.update(t)))
    console.print(profile)
    for n in counts:
        with console.status(f"timing kiln's engines at {n} thread(s)") as status:
            rates = load_rates(n, True, lambda text: status.update(text), console.print)
        table = Table(f"engine ({n} thread{'s' if n > 1 else ''})", "rows", "rate", "per block")
        for engine, by in rates.items():
            unit = "GFLOP/s" if engine.startswith("prefill") else "GB/s"
            for rows, cost in by.items():
                fixed = f"{cost.layer_s * 1e6:.1f} us"
                table.add_row(engine, str(rows), f"{cost.rate:.1f} {unit}", fixed)
        console.print(table)
