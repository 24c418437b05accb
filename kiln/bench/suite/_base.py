"""The ``BenchModel`` record and small helpers shared by the model families.

Every model is built in code with random weights from a fixed seed, so the parent
runner and each worker process rebuild bit-identical modules and inputs without
handing weights over.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

SEED = 0

# builder(batch) -> (module, example_inputs); called under a fixed RNG seed.
Builder = Callable[[int], tuple[nn.Module, tuple[Any, ...]]]


@dataclass(frozen=True)
class BenchModel:
    """One benchmark model.

    ``kind`` is the family (``mlp``, ``recsys``, ``transformer``, ``speech``, ``cnn``);
    ``config`` states the architecture and input shape in words (it goes into results);
    ``cpu_batch`` is the batch used for CPU timing (1-64), ``gpu_batch`` the one
    kept for GPU runs later.
    """

    name: str
    kind: str
    builder: Builder
    cpu_batch: int
    gpu_batch: int
    config: str
    tags: tuple[str, ...] = field(default=())

    def build(self, target: str = "cpu", seed: int = SEED) -> tuple[nn.Module, tuple[Any, ...]]:
        """Build ``(module.eval(), example_inputs)`` at the ``cpu`` or ``gpu`` shape.

        The global RNG is seeded (and restored afterwards), so two calls in two
        processes give identical weights and inputs. Tensors stay on the CPU.
        """
        if target not in ("cpu", "gpu"):
            raise ValueError(f"target must be 'cpu' or 'gpu', got {target!r}")
        batch = self.cpu_batch if target == "cpu" else self.gpu_batch
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            module, inputs = self.builder(batch)
        module.eval()
        for p in module.parameters():
            p.requires_grad_(False)
        return module, inputs


def randomize_norm_stats(module: nn.Module) -> None:
    """Give every BatchNorm non-trivial running statistics and affine parameters.

    Default BN buffers (mean 0, var 1, weight 1, bias 0) make eval-mode BN an
    identity, which would hide folding mistakes; these values keep activations
    at unit scale while making each normalisation do real work.
    """
    for m in module.modules():
        if isinstance(m, nn.modules.batchnorm._BatchNorm):
            c = m.num_features
            assert m.running_mean is not None and m.running_var is not None
            m.running_mean.copy_(0.1 * torch.randn(c))
            m.running_var.copy_(torch.rand(c) * 0.5 + 0.75)
            if m.affine:
                m.weight.data.copy_(torch.rand(c) * 0.5 + 0.75)
                m.bias.data.copy_(0.1 * torch.randn(c))
        elif isinstance(m, nn.LayerNorm | nn.InstanceNorm2d) and m.weight is not None:
            m.weight.data.copy_(torch.rand_like(m.weight) * 0.5 + 0.75)
            if m.bias is not None:
                m.bias.data.copy_(0.1 * torch.randn_like(m.bias))
