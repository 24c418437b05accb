"""Hardware a deployment is planned for: a device catalog and the ``--hardware`` spec parser.

A spec is ``[N x]DEVICE[,key=value]...`` (case-insensitive, spaces ignored), e.g.
``4xRTX3090``, ``8xA100-40GB,host=256GB,nvme=3GB/s``, ``cpu,ram=2GB``, ``2xH100,link=pcie5``.
Keys: ``host``/``ram`` host RAM (for ``cpu``, ``ram`` is also the device memory), ``nvme``/
``disk`` offload-disk read GB/s, ``link`` a ``LINKS`` name, ``price`` USD per device-hour,
``mem`` device memory, ``bw`` device bandwidth GB/s. Defaults: the device's own link, a
256 GB host per machine for GPUs (the RAM itself for ``cpu``), a 2 GB/s (NVMe) disk.
``Nxcpu`` is N ranks (processes) on this one host: they share its cores, its memory
bandwidth and its RAM, and the planner prices them so (``estimate_cpu``).

Units: memory sizes follow the JEDEC convention that device names already use ("A100-80GB"
holds 80 GiB): KB/MB/GB/TB and KiB/MiB/GiB/TiB are both powers of 1024, so ``mem=80GB``
equals the A100-80GB figure. Rates are decimal: GB/s is 1e9 bytes/s, TFLOP/s 1e12.

A spec may instead be the path of a JSON file (ending in ``.json`` or holding a ``/``; an
``Nx`` prefix overrides its count), for hardware not in the catalog::

    {"device": {"name": "MI250X", "kind": "gpu", "memory_bytes": 68719476736,
                "bandwidth_gbs": 1638, "tflops": {"fp32": 47.9, "fp16": 383},
                "link": "pcie4", "price_per_hour": 2.0},
     "count": 4, "link": "pcie4", "host_memory_bytes": 549755813888,
     "host_link": "pcie4", "disk_read_gbs": 3.0}

``device`` may also be a catalog name (``"A100-80GB"``); every other field is optional
and defaults as for a spec string. ``Hardware.to_json`` writes this format.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

DTYPES = ("fp32", "tf32", "fp16", "bf16", "int8", "fp16-2:4", "int8-2:4")
GIB = 2**30
DEFAULT_HOST_BYTES = 256 * GIB  # one GPU server's RAM when the spec does not say
DEFAULT_DISK_GBS = 2.0  # an NVMe SSD's sequential read


class HardwareSpecError(ValueError):
    """A hardware spec (string or JSON file) that cannot be read; the message says why."""


@dataclass(frozen=True)
class Link:
    """An interconnect: per-device one-direction bandwidth (GB/s) and per-message latency."""

    name: str
    bandwidth_gbs: float
    latency_us: float


# Effective (not signalling) rates; latencies are NCCL/cudaMemcpy small-message orders.
LINKS: Mapping[str, Link] = {
    lk.name: lk
    for lk in (
        Link("nvlink4", 450.0, 2.0),  # H100/H200 SXM: 900 GB/s bidirectional
        Link("nvlink3", 300.0, 2.0),  # A100 SXM: 600 GB/s bidirectional
        Link("nvlink2", 150.0, 2.0),  # V100 SXM2: 300 GB/s bidirectional
        Link("pcie3", 12.0, 5.0),  # x16, 15.75 GB/s raw
        Link("pcie4", 25.0, 5.0),  # x16, 31.5 GB/s raw
        Link("pcie5", 50.0, 5.0),  # x16, 63 GB/s raw
        Link("ethernet-100g", 12.5, 10.0),  # RDMA class
        Link("shared-memory", 20.0, 1.0),  # one process to another in RAM (memcpy order)
    )
}


@dataclass(frozen=True)
class Device:
    """One accelerator (or this CPU). ``tflops`` is dense peak TFLOP/s (TOPS for int8) by
    dtype from ``DTYPES``; a missing dtype is unsupported. Memory in bytes, bandwidth GB/s."""

    name: str
    kind: str
    memory_bytes: int
    bandwidth_gbs: float
    tflops: Mapping[str, float] = field(hash=False)
    link: str
    price_per_hour: float

    def __post_init__(self) -> None:
        bad = [k for k, v in self.tflops.items() if k not in DTYPES or not v > 0]
        if self.kind not in ("gpu", "cpu") or bad or not self.tflops:
            raise HardwareSpecError(f"device {self.name!r}: bad kind or tflops {bad}")
        if self.memory_bytes <= 0 or self.bandwidth_gbs <= 0 or self.price_per_hour < 0:
            raise HardwareSpecError(f"device {self.name!r}: memory/bandwidth must be > 0")
        if self.link not in LINKS:
            raise HardwareSpecError(
                f"device {self.name!r}: link {self.link!r} not in {_names(LINKS)}"
            )
        object.__setattr__(self, "tflops", dict(self.tflops))


def _gpu(name: str, gib: int, bw: float, link: str, price: float, sparse: bool = False,
         **tf: float) -> Device:  # fmt: skip
    """A catalog GPU; ``sparse`` adds the 2:4 tensor-core rates (twice dense, Ampere on)."""
    if sparse:
        tf |= {"fp16-2:4": 2 * tf["fp16"], "int8-2:4": 2 * tf["int8"]}
    return Device(name, "gpu", gib * GIB, bw, tf, link, price)


# Dense datasheet peaks (the "-2:4" rates are the 2:4-sparse ones). GeForce fp16/bf16 rates
# are with fp32 accumulate (what PyTorch uses); fp16 accumulate doubles them. Prices: rough
# on-demand USD per GPU-hour -- AWS list per GPU for datacentre parts, community clouds
# (RunPod/Vast.ai, Lambda for A6000) for workstation/consumer cards; order of magnitude only.
# fmt: off
DEVICES: Mapping[str, Device] = {
    d.name: d
    for d in (
        # NVIDIA V100 datasheet (SXM2 32GB); no int8/bf16 tensor cores, no sparsity. AWS p3 $3.06
        _gpu("V100-32GB", 32, 900, "nvlink2", 3.1, fp32=15.7, fp16=125),
        # NVIDIA A100 datasheet (SXM4 40GB, HBM2). AWS p4d $32.77/8
        _gpu("A100-40GB", 40, 1555, "nvlink3", 4.1, fp32=19.5, tf32=156, fp16=312, bf16=312,
             int8=624, sparse=True),
        # NVIDIA A100 datasheet (SXM4 80GB, HBM2e). AWS p4de $40.97/8
        _gpu("A100-80GB", 80, 2039, "nvlink3", 5.1, fp32=19.5, tf32=156, fp16=312, bf16=312,
             int8=624, sparse=True),
        # NVIDIA H100 datasheet (SXM5 80GB, HBM3; sheet lists sparse, dense = half). ~AWS p5/8
        _gpu("H100", 80, 3350, "nvlink4", 7.0, fp32=67, tf32=494.5, fp16=989.5, bf16=989.5,
             int8=1979, sparse=True),
        # NVIDIA H200 datasheet (SXM 141GB HBM3e, 4.8 TB/s; H100 compute). ~AWS p5e/8
        _gpu("H200", 141, 4800, "nvlink4", 8.0, fp32=67, tf32=494.5, fp16=989.5, bf16=989.5,
             int8=1979, sparse=True),
        # NVIDIA L4 datasheet (24GB GDDR6, 300 GB/s; sheet lists sparse). AWS g6.xlarge
        _gpu("L4", 24, 300, "pcie4", 0.8, fp32=30.3, tf32=60, fp16=121, bf16=121, int8=242.5, sparse=True),
        # NVIDIA T4 datasheet (16GB GDDR6, 320 GB/s; Turing: no bf16/tf32). AWS g4dn.xlarge
        _gpu("T4", 16, 320, "pcie3", 0.53, fp32=8.1, fp16=65, int8=130),
        # NVIDIA Ampere GA102 whitepaper, RTX A6000 column (48GB GDDR6, 768 GB/s). Lambda
        _gpu("A6000", 48, 768, "pcie4", 0.8, fp32=38.7, tf32=77.4, fp16=154.8, bf16=154.8,
             int8=309.7, sparse=True),
        # NVIDIA Turing TU102 whitepaper, RTX 2080 Ti (11GB GDDR6, 616 GB/s). Vast.ai
        _gpu("RTX2080Ti", 11, 616, "pcie3", 0.15, fp32=13.4, fp16=53.8, int8=215.2),
        # NVIDIA Ampere GA102 whitepaper, RTX 3090 (24GB GDDR6X, 936 GB/s). RunPod/Vast.ai
        _gpu("RTX3090", 24, 936, "pcie4", 0.3, fp32=35.6, tf32=35.6, fp16=71, bf16=71,
             int8=284, sparse=True),
        # NVIDIA Ada Lovelace whitepaper, RTX 4090 (24GB GDDR6X, 1008 GB/s). RunPod/Vast.ai
        _gpu("RTX4090", 24, 1008, "pcie4", 0.6, fp32=82.6, tf32=82.6, fp16=165.2, bf16=165.2,
             int8=660.6, sparse=True),
    )
}
# fmt: on
# device <-> host link: PCIe 3 before Ampere, 4 for Ampere/Ada, 5 for Hopper
_HOST_LINKS = {
    "V100-32GB": "pcie3",
    "T4": "pcie3",
    "RTX2080Ti": "pcie3",
    "H100": "pcie5",
    "H200": "pcie5",
}  # fmt: skip


def _key(name: str) -> str:
    return re.sub(r"[\s_\-]", "", name.lower()).removeprefix("nvidia").removeprefix("geforce")


_ALIASES = {_key(n): n for n in DEVICES} | {
    _key(n).removeprefix("rtx"): n for n in DEVICES if n.startswith("RTX")
}
_ALIASES |= {"v100": "V100-32GB", "h100sxm": "H100", "h10080gb": "H100", "h200141gb": "H200",
             "rtxa6000": "A6000", "l424gb": "L4", "t416gb": "T4"}  # fmt: skip
_AMBIGUOUS = {"a100": ("A100-40GB", "A100-80GB")}


def catalog_name(device_name: str) -> str:
    """The catalog's name for a device as its driver names it ("NVIDIA H200" -> "H200",
    "NVIDIA H100 80GB HBM3" -> "H100"): its words, dropped from the end until one matches."""
    words = device_name.split()
    for end in range(len(words), 0, -1):
        key = _key(re.sub(r"-?sxm\d?", "", "".join(words[:end]), flags=re.I)).removeprefix("tesla")
        if key in _ALIASES:
            return _ALIASES[key]
    raise HardwareSpecError(f"{device_name!r} is not in the catalog; valid devices: "
                            f"{_names(DEVICES)} (or describe it in a hardware file)")  # fmt: skip


def _names(m: Mapping[str, object]) -> str:
    return ", ".join(m)


def meminfo_bytes(key: str = "MemTotal", meminfo: str | Path = "/proc/meminfo") -> int:
    """``key`` (``MemTotal``, ``MemAvailable``, ...) from a /proc/meminfo-format file, in
    bytes (its "kB" are KiB)."""
    for line in Path(meminfo).read_text(encoding="utf-8").splitlines():
        if line.startswith(f"{key}:"):
            return int(line.split()[1]) * 1024
    raise OSError(f"no {key} in {meminfo}")


def this_machine(threads: int = 2, meminfo: str | Path = "/proc/meminfo") -> Device:
    """This CPU as a device: RAM from ``meminfo``, bandwidth and fp32 rate from the calibrated
    profile at ``threads`` (cached; about a second the first time). Price 0.0: it is already
    paid for, and a planner comparing clouds should price it itself (``price=``)."""
    from kiln.core.calibrate import load_profile  # torch; only when a cpu spec is read

    prof = load_profile(threads)
    return Device("cpu", "cpu", meminfo_bytes("MemTotal", meminfo), prof.mem_bw_gbs,
                  {"fp32": prof.peak_gflops / 1e3}, "shared-memory", 0.0)  # fmt: skip


@dataclass(frozen=True)
class Hardware:
    """``count`` devices joined by ``link``, on hosts with ``host_memory_bytes`` of RAM
    reached over ``host_link``, and a disk reading ``disk_read_gbs`` GB/s for offload."""

    device: Device
    count: int
    link: Link
    host_memory_bytes: int
    host_link: Link
    disk_read_gbs: float
    spec: str

    def __post_init__(self) -> None:
        if self.count < 1:
            raise HardwareSpecError(f"device count must be >= 1, got {self.count} in {self.spec!r}")
        if self.host_memory_bytes <= 0 or self.disk_read_gbs <= 0:
            raise HardwareSpecError(f"host memory and disk bandwidth must be > 0 in {self.spec!r}")

    @property
    def price_per_hour(self) -> float:
        return self.count * self.device.price_per_hour

    def with_count(self, count: int) -> Hardware:
        """The same hardware with ``count`` devices (the spec's count rewritten)."""
        prefix = f"{count}x" if count > 1 else ""
        return replace(self, count=count, spec=prefix + re.sub(r"^\d+x", "", self.spec))

    def to_json(self) -> str:
        """This hardware in the JSON-file format ``parse_hardware`` reads."""
        d = self.device
        dev = {"name": d.name, "kind": d.kind, "memory_bytes": d.memory_bytes,
               "bandwidth_gbs": d.bandwidth_gbs, "tflops": dict(d.tflops), "link": d.link,
               "price_per_hour": d.price_per_hour}  # fmt: skip
        return json.dumps({"device": dev, "count": self.count, "link": self.link.name,
                           "host_memory_bytes": self.host_memory_bytes,
                           "host_link": self.host_link.name,
                           "disk_read_gbs": self.disk_read_gbs}, indent=2)  # fmt: skip


_SIZE = re.compile(r"(\d+(?:\.\d+)?)([kmgt]i?)?b?")
_RATE = re.compile(r"(\d+(?:\.\d+)?)(?:([mgt])b/s|([mgt])b)?")
_KEYS = ("host", "ram", "nvme", "disk", "link", "price", "mem", "bw")


def parse_size(text: str) -> int:
    """'2GB' / '2GiB' -> 2 * 2**30 bytes (binary in both spellings, see the module doc)."""
    m = _SIZE.fullmatch(text.lower())
    if not m or float(m[1]) <= 0:
        raise HardwareSpecError(f"bad size {text!r}: expected e.g. 512MB, 24GB, 1.5TiB")
    return int(float(m[1]) * 1024 ** ("kmgt".index(m[2][0]) + 1 if m[2] else 0))


def _rate(text: str, what: str) -> float:
    """'3GB/s', '3' (GB/s), '500MB/s' -> GB/s."""
    m = _RATE.fullmatch(text.lower())
    if not m or float(m[1]) <= 0:
        raise HardwareSpecError(f"bad {what} {text!r}: expected GB/s, e.g. 3GB/s or 3")
    unit = m[2] or m[3] or "g"
    return float(m[1]) * {"m": 1e-3, "g": 1.0, "t": 1e3}[unit]


def _device(name: str, cpu: Device | None) -> Device:
    key = _key(name)
    if key == "cpu":
        return cpu if cpu is not None else this_machine()
    if key in _AMBIGUOUS:
        raise HardwareSpecError(f"ambiguous device {name!r}: say {' or '.join(_AMBIGUOUS[key])}")
    if key not in _ALIASES:
        raise HardwareSpecError(f"unknown device {name!r}; valid devices: {_names(DEVICES)}, cpu")
    return DEVICES[_ALIASES[key]]


def _link(name: str) -> Link:
    if name not in LINKS:
        raise HardwareSpecError(f"unknown link {name!r}; valid links: {_names(LINKS)}")
    return LINKS[name]


def _host_link(device: Device) -> Link:
    if device.kind == "cpu":
        return LINKS["shared-memory"]
    return LINKS[_HOST_LINKS.get(device.name, "pcie4")]


def parse_hardware(spec: str, *, cpu: Device | None = None) -> Hardware:
    """Hardware from a spec string or a JSON file path, optionally ``Nx``-prefixed (module
    docstring). ``cpu`` stands in for ``this_machine()`` (tests, a profile from elsewhere)."""
    m = re.fullmatch(r"\s*(?:(\d+)\s*[x*]\s*)?(.+?)\s*", spec, flags=re.IGNORECASE)
    count, name = (int(m[1]) if m and m[1] else 1), (m[2] if m else "")
    if count < 1:
        raise HardwareSpecError(f"device count must be >= 1, got {count} in {spec!r}")
    if name.lower().endswith(".json") or "/" in name.split(",")[0]:  # never a file "cpu"
        hw = _from_json(Path(name), cpu)
        return hw.with_count(count) if m and m[1] else hw
    head, *parts = re.sub(r"\s", "", name).split(",")
    device = _device(head, cpu)
    opts: dict[str, str] = {}
    for part in parts:
        key, eq, value = part.partition("=")
        key = key.lower()
        if not eq or not value or key not in _KEYS:
            raise HardwareSpecError(
                f"bad option {part!r} in {spec!r}; keys: {', '.join(_KEYS)}=VALUE"
            )
        if key in opts:
            raise HardwareSpecError(f"option {key!r} given twice in {spec!r}")
        opts[key] = value.lower()
    if "nvme" in opts and "disk" in opts:
        raise HardwareSpecError(f"give one of nvme= and disk= in {spec!r}")
    changes: dict[str, Any] = {}
    if "mem" in opts or ("ram" in opts and device.kind == "cpu"):
        changes["memory_bytes"] = parse_size(opts.get("mem") or opts["ram"])
    if "bw" in opts:
        changes["bandwidth_gbs"] = _rate(opts["bw"], "bandwidth")
    if "price" in opts:
        try:
            changes["price_per_hour"] = float(opts["price"].removeprefix("$"))
        except ValueError:
            raise HardwareSpecError(f"bad price {opts['price']!r}: USD per device-hour") from None
    device = replace(device, **changes)
    host = opts.get("host") or opts.get("ram")
    default_host = DEFAULT_HOST_BYTES if device.kind == "gpu" else device.memory_bytes
    norm = ",".join([f"{count}x{device.name}" if count > 1 else device.name]
                    + [f"{k}={v}" for k, v in opts.items()])  # fmt: skip
    return Hardware(
        device=device,
        count=count,
        link=_link(opts["link"]) if "link" in opts else LINKS[device.link],
        host_memory_bytes=parse_size(host) if host else default_host,
        host_link=_host_link(device),
        disk_read_gbs=_rate(opts.get("nvme") or opts.get("disk") or "2", "disk bandwidth"),
        spec=norm,
    )


def _from_json(path: Path, cpu: Device | None) -> Hardware:
    try:
        d = json.loads(path.read_text(encoding="utf-8"))
        raw = d["device"]
        if isinstance(raw, str):
            device = _device(raw, cpu)
        else:
            fields = {
                k: raw[k] for k in ("name", "kind", "memory_bytes", "bandwidth_gbs", "tflops")
            }
            device = Device(**fields, link=raw.get("link", "pcie4"),
                            price_per_hour=float(raw.get("price_per_hour", 0.0)))  # fmt: skip
        host = DEFAULT_HOST_BYTES if device.kind == "gpu" else device.memory_bytes
        return Hardware(
            device=device,
            count=int(d.get("count", 1)),
            link=_link(d.get("link", device.link)),
            host_memory_bytes=int(d.get("host_memory_bytes", host)),
            host_link=_link(d["host_link"]) if "host_link" in d else _host_link(device),
            disk_read_gbs=float(d.get("disk_read_gbs", DEFAULT_DISK_GBS)),
            spec=str(path),
        )
    except OSError as e:
        raise HardwareSpecError(f"cannot read hardware file {str(path)!r}: {e}") from None
    except (ValueError, KeyError, TypeError) as e:
        if isinstance(e, HardwareSpecError):
            raise
        raise HardwareSpecError(f"bad hardware file {str(path)!r}: {e!r}") from None
