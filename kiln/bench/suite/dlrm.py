"""DLRM in the Criteo-Kaggle configuration (Naumov et al. 2019), small tables."""

from __future__ import annotations

import torch
from torch import nn

from kiln.bench.suite._base import BenchModel


def _mlp(dims: list[int], last_act: nn.Module | None) -> nn.Sequential:
    layers: list[nn.Module] = []
    for i, (a, b) in enumerate(zip(dims[:-1], dims[1:], strict=True)):
        layers.append(nn.Linear(a, b))
        is_last = i == len(dims) - 2
        layers.append(nn.ReLU() if not is_last else (last_act or nn.Identity()))
    return nn.Sequential(*layers)


class DLRM(nn.Module):
    """13 dense features through a bottom MLP 13-512-256-64-16, 26 categorical
    features through embedding tables of dim 16 (one index per feature, as in
    Criteo Kaggle), pairwise dot interaction of the 27 vectors (the 351 strict
    lower-triangle entries) concatenated with the bottom output (367), then a
    top MLP 367-512-256-1 with a sigmoid. Tables have ``rows`` rows each.
    """

    pairs: torch.Tensor  # (351,) flat indices of the strict lower triangle of (27, 27)

    def __init__(self, n_dense: int = 13, n_sparse: int = 26, dim: int = 16, rows: int = 1000):
        super().__init__()
        self.bottom = _mlp([n_dense, 512, 256, 64, dim], nn.ReLU())
        self.tables = nn.ModuleList(nn.Embedding(rows, dim) for _ in range(n_sparse))
        n = n_sparse + 1
        li, lj = torch.tril_indices(n, n, offset=-1)  # 351 pairs (i > j)
        self.register_buffer("pairs", li * n + lj, persistent=False)  # flat indices into n*n
        self.top = _mlp([dim + n * (n - 1) // 2, 512, 256, 1], nn.Sigmoid())

    def forward(self, dense: torch.Tensor, sparse: torch.Tensor) -> torch.Tensor:
        # dense (B, 13) float, sparse (B, 26) int64
        x = self.bottom(dense)  # (B, 16)
        embs = [t(sparse[:, i]) for i, t in enumerate(self.tables)]  # 26 x (B, 16)
        t = torch.stack([x] + embs, dim=1)  # (B, 27, 16)
        z = torch.bmm(t, t.transpose(1, 2))  # (B, 27, 27)
        zflat = z.flatten(1).index_select(1, self.pairs)  # (B, 351)
        return self.top(torch.cat([x, zflat], dim=1))  # (B, 1)


def _build(batch: int) -> tuple[nn.Module, tuple[torch.Tensor, ...]]:
    model = DLRM()
    dense = torch.log1p(torch.rand(batch, 13) * 100.0)  # Criteo-style log-transformed counts
    sparse = torch.randint(0, 1000, (batch, 26), dtype=torch.int64)
    return model, (dense, sparse)


MODELS = [
    BenchModel(
        name="dlrm",
        kind="recsys",
        builder=_build,
        cpu_batch=32,
        gpu_batch=2048,
        config="DLRM Criteo-Kaggle: 13 dense, 26 sparse x Embedding(1000, 16), bottom "
        "13-512-256-64-16, dot interaction, top 367-512-256-1; batch 32",
    )
]
