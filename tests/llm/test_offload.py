"""Weight offloading: an offloaded model computes exactly what the resident model computes,
holds no block weights itself, and its peak resident memory stays far below the weights.

The reference is the same model run with its weights in memory (eager torch): the
offloaded forward runs the very same operations on the very same values, so logits must be
bitwise equal (tolerance 0), for fp32 and for INT8 / INT4 compressed blocks.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from kiln.compress import Int4WeightOnly, Int8WeightOnly
from kiln.llm.offload import HostKVCache, offload_
from kiln.llm.offload_store import DATA, block_state, read_store
from kiln.models.config import ModelConfig
from kiln.models.kv_cache import KVCache
from kiln.models.transformer import Transformer
from tests.support.compare import assert_close_to_reference
from tests.support.models import tiny_transformer

REPO = Path(__file__).resolve().parents[2]
CFG = ModelConfig(
    family="llama", vocab_size=512, hidden_size=256, n_layers=6, n_heads=4, n_kv_heads=2,
    head_dim=64, intermediate_size=1024, max_positions=64, rope_theta=100000.0,
)  # fmt: skip
PROMPT = torch.tensor([[5, 17, 300, 42, 7, 99, 256, 1]])  # (1, 8)
STEPS = 16


def random_model(compress: str = "fp32", seed: int = 0) -> Transformer:
    """CFG with the default init; "int8" / "int4": its blocks' linears compressed."""
    configs = {"fp32": None, "int8": Int8WeightOnly(), "int4": Int4WeightOnly(group_size=32)}
    return tiny_transformer(CFG, seed, compression=configs[compress], blocks_only=True)


@torch.inference_mode()
def greedy(
    model: Transformer, cache: KVCache | None = None, steps: int = STEPS
) -> tuple[torch.Tensor, torch.Tensor]:
    """Prefill PROMPT then ``steps`` greedy decode steps: (logits (1, 8 + steps, V), tokens)."""
    if cache is None:
        cache = model.new_cache(1, PROMPT.shape[1] + steps)
    logits = [model(PROMPT, 0, cache)]
    tokens = [logits[-1][:, -1].argmax(-1)]
    for pos in range(PROMPT.shape[1], PROMPT.shape[1] + steps):
        logits.append(model(tokens[-1][:, None], pos, cache))
        tokens.append(logits[-1][:, -1].argmax(-1))
    return torch.cat(logits, dim=1), torch.stack(tokens, dim=1)


@pytest.mark.parametrize(
    ("compress", "prefetch", "evict"),
    [("fp32", 1, False), ("fp32", 0, False), ("fp32", 3, True), ("int8", 1, False),
     ("int4", 2, False)],
)  # fmt: skip
def test_disk_offload_gives_identical_logits_and_tokens(
    tmp_path: Path, compress: str, prefetch: int, evict: bool
) -> None:
    model = random_model(compress)
    ref_logits, ref_tokens = greedy(model)
    store = tmp_path / "store"
    handle = offload_(model, store, tier="disk", prefetch=prefetch, evict_page_cache=evict)
    logits, tokens = greedy(model)
    assert torch.equal(tokens, ref_tokens)
    assert_close_to_reference(logits, ref_logits, rtol_to_max=0.0)  # bitwise: same ops, same data
    assert handle.fetches >= CFG.n_layers * (STEPS + 1)
    handle.close()


def test_compressed_buffers_are_offloaded_and_nothing_of_a_block_stays(tmp_path: Path) -> None:
    model = random_model("int4")
    handle = offload_(model, tmp_path, prefetch=1)
    names = {t.name for t in read_store(tmp_path)[0].tensors}
    assert {"attn.q.packed", "attn.q.scale", "attn.q.offset", "mlp.down.packed"} <= names
    for block in model.layers:
        assert all(t.is_meta for t in block_state(block).values())
    assert not model.embed.weight.is_meta and not model.final_norm.weight.is_meta
    largest = max(s.nbytes for s in read_store(tmp_path))
    assert handle.staging_bytes == 2 * largest
    greedy(model, steps=2)
    for block in model.layers:  # no kernel (a repacked copy of the weights) outlives a forward
        assert all(getattr(m, "_kernel", None) is None for m in block.modules())
    handle.close()


def test_close_with_restore_puts_weights_back(tmp_path: Path) -> None:
    model = random_model("int8")
    ref_logits, _ = greedy(model, steps=4)
    offload_(model, tmp_path, prefetch=1).close(restore=True)
    assert not any(t.is_meta for t in model.state_dict().values())
    logits, _ = greedy(model, steps=4)
    assert_close_to_reference(logits, ref_logits, rtol_to_max=0.0)
    offload_(model, tmp_path / "again").close()  # the hooks are gone: it can be offloaded again


