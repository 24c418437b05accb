"""Launch configurations tuned per kernel on the device, cached on disk.

A generated kernel lists its launch variants (block sizes, warps, stages); on a CUDA
device each variant is timed on the program's own buffers (CUDA events, best of a few
repetitions) and the fastest is kept. Choices are stored in one JSON file per device
under the cache directory, keyed by the kernel's source and variants, so compiling the
same model again does not tune again. Re-running a kernel is harmless: the static
memory plan never lets a kernel's outputs overlap its inputs.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
from collections.abc import Callable
from pathlib import Path

import torch

from kiln.compiler.codegen.gpu.source import Launch
from kiln.core.cache import cache_dir
from kiln.core.gpu_profile import gpu_time_us


def tune_path(device: torch.device) -> Path:
    name = torch.cuda.get_device_name(device).replace(" ", "-").replace("/", "-")
    return cache_dir("triton-tune") / f"{name}.json"


def launch_key(launch: Launch) -> str:
    return hashlib.sha256((launch.source + repr(launch.variants)).encode()).hexdigest()[:32]


def tune(launches: list[tuple[Launch, Callable[[], None]]], device: torch.device) -> int:
    """Set each multi-variant launch's ``choice`` to its fastest variant (from the cache
    when known); return how many were timed now."""
    path = tune_path(device)
    try:
        table: dict[str, int] = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        table = {}
    timed = 0
    for launch, run in launches:
        if len(launch.variants) < 2:
            continue
        key = launch_key(launch)
        if key in table and 0 <= table[key] < len(launch.variants):
            launch.choice = table[key]
            continue
        best, best_us = 0, math.inf
        for i in range(len(launch.variants)):
            launch.choice = i
            try:
                us = gpu_time_us(run, reps=10, trials=3)
            except Exception:  # noqa: BLE001 - a variant that does not fit (registers, smem)
                continue
            if us < best_us:
                best, best_us = i, us
        launch.choice = table[key] = best
        timed += 1
    if timed:
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(table, sort_keys=True), encoding="utf-8")
        tmp.replace(path)
    return timed
