"""What one deployment layout costs: memory per device and host, and time per token.

A ``Layout`` fixes everything the planner chooses: the weight format, the devices, tensor-
and pipeline-parallel degrees, where the weights that do not fit go (host memory or disk,
streamed back every token), batch and context. ``estimate`` turns a layout, an
``Architecture`` and a ``Hardware`` into an ``Estimate``.

Memory is bounded from above, never below: weights at their stored size, the KV cache for
the whole batch at the full context (grouped-query heads and sliding windows counted, kv
heads replicated when fewer than the tensor-parallel degree), the largest prefill
activations, a dequantization workspace for packed formats, a fixed runtime reserve per
device and a fragmentation margin. Time is a roofline per layer (the larger of bytes over
bandwidth and FLOPs over peak, each at a stated efficiency), plus two all-reduces per layer
under tensor parallelism, stage-to-stage transfers under pipeline parallelism, and the
transfer of offloaded weights, overlapped with compute; on a GPU, plus every kernel's fixed
cost (``gpu_launches``). A CPU plan is priced with this machine's measured engines instead
(``estimate_cpu``).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from kiln.deploy import estimate_cpu, gpu_launches, mixed
from kiln.deploy.architecture import Architecture
from kiln.deploy.hardware import Hardware
from kiln.deploy.kernel_rates import Rates
from kiln.deploy.stages import balanced_stages

if TYPE_CHECKING:
    from kiln.deploy.plan_quality import MeasuredAccuracy


@dataclass(frozen=True)
class WeightFormat:
    """How the linear layers of the blocks are stored (embeddings and norms stay 16-bit).

    bits          stored bits per weight, scales and offsets included
    compute       the dtype the matmuls run in (weight-only formats dequantize to it)
    packed        whether a kernel dequantizes in the loop (needs a small workspace)
    """

    name: str
    bits: float
    compute: str
    packed: bool
    # a per-layer mix (``deploy.mixed``, ``name`` its spec): (format, share of the stored
    # bytes, share of the parameters) of each format it uses
    mix: tuple[tuple[str, float, float], ...] = ()

    @property
    def label(self) -> str:
        """The name tables show (a mixed spec is one letter per layer)."""
        return mixed.shown(self.name)


FORMATS: dict[str, WeightFormat] = {
    "fp32": WeightFormat("fp32", 32.0, "fp32", False),
    "fp16": WeightFormat("fp16", 16.0, "fp16", False),
    "bf16": WeightFormat("bf16", 16.0, "bf16", False),
    # per output channel: one fp32 scale per row of K weights (K >= 512 here: < 0.07 bit)
    "int8": WeightFormat("int8", 8.0 + 32.0 / 512, "fp16", True),
    # groups of g along K with an fp16 scale and offset each
    "int4-g128": WeightFormat("int4-g128", 4.0 + 32.0 / 128, "fp16", True),
    "int4-g64": WeightFormat("int4-g64", 4.0 + 32.0 / 64, "fp16", True),
    "int4-g32": WeightFormat("int4-g32", 4.0 + 32.0 / 32, "fp16", True),
}

# Stated efficiencies of the roofline (fractions of the datasheet peak that kernels reach).
BANDWIDTH_EFFICIENCY = {"gpu": 0.80, "cpu": 0.80}  # streaming weight reads (GEMV)
COMPUTE_EFFICIENCY = {"gpu": 0.60, "cpu": 0.50}  # large GEMMs (prefill)
RUNTIME_RESERVE = {"gpu": 1.0 * 2**30, "cpu": 0.45 * 2**30}  # CUDA context / interpreter + libs
FRAGMENTATION = 0.05  # allocator slack on everything allocated at run time


def mixed_format(spec: str, arch: Architecture) -> WeightFormat:
    """The ``WeightFormat`` of mixed spec ``spec`` (``deploy.mixed``) for ``arch``'s blocks:
    its mean stored bits and each of its formats' shares."""
    if len(mixed.parse_spec(spec)) != arch.n_layers * len(arch.layer_linears):
        raise ValueError(f"mixed format {mixed.label(spec)} is for another model: {arch.name} "
                         f"has {arch.n_layers} x {len(arch.layer_linears)} block linears")  # fmt: skip
    sizes = [lin.out_features * lin.in_features for lin in arch.layer_linears]
    mix = mixed.shares(spec, sizes, {name: f.bits for name, f in FORMATS.items()})
    return WeightFormat(spec, mix.bits, "fp16", True, mix.parts)


