"""The planner's table of measured engine costs for this CPU, cached on disk.

One JSON file per CPU (model name and ISA flags: a Zen 3 and a Zen 5 host are both "AMD
EPYC") and thread count: the one-process engines (``kernel_rates.measure_rates``), the gloo
collective, and, at a thread count that several ranks share the cores with, those ranks'
layouts timed launched (``rank_rates``). ``kiln calibrate`` refreshes it.

Timings taken while other processes used more than ``MAX_OTHER_LOAD`` of the CPU
(``core.host_load``) price the plan at hand but are never cached: on a 2-core host such
timings came out 3-6x slow and, cached, mispriced every later plan.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Callable

from kiln.core.cache import cache_dir
from kiln.core.hardware import cpu_model
from kiln.core.host_load import OtherLoad
from kiln.core.native import cpu_flags
from kiln.deploy.kernel_rates import FORMATS, VERSION, Cost, measure_rates
from kiln.deploy.rank_rates import measure_collective, measure_layouts

MAX_OTHER_LOAD = 0.2  # share of the CPU other processes may use while timings are cached


def cpu_key() -> str:
    """What names this CPU in a cache key: its model name and ISA flags."""
    return f"{cpu_model()}|{' '.join(cpu_flags())}"


def rates_path(threads: int) -> str:
    key = hashlib.sha256(cpu_key().encode()).hexdigest()[:12]
    return str(cache_dir("kernel-rates") / f"rates-v{VERSION}-{key}-{threads}t.json")


def read_table(path: str) -> dict[str, dict[int, Cost]] | None:
    """A cached table (engine -> rows -> cost), or None when it is missing, stale or
    corrupt (then it is measured again)."""
    if not os.path.exists(path):
        return None
    try:
        with open(path, encoding="utf-8") as f:
            raw = json.load(f)
        return {
            engine: {int(r): Cost(float(c[0]), float(c[1])) for r, c in by.items()}
            for engine, by in raw.items()
        }
    except (ValueError, KeyError, TypeError, AttributeError, IndexError):
        return None


def write_table(path: str, rates: dict[str, dict[int, Cost]]) -> None:
    """Write a table atomically (a reader never sees half of it)."""
    tmp = f"{path}.{os.getpid()}.tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        raw_out = {e: {r: [c.rate, c.layer_s] for r, c in by.items()} for e, by in rates.items()}
        json.dump(raw_out, f, indent=1)
    os.replace(tmp, path)


def cache_if_quiet(
    path: str, rates: dict[str, dict[int, Cost]], others: float, what: str,
    warn: Callable[[str], None],
) -> None:  # fmt: skip
    """Write ``rates`` to ``path`` unless other processes used more than
    ``MAX_OTHER_LOAD`` of the CPU (``others``) while ``what`` was timed; ``warn`` hears
    when they are not written."""
    if others > MAX_OTHER_LOAD:
        warn(f"other processes used {others:.0%} of the CPU while {what} were timed: "
             "the timings are used now but not cached (time again on a quieter machine)")  # fmt: skip
        return
    write_table(path, rates)


def load_rates(
    threads: int = 2,
    refresh: bool = False,
    note: Callable[[str], None] = lambda _: None,
    warn: Callable[[str], None] | None = None,
) -> dict[str, dict[int, Cost]]:
    """This CPU's table at ``threads`` threads (cached JSON), measured now when missing
    (a minute or two; ``note`` hears what is being timed, ``warn`` (default ``note``) that
    a busy host's timings were not cached)."""
    path = rates_path(threads)
    cached = None if refresh else read_table(path)
    if cached is not None:
        return cached
    with OtherLoad() as load:
        rates = measure_rates(threads, note)
        note("timing a gloo all-reduce between two ranks")
        gloo = measure_collective(2)
        rates["gloo"] = {2: gloo}
        ranks = len(os.sched_getaffinity(0)) // threads  # the ranks at this thread count
        if ranks >= 2:
            rates.update(measure_layouts(ranks, FORMATS, gloo, note, one_process=rates))
    cache_if_quiet(path, rates, load.share, "the engines", warn or note)
    return rates
