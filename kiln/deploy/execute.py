"""Execute a plan on this machine and measure it: the check behind ``kiln plan --verify``.

``run_layout`` loads the checkpoint as ``kiln run`` loads a plan — block by block, each
block stored in the plan's format as it is read (kiln's INT8 / INT4 kernels, bf16, or
fp32) and, when the plan offloads, written to a disk store and streamed back — and decodes a batch of prompts of the plan's length with kiln's one generation loop (the fast
C++ step where it runs, else eager), greedy. ``measure`` runs that in a fresh process
(``python -m kiln.deploy.execute``) so its peak resident memory is the plan's alone.

A plan of ``tp x pp`` ranks is launched as ``kiln run`` launches it (``kiln.parallel``: one
process per rank, gloo), each rank timed as one process is; its peak memory is the sum of
every rank's high-water mark and the launcher's (an upper bound of the moment they peak
together). Offloaded plans run in one process.

A GPU plan (``layout["device"]`` "cuda": one device, every weight in its memory) loads
straight onto the GPU and decodes with the CUDA-graph step; its peak memory is the GPU's:
the caching allocator's high-water mark plus what lives outside the allocator (the CUDA
context, library workspaces), read from the device.
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch


@dataclass(frozen=True)
class Measured:
    """What one executed plan did (times in ms, memory in bytes)."""

    ms_per_token: float
    ttft_ms: float
    tokens_per_s: float
    peak_rss_bytes: int
    engine: str
    peak_device_bytes: int | None = None  # a GPU plan's (``peak_device_bytes``)
    device_name: str = "cpu"

    @property
    def peak_bytes(self) -> int:
        """The plan's device memory at its peak: the GPU's, or on a CPU the processes'."""
        return self.peak_device_bytes if self.peak_device_bytes is not None else self.peak_rss_bytes


def run_layout(
    model: str, layout: dict[str, Any], fmt: str, prompt_len: int, gen_len: int
) -> dict[str, Any]:
    """Execute in this process, or on ``tp x pp`` ranks it launches; return the timings
    and the ranks' peak RSS (this process's own is ``measure``'s to add)."""
    batch, device = int(layout["batch"]), str(layout.get("device", "cpu"))
    gen_tokens = torch.Generator().manual_seed(0)
    vocab = _vocab_size(model)
    prompt = torch.randint(0, vocab, (batch, prompt_len), generator=gen_tokens)  # (B, P)
    tp, pp = int(layout["tp"]), int(layout["pp"])
    if device != "cpu" and (tp * pp > 1 or layout["offload"] != "none"):
        raise ValueError("kiln executes GPU plans on one device, without offload")
    if tp * pp == 1:
        return _run_here(model, layout, fmt, prompt, gen_len, device)
    if layout["offload"] != "none":
        raise ValueError("kiln executes offloaded plans in one process only (tp = pp = 1)")
    from kiln.parallel.launch import launch

    split = tuple(layout["stage_layers"]) if layout.get("stage_layers") else None
    spec = (model, fmt, prompt, gen_len, tp, pp, split)
    ranks = launch(_rank_run, tp * pp, spec, timeout_s=600.0)
    last = ranks[(pp - 1) * tp]  # the rank whose logits every rank takes
    return {**last, "rank_peak_rss_bytes": [r["peak_rss_bytes"] for r in ranks],
            "engine": f"eager, {tp * pp} ranks (tp {tp}, pp {pp}) over gloo"}  # fmt: skip


def _vocab_size(model: str) -> int:
    from kiln.deploy.architecture import read_architecture

    return read_architecture(model).vocab_size


def run_request(model: str, fmt: str, device: str = "cpu") -> Any:
    """The ``kiln run`` request of a plan in format ``fmt`` (the loads below are its own)."""
    from kiln.deploy.generate_job import GenerateRequest

    return GenerateRequest(checkpoint=model, prompt="", weights=fmt, packed=False, device=device)


def _run_here(
    model: str, layout: dict[str, Any], fmt: str, prompt: torch.Tensor, gen_len: int,
    device: str,
) -> dict[str, Any]:  # fmt: skip
    """One process, loaded as ``kiln run`` loads a plan: block by block, each block stored
    in the plan's format as it is read (and, offloaded, written to the store and released)."""
    from kiln.deploy.generate_job import choose_decoder, load_options, prepare
    from kiln.llm.generate import EagerDecoder
    from kiln.llm.offload import load_offloaded
    from kiln.models.load import load_model

    request = run_request(model, fmt, device)
    dtype, in_format = load_options(request)
    batch, max_len = prompt.shape[0], prompt.shape[1] + gen_len
    with tempfile.TemporaryDirectory(prefix="kiln-plan-") as store:
        if layout["offload"] != "none":
            loaded, _ = load_offloaded(model, store, dtype, packed=False, with_tokenizer=False,
                                       on_block=in_format)  # fmt: skip
            prepare(loaded, request)
            decoder: Any = EagerDecoder(loaded.model, batch, max_len)
            engine = "eager, blocks streamed from disk"
        else:
            loaded = load_model(model, dtype, packed=False, device=device,
                                with_tokenizer=False, on_block=in_format)  # fmt: skip
            prepare(loaded, request)
            decoder, engine = choose_decoder(loaded.model, request, batch, max_len)
        timed = {**_timed(decoder, prompt, gen_len), "engine": engine}
        if device != "cpu":
            timed |= {"peak_device_bytes": peak_device_bytes(), "device_name":
                      torch.cuda.get_device_name()}  # fmt: skip
        return timed


