"""Facts about the machine and software a result records, read without importing
any runtime: CPU name and ISA flags, versions, load average and CPU busy share."""

from __future__ import annotations

import json
import os
import platform
import re
import sys
import time
from importlib import metadata
from pathlib import Path
from typing import Any


def cpu_info() -> dict[str, Any]:
    """CPU model name, logical CPU count and the avx512f / avx2 / fma flags."""
    name, flags = platform.processor() or "unknown-cpu", set()
    try:
        with open("/proc/cpuinfo") as f:
            text = f.read()
        m = re.search(r"^model name\s*:\s*(.+)$", text, re.M)
        if m:
            name = m.group(1).strip()
        m = re.search(r"^flags\s*:\s*(.+)$", text, re.M)
        if m:
            flags = set(m.group(1).split())
    except OSError:
        pass
    return {
        "name": name,
        "logical_cpus": os.cpu_count(),
        "avx512f": "avx512f" in flags,
        "avx2": "avx2" in flags,
        "fma": "fma" in flags,
    }


def device_slug(cpu: dict[str, Any]) -> str:
    """File-name-safe device id, e.g. ``amd-epyc-avx2``: CPU name plus widest ISA."""
    base = re.sub(r"[^a-z0-9]+", "-", cpu["name"].lower())
    base = re.sub(r"-(processor|cpu)\b", "", base).strip("-")[:40].strip("-")
    isa = "avx512" if cpu["avx512f"] else ("avx2" if cpu["avx2"] else "generic")
    return f"{base}-{isa}"


def versions() -> dict[str, str | None]:
    """Installed versions of python and each runtime (from package metadata)."""
    out: dict[str, str | None] = {"python": sys.version.split()[0]}
    for pkg in ("torch", "onnxruntime", "openvino", "onnx", "onnxscript", "numpy"):
        try:
            out[pkg] = metadata.version(pkg)
        except metadata.PackageNotFoundError:
            out[pkg] = None
    return out


def _cpu_times() -> tuple[int, int]:
    """(busy, total) jiffies summed over all CPUs, from /proc/stat."""
    with open("/proc/stat") as f:
        vals = [int(v) for v in f.readline().split()[1:]]
    idle = vals[3] + (vals[4] if len(vals) > 4 else 0)  # idle + iowait
    return sum(vals) - idle, sum(vals)


def load_snapshot(window_s: float = 0.5) -> dict[str, Any]:
    """Load averages and the share of all CPUs busy over ``window_s`` seconds.

    Taken while this run is idle, so ``busy`` is what co-tenants use."""
    snap: dict[str, Any] = {"time": time.time()}
    try:
        snap["loadavg"] = list(os.getloadavg())
        b0, t0 = _cpu_times()
        time.sleep(window_s)
        b1, t1 = _cpu_times()
        snap["busy"] = round((b1 - b0) / max(t1 - t0, 1), 3)
    except OSError:
        snap.setdefault("loadavg", None)
        snap["busy"] = None
    return snap


def busy_jiffies() -> tuple[int, int]:
    """(busy, total) jiffies over all CPUs right now; pair two calls to get a share."""
    try:
        return _cpu_times()
    except OSError:
        return 0, 0


def process_jiffies(pid: int) -> int:
    """User + system jiffies used so far by process ``pid`` (all its threads)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return int(fields[11]) + int(fields[12])  # utime, stime (fields 14, 15 of the line)
    except (OSError, IndexError, ValueError):
        return 0


def wait_quiet(max_wait_s: float, threshold: float, sample_s: float = 0.1) -> float:
    """Wait (up to ``max_wait_s``) until the share of all CPUs busy over a
    ``sample_s`` window is at most ``threshold``; return the last share seen.

    The runner calls this while its own workers sleep, so the share is what
    co-tenants use: timing then starts in a quiet moment when there is one.
    """
    deadline = time.monotonic() + max_wait_s
    while True:
        b0, t0 = busy_jiffies()
        time.sleep(sample_s)
        b1, t1 = busy_jiffies()
        share = (b1 - b0) / max(t1 - t0, 1)
        if share <= threshold or time.monotonic() >= deadline:
            return round(share, 3)


def portable_path(path: str | Path) -> str:
    """``path`` as a result file records it, with nothing of this machine's layout in it:
    relative to the working directory when under it, ``<package>/...`` when inside an
    installed package (``site-packages``), else its file name alone."""
    p = Path(path).absolute()
    parts = p.parts
    if "site-packages" in parts:
        return "/".join(parts[parts.index("site-packages") + 1 :])
    try:
        return p.relative_to(Path.cwd()).as_posix()
    except ValueError:
        return p.name


def publish(result: dict[str, Any], out_dir: str | Path, stem: str, markdown: str) -> None:
    """Write ``result`` as ``out_dir/<stem>-<yyyymmdd>.json`` with its markdown beside it
    (``write_result``: never over an earlier one), print the markdown and where it went."""
    write_result(result, out_dir, f"{stem}-{time.strftime('%Y%m%d')}.json", markdown)
    print(markdown)
    print(f"wrote {result['path']}")


def write_result(
    result: dict[str, Any], out_dir: str | Path, name: str, markdown: str | None = None
) -> dict[str, Any]:
    """Write ``result`` as ``out_dir/name`` (JSON, recording its own portable path) and,
    if given, ``markdown`` beside it (``.md``); return ``result`` with the usable paths.
    An earlier result of that name is never overwritten: the new one is ``name-2``, ..."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    path = out / name
    n = 1
    while path.exists() or path.with_suffix(".md").exists():
        n += 1
        path = out / f"{Path(name).stem}-{n}{Path(name).suffix}"
    result["path"] = portable_path(path)
    if markdown is not None:
        result["markdown_path"] = portable_path(path.with_suffix(".md"))
    path.write_text(json.dumps(result, indent=1, default=str))
    if markdown is not None:
        path.with_suffix(".md").write_text(markdown)
        result["markdown_path"] = str(path.with_suffix(".md"))
    result["path"] = str(path)
    return result
