"""What "accuracy" means for the model being compressed: a task.

A task supplies the calibration batches, the loss whose gradients weight the
sensitivity estimate, and ``measure(model)``: the measured loss increase of a (partly
compressed) model over the original, in the same units as the predictions, on
held-out data that calibration never sees.

* ``LanguageModelTask``: next-token cross-entropy. Calibration windows of *Emma*; the
  measured increase is log(ppl / ppl_original) on *Pride and Prejudice* (sliding window,
  context 512, stride 256), so a budget of "1 % perplexity" is log(1.01) nats per token.
* ``EncoderTask``: unit-norm sentence embeddings; the loss is 1 - cos(e, e_original),
  whose Hessian is estimated with random output projections. Calibration on sentences of
  *Emma*, measurement on sentences of *Pride and Prejudice*.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from kiln.compress.moments import causal_lm_loss
from kiln.quality import corpus, embedding
from kiln.quality.perplexity import perplexity

Progress = Callable[[int, int], None]


@dataclass
class LanguageModelTask:
    model: nn.Module
    tokenizer: Any
    calib_samples: int = 16
    seq_len: int = 512
    eval_tokens: int = 4096
    batch_size: int = 2
    seed: int = 0
    progress: Progress | None = None
    _eval: Tensor | None = field(default=None, init=False, repr=False)
    _base_ppl: float | None = field(default=None, init=False, repr=False)

    kind = "lm"

    def calibration(self) -> list[Tensor]:
        ids = corpus.calibration_batches(
            self.tokenizer, self.calib_samples, self.seq_len, self.seed
        )
        return list(ids.split(self.batch_size))  # each (B, T)

    def loss_fn(self, model: nn.Module, batch: Tensor) -> Tensor:
        return causal_lm_loss(model, batch)

    def budget(self, max_increase: float) -> float:
        """Relative perplexity increase (0.01 = 1 %) -> loss budget in nats per token."""
        return math.log1p(max_increase)

    def describe(self, loss_increase: float) -> float:
        """Loss increase -> relative perplexity increase."""
        return math.expm1(loss_increase)

    def eval_ids(self) -> Tensor:
        if self._eval is None:
            self._eval = corpus.evaluation_tokens(self.tokenizer, self.eval_tokens)
        return self._eval

    def ppl(self, model: nn.Module) -> float:
        return perplexity(model, self.eval_ids(), progress=self.progress).ppl

    def baseline(self) -> float:
        """The original model's perplexity (measured once, before any compression)."""
        if self._base_ppl is None:
            self._base_ppl = self.ppl(self.model)
        return self._base_ppl

    def measure(self, model: nn.Module) -> float:
        if self._base_ppl is None:
            raise RuntimeError("call baseline() on the original model before measure()")
        return math.log(self.ppl(model) / self._base_ppl)


@dataclass
class EncoderTask:
    model: nn.Module
    tokenizer: Any
    calib_sentences: int = 256
    eval_sentences: int = 256
    batch_size: int = 32
    seed: int = 0
    _reference: Tensor | None = field(default=None, init=False, repr=False)
    _eval: list[str] | None = field(default=None, init=False, repr=False)

    kind = "encoder"

    def calibration(self) -> list[dict[str, Tensor]]:
        text = corpus.sentences(corpus.CALIBRATION_NOVEL, self.calib_sentences, seed=self.seed)
        return [
            dict(self.tokenizer(text[i : i + self.batch_size], padding=True, truncation=True,
                                max_length=embedding.MAX_SEQ_LEN, return_tensors="pt"))
            for i in range(0, len(text), self.batch_size)
        ]  # fmt: skip

    def loss_fn(self, model: nn.Module, batch: dict[str, Tensor]) -> Tensor:
        """v . e with v ~ N(0, I) per sentence: its gradient J^T v has E[g g^T] = J^T J,
        the Gauss-Newton Hessian of 1/2 |e' - e|^2 = 1 - cos(e', e) for unit vectors."""
        hidden = model(**batch).last_hidden_state  # (B, T, D)
        e = F.normalize(embedding.mean_pool(hidden.float(), batch["attention_mask"]), dim=-1)
        gen = torch.Generator().manual_seed(self.seed + int(batch["input_ids"].sum()))
        # Mean pooling divides each token's gradient by the sentence length T, but one
        # weight change moves every token's output alike, so the errors add up over the
        # sentence rather than averaging out: scale by T so the per-token Fisher counts
        # each token's error at full weight (measured: ~300x under-prediction without).
        lengths = batch["attention_mask"].sum(dim=1, keepdim=True).float()  # (B, 1)
        v = torch.randn(e.shape, generator=gen) * lengths
        return (v * e).sum()

    def budget(self, max_increase: float) -> float:
        """Allowed mean (1 - cosine): 0.01 keeps the mean cosine >= 0.99."""
        return max_increase

    def describe(self, loss_increase: float) -> float:
        return loss_increase

    def sentences(self) -> list[str]:
        if self._eval is None:
            self._eval = corpus.sentences(
                corpus.EVALUATION_NOVEL, self.eval_sentences, seed=self.seed
            )
        return self._eval

    def embed(self, model: nn.Module) -> Tensor:
        return embedding.embed(model, self.tokenizer, self.sentences(), self.batch_size)

    def baseline(self) -> float:
        if self._reference is None:
            self._reference = self.embed(self.model)
        return 1.0

    def cosine(self, model: nn.Module) -> float:
        if self._reference is None:
            raise RuntimeError("call baseline() on the original model before measuring")
        return embedding.mean_cosine(self.embed(model), self._reference)

    def measure(self, model: nn.Module) -> float:
        return 1.0 - self.cosine(model)


Task = LanguageModelTask | EncoderTask
