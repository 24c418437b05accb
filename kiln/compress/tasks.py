"""What "accuracy" means for the model being compressed: a task.

A task supplies the calibration batches, the loss whose gradients weight the sensitivity
estimate, and two measurements of a (partly compressed) model against the original, in the
same units as the predictions, each with a confidence margin (``kiln.quality.spread``):

* ``measure_search(model)``: on the *search* text, the one plans are tuned on. The search
  accepts a plan only if its increase plus margin is within the budget.
* ``measure_confirmation(model)``: on the *confirmation* text, a different novel that
  neither calibration nor the search ever sees. The chosen plan's figure there is its
  reported accuracy.

``measure(model)`` is the search text's increase alone (no margin).

* ``LanguageModelTask``: next-token cross-entropy. Calibration windows of *Emma*; the
  increase is log(ppl / ppl_original) on the first tokens of *Pride and Prejudice*
  (search) or *Sense and Sensibility* (confirmation), sliding window (context 512, stride
  256), so a budget of "1 % perplexity" is log(1.01) nats per token. The margin comes from
  the per-window paired difference of mean NLL between the compressed and original model.
* ``EncoderTask``: unit-norm sentence embeddings; the loss is 1 - cos(e, e_original), whose
  Hessian is estimated with random output projections. Calibration on sentences of *Emma*;
  search on sentences of *Pride and Prejudice*, confirmation on sentences of *Sense and
  Sensibility*; the margin comes from the per-sentence spread of 1 - cos.
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
from kiln.quality.perplexity import WindowLosses, window_losses
from kiln.quality.spread import Z_ONE_SIDED_95, PairedDifference, paired_difference

Progress = Callable[[int, int], None]
CONFIRM_TOKENS = 20_000  # the benchmark protocol's confirmation text: 20k tokens of S&S
CONFIRM_SENTENCES = 1024  # an encoder's confirmation sentences of S&S (3,976 are long enough)


@dataclass
class LanguageModelTask:
    model: nn.Module
    tokenizer: Any
    calib_samples: int = 16
    seq_len: int = 512
    eval_tokens: int = 4096  # search text: the first tokens of Pride and Prejudice
    confirm_tokens: int = CONFIRM_TOKENS  # confirmation: the first tokens of S&S
    context: int = 512  # perplexity window
    stride: int = 256
    z: float = Z_ONE_SIDED_95  # margins are z standard errors of the mean difference
    batch_size: int = 2
    seed: int = 0
    progress: Progress | None = None
    _eval: Tensor | None = field(default=None, init=False, repr=False)
    _confirm: Tensor | None = field(default=None, init=False, repr=False)
    _base: WindowLosses | None = field(default=None, init=False, repr=False)
    _base_confirm: WindowLosses | None = field(default=None, init=False, repr=False)

    kind = "lm"

    @property
    def search_text(self) -> str:
        return f"{corpus.TITLES[corpus.SEARCH_NOVEL]} (first {self.eval_tokens:,} tokens)"

    @property
    def confirm_text(self) -> str:
        return f"{corpus.TITLES[corpus.CONFIRMATION_NOVEL]} (first {self.confirm_tokens:,} tokens)"

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
        """The search text's token ids -> (eval_tokens,) int64."""
        if self._eval is None:
            self._eval = corpus.search_tokens(self.tokenizer, self.eval_tokens)
        return self._eval

    def confirm_ids(self) -> Tensor:
        """The confirmation text's token ids -> (confirm_tokens,) int64."""
        if self._confirm is None:
            self._confirm = corpus.confirmation_tokens(self.tokenizer, self.confirm_tokens)
        return self._confirm

    def _losses(self, model: nn.Module, ids: Tensor) -> WindowLosses:
        return window_losses(model, ids, self.context, self.stride, progress=self.progress)

    def ppl(self, model: nn.Module) -> float:
        """``model``'s perplexity on the search text."""
        return self._losses(model, self.eval_ids()).total().ppl

    def baseline(self) -> float:
        """The original model's perplexity on the search text. The first call (which must be
        on the original model, before any compression) scores it on both texts."""
        if self._base is None:
            self._base = self._losses(self.model, self.eval_ids())
            self._base_confirm = self._losses(self.model, self.confirm_ids())
        return self._base.total().ppl

    def confirm_baseline(self) -> float:
        """The original model's perplexity on the confirmation text."""
        self.baseline()
        assert self._base_confirm is not None
        return self._base_confirm.total().ppl

    def _paired(
        self, model: nn.Module, ids: Callable[[], Tensor], base: WindowLosses | None
    ) -> PairedDifference:
        """Per-window paired difference of mean NLL against the original: the token-weighted
        mean is exactly log(ppl / ppl_original)."""
        if base is None:
            raise RuntimeError("call baseline() on the original model before measuring")
        losses = self._losses(model, ids())
        diffs = losses.mean_nll - base.mean_nll  # (W,) nats per token, window by window
        return paired_difference(diffs, base.counts, self.z)

    def measure_search(self, model: nn.Module) -> PairedDifference:
        return self._paired(model, self.eval_ids, self._base)

    def measure_confirmation(self, model: nn.Module) -> PairedDifference:
        return self._paired(model, self.confirm_ids, self._base_confirm)

    def measure(self, model: nn.Module) -> float:
        return self.measure_search(model).mean


