"""Output errors: each contender's outputs against eager fp32, and eager fp32
against an fp64 run of the same model (the noise floor to judge them by).

Relative error is normwise per output, ``max|y - ref| / max|ref|``, then the
maximum over outputs: elementwise ratios blow up where the reference is ~0.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import torch

from kiln.bench.contenders import flatten_outputs


def compare(outs: list[torch.Tensor], ref: list[torch.Tensor]) -> dict[str, Any]:
    """``{"max_abs_err", "max_rel_err"}`` over all outputs, or ``{"check_error"}``
    when the outputs do not line up (count, shape) or are not finite."""
    if len(outs) != len(ref):
        return {"check_error": f"{len(outs)} outputs, eager has {len(ref)}"}
    abs_err = rel_err = 0.0
    for o, r in zip(outs, ref, strict=True):
        if tuple(o.shape) != tuple(r.shape):
            return {"check_error": f"shape {tuple(o.shape)} vs eager {tuple(r.shape)}"}
        if not r.is_floating_point():
            if not torch.equal(o.to(r.dtype), r):
                return {"check_error": "integer output differs"}
            continue
        d = (o.double() - r.double()).abs().max().item()
        if d != d:  # NaN
            return {"check_error": "non-finite output"}
        scale = max(r.double().abs().max().item(), 1e-30)
        abs_err, rel_err = max(abs_err, d), max(rel_err, d / scale)
    return {"max_abs_err": abs_err, "max_rel_err": rel_err}


def attach_errors(results: dict[str, dict[str, Any]], workdir: Path) -> None:
    """Load ``<contender>.pt`` from ``workdir`` and store each contender's error vs eager."""
    ref_path = workdir / "eager.pt"
    if not ref_path.exists():
        return
    ref = torch.load(ref_path)
    for c, res in results.items():
        path = workdir / f"{c}.pt"
        if c != "eager" and path.exists():
            res.update(compare(torch.load(path), ref))


def fp64_error(model: torch.nn.Module, inputs: tuple[Any, ...]) -> float | None:
    """Normwise max relative error of eager fp32 against the model run in fp64."""
    try:
        m64 = copy.deepcopy(model).double()
        in64 = tuple(t.double() if t.is_floating_point() else t for t in inputs)
        with torch.inference_mode():
            ref = flatten_outputs(m64(*in64))
            out = flatten_outputs(model(*inputs))
    except Exception:  # noqa: BLE001 - some ops lack fp64 kernels; then no noise floor
        return None
    res = compare(out, ref)
    return res.get("max_rel_err")
