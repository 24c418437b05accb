"""BERT-small encoder (hidden 256, 4 layers, 4 heads), written out in code."""

from __future__ import annotations

import torch
from torch import nn

from kiln.bench.suite._base import BenchModel, randomize_norm_stats
from kiln.bench.suite._blocks import EncoderLayer


class BertSmall(nn.Module):
    """Token + position + segment embeddings, embedding LayerNorm, then post-LN
    encoder layers (hidden 256, 4 heads, FFN 1024, GELU). Returns the last
    hidden state. The vocabulary is cut to 8192 rows (from 30522) so the
    embedding table does not dominate the model's bytes; only 64 rows are read.
    """

    def __init__(
        self,
        vocab: int = 8192,
        hidden: int = 256,
        layers: int = 4,
        heads: int = 4,
        max_pos: int = 512,
    ) -> None:
        super().__init__()
        self.tok = nn.Embedding(vocab, hidden)
        self.pos = nn.Embedding(max_pos, hidden)
        self.seg = nn.Embedding(2, hidden)
        self.ln = nn.LayerNorm(hidden, eps=1e-12)
        self.layers = nn.ModuleList(
            EncoderLayer(hidden, heads, 4 * hidden, pre_norm=False, eps=1e-12)
            for _ in range(layers)
        )

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        # ids (B, T) int64
        t = ids.shape[1]
        pos = torch.arange(t, device=ids.device)  # (T,)
        x = self.tok(ids) + self.pos(pos) + self.seg.weight[0]  # (B, T, C)
        x = self.ln(x)
        for layer in self.layers:
            x = layer(x)
        return x  # (B, T, C)


def _build(batch: int) -> tuple[nn.Module, tuple[torch.Tensor, ...]]:
    model = BertSmall()
    randomize_norm_stats(model)
    return model, (torch.randint(0, 8192, (batch, 64), dtype=torch.int64),)


MODELS = [
    BenchModel(
        name="bert_small",
        kind="transformer",
        builder=_build,
        cpu_batch=1,
        gpu_batch=64,
        config="BERT-small encoder: hidden 256, 4 layers, 4 heads, FFN 1024, vocab 8192, "
        "seq 64; batch 1",
    )
]