@dataclass
class EncoderTask:
    model: nn.Module
    tokenizer: Any
    calib_sentences: int = 256
    eval_sentences: int = 256  # search: sentences of Pride and Prejudice
    confirm_sentences: int = CONFIRM_SENTENCES  # confirmation: sentences of S&S
    batch_size: int = 32
    z: float = Z_ONE_SIDED_95
    seed: int = 0
    _reference: Tensor | None = field(default=None, init=False, repr=False)
    _confirm_reference: Tensor | None = field(default=None, init=False, repr=False)
    _eval: list[str] | None = field(default=None, init=False, repr=False)
    _confirm: list[str] | None = field(default=None, init=False, repr=False)

    kind = "encoder"

    @property
    def search_text(self) -> str:
        return f"{corpus.TITLES[corpus.SEARCH_NOVEL]} ({self.eval_sentences:,} sentences)"

    @property
    def confirm_text(self) -> str:
        return f"{corpus.TITLES[corpus.CONFIRMATION_NOVEL]} ({self.confirm_sentences:,} sentences)"

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
        """The search sentences (Pride and Prejudice)."""
        if self._eval is None:
            self._eval = corpus.sentences(corpus.SEARCH_NOVEL, self.eval_sentences, seed=self.seed)
        return self._eval

    def confirmation_sentences(self) -> list[str]:
        """The confirmation sentences (Sense and Sensibility)."""
        if self._confirm is None:
            self._confirm = corpus.confirmation_sentences(self.confirm_sentences, seed=self.seed)
        return self._confirm

    def embed(self, model: nn.Module, sentences: list[str] | None = None) -> Tensor:
        """Embeddings of ``sentences`` (default: the search sentences) -> (n, D)."""
        text = self.sentences() if sentences is None else sentences
        return embedding.embed(model, self.tokenizer, text, self.batch_size)

    def baseline(self) -> float:
        """The original model's embeddings of both sentence sets (call it first, on the
        original model); the baseline mean cosine is 1."""
        if self._reference is None:
            self._reference = self.embed(self.model)
            self._confirm_reference = self.embed(self.model, self.confirmation_sentences())
        return 1.0

    def confirm_baseline(self) -> float:
        return self.baseline()

    def _paired(
        self, model: nn.Module, text: Callable[[], list[str]], ref: Tensor | None
    ) -> PairedDifference:
        """Mean over sentences of 1 - cos(e, e_original), and its margin."""
        if ref is None:
            raise RuntimeError("call baseline() on the original model before measuring")
        cos = embedding.cosines(self.embed(model, text()), ref)  # (n,)
        return paired_difference(1.0 - cos, z=self.z)

    def measure_search(self, model: nn.Module) -> PairedDifference:
        return self._paired(model, self.sentences, self._reference)

    def measure_confirmation(self, model: nn.Module) -> PairedDifference:
        return self._paired(model, self.confirmation_sentences, self._confirm_reference)

    def cosine(self, model: nn.Module) -> float:
        """Mean cosine to the original's embeddings on the search sentences."""
        return 1.0 - self.measure(model)

    def measure(self, model: nn.Module) -> float:
        return self.measure_search(model).mean


Task = LanguageModelTask | EncoderTask
