"""``OtherLoad``: the CPU share other processes used, measured against a real busy child."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from kiln.core.host_load import OtherLoad

linux_only = pytest.mark.skipif(not os.path.exists("/proc/stat"), reason="needs /proc/stat")
pytestmark = pytest.mark.serial  # other tests running beside these would count as others


@linux_only
def test_a_busy_process_beside_us_is_counted() -> None:
    # One child spinning for the whole window holds one CPU: 1 / cpus of the machine.
    cpus = os.cpu_count() or 1
    child = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        time.sleep(0.3)  # the interpreter is up and spinning
        with OtherLoad() as load:
            time.sleep(1.0)
    finally:
        child.kill()
        child.wait()
    assert load.share >= 0.6 / cpus


@linux_only
def test_our_own_work_is_not_counted() -> None:
    # Spinning in this process for the window: the machine is busy, but not by others.
    # (A co-tenant may still add some; a spin of ours counted would read >= 1 / cpus.)
    cpus = os.cpu_count() or 1
    with OtherLoad() as load:
        end = time.perf_counter() + 1.0
        while time.perf_counter() < end:
            pass
    assert load.share < 0.5 / cpus


@linux_only
def test_children_we_wait_for_are_our_own_work() -> None:
    # The ranks of a launched layout are children the timing process waits for: their
    # spin is ours, not a co-tenant's.
    cpus = os.cpu_count() or 1
    spin = "import time\nend = time.perf_counter() + 1.0\nwhile time.perf_counter() < end: pass"
    with OtherLoad() as load:
        subprocess.run([sys.executable, "-c", spin], check=True)
    assert load.share < 0.5 / cpus