def test_existing_store_runs_a_model_built_on_meta(tmp_path: Path) -> None:
    model = random_model()
    ref_logits, _ = greedy(model, steps=4)
    offload_(model, tmp_path, prefetch=1)
    with torch.device("meta"):
        skeleton = Transformer(CFG).eval()  # no memory for the blocks at all
    resident = {k: v for k, v in model.state_dict().items() if not k.startswith("layers.")}
    skeleton.load_state_dict(resident, strict=False, assign=True)
    handle = offload_(skeleton, tmp_path, write=False)
    logits, _ = greedy(skeleton, steps=4)
    assert_close_to_reference(logits, ref_logits, rtol_to_max=0.0)
    handle.close()
    with torch.device("meta"):
        other = Transformer(CFG.__class__(**{**CFG.__dict__, "intermediate_size": 512}))
    with pytest.raises(ValueError, match=r"block 0 tensor mlp.gate.weight is torch.float32 \(512"):
        offload_(other, tmp_path, write=False)


def test_truncated_or_missing_store_is_refused(tmp_path: Path) -> None:
    offload_(random_model(), tmp_path).close()
    with open(tmp_path / DATA, "r+b") as f:
        f.truncate(1000)
    with pytest.raises(ValueError, match=f"{DATA} is truncated"):
        read_store(tmp_path)
    with pytest.raises(FileNotFoundError, match="manifest.json not found"):
        read_store(tmp_path / "nothing")


def test_host_kv_cache_gives_identical_logits(tmp_path: Path) -> None:
    model = random_model()
    ref_logits, _ = greedy(model, steps=4)
    handle = offload_(model, tmp_path)
    logits, _ = greedy(model, HostKVCache.for_model(model, 1, PROMPT.shape[1] + 4), steps=4)
    assert_close_to_reference(logits, ref_logits, rtol_to_max=0.0)
    handle.close()


def test_bad_requests_are_refused(tmp_path: Path) -> None:
    model = random_model()
    with pytest.raises(ValueError, match="tier 'disk' needs a store folder"):
        offload_(model, None, tier="disk")
    with pytest.raises(ValueError, match="prefetch must be >= 0"):
        offload_(model, tmp_path, prefetch=-1)
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="tier 'cpu' streams pinned host memory"):
            offload_(model, None, tier="cpu", device="cpu")
    handle = offload_(model, tmp_path)
    with pytest.raises(ValueError, match="already offloaded"):
        offload_(model, tmp_path / "b")
    handle.close()


MEMORY_SCRIPT = """
import json, sys, tempfile, torch
from pathlib import Path
from kiln.models.config import ModelConfig
from kiln.models.transformer import Transformer
from kiln.bench.offload_memory import measure_offload
cfg = ModelConfig(family="llama", vocab_size=512, hidden_size=512, n_layers=12, n_heads=8,
                  n_kv_heads=8, head_dim=64, intermediate_size=2048, max_positions=64)
torch.manual_seed(0)
model = Transformer(cfg).eval()
prompt = torch.randint(0, 512, (1, 8))
with tempfile.TemporaryDirectory(dir=sys.argv[1]) as tmp:
    print(json.dumps(measure_offload(model, prompt, 16, Path(tmp), prefetch=1)))
"""


@pytest.mark.skipif(not Path("/proc/self/clear_refs").exists(), reason="needs Linux /proc")
def test_peak_resident_memory_stays_far_below_the_weights(tmp_path: Path) -> None:
    """~200 MB of block weights (12 blocks of 16.8 MB): generating offloaded raises peak RSS
    by the two staging buffers (~17%) plus activations, measured in a fresh process."""
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.run(
        [sys.executable, "-c", MEMORY_SCRIPT, str(tmp_path)],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=180,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    print(result)
    assert result["same_tokens"]
    assert result["block_bytes"] > 190e6
    assert result["peak_rss_increase_bytes"] < 0.4 * result["block_bytes"], result


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="the 'cpu' tier needs a CUDA GPU")
@pytest.mark.parametrize("compress", ["fp32", "int4"])
def test_pinned_cpu_tier_on_cuda_matches_resident(compress: str) -> None:
    model = random_model(compress).to("cuda")
    ref_logits, ref_tokens = greedy(model)
    before = torch.cuda.memory_allocated()
    handle = offload_(model, None, tier="cpu", device="cuda", prefetch=1)
    assert torch.cuda.memory_allocated() < before  # the blocks left the device
    logits, tokens = greedy(model)
    assert torch.equal(tokens, ref_tokens)
    assert_close_to_reference(logits, ref_logits, rtol_to_max=0.0)
    host_logits, _ = greedy(model, HostKVCache.for_model(model, 1, PROMPT.shape[1] + STEPS))
    assert_close_to_reference(host_logits, ref_logits, rtol_to_max=0.0)
    handle.close(restore=True)
    assert all(t.is_cuda for t in model.state_dict().values())