@dataclass(frozen=True)
class Layout:
    """One candidate deployment."""

    fmt: WeightFormat
    devices: int
    tp: int
    pp: int
    batch: int
    prompt_len: int
    gen_len: int
    offload: str = "none"  # "none" | "host" | "disk": where weights that do not fit go
    act_bytes: int = 2  # activations and KV cache element size (fp16 / bf16)

    @property
    def context(self) -> int:
        return self.prompt_len + self.gen_len


@dataclass(frozen=True)
class Estimate:
    """Predicted figures of one layout (bytes, milliseconds)."""

    layout: Layout
    weight_bytes: int  # all weights at their stored size
    device_weight_bytes: int  # on the busiest device
    offloaded_bytes: int  # per device, streamed from host / disk each token
    kv_bytes: int  # per device
    activation_bytes: int  # per device, prefill peak
    peak_device_bytes: int
    peak_host_bytes: int
    ms_per_token: float
    ttft_ms: float
    device_memory_bytes: int  # what one device has
    stages: tuple[int, ...]  # layers per pipeline stage (``stages.balanced_stages``)

    @property
    def tokens_per_s(self) -> float:
        return self.layout.batch * 1e3 / self.ms_per_token


@dataclass(frozen=True)
class Measurements:
    """What kiln knows of this model and machine beyond their datasheets.

    checkpoint_bytes  the checkpoint file(s) the loader maps (resident while read)
    rates             this CPU's measured engine costs (``kernel_rates``) per thread count:
                      a plan of R ranks is priced with the table at ``cores // R`` threads
                      (``estimate_cpu``), replacing the roofline's guess
    cores             the cores the ranks share
    accuracy          each weight format's perplexity increase on this checkpoint, measured
                      on the search text (``plan_quality``), in place of the planner's priors
    mixed             its per-layer mixed formats and their predicted increases
    """

    checkpoint_bytes: int = 0
    rates: Mapping[int, Rates] | None = None
    cores: int = 2
    accuracy: MeasuredAccuracy | None = None
    # mixed per-layer formats of this checkpoint (``deploy.mixed`` specs) -> each one's
    # predicted perplexity increase: the planner's ``mixed`` candidates
    mixed: Mapping[str, float] = field(default_factory=dict)


NOTHING_MEASURED = Measurements()


