"""kiln.kernels.cpu.panels: one repacked copy per source tensor, while anyone holds it, and
a new one when the source changes."""

from __future__ import annotations

import gc

import torch

from kiln.core.huge_pages import HUGE_PAGE, huge_page_empty, thp_mode
from kiln.kernels.cpu import panels as kp


def test_int8_panels_are_shared_while_held_and_remade_after_a_change() -> None:
    q = torch.randint(-127, 128, (40, 64), dtype=torch.int8)
    scale = torch.rand(40)
    w, s = kp.int8_panels(q, scale, 16)
    assert torch.equal(w, kp.panels_int8(q, 16)) and torch.equal(s[:40], scale)
    assert not s[40:].any()  # padding to whole panels
    again, _ = kp.int8_panels(q, scale, 16)
    assert again is w  # the same copy, not a second one
    q[0, 0] = -q[0, 0] - 1  # in place: the version counter moves
    changed, _ = kp.int8_panels(q, scale, 16)
    assert changed is not w and torch.equal(changed, kp.panels_int8(q, 16))
    assert kp.int8_panels(q, scale, 8)[0].shape == (5, 64, 8)  # other lanes: another copy


def test_int4_panels_go_with_their_last_user() -> None:
    packed = torch.randint(0, 256, (16, 32), dtype=torch.uint8)
    scale, offset = torch.rand(16, 2).half(), torch.rand(16, 2).half()
    rec = kp.int4_panels(packed, scale, offset, 32, 8)
    assert torch.equal(rec, kp.panels_int4(packed, scale, offset, 32, 8))
    assert kp.int4_panels(packed, scale, offset, 32, 8) is rec
    del rec
    gc.collect()
    assert kp._SHARED[("int4", id(packed))][3][0]() is None  # nobody held it: it is gone
    fresh = kp.int4_panels(packed, scale, offset, 32, 8)  # and is made again
    assert torch.equal(fresh, kp.panels_int4(packed, scale, offset, 32, 8))


def test_huge_page_empty_carves_aligned_tensors() -> None:
    a, b = huge_page_empty((3, 5), torch.float32), huge_page_empty((7,), torch.int8)
    assert a.shape == (3, 5) and a.dtype == torch.float32 and a.is_contiguous()
    assert b.shape == (7,) and b.dtype == torch.int8
    if thp_mode() in ("always", "madvise"):
        assert a.data_ptr() % 64 == 0 and b.data_ptr() % 64 == 0
        big = huge_page_empty((HUGE_PAGE * 16,), torch.uint8)  # over a quarter chunk: its own
        assert big.data_ptr() % HUGE_PAGE == 0
