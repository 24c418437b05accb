"""On-disk cache of capture results, so a warm compile skips ``torch.export``.

The key covers what decides the captured graph: the source files that define the
classes of every submodule (so helper functions in those files count too), the
module tree's structure, the bytes of every parameter and buffer, the example
inputs' shapes and dtypes, and the torch and kiln versions. Code the forward pass
calls from *other* files is not covered: pass ``cache=False`` to ``kiln.compile``
when such code changes between runs. kiln's own capture code is part of the key.
"""

from __future__ import annotations

import contextlib
import hashlib
import inspect
import io
import os
import pickle
from pathlib import Path
from typing import Any

import torch

from kiln.compiler.capture.export import CaptureResult
from kiln.core.cache import cache_dir


def capture_key(model: torch.nn.Module, example_inputs: tuple[torch.Tensor, ...]) -> str:
    h = hashlib.sha256()
    h.update(f"{torch.__version__}|{_kiln_digest()}".encode())
    files: set[str] = set()
    for name, m in model.named_modules():
        cls = type(m)
        h.update(f"{name}:{cls.__module__}.{cls.__qualname__};".encode())
        if isinstance(m, torch.fx.GraphModule):  # one class, any code: key on the code
            h.update(m.code.encode())
        with contextlib.suppress(TypeError):  # built-in classes have no source file
            files.add(inspect.getsourcefile(cls) or "")
        h.update(
            repr(
                sorted(
                    (k, v)
                    for k, v in vars(m).items()
                    if isinstance(v, (int, float, bool, str, tuple))
                )
            ).encode()
        )
    for f in sorted(files):
        if f and os.path.exists(f):
            h.update(Path(f).read_bytes())
    for name, t in [*model.named_parameters(), *model.named_buffers()]:
        h.update(f"{name}{tuple(t.shape)}{t.dtype}".encode())
        data = t.detach().contiguous().cpu()
        if data.dtype == torch.bfloat16:  # numpy has no bf16: hash its bits
            data = data.view(torch.int16)
        h.update(data.numpy().tobytes())
    for t in example_inputs:
        h.update(
            f"in{tuple(t.shape)}{t.dtype}".encode()
            if isinstance(t, torch.Tensor)
            else repr(t).encode()
        )
    return h.hexdigest()


def _kiln_digest() -> str:
    """Hash of kiln's own capture code and IR: a change to a lowering invalidates."""
    compiler = Path(__file__).resolve().parents[1]
    h = hashlib.sha256()
    for f in sorted([*(compiler / "capture").glob("*.py"), *(compiler / "ir").glob("*.py")]):
        h.update(f.read_bytes())
    return h.hexdigest()


class _Pickler(pickle.Pickler):
    """ATen op handles are not picklable; store their qualified names."""

    def reducer_override(self, obj: Any) -> Any:
        if isinstance(obj, torch._ops.OpOverload):
            return _resolve_op, (obj.namespace, obj._opname, obj._overloadname)
        return NotImplemented


def _resolve_op(namespace: str, name: str, overload: str) -> torch._ops.OpOverload:
    return getattr(getattr(getattr(torch.ops, namespace), name), overload)


def load(key: str) -> CaptureResult | None:
    path = cache_dir("captures") / f"{key}.pkl"
    try:
        with path.open("rb") as f:
            result = pickle.load(f)
    except (OSError, pickle.UnpicklingError, EOFError, AttributeError, ImportError):
        return None
    return result if isinstance(result, CaptureResult) else None


def store(key: str, result: CaptureResult) -> None:
    """Write atomically; a result that cannot be pickled is simply not cached."""
    directory = cache_dir("captures")
    directory.mkdir(parents=True, exist_ok=True)
    buf = io.BytesIO()
    try:
        _Pickler(buf, protocol=pickle.HIGHEST_PROTOCOL).dump(result)
    except (pickle.PicklingError, TypeError, AttributeError, RuntimeError):
        return
    tmp = directory / f".{key}.{os.getpid()}.tmp"
    tmp.write_bytes(buf.getvalue())
    tmp.replace(directory / f"{key}.pkl")