def estimate(
    arch: Architecture, hw: Hardware, layout: Layout, known: Measurements = NOTHING_MEASURED
) -> Estimate:
    """Memory and time of ``layout`` for ``arch`` on ``hw`` (see the module docstring)."""
    dev, kind = hw.device, hw.device.kind
    tp, pp, b = layout.tp, layout.pp, layout.batch
    fmt = layout.fmt
    fb = _float_bytes(kind, fmt)
    layer_w = _layer_weight_bytes(arch, fmt, fb)  # one block, all ranks together
    embed_w = arch.embedding_params * fb
    # an untied head in the float dtype; kiln's CPU step reads a compressed model's head as
    # INT8 (untied from a tied embedding), as kiln generate runs it
    head_w = arch.head_params * fb
    if kind == "cpu" and fmt.packed:
        head_w = (arch.head_params or arch.embedding_params) * 1
    kv_heads = max(1, math.ceil(arch.n_kv_heads / tp))  # replicated when fewer than tp
    kv_per_layer = [
        b * arch.kv_positions(layer, layout.context) * 2 * kv_heads * arch.head_dim
        for layer in range(arch.n_layers)
    ]
    # kiln shards the blocks only: every rank of the first stage holds the whole embedding,
    # every rank of the last the whole head (a tied head: the embedding again, when pp > 1)
    last_w = head_w if head_w else (embed_w if pp > 1 else 0)
    per_layer = [layer_w / tp + kv * layout.act_bytes for kv in kv_per_layer]
    stages = balanced_stages(per_layer, pp, embed_w, last_w)
    stage_w = [n * layer_w / tp for n in stages]
    stage_w[0] += embed_w
    stage_w[-1] += last_w
    device_w = int(max(stage_w))
    kv_device = int(max(_stage_sums(kv_per_layer, stages)) * layout.act_bytes)
    act = _activation_bytes(arch, layout, tp)
    workspace = _largest_linear(arch) * 2 / tp if fmt.packed else 0
    fixed = RUNTIME_RESERVE[kind]
    capacity = dev.memory_bytes
    dynamic = (kv_device + act + workspace) * (1 + FRAGMENTATION)
    resident_budget = (capacity - fixed - dynamic) / (1 + FRAGMENTATION)
    offloaded = 0
    if layout.offload != "none" and kind == "cpu":  # kiln streams every block from the store
        offloaded = int(sum(stages) * layer_w / tp)
    elif layout.offload != "none":
        offloaded = int(max(0.0, device_w - max(resident_budget, 0.0)))
    resident = device_w - offloaded
    total_w = int(arch.n_layers * layer_w + embed_w + head_w)
    peak_device = int(fixed + resident * (1 + FRAGMENTATION) + dynamic)
    if kind == "cpu":  # the ranks are processes of this host: their peaks add up
        per_stage_kv = [kv * layout.act_bytes for kv in _stage_sums(kv_per_layer, stages)]
        peak_device = _cpu_peak_bytes(
            arch, layout, stages, stage_w, per_stage_kv, act + workspace, layer_w, embed_w,
            known.checkpoint_bytes,
        )  # fmt: skip
    peak_host = _host_bytes(hw, layout, offloaded, device_w)
    head_read = head_w or embed_w  # a tied head reads the embedding table whole
    ms, ttft = None, None
    rates = estimate_cpu.tables_for(known.rates, known.cores, tp * pp) if kind == "cpu" else None
    if rates is not None and fmt.mix:  # a mixed format: its formats' engines, blended
        rates = {**rates, **estimate_cpu.blend(rates, fmt.name, mixed.Shares(fmt.mix, fmt.bits))}
    if rates is not None:
        run = estimate_cpu.CpuRun(
            fmt.name, tp, pp, b, layout.prompt_len, layout.context, layout.offload,
            layout.act_bytes, stages, layer_w, head_read,
        )  # fmt: skip
        ms, ttft = (
            estimate_cpu.decode_ms(arch, run, rates),
            estimate_cpu.prefill_ms(arch, run, rates),
        )
    if ms is None:
        ms = _decode_ms(arch, hw, layout, layer_w, head_read, stages, kv_per_layer, offloaded)
    if ttft is None:
        ttft = _prefill_ms(arch, hw, layout, total_w)
    if kind == "gpu":  # hundreds of kernels a step, each with a fixed cost (gpu_launches)
        counts, costs = gpu_launches.kernel_counts(arch), gpu_launches.launch_costs(dev)
        ms = gpu_launches.step_ms(ms, counts.decode, costs)
        ttft = gpu_launches.prefill_ms(ttft, counts.prefill, costs)
    return Estimate(
        layout, total_w, device_w, offloaded, kv_device, int(act), peak_device, peak_host,
        ms, ttft, capacity, tuple(stages),
    )  # fmt: skip


# ------------------------------------------------------------------ memory parts
def _float_bytes(kind: str, fmt: WeightFormat) -> int:
    """Bytes of the tensors kept in floating point (embeddings, norms, biases): fp32 on the
    CPU unless the weights are 16-bit, 16-bit on GPUs unless the weights are fp32."""
    if fmt.name == "fp32" or (kind == "cpu" and fmt.name not in ("bf16", "fp16")):
        return 4
    return 2


def _layer_weight_bytes(arch: Architecture, fmt: WeightFormat, float_bytes: int) -> float:
    linear = sum(lin.out_features * lin.in_features for lin in arch.layer_linears)
    rest = arch.params_per_layer - linear  # biases and norms stay in floating point
    return linear * fmt.bits / 8 + rest * float_bytes


def _largest_linear(arch: Architecture) -> int:
    return max(lin.out_features * lin.in_features for lin in arch.layer_linears)


def _stage_sums(per_layer: list[int], stages: list[int]) -> list[int]:
    sums, i = [], 0
    for n in stages:
        sums.append(sum(per_layer[i : i + n]))
        i += n
    return sums


