"""Command line: ``python -m kiln.bench --models a,b --contenders eager,ort --rounds 3``.

Runs the suite side by side with a progress display, writes the result JSON,
prints the markdown table and, with ``--readme``, updates the README block.
``--list`` shows the models; ``--from-result FILE`` only renders a saved result.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

from kiln.bench import RESULTS_DIR
from kiln.bench.contenders import NAMES
from kiln.bench.suite import DEFAULT_MODEL, MODELS
from kiln.bench.suite_runner import run_suite
from kiln.bench.suite_table import render_table, update_readme


def _parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m kiln.bench", description=__doc__)
    p.add_argument("--models", default=DEFAULT_MODEL, help="comma list, or 'all'")
    p.add_argument("--contenders", default="eager,inductor,ort,openvino,kiln",
                   help=f"comma list of {', '.join(NAMES)}")  # fmt: skip
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--reps", type=int, default=10)
    p.add_argument("--rep-ms", type=float, default=5.0, help="length of one repetition")
    p.add_argument("--warmup-s", type=float, default=0.3)
    p.add_argument("--quiet-wait-s", type=float, default=1.0,
                   help="before each round, wait up to this long for co-tenants to go quiet")  # fmt: skip
    p.add_argument("--warm-compile", action="store_true", help="also time a warm-cache compile")
    p.add_argument("--out", default=str(RESULTS_DIR))
    p.add_argument("--tag", default="", help="result file name suffix: DEVICE-DATE-TAG.json "
                   "(a same-day run with the same tag overwrites the file)")  # fmt: skip
    p.add_argument("--readme", default=None, help="README to update between the bench markers")
    p.add_argument("--from-result", default=None, help="render this result JSON, run nothing")
    p.add_argument("--list", action="store_true", help="list the models and exit")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    """Entry point for ``python -m kiln.bench`` (and for a CLI wrapper to call)."""
    args = _parse(argv)
    console = Console()
    if args.list:
        for m in MODELS.values():
            console.print(f"[bold]{m.name}[/] ({m.kind}): {m.config}")
        return 0
    if args.from_result:
        result = json.loads(Path(args.from_result).read_text())
    else:
        models = list(MODELS) if args.models == "all" else args.models.split(",")
        cons = args.contenders.split(",")
        result = _run_with_progress(console, args, models, cons)
        console.print(f"wrote {result['path']}")
    console.print(render_table(result), markup=False, highlight=False, soft_wrap=True)
    if args.readme:
        update_readme(args.readme, result)
        console.print(f"updated {args.readme}")
    return 0


def _run_with_progress(
    console: Console, args: argparse.Namespace, models: list[str], cons: list[str]
) -> dict[str, Any]:
    """run_suite with a rich progress bar over models and a status line per step."""
    with Progress(
        TextColumn("[bold]{task.description}"), BarColumn(), TextColumn("{task.fields[step]}"),
        TimeElapsedColumn(), console=console,
    ) as progress:  # fmt: skip
        task = progress.add_task("models", total=len(models), step="")

        def on_event(kind: str, info: dict[str, Any]) -> None:
            if kind == "prepare":
                progress.update(task, step=f"{info['model']}: preparing {info['contender']}")
            elif kind == "prepared" and "error" in info:
                msg = str(info["error"])[:100]
                progress.console.print(f"[yellow]{info['model']} / {info['contender']}: {msg}")
            elif kind == "round":
                progress.update(
                    task, step=f"{info['model']}: round {info['round']}/{info['rounds']}"
                )
            elif kind == "model_done":
                sp = ", ".join(
                    f"{c} {v:.2f}x"
                    for c, v in info["speedup_vs_eager"].items()
                    if v and c != "eager"
                )
                eager = info["results"]["eager"].get("ms")
                progress.console.print(
                    f"{info['model']}: eager {eager or float('nan'):.3f} ms; {sp}"
                )
                progress.advance(task)

        return run_suite(
            models, cons, rounds=args.rounds, reps=args.reps, out_dir=args.out,
            warmup_s=args.warmup_s, rep_ms=args.rep_ms, warm_compile=args.warm_compile,
            quiet_wait_s=args.quiet_wait_s, on_event=on_event, tag=args.tag,
        )  # fmt: skip


if __name__ == "__main__":
    sys.exit(main())
