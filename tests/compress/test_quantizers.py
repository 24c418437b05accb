"""Round-to-nearest quantizers, packing and the error-compensating (OBS) variants."""

from __future__ import annotations

import pytest
import torch

from kiln.compress import obs
from kiln.compress import quantizers as qz
from kiln.core.compare import sqnr_db
from kiln.kernels.formats import pack_int4, unpack_int4
from tests.support.compare import assert_close_to_reference


def gaussian(n: int, k: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(n, k, generator=torch.Generator().manual_seed(seed))


def test_int8_sqnr_above_35db() -> None:
    w = gaussian(256, 512)
    q, scale = qz.quantize_int8(w)
    assert q.dtype == torch.int8 and scale.shape == (256,)
    assert sqnr_db(w, q.float() * scale[:, None]) > 35


@pytest.mark.parametrize("group_size", [32, 64, 128])
@pytest.mark.parametrize("symmetric", [True, False])
def test_int4_sqnr_and_grid(group_size: int, symmetric: bool) -> None:
    w = gaussian(64, 256, seed=group_size)
    q, scale, offset = qz.quantize_int4(w, group_size, symmetric)
    assert q.max() <= 15 and scale.dtype == torch.float16 and scale.shape == (64, 256 // group_size)
    deq = qz.dequantize_int4_codes(q, scale, offset)
    if group_size == 32:
        assert sqnr_db(w, deq) > 18
    # every weight lands within half a step of its grid value (plus clamping at the ends)
    step = scale.float().repeat_interleave(group_size, dim=1)
    lo = offset.float().repeat_interleave(group_size, dim=1)
    inside = (w >= lo - 0.5 * step) & (w <= lo + 15.5 * step)
    assert bool(((deq - w).abs() <= 0.5 * step * 1.001 + 1e-6)[inside].all())
    if symmetric:
        assert torch.equal(offset, -8 * scale)


def test_int4_asymmetric_is_exact_on_its_own_grid() -> None:
    """Weights already on a 16-level grid per group (like a Q4_1 file) come back exactly."""
    gen = torch.Generator().manual_seed(3)
    scale = torch.rand(8, 4, generator=gen).half() + 0.01
    offset = -torch.rand(8, 4, generator=gen).half()
    codes = torch.randint(0, 16, (8, 128), generator=gen, dtype=torch.uint8)
    codes[:, ::32] = 0  # each group spans its full range
    codes[:, 1::32] = 15
    w = qz.dequantize_int4_codes(codes, scale, offset)
    q, s, o = qz.quantize_int4(w, 32, symmetric=False)
    # fp16 scale / offset rounding: the old atol=2e-3 over max |w| ~13.6
    assert_close_to_reference(qz.dequantize_int4_codes(q, s, o), w, rtol_to_max=1.5e-4)


def test_pack_unpack_roundtrip() -> None:
    q = torch.randint(0, 16, (5, 64), dtype=torch.uint8)
    packed = pack_int4(q)
    assert packed.shape == (5, 32)
    assert torch.equal(packed[:, 0], q[:, 0] | (q[:, 1] << 4))
    assert torch.equal(unpack_int4(packed), q)


def test_mask_24_keeps_two_largest() -> None:
    w = torch.tensor([[0.1, -3.0, 2.0, 0.5, 1.0, 1.0, -0.2, 0.0]])
    mask = qz.mask_24_magnitude(w)
    assert mask.tolist() == [[False, True, True, False, True, True, False, False]]


def correlated_inputs(k: int, rows: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    mix = torch.randn(k, k, generator=gen) / k**0.5 + torch.eye(k)
    return torch.randn(rows, k, generator=gen) @ mix  # (rows, K)


def output_error(w: torch.Tensor, wq: torch.Tensor, x: torch.Tensor) -> float:
    return float(((w - wq) @ x.T).pow(2).sum())


@pytest.mark.parametrize("kind", ["int8", "int4", "2:4"])
def test_obs_beats_round_to_nearest_on_outputs(kind: str) -> None:
    """GPTQ / SparseGPT minimise the output error on the calibration inputs, so they
    must beat round-to-nearest / magnitude pruning there."""
    w, x = gaussian(48, 256, seed=1), correlated_inputs(256, 2048, seed=2)
    h = x.T @ x / x.shape[0]
    if kind == "int8":
        q, s = obs.gptq_int8(w, h)
        ours = q.float() * s[:, None]
        q0, s0 = qz.quantize_int8(w)
        base = q0.float() * s0[:, None]
    elif kind == "int4":
        ours = qz.dequantize_int4_codes(*obs.gptq_int4(w, h, 64, True))
        base = qz.dequantize_int4_codes(*qz.quantize_int4(w, 64, True))
    else:
        ours = obs.sparsegpt_24(w, h)
        base = w * qz.mask_24_magnitude(w)
        assert bool(((ours.reshape(48, -1, 4) != 0).sum(-1) <= 2).all())
    assert output_error(w, ours, x) < 0.9 * output_error(w, base, x)


def test_inverse_hessian_factor_matches_inverse() -> None:
    x = correlated_inputs(32, 500, seed=5)
    h = x.T @ x / 500
    u = obs.inverse_hessian_factor(h, damp=0.0).double()
    # entries span 1e7 (median) to 3e8 (max): 1e-6 of the max is ~2e-5 of a median entry
    assert_close_to_reference(u.T @ u, torch.linalg.inv(h.double()), rtol_to_max=1e-6)
