"""launch(): results come back; a rank that raises, is SIGKILLed or hangs ends the whole job
with RankFailed naming it, and no process of the job (nor a child of a rank) survives."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest
import torch

from kiln.parallel import RankFailed, launch, torchrun_command
from kiln.parallel.launch import threads_per_rank
from tests.parallel import ranks


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def test_results_come_back_in_rank_order() -> None:
    out = launch(ranks.report, 2, args=(0.5,))
    assert [float(r["sum"]) for r in out] == [2.0, 2.0]  # (0.5) + (1.5)
    assert [r["env"]["RANK"] for r in out] == ["0", "1"]
    assert all(r["env"]["WORLD_SIZE"] == "2" and r["threads"] == threads_per_rank(2) for r in out)
    assert not any(alive(r["pid"]) for r in out)


def test_a_rank_that_raises_is_named_with_its_exception() -> None:
    start = time.monotonic()
    with pytest.raises(RankFailed) as info:
        launch(ranks.raise_on_rank_1, 2, timeout_s=20)
    err = info.value
    assert err.rank == 1 and err.exitcode == 1
    assert "ValueError: rank 1 refuses to go on" in str(err)
    assert time.monotonic() - start < 30
    assert not any(alive(pid) for pid in err.pids)


def test_a_killed_rank_ends_the_job_and_no_process_survives(tmp_path: Path) -> None:
    start = time.monotonic()
    with pytest.raises(RankFailed) as info:
        launch(ranks.sigkill_rank_1, 2, args=(str(tmp_path),), timeout_s=60)
    elapsed = time.monotonic() - start
    err = info.value
    assert err.rank == 1 and err.exitcode == -9, err
    assert "rank 1 failed (killed by SIGKILL)" in str(err)
    assert elapsed < 30, f"the job took {elapsed:.1f} s to stop"
    # the ranks and the children they started (their process groups) are all gone
    pids = [int(p) for f in tmp_path.iterdir() for p in f.read_text().split()]
    assert len(pids) == 4 and set(err.pids) <= set(pids)
    deadline = time.monotonic() + 2  # a killed grandchild is reaped by init, not by us
    while any(alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not [p for p in pids if alive(p)]


def test_a_hung_rank_hits_the_timeout() -> None:
    start = time.monotonic()
    with pytest.raises(RankFailed) as info:
        launch(ranks.hang_rank_1, 2, timeout_s=3)
    err = info.value
    assert err.rank == 1 and err.exitcode is None
    assert "no progress for 3 s" in str(err)
    assert time.monotonic() - start < 30
    assert not any(alive(pid) for pid in err.pids)


def test_under_torchrun_the_environment_is_used(monkeypatch: pytest.MonkeyPatch) -> None:
    """With RANK/WORLD_SIZE set (as torchrun sets them) launch runs here, as that rank."""
    from kiln.parallel.launch import free_port

    env = {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1"}
    for key, value in {**env, "MASTER_PORT": str(free_port())}.items():
        monkeypatch.setenv(key, value)
    out = launch(ranks.report, 1, args=(2.0,))
    assert len(out) == 1 and out[0]["pid"] == os.getpid()
    assert torch.equal(out[0]["sum"], torch.tensor([2.0]))
    with pytest.raises(ValueError, match="WORLD_SIZE=1 but the job asks for 2"):
        launch(ranks.report, 2, args=(2.0,))


def test_torchrun_command() -> None:
    cmd = torchrun_command(2, 4, "node0:29400", ["-m", "kiln.cli", "generate"], node_rank=1)
    assert cmd[:6] == [
        "torchrun", "--nnodes=2", "--nproc-per-node=4", "--rdzv-backend=c10d",
        "--rdzv-endpoint=node0:29400", "--rdzv-id=kiln",
    ]  # fmt: skip
    assert cmd[6:] == ["--node-rank=1", "-m", "kiln.cli", "generate"]
    with pytest.raises(ValueError, match="HOST:PORT"):
        torchrun_command(2, 4, "node0", ["x.py"])
