"""Per-layer mixed formats measured on a real checkpoint (``deploy.mixed`` has the specs,
the calibration and the frontier): the block linears' sensitivity to each INT8 / INT4
format, from calibration on *Emma* (cached per checkpoint), and the mixed plans the
planner has measured on the search text, kept so every later search calibrates on them.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import torch

from kiln.deploy.mixed import CODES, Sensitivity

if TYPE_CHECKING:
    from torch import nn

    from kiln.compress.sensitivity import SensitivityTable
    from kiln.models.transformer import Transformer

CALIBRATION = (16, 512, 4)  # windows of Emma, tokens each, windows per backward pass
VERSION = 3  # of the cached per-layer sensitivity


def sensitivity(
    model: Transformer, batches: Sequence[torch.Tensor], formats: Sequence[str],
    progress: Callable[[int, int], None] | None = None,
) -> SensitivityTable:  # fmt: skip
    """Every block linear of ``model`` (fp32) compressed in each of ``formats`` as
    execution stores it, with its predicted loss increase from calibration ``batches``
    (each (B, T) token ids): the next-token loss's output gradients weight the errors."""
    from kiln.compress.moments import collect_stats, linear_layers
    from kiln.compress.sensitivity import DENSE, analyse
    from kiln.deploy.weights import quantization

    layers = linear_layers(model, lambda _m, name: name.startswith("layers."))
    stats = collect_stats(model, batches, layers, loss_fn=_next_token_loss, n_batches=len(batches))
    configs = [quantization(f) for f in formats]
    return analyse(layers, stats, configs, progress=progress).without({DENSE})


def _next_token_loss(model: nn.Module, ids: torch.Tensor) -> torch.Tensor:
    """``kiln compress``'s summed next-token loss of kiln's ``Transformer`` on ids (B, T)."""
    from kiln.compress.moments import causal_lm_loss
    from kiln.deploy.plan_quality import logits_fn

    return causal_lm_loss(logits_fn(model), ids)


def sensitivity_of(
    model: str, formats: Sequence[str], note: Callable[[str], None] = lambda _: None
) -> Sensitivity | None:
    """Checkpoint ``model``'s per-layer sensitivity over ``formats`` (those of ``CODES``,
    two at least), cached per checkpoint; None when it cannot be calibrated here (no
    tokenizer, too large, texts not installed)."""
    from kiln.deploy.plan_quality import checkpoint_key, unscorable

    usable = [f for f in CODES if f in formats]
    if len(usable) < 2:
        return None
    path = _cache_path(f"{checkpoint_key(model)}|{','.join(usable)}|{torch.__version__}")
    if path.is_file():
        data = json.loads(path.read_text(encoding="utf-8"))
        return Sensitivity(tuple(tuple((f, int(n), float(x)) for f, n, x in opts)
                                 for opts in data["layers"]))  # fmt: skip
    why = unscorable(model) or too_large_to_calibrate(model)
    if why is not None:
        note(f"no mixed per-layer plans: {why}")
        return None
    from kiln.models.load import load_model
    from kiln.quality import corpus

    loaded = load_model(model, torch.float32, packed=False, with_tokenizer=True)
    assert loaded.tokenizer is not None  # checked by ``unscorable``
    n, seq, per = CALIBRATION
    ids = corpus.calibration_batches(loaded.tokenizer, n, seq, seed=0)  # (n, seq)
    note(f"calibrating per-layer formats on {n} x {seq} tokens of {corpus.CALIBRATION_NOVEL} "
         f"({', '.join(usable)}; cached)")  # fmt: skip
    found = Sensitivity.of(sensitivity(loaded.model, list(ids.split(per)), usable))
    path.write_text(json.dumps({"version": VERSION, "layers": found.layers}), encoding="utf-8")
    return found


def calibration_bytes(model: str) -> int:
    """What calibrating ``model`` holds at its peak, with 15% to spare: the interpreter and
    libraries, the mapped checkpoint and the fp32 model, every block linear's input second
    moment (K x K fp32, all kept to the end) and output Fisher, a batch's logits with
    their log-softmax and gradient, the activations its backward pass keeps (about six
    hidden-wide and three MLP-wide rows per token and block), and every layer compressed
    in every format (the table keeps them). SmolLM2-135M: 5.35 GB measured."""
    from kiln.deploy.architecture import read_architecture
    from kiln.deploy.estimate import FORMATS, RUNTIME_RESERVE
    from kiln.deploy.plan_quality import checkpoint_bytes

    arch = read_architecture(model)
    moments = arch.n_layers * sum(4 * (lin.in_features**2 + lin.out_features)
                                  for lin in arch.layer_linears)  # fmt: skip
    _, seq, per = CALIBRATION
    logits = 3 * 4 * per * seq * arch.vocab_size
    width = 6 * arch.hidden_size + 3 * max(lin.out_features for lin in arch.layer_linears)
    kept = 4 * arch.n_layers * per * seq * width
    linear = arch.n_layers * sum(lin.out_features * lin.in_features for lin in arch.layer_linears)
    compressed = sum(linear * FORMATS[f].bits / 8 for f in CODES)
    held = RUNTIME_RESERVE["cpu"] + checkpoint_bytes(model) + 4 * arch.total_params
    return int(1.15 * (held + moments + logits + kept + compressed))


def too_large_to_calibrate(model: str, meminfo: str = "/proc/meminfo") -> str | None:
    """Why calibrating ``model`` would not fit here (None when it fits): its peak
    (``calibration_bytes``) must stay within half of the memory available now."""
    from kiln.deploy.hardware import meminfo_bytes

    need, have = calibration_bytes(model), meminfo_bytes("MemAvailable", meminfo)
    if need <= have / 2:
        return None
    return (f"calibrating it layer by layer needs about {need / 2**30:.1f} GiB, more than "
            f"half of the {have / 2**30:.1f} GiB available here")  # fmt: skip


def measured_before(model: str) -> dict[str, tuple[float, float]]:
    """Mixed plans of checkpoint ``model`` measured by earlier searches: spec -> (increase,
    95% upper bound) on the search text. A new search calibrates on them from its start."""
    path = _measured_path(model)
    if not path.is_file():
        return {}
    kept = json.loads(path.read_text(encoding="utf-8"))
    return {spec: (float(v[0]), float(v[1])) for spec, v in kept.items()}


def remember(model: str, spec: str, increase: float, upper: float) -> None:
    """Keep mixed plan ``spec``'s measurement for later searches (``measured_before``)."""
    kept = {**measured_before(model), spec: (increase, upper)}
    _measured_path(model).write_text(json.dumps(kept), encoding="utf-8")


def _measured_path(model: str) -> Any:
    from kiln.deploy.plan_quality import SEARCH_TOKENS, checkpoint_key

    return _cache_path(f"measured|{checkpoint_key(model)}|{SEARCH_TOKENS}|{torch.__version__}")


def _cache_path(key: str) -> Any:
    from kiln.core.cache import cache_dir

    digest = hashlib.sha256(key.encode()).hexdigest()[:20]
    return cache_dir("plan_mixed") / f"v{VERSION}-{digest}.json"