def _activation_bytes(arch: Architecture, layout: Layout, tp: int) -> float:
    """Prefill peak of one layer's live activations on one device: the residual stream and
    norm output, q/k/v, attention scores (materialised, an upper bound for fused kernels),
    the MLP's inner activations, and fp32 logits of the last position."""
    b, t, e = layout.batch, layout.prompt_len, layout.act_bytes
    hidden = 3 * b * t * arch.hidden_size * e
    qkv = b * t * (arch.n_heads + 2 * arch.n_kv_heads) * arch.head_dim * e / tp
    scores = b * math.ceil(arch.n_heads / tp) * t * t * 4  # fp32 softmax
    mlp = 3 * b * t * arch.intermediate_size * e / tp
    logits = b * arch.vocab_size * 4 / tp
    return hidden + qkv + scores + mlp + logits


def _load_transient(arch: Architecture, embed_w: float, quantized_head: bool) -> float:
    """What kiln's streaming load holds beyond the weights it keeps: one block read in
    fp32 (a plan quantizes it as soon as it is filled, so briefly both), and the largest
    single tensor once more (the fast step moves weights into huge pages one tensor at a
    time). A compressed plan's INT8 head is quantized from the float embedding: the
    quantizer's temporaries (|w| for the scales, w / scale before rounding) are twice the
    table (measured: Qwen2-0.5B's 545 MB table peaked 0.93 GB above the loaded model)."""
    block = arch.params_per_layer * 4 * 2
    head = 2 * embed_w if quantized_head else embed_w
    return block + max(head, _largest_linear(arch) * 4)


def _cpu_peak_bytes(
    arch: Architecture,
    layout: Layout,
    stages: list[int],
    stage_w: Sequence[float],
    stage_kv: Sequence[float],
    scratch: float,
    layer_w: float,
    embed_w: float,
    checkpoint_bytes: int,
) -> int:
    """The host's peak on a CPU: every rank process at its runtime reserve plus the larger
    of its load-time and running peaks, plus the launcher when there are several ranks.

    Running: resident weights (and the C++ step's repacked copy of packed ones), KV cache
    (this rank's heads), activations, scratch. Loading
    (kiln streams blocks, ``kiln.models.fill``): the weights the rank keeps plus one block in
    flight; a float plan loaded whole by one process may keep the checkpoint's pages
    mapped (views, or pages read to convert), so the checkpoint counts too; a quantized,
    sharded or offloaded load reads into its own memory, and pages of the file do not stay.
    A plan that streams its blocks from disk keeps none of them resident."""
    reserve = RUNTIME_RESERVE["cpu"]
    ranks = layout.tp * layout.pp
    mapped = (
        checkpoint_bytes if ranks == 1 and not layout.fmt.packed and layout.offload == "none" else 0
    )
    transient = _load_transient(arch, embed_w, layout.fmt.packed)
    # kiln's C++ step repacks INT8 / INT4 weights (blocks and head) for its kernels, beside
    # the model's own copy
    repacked = 0.0
    if ranks == 1 and layout.offload == "none" and layout.fmt.packed:
        linear = sum(lin.out_features * lin.in_features for lin in arch.layer_linears)
        head = arch.head_params or arch.embedding_params
        repacked = arch.n_layers * linear * layout.fmt.bits / 8 + head
    total = reserve if ranks > 1 else 0.0
    for layers, weights, kv in zip(stages, stage_w, stage_kv, strict=True):
        streamed = layout.offload != "none"
        resident = weights - (layers * layer_w / layout.tp if streamed else 0)
        in_flight = 2 * layer_w / layout.tp if streamed else 0  # the block run, the one fetched
        run = (resident + in_flight + repacked + kv + scratch) * (1 + FRAGMENTATION)
        load = resident + transient + mapped
        total += layout.tp * (reserve + max(run, load))
    return int(total)


def _host_bytes(hw: Hardware, layout: Layout, offloaded: int, device_w: int) -> int:
    """Host memory: the runtime, the offloaded weights kept in RAM (host offload), and, at
    load, one tensor-sized staging buffer per device (weights stream from the checkpoint
    file to their device one tensor at a time)."""
    reserve = RUNTIME_RESERVE["cpu"]
    kept = offloaded * layout.devices if layout.offload == "host" else 0
    staging = min(device_w, 2 * 2**30) * layout.devices
    if hw.device.kind == "cpu":  # the devices are the host: weights and caches live in RAM
        return int(reserve + staging)
    return int(reserve + kept + staging)


