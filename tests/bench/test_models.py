"""Every benchmark model builds deterministically, runs eager, and exports."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kiln.bench.suite import DEFAULT_MODEL, MODELS, get
from kiln.bench.suite.dlrm import DLRM
from kiln.bench.suite.swiglu import SwiGLUBlock, SwiGLUTower
from tests.support.compare import assert_close_to_reference

NAMES = sorted(MODELS)


def test_registry_covers_the_suite() -> None:
    assert len(MODELS) >= 11
    assert DEFAULT_MODEL in MODELS
    assert {m.kind for m in MODELS.values()} == {"mlp", "recsys", "transformer", "speech", "cnn"}
    with pytest.raises(KeyError, match="known"):
        get("no_such_model")


@pytest.mark.parametrize("name", NAMES)
def test_builds_deterministically_and_runs(name: str) -> None:
    spec = MODELS[name]
    m1, x1 = spec.build()
    m2, x2 = spec.build()
    assert not m1.training
    assert 1 <= spec.cpu_batch <= 64
    assert x1[0].shape[0] == spec.cpu_batch
    for a, b in zip(x1, x2, strict=True):
        assert torch.equal(a, b)
    s1, s2 = m1.state_dict(), m2.state_dict()
    assert all(torch.equal(s1[k], s2[k]) for k in s1)
    with torch.inference_mode():
        out = m1(*x1)
    outs = out if isinstance(out, tuple) else (out,)
    for o in outs:
        assert torch.isfinite(o).all()
        assert o.abs().max() > 0


@pytest.mark.parametrize("name", NAMES)
def test_gpu_shape_builds(name: str) -> None:
    spec = MODELS[name]
    _, inputs = spec.build("gpu")
    assert inputs[0].shape[0] == spec.gpu_batch


@pytest.mark.parametrize("name", NAMES)
def test_torch_export(name: str) -> None:
    """torch.export captures every model (none fail on torch 2.13) and the
    exported program computes what eager does."""
    model, inputs = MODELS[name].build()
    ep = torch.export.export(model, inputs)
    with torch.inference_mode():
        ref = model(*inputs)
        got = ep.module()(*inputs)
    refs = ref if isinstance(ref, tuple) else (ref,)
    gots = got if isinstance(got, tuple) else (got,)
    for r, g in zip(refs, gots, strict=True):
        # same kernels, but the exported graph may order reductions differently
        assert_close_to_reference(g, r, rtol_to_max=1e-5)


def test_dlrm_interaction_matches_pairwise_loop() -> None:
    model, (dense, sparse) = MODELS["dlrm"].build()
    assert isinstance(model, DLRM)
    with torch.inference_mode():
        x = model.bottom(dense)  # (B, 16)
        vecs = [x] + [t(sparse[:, i]) for i, t in enumerate(model.tables)]
        dots = [(vecs[i] * vecs[j]).sum(-1) for i in range(27) for j in range(i)]  # 351
        feats = torch.cat([x, torch.stack(dots, dim=1)], dim=1)  # (B, 367)
        assert_close_to_reference(model(dense, sparse), model.top(feats), rtol_to_max=1e-5)


def test_swiglu_tower_matches_formula() -> None:
    model, (x,) = MODELS["swiglu_tower"].build()
    assert isinstance(model, SwiGLUTower)
    with torch.inference_mode():
        y = x
        for blk in model.blocks:
            assert isinstance(blk, SwiGLUBlock)
            g, u, d = blk.gate.weight, blk.up.weight, blk.down.weight  # (864,320) x2, (320,864)
            y = y + (F.silu(y @ g.T) * (y @ u.T)) @ d.T
        assert_close_to_reference(model(x), y, rtol_to_max=1e-5)