TTFT_RUNS = 3  # prompts timed to the first token; their median is the figure


def _timed(decoder: Any, prompt: torch.Tensor, gen_len: int) -> dict[str, Any]:
    """Decode ``gen_len`` tokens greedily after a warm-up with the same prompt shape (the
    prefill engine differs with the prompt's length, and its first call allocates): the
    median step time, the median time to first token over ``TTFT_RUNS`` prompts (one
    prefill is one sample of a host whose speed swings), tokens per second."""
    from kiln.llm.generate import Sampling, generate

    generate(decoder, prompt, 2, Sampling())  # warm-up (prefill rewrites the cache)
    firsts = [generate(decoder, prompt, 1, Sampling()).ttft_s for _ in range(TTFT_RUNS - 1)]
    out = generate(decoder, prompt, gen_len, Sampling())
    ms = statistics.median(out.step_s) * 1e3
    ttft_ms = statistics.median([*firsts, out.ttft_s]) * 1e3
    batch = prompt.shape[0]
    return {"ms_per_token": ms, "ttft_ms": ttft_ms, "tokens_per_s": batch * 1e3 / ms}


def _rank_run(
    rank: int, world: int, model: str, fmt: str, prompt: torch.Tensor, gen_len: int, tp: int,
    pp: int, split: tuple[int, ...] | None,
) -> dict[str, Any]:  # fmt: skip
    """One rank of a parallel plan: only its stage and shard of the model read (as ``kiln
    run`` reads it), timed as one process is, and its own peak RSS."""
    from kiln.deploy.generate_job import load_rank_part
    from kiln.parallel.mesh import Mesh, PartLoader, rank_decoder

    mesh = Mesh.create(tp, pp)
    source = PartLoader(partial(load_rank_part, run_request(model, fmt)))
    decoder = rank_decoder(source, mesh, prompt.shape[0], prompt.shape[1] + gen_len, split)
    return {**_timed(decoder, prompt, gen_len), "peak_rss_bytes": peak_rss_bytes()}


def measure(
    model: str, layout: dict[str, Any], fmt: str, prompt_len: int, gen_len: int
) -> Measured:
    """``run_layout`` in a fresh process, which reports its own peak RSS (the kernel's
    high-water mark of its resident memory, loading included)."""
    args = json.dumps({"model": model, "layout": layout, "fmt": fmt,
                       "prompt_len": prompt_len, "gen_len": gen_len})  # fmt: skip
    proc = subprocess.run([sys.executable, "-m", "kiln.deploy.execute", args],
                          capture_output=True, text=True, timeout=1800)  # fmt: skip
    if proc.returncode != 0:
        raise RuntimeError(f"executing the plan failed:\n{proc.stderr[-2000:]}")
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    return Measured(got["ms_per_token"], got["ttft_ms"], got["tokens_per_s"],
                    got["peak_rss_bytes"], got["engine"], got.get("peak_device_bytes"),
                    got.get("device_name", "cpu"))  # fmt: skip


def peak_device_bytes() -> int:
    """This process's peak use of its GPU: the caching allocator's high-water mark plus
    what lives outside the allocator (CUDA context, cuBLAS workspace, Triton's modules),
    read now as the device's used memory less the allocator's reservation."""
    free, total = torch.cuda.mem_get_info()
    outside = (total - free) - torch.cuda.memory_reserved()
    return int(torch.cuda.max_memory_reserved() + max(0, outside))


def peak_rss_bytes() -> int:
    """This process's resident-memory high-water mark (``kiln.core.memory``); a plan's
    memory cannot be checked where the kernel does not report one."""
    from kiln.core.memory import peak_rss_bytes as vm_hwm

    got = vm_hwm()
    if got is None:
        raise RuntimeError("no VmHWM in /proc/self/status: peak memory cannot be measured here")
    return got


def main() -> int:
    spec = json.loads(sys.argv[1])
    torch.set_num_threads(2)
    result = run_layout(
        spec["model"], spec["layout"], spec["fmt"], spec["prompt_len"], spec["gen_len"]
    )
    # the process this runs in is the plan's launcher (or its only process): its own peak
    # adds to the ranks'
    result["peak_rss_bytes"] = peak_rss_bytes() + sum(result.get("rank_peak_rss_bytes", []))
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    # run as the imported module, not as __main__: the ranks unpickle ``_rank_run`` by its
    # module's name, which must be importable in their processes
    from kiln.deploy import execute

    raise SystemExit(execute.main())
