"""The ``kiln`` command: a thin map from sub-command to library function.

One module per sub-command (parse -> one library call -> rich rendering); the logic they
call lives in the library (``kiln.deploy``, ``kiln.core``, and ``kiln.bench``, which only
the CLI may import):

kiln demo       compile the default model and race it against the peers  (demo.py)
kiln compile    compile one suite model and print what kiln chose       (compile.py)
kiln bench      the side-by-side benchmark suite                        (bench.py)
kiln calibrate  measure this machine's hardware profile                 (calibrate.py)
kiln compress   compress a language model (or encoder) to an accuracy budget (compress.py)
kiln generate   generate text with a language model checkpoint, timed   (generate.py)
kiln run        the same on tensor- and pipeline-parallel ranks         (generate.py)
kiln plan       the cheapest deployment meeting accuracy, latency, hardware (plan.py)

Each command is a typed function whose docstring is its help (``_console.help_text``
unwraps its paragraphs so the terminal wraps them).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import typer

from kiln.cli._console import help_text
from kiln.cli.bench import bench
from kiln.cli.calibrate import calibrate
from kiln.cli.compile import compile_model
from kiln.cli.compress import compress
from kiln.cli.demo import demo
from kiln.cli.generate import generate, run
from kiln.cli.plan import plan

app = typer.Typer(
    add_completion=False,
    no_args_is_help=True,
    help="kiln: make trained PyTorch models cheaper and faster to serve. Small models: "
    "compile, bench, demo, calibrate. Language models: compress, generate, run, plan.",
)

COMMANDS: list[tuple[str, Callable[..., Any]]] = [
    ("demo", demo), ("compile", compile_model), ("bench", bench), ("calibrate", calibrate),
    ("compress", compress), ("generate", generate), ("run", run), ("plan", plan),
]  # fmt: skip
for _name, _command in COMMANDS:
    app.command(name=_name, help=help_text(_command))(_command)
