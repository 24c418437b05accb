"""How much of this machine's CPU other processes used while we timed something.

A timing taken while another process ran is slow, and a slow timing that is cached
misprices every later plan: on a 2-core host, engine timings taken while other work ran
came out 3-6x slow (SmolLM2's fp32 decode step at 4 GB/s where it streams at 23), and the
planner then predicted that plan 4x slow on every later run. ``OtherLoad`` measures the
share of all CPUs that other processes were busy over a window (from ``/proc/stat`` less
this process's own CPU time, its threads included, and that of the children it waited
for, such as the ranks of a launched layout), so a caller can refuse to cache such
timings. Linux only; elsewhere the share reads 0.
"""

from __future__ import annotations

import os
import time
from types import TracebackType


def machine_busy_s() -> tuple[float, float] | None:
    """(busy, total) CPU seconds of all CPUs since boot, from ``/proc/stat``."""
    try:
        with open("/proc/stat") as f:
            v = [int(x) for x in f.readline().split()[1:]]
    except (OSError, ValueError):
        return None
    if len(v) < 4:
        return None
    idle = v[3] + (v[4] if len(v) > 4 else 0)  # idle and iowait
    tick = os.sysconf("SC_CLK_TCK")
    return (sum(v) - idle) / tick, sum(v) / tick


def own_cpu_s() -> float:
    """CPU seconds of this process (all its threads) and of the children it has waited for."""
    t = os.times()
    return time.process_time() + t.children_user + t.children_system


class OtherLoad:
    """Context manager: ``share`` is the fraction of all CPUs' time that other processes
    were busy between enter and exit (0 to 1; 0 where ``/proc/stat`` is missing)."""

    def __init__(self) -> None:
        self.share = 0.0
        self._start: tuple[float, float] | None = None
        self._own = 0.0

    def __enter__(self) -> OtherLoad:
        self._start = machine_busy_s()
        self._own = own_cpu_s()
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        err: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        end = machine_busy_s()
        if self._start is None or end is None:
            return
        busy, total = end[0] - self._start[0], end[1] - self._start[1]
        others = busy - (own_cpu_s() - self._own)
        self.share = min(1.0, max(0.0, others / total)) if total > 0 else 0.0
