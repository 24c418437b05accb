"""Running one call at one thread and at several: kernels that promise the same bits
whatever torch's thread count is (each output summed by one thread in a fixed order)."""

from __future__ import annotations

from collections.abc import Callable

import torch


def at_one_and_many_threads(
    fn: Callable[[], torch.Tensor],
) -> tuple[torch.Tensor, torch.Tensor]:
    """fn() at 1 thread, then at max(2, torch's count); the count is restored after."""
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = fn()
        torch.set_num_threads(max(2, before))
        many = fn()
    finally:
        torch.set_num_threads(before)
    return one, many
