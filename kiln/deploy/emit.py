"""A plan as the launch line of an engine people already run: torchrun (kiln's own ranks)
or ``vllm serve``, with what that engine cannot express said plainly.

``emit(doc, engine)`` reads a ``kiln.plan/1`` document and returns the command line(s) and
the parts of the plan the engine drops. Machines hold up to ``GPUS_PER_MACHINE`` devices
(a plan with more spreads its ranks over several, pipeline stages across machines first,
as tensor parallelism wants the fast link inside one).
"""

from __future__ import annotations

import math
import shlex
from dataclasses import dataclass, field
from typing import Any, Literal

from kiln.deploy.mixed import shown

Engine = Literal["torchrun", "vllm"]
ENGINES: tuple[Engine, ...] = ("torchrun", "vllm")
GPUS_PER_MACHINE = 8
RDZV = "HOST:29500"  # placeholder: the machine every rank reaches
# vLLM's --dtype for kiln's 16-bit formats; the quantized ones need a checkpoint made for it
VLLM_DTYPES = {"fp16": "float16", "bf16": "bfloat16", "fp32": "float32"}


@dataclass
class Emitted:
    """Command lines (one per machine for torchrun) and what the engine cannot express."""

    lines: list[str]
    cannot_express: list[str] = field(default_factory=list)


def emit(doc: dict[str, Any], engine: Engine) -> Emitted:
    """The ``engine`` launch of the plan ``doc`` (a checked ``kiln.plan/1`` document)."""
    if engine == "torchrun":
        return _torchrun(doc)
    if engine == "vllm":
        return _vllm(doc)
    raise ValueError(f"engine must be one of {ENGINES}, got {engine!r}")


def _machines(devices: int) -> tuple[int, int]:
    nnodes = math.ceil(devices / GPUS_PER_MACHINE)
    if devices % nnodes:
        raise ValueError(f"{devices} devices do not split evenly over {nnodes} machines")
    return nnodes, devices // nnodes


def _torchrun(doc: dict[str, Any]) -> Emitted:
    lay, comp = doc["layout"], doc["compression"]
    nnodes, per_node = _machines(lay["devices"])
    program = ["-m", "kiln.cli", "run", doc["model"], "--tp", str(lay["tp"]), "--pp",
               str(lay["pp"]), "--split", ",".join(map(str, lay["stage_layers"]))]  # fmt: skip
    lines = []
    for rank in range(nnodes):
        cmd = ["torchrun", f"--nnodes={nnodes}", f"--nproc-per-node={per_node}",
               f"--node-rank={rank}", "--rdzv-backend=c10d", f"--rdzv-endpoint={RDZV}",
               *program]  # fmt: skip
        lines.append(shlex.join(cmd))
    missing = []
    if comp["format"] not in ("fp32", "bf16", "fp16"):
        missing.append(f"weights in {shown(comp['format'])}: compress first (kiln compress ... --out DIR) "
                       "and run that folder; kiln run loads the checkpoint as stored")  # fmt: skip
    if lay["offload"] != "none":
        missing.append(f"offload to {lay['offload']}: kiln's offloading runs in one process")
    return Emitted(lines, missing)


def _vllm(doc: dict[str, Any]) -> Emitted:
    lay, comp, req = doc["layout"], doc["compression"], doc["request"]
    cmd = ["vllm", "serve", doc["model"], "--tensor-parallel-size", str(lay["tp"]),
           "--pipeline-parallel-size", str(lay["pp"]), "--max-num-seqs", str(lay["batch"]),
           "--max-model-len", str(req["prompt_len"] + req["gen_len"]),
           "--kv-cache-dtype", "auto"]  # fmt: skip
    missing = []
    fmt = comp["format"]
    if fmt in VLLM_DTYPES:
        cmd += ["--dtype", VLLM_DTYPES[fmt]]
    else:
        cmd += ["--quantization", "gptq"]
        missing.append(f"{shown(fmt)} weights: vLLM serves a checkpoint already quantized (GPTQ of the "
                       "same bits here); it cannot apply kiln's format or per-layer mixed "
                       "precision itself")  # fmt: skip
    if lay["offload"] == "host":
        per_gpu = doc["placement"]["host_bytes"] / lay["devices"] / 2**30
        cmd += ["--cpu-offload-gb", f"{math.ceil(per_gpu)}"]
    elif lay["offload"] == "disk":
        missing.append("offload to disk: vLLM offloads to CPU memory only")
    nnodes, _ = _machines(lay["devices"])
    if nnodes > 1:
        missing.append(f"{nnodes} machines: start a Ray cluster over them first (vLLM's "
                       "multi-node serving), then run this line on its head")  # fmt: skip
    return Emitted([shlex.join(cmd)], missing)