# ------------------------------------------------------------------ time parts
def _decode_ms(
    arch: Architecture,
    hw: Hardware,
    layout: Layout,
    layer_w: float,
    head_read: float,
    stages: list[int],
    kv_per_layer: list[int],
    offloaded: int,
) -> float:
    """One decode step on the roofline: per layer the larger of its reads (weights and KV
    cache) over the bandwidth and its FLOPs over the peak, two all-reduces under TP; the
    whole head (kiln does not shard it); stage-to-stage sends under PP and the logits
    broadcast to every rank; offloaded weights streamed alongside, overlapped."""
    dev, kind = hw.device, hw.device.kind
    tp, b = layout.tp, layout.batch
    bw = dev.bandwidth_gbs * 1e9 * BANDWIDTH_EFFICIENCY[kind]
    peak = _peak_flops(hw, layout.fmt.compute) * COMPUTE_EFFICIENCY[kind]
    attn = 2 * arch.head_dim * arch.n_heads * layout.context
    flops_layer = 2 * b * (arch.params_per_layer + attn)
    ms = 0.0
    for layer in range(sum(stages)):
        kv_read = kv_per_layer[layer] * layout.act_bytes / tp
        ms += max((layer_w / tp + kv_read) / bw, flops_layer / tp / peak) * 1e3
        ms += 2 * _allreduce_ms(hw, b * arch.hidden_size * layout.act_bytes, tp)
    ms += max(head_read / bw, 2 * b * arch.vocab_size * arch.hidden_size / peak) * 1e3
    ms += (layout.pp - 1) * _p2p_ms(hw, b * arch.hidden_size * layout.act_bytes)
    if layout.devices > 1:
        ms += _p2p_ms(hw, b * arch.vocab_size * 4)  # the logits, to every rank
    if offloaded:  # streamed every token, overlapped with the rest of the step
        link = hw.host_link.bandwidth_gbs if layout.offload == "host" else hw.disk_read_gbs
        if kind == "cpu" and hw.host_memory_bytes > 2 * offloaded * layout.devices:
            link = dev.bandwidth_gbs  # the store stays in the page cache: a memory copy
        ms = max(ms, offloaded * layout.pp / (link * 1e9) * 1e3)
    return ms


def _prefill_ms(arch: Architecture, hw: Hardware, layout: Layout, total_w: int) -> float:
    """Time to first token on the roofline: the prompt's FLOPs at the peak (at a stated
    efficiency) or its weight reads, whichever is longer, plus TP all-reduces and PP sends
    of the activations."""
    kind = hw.device.kind
    tokens = layout.batch * layout.prompt_len
    flops = 2 * tokens * arch.total_params + 2 * arch.n_layers * layout.batch * (
        2 * arch.n_heads * arch.head_dim * layout.prompt_len**2
    )
    peak = _peak_flops(hw, layout.fmt.compute) * COMPUTE_EFFICIENCY[kind] * layout.tp
    read = (
        total_w
        / layout.pp
        / layout.tp
        / (hw.device.bandwidth_gbs * 1e9 * BANDWIDTH_EFFICIENCY[kind])
    )
    compute = flops / layout.pp / peak
    ms = (max(compute, read) * layout.pp) * 1e3  # stages run one after another for one prompt
    ms += (
        2
        * arch.n_layers
        * _allreduce_ms(hw, tokens * arch.hidden_size * layout.act_bytes, layout.tp)
    )
    ms += (layout.pp - 1) * _p2p_ms(hw, tokens * arch.hidden_size * layout.act_bytes)
    return ms


def _peak_flops(hw: Hardware, dtype: str) -> float:
    rates = hw.device.tflops
    for key in (dtype, "fp16", "bf16", "fp32"):
        if rates.get(key):
            return rates[key] * 1e12
    raise ValueError(f"{hw.device.name} lists no FLOP rate")


def _allreduce_ms(hw: Hardware, nbytes: float, tp: int) -> float:
    """Ring all-reduce: 2 (tp - 1) messages, each moving nbytes / tp over the link."""
    if tp == 1:
        return 0.0
    link = hw.link
    return 2 * (tp - 1) * (link.latency_us * 1e-3 + nbytes / tp / (link.bandwidth_gbs * 1e9) * 1e3)


def _p2p_ms(hw: Hardware, nbytes: float) -> float:
    link = hw.link
    return link.latency_us * 1e-3 + nbytes / (link.bandwidth_gbs * 1e9) * 1e3
