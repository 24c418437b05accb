"""Fused attention kernel against an independent float64 softmax(scale * q @ k^T + mask) @ v.

Without a GPU the kernel runs through Triton's interpreter (conftest.py), so shapes stay small;
small tiles (16 x 16) give several query and key tiles, with tails, even at these sizes.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor
from torch.nn.attention.bias import causal_lower_right

from kiln.core.compare import compare, tolerance

pytest.importorskip("triton")
from kiln.kernels.gpu import attention as att  # noqa: E402  (after the importorskip)

gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
# Rows with every key masked are 0 / 0 = NaN on purpose; the interpreter's numpy says so.
nan_rows = pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")
SMALL = att.AttentionConfig(16, 16)
DTYPES = [torch.float32, torch.float16, torch.bfloat16]


# ----------------------------------------------------------------------------------------------
# A float64 oracle and inputs, written apart from the kernel's file
# ----------------------------------------------------------------------------------------------


def ref64(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    scale: float = 1.0,
    mask: Tensor | None = None,
    causal: bool = False,
) -> Tensor:
    """float64 attention; causal keeps key j for query i iff j - i <= N - M."""
    s = scale * torch.einsum("bmd,bnd->bmn", q.double(), k.double())
    if mask is not None:
        s = s + mask.double()
    if causal:
        m, n = s.shape[-2:]
        i = torch.arange(m, device=s.device)[:, None]
        j = torch.arange(n, device=s.device)[None, :]
        s = s.masked_fill(j - i > n - m, float("-inf"))
    return torch.einsum("bmn,bne->bme", torch.softmax(s, dim=-1), v.double())


def qkv(
    b: int, m: int, n: int, d: int, dv: int, dtype: torch.dtype, device: torch.device
) -> tuple[Tensor, Tensor, Tensor]:
    q = torch.randn(b, m, d, device=device).to(dtype)
    k = torch.randn(b, n, d, device=device).to(dtype)
    v = torch.randn(b, n, dv, device=device).to(dtype)
    return q, k, v


def make_mask(kind: str, b: int, m: int, n: int, device: torch.device) -> Tensor | None:
    if kind == "none":
        return None
    if kind == "additive":  # (1, M, N): a bias with ~20% -inf entries
        bias = 0.5 * torch.randn(1, m, n, device=device)
        return bias.masked_fill(torch.rand(1, m, n, device=device) < 0.2, float("-inf"))
    # "padding": (B, 1, N), the last keys of batch entry 1 are padding; stride 0 along M
    pad = torch.zeros(b, 1, n, device=device)
    pad[1, :, n - n // 3 :] = float("-inf")
    return pad


def check(out: Tensor, expected: Tensor) -> None:
    r = compare(out, expected)
    assert r.ok, r.detail


# ----------------------------------------------------------------------------------------------
# Values against the oracle
# ----------------------------------------------------------------------------------------------


@nan_rows
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("mask_kind", ["none", "additive", "padding"])
@pytest.mark.parametrize(
    ("b", "m", "n", "d", "dv"),
    [(2, 7, 5, 16, 16), (2, 33, 70, 40, 80), (2, 33, 18, 64, 40)],
    ids=lambda s: str(s),
)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_matches_reference(
    dtype: torch.dtype,
    b: int,
    m: int,
    n: int,
    d: int,
    dv: int,
    mask_kind: str,
    causal: bool,
    device: torch.device,
) -> None:
    q, k, v = qkv(b, m, n, d, dv, dtype, device)
    mask = make_mask(mask_kind, b, m, n, device)
    scale = d**-0.5
    out = att.attention(q, k, v, scale=scale, mask=mask, causal=causal, config=SMALL)
    check(out, ref64(q, k, v, scale, mask, causal).to(dtype))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_default_config_and_scale(dtype: torch.dtype, device: torch.device) -> None:
    q, k, v = qkv(3, 20, 45, 96, 24, dtype, device)
    check(att.attention(q, k, v), ref64(q, k, v).to(dtype))  # scale 1: peaky softmax
    check(att.attention(q, k, v, scale=0.1), ref64(q, k, v, 0.1).to(dtype))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_strided_views_and_cast_on_store(dtype: torch.dtype, device: torch.device) -> None:
    """q transposed, k given as kT.transpose(1, 2), v permuted, a 2-D mask transposed, and a
    strided out of another dtype; nothing may be copied, every out entry must be written."""
    b, m, n, d, dv = 2, 21, 37, 40, 24
    q = torch.randn(b, d, m, device=device).to(dtype).transpose(1, 2)  # (B, M, D)
    kt = torch.randn(b, d, n, device=device).to(dtype)  # a caller holding k^T
    v = torch.randn(n, b, dv, device=device).to(dtype).permute(1, 0, 2)  # (B, N, Dv)
    mask = torch.randn(n, m, device=device).T  # (M, N), column-major
    out_dtype = torch.float32 if dtype != torch.float32 else torch.float16
    store = torch.full((dv, b, m), float("nan"), device=device, dtype=out_dtype)
    out = store.permute(1, 2, 0)  # (B, M, Dv), no dim contiguous
    got = att.attention(q, kt.transpose(1, 2), v, scale=0.2, mask=mask, causal=True, out=out)
    assert got.data_ptr() == out.data_ptr()
    expected = ref64(q, kt.transpose(1, 2), v, 0.2, mask, causal=True)
    if out_dtype == torch.float32:
        # Half inputs: p is rounded to the inputs' dtype before p @ v (tensor cores), so the
        # fp32 output carries half-precision error; compare at the inputs' tolerance.
        r = compare(got, expected.float(), tolerance(dtype))
        assert r.ok, r.detail
    else:
        check(got, expected.to(out_dtype))


@nan_rows
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_masked_leading_key_tiles_and_fully_masked_rows(
    dtype: torch.dtype, device: torch.device
) -> None:
    """Rows 0-3 see only keys >= 40 (their first key tiles are all -inf: the running max is
    -inf there), rows 4-5 see nothing (NaN, like eager), row 6 sees only the last key."""
    b, m, n, d = 2, 9, 70, 32
    q, k, v = qkv(b, m, n, d, d, dtype, device)
    mask = torch.zeros(m, n, device=device)
    mask[:4, :40] = float("-inf")
    mask[4:6] = float("-inf")
    mask[6, :-1] = float("-inf")
    out = att.attention(q, k, v, scale=0.3, mask=mask, config=SMALL)
    expected = ref64(q, k, v, 0.3, mask).to(dtype)
    assert out[:, 4:6].isnan().all() and not out[:, :4].isnan().any()
    check(out, expected)


@nan_rows
def test_causal_with_more_queries_than_keys(device: torch.device) -> None:
    """Bottom-right alignment: with M > N the first M - N query rows see no key (NaN)."""
    q, k, v = qkv(1, 40, 17, 16, 16, torch.float32, device)
    out = att.attention(q, k, v, causal=True, config=SMALL)
    assert out[:, :23].isnan().all() and not out[:, 23:].isnan().any()
    check(out, ref64(q, k, v, causal=True).float())


def test_head_dim_256(device: torch.device) -> None:
    q, k, v = qkv(1, 5, 19, 256, 200, torch.float16, device)
    check(att.attention(q, k, v, scale=1 / 16), ref64(q, k, v, 1 / 16).half())


def test_empty_sizes(device: torch.device) -> None:
    q, k, v = qkv(2, 3, 0, 16, 8, torch.float32, device)
    assert torch.equal(att.attention(q, k, v), torch.zeros(2, 3, 8, device=device))  # as eager
    q, k, v = qkv(2, 0, 4, 16, 8, torch.float32, device)
    assert att.attention(q, k, v).shape == (2, 0, 8)


def test_oracle_pins_causal_alignment_to_sdpa() -> None:
    """The oracle's causal rule is torch's: is_causal for M == N, lower-right for M != N."""
    q, k, v = qkv(2, 12, 12, 16, 16, torch.float64, torch.device("cpu"))
    sdpa = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=0.25)
    check(ref64(q, k, v, 0.25, causal=True), sdpa)
    q, k, v = qkv(2, 7, 12, 16, 16, torch.float64, torch.device("cpu"))
    sdpa = F.scaled_dot_product_attention(q, k, v, attn_mask=causal_lower_right(7, 12))
    check(ref64(q, k, v, 16**-0.5, causal=True), sdpa)


def test_cpu_fallback_without_interpreter(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    q, k, v = qkv(2, 6, 9, 16, 8, torch.bfloat16, torch.device("cpu"))
    mask = torch.randn(2, 1, 9)
    expected = att.attention_reference(q, k, v, scale=0.5, mask=mask, causal=True)
    assert expected.dtype == torch.bfloat16
    assert torch.equal(att.attention(q, k, v, scale=0.5, mask=mask, causal=True), expected)
    out = torch.empty(2, 6, 8)
    att.attention(q, k, v, scale=0.5, mask=mask, causal=True, out=out)
    check(out, ref64(q, k, v, 0.5, mask, causal=True).float())


# ----------------------------------------------------------------------------------------------
# Configurations and validation
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("d", [16, 40, 64, 128, 256])
def test_configs_suit_the_kernel(d: int) -> None:
    configs = att.attention_configs(d)
    assert configs and len(set(configs)) == len(configs)
    for dtype in DTYPES:
        assert isinstance(att.default_config(d, dtype), att.AttentionConfig)
    with pytest.raises(ValueError, match="power of two"):
        att.AttentionConfig(16, 24)
    with pytest.raises(ValueError, match="power of two"):
        att.AttentionConfig(8, 16)


def test_rejects_bad_operands() -> None:
    q, k, v = qkv(2, 4, 6, 16, 8, torch.float32, torch.device("cpu"))
    bad: list[tuple[tuple[Tensor, Tensor, Tensor], dict[str, object], str]] = [
        ((q, k[..., :8], v), {}, r"k must be \(B, N, D\) = \(2, N, 16\) .*\(2, 6, 8\)"),
        ((q, k[:1], v), {}, "k must be"),
        ((q, k, v[:, :5]), {}, r"v must be .*got \(2, 5, 8\)"),
        ((q[0], k, v), {}, "q must be 3-D"),
        ((q, k.half(), v), {}, "dtypes differ"),
        ((q.double(), k.double(), v.double()), {}, "q must be float32"),
        ((q, k.to("meta"), v), {}, "k is on meta but q is on cpu"),
        ((q, k, v), {"mask": torch.zeros(2, 4, 5)}, r"mask \(2, 4, 5\) does not broadcast"),
        ((q, k, v), {"mask": torch.zeros(3, 1, 6)}, "does not broadcast"),
        ((q, k, v), {"mask": torch.zeros(4, 6, dtype=torch.bool)}, "must be additive"),
        ((q, k, v), {"mask": torch.zeros(4, 6, device="meta")}, "mask is on meta"),
        ((q, k, v), {"out": torch.empty(2, 4, 16)}, r"out must be .*\(2, 4, 8\), got"),
        ((q, k, v), {"out": torch.empty(2, 4, 8, dtype=torch.int32)}, "out must be float32"),
    ]
    big = torch.randn(1, 2, 257)
    bad.append(((big, big, big), {}, "head dims must be <= 256"))
    for args, kwargs, match in bad:
        with pytest.raises(ValueError, match=match):
            att.attention(*args, **kwargs)  # type: ignore[arg-type]


# ----------------------------------------------------------------------------------------------
# GPU only: the compiled kernel at model-like sizes, default and every candidate configuration
# ----------------------------------------------------------------------------------------------


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("d", [64, 80, 128, 256])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_gpu_model_sizes(dtype: torch.dtype, d: int, causal: bool) -> None:
    device = torch.device("cuda")
    q, k, v = qkv(4, 300, 515, d, d, dtype, device)
    mask = make_mask("padding", 4, 300, 515, device)
    expected = ref64(q, k, v, d**-0.5, mask, causal).to(dtype)
    check(att.attention(q, k, v, scale=d**-0.5, mask=mask, causal=causal), expected)
    if dtype == torch.float16:
        for cfg in att.attention_configs(d):
            out = att.attention(q, k, v, scale=d**-0.5, mask=mask, causal=causal, config=cfg)
            r = compare(out, expected)
            assert r.ok, f"{cfg}: {r.detail}"
