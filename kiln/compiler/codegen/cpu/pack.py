"""Compile-time packing of GEMM weights into the panel layout of kiln_gemm.h.

The layout (see kiln_gemm.h): B (K, N) becomes ceil(N / NR) column panels of NR = 2 * W
columns (W = float lanes: 16 on AVX-512, 8 on AVX2), zero-padded, each panel k-major:

    Bp[p, k, j] = B[k, p * NR + j]      Bp: (P, K, NR), contiguous

so the flat memory is exactly ``Bp[p * K * NR + k * NR + j]``, what ``kg::gemm_panel`` reads.
"""

from __future__ import annotations

import torch
from torch import Tensor

from kiln.compiler.codegen.cpu import build

_NR = {"avx512": 32, "avx2": 16}


def nr(isa: str | None = None) -> int:
    """Panel width NR (columns) for ``isa`` ("avx512" or "avx2"; default: this machine)."""
    key = isa if isa is not None else build.isa()
    if key not in _NR:
        raise ValueError(f"unknown ISA {key!r}; expected one of {sorted(_NR)}")
    return _NR[key]


def pack_b(b: Tensor, isa: str | None = None) -> Tensor:
    """Pack ``b`` (K, N) fp32 into panels: returns a contiguous (P, K, NR) fp32 tensor.

    P = ceil(N / NR); columns past N are zero. Pass ``isa`` to pack for another machine.
    """
    if b.dim() != 2:
        raise ValueError(f"pack_b expects a 2-D (K, N) tensor, got shape {tuple(b.shape)}")
    n_r = nr(isa)
    k, n = b.shape
    panels = -(-n // n_r)
    padded = torch.zeros(k, panels * n_r, dtype=torch.float32)  # (K, P * NR)
    padded[:, :n] = b.detach().to(device="cpu", dtype=torch.float32)
    return padded.view(k, panels, n_r).permute(1, 0, 2).contiguous()  # (P, K, NR)
