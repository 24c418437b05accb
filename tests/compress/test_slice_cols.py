"""slice_cols: a compressed layer restricted to input features [start, stop).

The reference is the unsliced layer's own dense weight: the slice must hold exactly its
columns (no requantization), keep the whole bias, and refuse boundaries its format cannot
cut (INT4 inside a group, 2:4 inside a group of 4).
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from kiln.compress.configs import Int4WeightOnly, Int8WeightOnly, LowRank, SemiStructured24
from kiln.compress.layer import compress_linear
from tests.support.compare import assert_close_to_reference

# (config, a legal [start, stop) for K = 128)
CASES = [
    (Int8WeightOnly(), (3, 77)),
    (Int4WeightOnly(group_size=32), (32, 96)),
    (SemiStructured24(), (4, 52)),  # starts inside a packed byte: nibbles are repacked
    (LowRank(rank=8), (5, 128)),
]


@pytest.mark.parametrize(("config", "cols"), CASES, ids=lambda c: getattr(c, "name", str(c)))
def test_slice_cols_holds_exactly_those_columns(config, cols: tuple[int, int]) -> None:
    torch.manual_seed(0)
    q = compress_linear(nn.Linear(128, 48), config)
    start, stop = cols
    part = q.slice_cols(start, stop)
    assert (part.in_features, part.out_features) == (stop - start, 48)
    assert torch.equal(part.dense_weight(), q.dense_weight()[:, start:stop])
    assert part.bias is not None and q.bias is not None and torch.equal(part.bias, q.bias)
    whole = {t.untyped_storage().data_ptr() for t in q.buffers()}
    assert not whole & {t.untyped_storage().data_ptr() for t in part.buffers()}  # own storage
    x = torch.randn(3, stop - start)
    with torch.no_grad():
        expected = x @ q.dense_weight()[:, start:stop].T + q.bias
        assert_close_to_reference(part(x), expected, rtol_to_max=2e-5)


@pytest.mark.parametrize("config", [c for c, _ in CASES], ids=lambda c: c.name)
def test_column_slices_sum_to_the_whole(config) -> None:
    """Row-parallel use: partial products of disjoint slices add up to the full product."""
    torch.manual_seed(1)
    q = compress_linear(nn.Linear(128, 48, bias=False), config)
    x = torch.randn(2, 128)
    with torch.no_grad():
        total = q.slice_cols(0, 64)(x[:, :64]) + q.slice_cols(64, 128)(x[:, 64:])
        assert_close_to_reference(total, q(x), rtol_to_max=2e-5)


def test_int4_refuses_a_cut_inside_a_group() -> None:
    q = compress_linear(nn.Linear(128, 16), Int4WeightOnly(group_size=32))
    with pytest.raises(ValueError, match="column 48 is not a multiple of 32"):
        q.slice_cols(0, 48)


def test_sparse24_refuses_bad_boundaries() -> None:
    q = compress_linear(nn.Linear(128, 16), SemiStructured24())
    with pytest.raises(ValueError, match="multiple of 4"):
        q.slice_cols(2, 34)
    with pytest.raises(ValueError, match="multiple of 8"):
        q.slice_cols(0, 12)


def test_refuses_an_empty_or_outside_range() -> None:
    q = compress_linear(nn.Linear(128, 16), Int8WeightOnly())
    with pytest.raises(ValueError, match="not a non-empty range"):
        q.slice_cols(64, 64)
    with pytest.raises(ValueError, match="not a non-empty range"):
        q.slice_cols(0, 129)
