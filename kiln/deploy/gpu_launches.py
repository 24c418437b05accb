"""What kernels cost on a GPU beside their reads and FLOPs: the planner's launch term.

kiln runs a model on a GPU as PyTorch operators: a decode step is replayed as one CUDA
graph (``llm.graph_decoder``), a prefill is launched operator by operator from Python.
Every kernel has a fixed cost the roofline does not see — a node of a replayed graph about
2 µs, a launch from Python about 6 µs (``core.gpu_profile``'s planning values, replaced by
``kiln calibrate`` on the device) — and a small model's step is a thousand of them:
Qwen2-0.5B's is 24 blocks of 49 kernels. Its 1 GB of bf16 weights stream in 0.26 ms at
4.8 TB/s; its kernels' fixed costs alone are about 2.4 ms.

``kernel_counts`` counts them on the model's own code: the architecture built on PyTorch's
meta device (no memory, no kernels run), a prefill and one decode step run under a
dispatch mode that counts every ATen operator that is not a view. An architecture kiln has
no module for (a config such as GLM-130B's) is counted as Qwen2-style blocks
(``ASSUMED_PER_BLOCK``), and its source says so.

``step_ms`` prices a decode step as its roofline plus every kernel's graph-node cost (the
nodes run one after another); ``prefill_ms`` as the larger of the roofline and the
Python launches (the host queues kernels while the device runs the earlier ones).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from functools import lru_cache
from typing import TYPE_CHECKING, Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

if TYPE_CHECKING:
    from kiln.deploy.architecture import Architecture
    from kiln.deploy.hardware import Device
    from kiln.models.config import ModelConfig


@dataclass(frozen=True)
class KernelCounts:
    """Kernels of one decode step and of one prefill of a whole model."""

    decode: int
    prefill: int
    source: str  # "counted" on the model's code, or "assumed" (``ASSUMED_PER_BLOCK``)


# Counted on kiln's Qwen2 module (qwen2-0.5b's config: 24 x 49 + 11 a decode step, 24 x 49 + 10 a prefill):
# the stand-in for an architecture kiln cannot build, per block and besides the blocks.
ASSUMED_PER_BLOCK, ASSUMED_REST = 49, 11


@dataclass(frozen=True)
class LaunchCosts:
    """Fixed µs of a kernel: a node of a replayed CUDA graph, a launch from Python."""

    graph_us: float
    launch_us: float
    source: str  # "calibrated on <device>" or "planning estimate"


def launch_costs(device: Device) -> LaunchCosts:
    """The launch costs of GPU ``device``: this machine's calibration when its GPU is that
    model and ``kiln calibrate`` measured it, else the built-in planning estimates (read
    once per process and device name: the planner prices thousands of layouts)."""
    return _launch_costs(device.name)


@lru_cache(maxsize=8)
def _launch_costs(device_name: str) -> LaunchCosts:
    from kiln.core import gpu_profile as gp

    if torch.cuda.is_available():
        name = torch.cuda.get_device_name()
        if gp.family(name) == gp.family(device_name) and gp.gpu_profile_path(name).is_file():
            prof = gp.load_gpu_profile()
            return LaunchCosts(prof.graph_launch_us, prof.launch_us, f"calibrated on {name}")
    return LaunchCosts(gp.PLANNING_GRAPH_LAUNCH_US, gp.PLANNING_LAUNCH_US, "planning estimate")


def kernel_counts(arch: Architecture) -> KernelCounts:
    """The kernels of ``arch``'s decode step and prefill: counted on its model when kiln
    builds it, else ``ASSUMED_PER_BLOCK`` per block."""
    if arch.config is None:
        kernels = arch.n_layers * ASSUMED_PER_BLOCK + ASSUMED_REST
        return KernelCounts(kernels, kernels, "assumed")
    return _counted(arch.config)


PROMPT = 16  # tokens of the counted prefill (the count does not depend on it)


@lru_cache(maxsize=32)
def _counted(cfg: ModelConfig) -> KernelCounts:
    """Blocks differ only by their attention window (sliding-window and global layers
    alternate in some families): each kind of block is counted once, as the difference of
    a model of two such blocks and a model of one (the rest: embedding, final norm, head),
    and the model's blocks summed. Counting the whole of an 80-block model on the meta
    device would take two seconds; this takes a tenth of one."""
    windows = cfg.sliding_windows or (None,) * cfg.n_layers
    per_block: dict[int | None, tuple[int, int]] = {}
    rest = (0, 0)
    for window in dict.fromkeys(windows):
        kind = (window,) if cfg.sliding_windows else ()
        one = _count(replace(cfg, n_layers=1, sliding_windows=kind))
        two = _count(replace(cfg, n_layers=2, sliding_windows=kind * 2))
        per_block[window] = (two[0] - one[0], two[1] - one[1])
        rest = (one[0] - per_block[window][0], one[1] - per_block[window][1])
    decode = rest[0] + sum(per_block[w][0] for w in windows)
    prefill = rest[1] + sum(per_block[w][1] for w in windows)
    return KernelCounts(decode, prefill, "counted")


def _count(cfg: ModelConfig) -> tuple[int, int]:
    """(decode step, prefill) kernels of ``cfg``'s model, built on the meta device."""
    from kiln.llm.graph_decoder import GraphDecoder
    from kiln.models.transformer import Transformer

    with torch.device("meta"):
        model = Transformer(replace(cfg, max_positions=max(cfg.max_positions, 2 * PROMPT)))
    decoder = GraphDecoder(model.to(torch.bfloat16), 1, 2 * PROMPT, graphs=False)
    prompt = torch.zeros(1, PROMPT, dtype=torch.long, device="meta")
    token = torch.zeros(1, dtype=torch.long, device="meta")
    counts = []
    for run in (lambda: decoder.prefill(prompt), lambda: decoder.step(token, PROMPT)):
        counter = KernelCounter()  # as a generation runs them: the prefill, then a step
        with counter:
            run()
        counts.append(counter.kernels)
    return counts[1], counts[0]


class KernelCounter(TorchDispatchMode):
    """Counts the ATen operators dispatched inside it that are not views (a view launches
    no kernel; every other operator launches one on a GPU)."""

    def __init__(self) -> None:
        super().__init__()
        self.kernels = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:  # fmt: skip
        self.kernels += int(not func.is_view)
        return func(*args, **(kwargs or {}))


def step_ms(roofline_ms: float, kernels: int, costs: LaunchCosts) -> float:
    """A CUDA-graph decode step: the roofline plus each node's fixed cost."""
    return roofline_ms + kernels * costs.graph_us * 1e-3


def prefill_ms(roofline_ms: float, kernels: int, costs: LaunchCosts) -> float:
    """An eager prefill: the roofline, or the host's launches when they take longer."""
    return max(roofline_ms, kernels * costs.launch_us * 1e-3)
