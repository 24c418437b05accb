"""How much of this machine's memory bandwidth a generation's weight reads took."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kiln.core.calibrate import load_profile
from kiln.deploy.generate_job import GenerateResult


@dataclass(frozen=True, kw_only=True)
class WeightBandwidth:
    """Weight bytes read per second while decoding, next to the measured peak."""

    weights_gbs: float  # weight bytes per token x tokens/s, in GB/s
    measured_gbs: float  # this machine's measured memory bandwidth (kiln calibrate)

    @property
    def share(self) -> float:
        return self.weights_gbs / self.measured_gbs


def weight_bandwidth(result: GenerateResult) -> WeightBandwidth:
    """The weights' read rate of ``result`` and the calibrated bandwidth at torch's
    thread count (cached; calibrated now, about a second, the first time)."""
    weights_gbs = result.weight_bytes * result.generation.tokens_per_s / 1e9
    profile = load_profile(threads=torch.get_num_threads())
    return WeightBandwidth(weights_gbs=weights_gbs, measured_gbs=profile.mem_bw_gbs)
