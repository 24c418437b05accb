"""What the sub-commands share: the console they print to, usage errors, help text."""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import typer
from rich.console import Console

console = Console()

ALL_CONTENDERS = "eager,inductor,ort,openvino,kiln"


@contextmanager
def refused() -> Iterator[None]:
    """A ValueError raised while reading the arguments or checking a request becomes a
    usage error (exit code 2, the message under the usage line), not a traceback."""
    try:
        yield
    except ValueError as err:
        raise typer.BadParameter(str(err)) from None


def help_text(command: Callable[..., Any]) -> str:
    """The command's docstring as help: paragraphs kept, the line breaks inside each
    paragraph (the source's wrapping) removed, so the terminal wraps it to its width."""
    doc = inspect.cleandoc(command.__doc__ or "")
    return "\n\n".join(" ".join(par.split()) for par in doc.split("\n\n"))
