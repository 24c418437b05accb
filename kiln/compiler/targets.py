"""A user's model and example inputs from a command-line target (``kiln compile``).

Two forms, besides the benchmark suite's model names (which the CLI resolves itself):

* a ``torch.export.save`` file (``model.pt2``): its program's module, with the example
  inputs saved in it, or with random inputs of the given shapes and the program's
  dtypes;
* ``path/to/file.py:Name`` or ``package.module:Name``: ``Name()`` (a class, or a function
  returning the model) called with no arguments, in eval mode, with random inputs of the
  given shapes (``8,320``; ``8,128:int64`` for an integer input).

Example::

    target = load_target("net.py:Net", ["8,320"])
    kiln.compile(target.model, target.inputs)
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import re
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

import torch
from torch.export.graph_signature import InputKind

Tensor = torch.Tensor

DTYPES = {
    "float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16,
    "float64": torch.float64, "int64": torch.int64, "int32": torch.int32, "bool": torch.bool,
}  # fmt: skip


class TargetError(ValueError):
    """A target that names no loadable model, or inputs that cannot be made for it."""


@dataclass
class Target:
    """A model ready for ``kiln.compile``, its example inputs, and a name for reports."""

    name: str
    model: torch.nn.Module
    inputs: tuple[Tensor, ...]


def is_user_target(target: str) -> bool:
    """Whether ``target`` names a file or a ``module:Name`` rather than a suite model."""
    return ":" in target or "/" in target or os.sep in target or "." in target


def parse_dtype(name: str) -> torch.dtype:
    try:
        return DTYPES[name]
    except KeyError:
        raise TargetError(f"unknown dtype {name!r}; known: {', '.join(DTYPES)}") from None


def parse_shape(
    text: str, dtype: torch.dtype = torch.float32
) -> tuple[tuple[int, ...], torch.dtype]:
    """``"8,320"`` -> ((8, 320), dtype); ``"8,128:int64"`` names the input's dtype;
    ``""`` or ``"scalar"`` is a 0-d tensor."""
    dims, _, dt = text.partition(":")
    if dt:
        dtype = parse_dtype(dt.strip())
    dims = dims.strip()
    if dims in ("", "scalar"):
        return (), dtype
    try:
        shape = tuple(int(d) for d in dims.replace("x", ",").split(","))
    except ValueError:
        raise TargetError(f"bad input shape {text!r}: write sizes like 8,320") from None
    if any(d < 0 for d in shape):
        raise TargetError(f"bad input shape {text!r}: sizes must be >= 0")
    return shape, dtype


def random_input(shape: tuple[int, ...], dtype: torch.dtype) -> Tensor:
    """Normal floats; integers and bools 0 or 1 (valid indices for any table)."""
    if dtype.is_floating_point:
        return torch.randn(shape, dtype=dtype)
    return torch.randint(0, 2, shape).to(dtype)


def load_target(
    target: str,
    input_shapes: Sequence[str] = (),
    dtype: torch.dtype | None = None,
    device: str = "cpu",
    seed: int = 0,
) -> Target:
    """Load ``target`` (see the module docstring) as a model and example inputs on
    ``device``. ``dtype`` casts a class's model and is its float inputs' dtype (default
    float32); an exported program keeps its own dtypes. Raises ``TargetError``."""
    torch.manual_seed(seed)
    path, sep, attr = target.rpartition(":")
    if Path(target).is_file() or not sep:
        if dtype is not None:
            raise TargetError(f"{target}: an exported program keeps its dtypes; drop --dtype")
        model, inputs, name = _load_exported(target, input_shapes)
    elif attr.isidentifier() and path:
        if not input_shapes:
            raise TargetError(
                f"{target}: give the model's input shapes, e.g. --input-shape 8,320 "
                "(once per input; 8,128:int64 for an integer input)"
            )
        if dtype is not None and not dtype.is_floating_point:
            raise TargetError(f"--dtype casts the model: a floating type, not {dtype}")
        model, name = _load_callable(path, attr), attr
        if dtype is not None:
            model = model.to(dtype)
        inputs = tuple(random_input(*parse_shape(s, dtype or torch.float32)) for s in input_shapes)
    else:
        raise TargetError(f"bad target {target!r}: write path/to/file.py:Name or module:Name")
    return Target(name, model.to(device), tuple(t.to(device) for t in inputs))


def _load_callable(where: str, attr: str) -> torch.nn.Module:
    if where.endswith(".py") or os.sep in where or "/" in where:
        module = _import_file(Path(where))
    else:
        if os.getcwd() not in sys.path:  # the ``kiln`` script's path holds no cwd
            sys.path.insert(0, os.getcwd())
        try:
            module = importlib.import_module(where)
        except ImportError as e:
            raise TargetError(f"cannot import module {where!r}: {e}") from None
    factory = getattr(module, attr, None)
    if factory is None:
        known = sorted(
            n for n, v in vars(module).items()
            if isinstance(v, type) and issubclass(v, torch.nn.Module) and v.__module__ == module.__name__
        )  # fmt: skip
        raise TargetError(
            f"{where} has no {attr!r}" + (f"; its models: {', '.join(known)}" if known else "")
        )
    if not callable(factory):
        raise TargetError(f"{where}:{attr} is not a class or function")
    try:
        model = factory()
    except TypeError as e:
        raise TargetError(
            f"{attr}() failed ({e}): kiln compile calls it with no arguments; give its "
            "arguments defaults, or name a function that builds the model"
        ) from None
    if not isinstance(model, torch.nn.Module):
        raise TargetError(f"{attr}() returned {type(model).__name__}, not a torch.nn.Module")
    return model.eval()


def _import_file(path: Path) -> ModuleType:
    if not path.is_file():
        raise TargetError(f"no such file: {path}")
    name = re.sub(r"\W", "_", path.stem)
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise TargetError(f"cannot import {path} (a Python file?)")
    module = importlib.util.module_from_spec(spec)
    folder = str(path.resolve().parent)
    if folder not in sys.path:  # so the file's own imports of its neighbours work
        sys.path.insert(0, folder)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[name]
        raise
    return module


def _load_exported(
    where: str, input_shapes: Sequence[str]
) -> tuple[torch.nn.Module, tuple[Tensor, ...], str]:
    path = Path(where)
    if not path.is_file():
        raise TargetError(
            f"no such file: {where} (a target is a suite model name, a torch.export.save "
            "file, or path/to/file.py:Name / module:Name)"
        )
    if path.suffix == ".py":
        raise TargetError(f"{where}: name the model in it, as {where}:ClassName")
    try:
        ep = torch.export.load(path)
    except Exception as e:  # noqa: BLE001 - any unreadable file: say which and why
        raise TargetError(f"{where} is not a torch.export.save file: {e}") from None
    saved = _saved_inputs(ep)
    specs = _user_input_dtypes(ep)
    if input_shapes:
        if len(input_shapes) != len(specs):
            raise TargetError(
                f"{where} takes {len(specs)} inputs; {len(input_shapes)} --input-shape given"
            )
        inputs = tuple(random_input(*parse_shape(s, dt)) for s, dt in zip(input_shapes, specs))
        _check_static_sizes(ep, inputs, where)
    elif saved is not None:
        inputs = saved
    else:
        inputs = tuple(random_input(shape, dt) for shape, dt in _user_input_shapes(ep, where))
    return ep.module(), inputs, path.name


def _saved_inputs(ep: torch.export.ExportedProgram) -> tuple[Tensor, ...] | None:
    """The example inputs ``torch.export.save`` kept (positional tensors only)."""
    example = getattr(ep, "example_inputs", None)
    if not example:
        return None
    args, kwargs = example
    if kwargs or not all(isinstance(a, Tensor) for a in args):
        return None
    return tuple(args)


def _user_placeholders(ep: torch.export.ExportedProgram) -> list[object]:
    by_name = {n.name: n for n in ep.graph.nodes if n.op == "placeholder"}
    vals = []
    for spec in ep.graph_signature.input_specs:
        if spec.kind == InputKind.USER_INPUT:
            vals.append(by_name[spec.arg.name].meta.get("val"))  # type: ignore[union-attr]
    return vals


def _check_static_sizes(
    ep: torch.export.ExportedProgram, inputs: Sequence[Tensor], where: str
) -> None:
    """A size the program was exported with as a constant cannot change."""
    for i, (v, t) in enumerate(zip(_user_placeholders(ep), inputs)):
        if not isinstance(v, Tensor):
            continue
        fixed = [d if isinstance(d, int) else None for d in v.shape]
        if len(fixed) != t.dim() or any(f is not None and f != n for f, n in zip(fixed, t.shape)):
            raise TargetError(
                f"{where}: input {i} was exported with shape "
                f"{[d if d is not None else '?' for d in fixed]} ('?': dynamic), not "
                f"{list(t.shape)}; export with dynamic_shapes to compile other sizes"
            )


def _user_input_dtypes(ep: torch.export.ExportedProgram) -> list[torch.dtype]:
    return [v.dtype if isinstance(v, Tensor) else torch.float32 for v in _user_placeholders(ep)]


def _user_input_shapes(
    ep: torch.export.ExportedProgram, where: str
) -> list[tuple[tuple[int, ...], torch.dtype]]:
    """Each user input's shape and dtype from the program's placeholders (a dynamic
    size at its hint, the size it was traced at)."""
    out = []
    for v in _user_placeholders(ep):
        if not isinstance(v, Tensor):
            raise TargetError(f"{where} takes a non-tensor input ({v!r}); kiln compiles tensors")
        hints = [d if isinstance(d, int) else d.node.hint for d in v.shape]
        if any(h is None for h in hints):
            raise TargetError(
                f"{where}: input sizes {list(v.shape)} are dynamic; give --input-shape"
            )
        shape = tuple(int(h) for h in hints)
        out.append((shape, v.dtype))
    return out
