"""Sentence embeddings of a BERT encoder, and how close two sets of them are.

Embeddings are computed the way sentence-transformers does for all-MiniLM-L6-v2
(``modules.json``: Transformer -> Pooling(mean) -> Normalize): the encoder's last hidden
states are averaged over the real (attention-mask) tokens of each sentence, then scaled to
unit L2 norm. A compressed encoder is judged by ``mean_cosine`` of its embeddings to the
uncompressed encoder's on the same sentences (1.0 = identical directions).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.nn.functional as F

MAX_SEQ_LEN = 256  # all-MiniLM-L6-v2's sentence_bert_config.json max_seq_length


def _hidden_states(output: Any) -> torch.Tensor:
    """The (B, T, D) last hidden states from an encoder's output."""
    if isinstance(output, torch.Tensor):
        hidden = output
    elif hasattr(output, "last_hidden_state"):
        hidden = output.last_hidden_state
    else:
        hidden = output[0]
    if not isinstance(hidden, torch.Tensor) or hidden.dim() != 3:
        raise TypeError(f"encoder must return (B, T, D) hidden states, got {type(output)}")
    return hidden


def mean_pool(hidden: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Average of ``hidden`` (B, T, D) over positions where ``mask`` (B, T) is 1 -> (B, D)."""
    weights = mask.to(hidden.dtype).unsqueeze(-1)  # (B, T, 1)
    total = (hidden * weights).sum(dim=1)  # (B, D)
    count = weights.sum(dim=1).clamp(min=1e-9)  # (B, 1)
    return total / count


def embed(
    model: Callable[..., Any],
    tokenizer: Callable[..., Any],
    sentences: Sequence[str],
    batch_size: int = 32,
    max_length: int = MAX_SEQ_LEN,
) -> torch.Tensor:
    """Unit-norm sentence embeddings -> (n, D) float32, in the order of ``sentences``.

    ``model(input_ids=..., attention_mask=..., token_type_ids=...)`` is a BERT-style
    encoder (a Hugging Face ``AutoModel``) and ``tokenizer`` its tokenizer; sentences are
    truncated to ``max_length`` tokens and padded per batch.
    """
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    device = torch.device("cpu")
    if isinstance(model, torch.nn.Module):
        device = next(iter(model.parameters()), torch.empty(0)).device
    chunks: list[torch.Tensor] = []
    with torch.inference_mode():
        for i in range(0, len(sentences), batch_size):
            batch = list(sentences[i : i + batch_size])
            enc = tokenizer(
                batch, padding=True, truncation=True, max_length=max_length, return_tensors="pt"
            )
            enc = {k: v.to(device) for k, v in enc.items()}
            hidden = _hidden_states(model(**enc))  # (B, T, D)
            pooled = mean_pool(hidden.float(), enc["attention_mask"])  # (B, D)
            chunks.append(F.normalize(pooled, p=2.0, dim=-1).cpu())
    if not chunks:
        raise ValueError("no sentences to embed")
    return torch.cat(chunks)  # (n, D)


def cosines(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Cosine similarity of each row of ``a`` to the matching row of ``b`` (both (n, D))
    -> (n,) float64: the per-sentence figures behind ``mean_cosine`` and their spread."""
    if a.shape != b.shape or a.dim() != 2:
        raise ValueError(f"need two (n, D) tensors of one shape, got {a.shape} and {b.shape}")
    return F.cosine_similarity(a.double(), b.double(), dim=-1)  # (n,)


def mean_cosine(a: torch.Tensor, b: torch.Tensor) -> float:
    """Mean cosine similarity of matching rows of ``a`` and ``b`` (both (n, D))."""
    return float(cosines(a, b).mean())
