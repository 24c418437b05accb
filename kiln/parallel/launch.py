"""Start the ranks of a torch.distributed job on this machine, watch them, return results.

``launch(fn, world_size, args)`` runs ``fn(rank, world_size, *args)`` in ``world_size``
processes, each with its process group initialised (gloo on CPU, NCCL on GPU), and returns
the ranks' return values in rank order (tensors moved to the CPU)::

    results = launch(my_fn, 2, args=(model_factory,), timeout_s=60)

Each rank is ``python -m kiln.parallel.worker RUN_DIR`` in a session of its own (so its own
children share its process group), with ``MASTER_ADDR``/``MASTER_PORT`` (a free local
port), ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK`` in its environment and ``cores // world``
torch threads. ``fn`` and ``args`` travel by pickle (``fn`` must be importable: a module
level function, or a ``functools.partial`` of one) and so do the results.

The parent polls every rank. A rank that exits with an exception or is killed by a signal,
or a job that makes no progress for ``timeout_s`` seconds (a rank reports progress by
calling ``progress()``; joining the process group is its first report, which every rank
must make within ``start_timeout_s``: importing torch on a busy machine takes seconds),
ends the job: every rank's process group is killed with SIGKILL and reaped (no zombies, no
orphans) and ``RankFailed`` names the rank and its exit code, signal or exception text.
The ranks' own collective timeout is longer than both, so the parent's diagnosis comes
first.

Several machines (torchrun rendezvous): run the same program on every machine through
``torchrun`` (``torchrun_command`` builds the line), e.g. on each of 2 machines::

    torchrun --nnodes=2 --nproc-per-node=2 --rdzv-backend=c10d \\
        --rdzv-endpoint=HOST0:29400 --rdzv-id=kiln -m kiln.cli generate ... --tp 2 --pp 2

torchrun sets ``RANK``/``WORLD_SIZE``/``LOCAL_RANK``/``MASTER_ADDR``/``MASTER_PORT`` in each
process; ``launch`` sees them and, instead of spawning, runs ``fn`` in this process as that
rank and all-gathers every rank's result, so the same call works in both settings.
"""

from __future__ import annotations

import contextlib
import os
import pickle
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

POLL_S = 0.05  # how often the parent looks at its ranks
GRACE_S = 0.5  # after a first failure, how long to wait for the others' exit states
COLLECTIVE_MARGIN_S = 5.0  # ranks' own timeout = start_timeout_s + timeout_s + this
PROGRESS_FILE = "progress_{rank}"
RESULT_FILE = "result_{rank}.pkl"
ERROR_FILE = "error_{rank}.txt"
PAYLOAD_FILE = "payload.pkl"


class RankFailed(RuntimeError):
    """One rank of a job died, raised or hung; the whole job was stopped.

    ``rank``: the rank to blame (a signal-killed rank before one that raised; for a hang,
    the rank with the least progress); ``exitcode``: its exit code (negative: the signal)
    or None if it was still running (hung); ``detail``: its exception text or the reason;
    ``pids``: the process ids of every rank of the job (all reaped when this is raised).
    """

    def __init__(self, rank: int, exitcode: int | None, detail: str, pids: list[int]) -> None:
        self.rank, self.exitcode, self.detail, self.pids = rank, exitcode, detail, pids
        super().__init__(f"rank {rank} failed ({describe_exit(exitcode)}): {detail}")


def describe_exit(exitcode: int | None) -> str:
    """'exit code 1', 'killed by SIGKILL', or 'still running' for a process's return code."""
    if exitcode is None:
        return "still running"
    if exitcode < 0:
        return f"killed by {signal.Signals(-exitcode).name}"
    return f"exit code {exitcode}"


def threads_per_rank(world_size: int) -> int:
    """This machine's cores (those the process may run on) divided among the ranks, >= 1."""
    return max(1, len(os.sched_getaffinity(0)) // world_size)


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def under_torchrun() -> bool:
    """Whether this process is a rank started by torchrun (or another launcher)."""
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def progress() -> None:
    """Report that this rank is making progress (e.g. once per generated token). Outside a
    rank started by ``launch`` it does nothing."""
    run_dir = os.environ.get("KILN_RUN_DIR")
    if run_dir is None:
        return
    path = Path(run_dir) / PROGRESS_FILE.format(rank=os.environ["RANK"])
    count = int(path.read_text()) + 1 if path.exists() else 1
    path.write_text(str(count))


def to_cpu(value: Any) -> Any:
    """``value`` with every tensor (inside lists, tuples, dicts) moved to the CPU."""
    if isinstance(value, torch.Tensor):
        return value.detach().cpu()
    if isinstance(value, list | tuple):
        return type(value)(to_cpu(v) for v in value)
    if isinstance(value, dict):
        return {k: to_cpu(v) for k, v in value.items()}
    return value


def run_rank(
    fn: Callable[..., Any], rank: int, world_size: int, args: Sequence[Any],
    backend: str, collective_timeout_s: float,
) -> Any:  # fmt: skip
    """Initialise the process group from the environment, run ``fn`` as ``rank``, wait for
    every rank to finish it, tear the group down. Returns ``fn``'s result on the CPU."""
    timeout = timedelta(seconds=collective_timeout_s)
    if backend == "nccl":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank)))
    dist.init_process_group(backend, rank=rank, world_size=world_size, timeout=timeout)
    progress()  # joined: the parent's stall clock starts
    # No teardown on an exception: the worker records it and exits at once, before its
    # peers notice, so the parent can tell the cause from the consequences.
    result = to_cpu(fn(rank, world_size, *args))
    dist.barrier()  # rank 0 hosts the rendezvous store: nobody leaves early
    dist.destroy_process_group()
    return result


def launch(
    fn: Callable[..., Any],
    world_size: int,
    args: Sequence[Any] = (),
    timeout_s: float = 30.0,
    backend: str = "gloo",
    start_timeout_s: float = 120.0,
) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` ranks; their results in rank
    order. Raises ``RankFailed`` if a rank dies, raises, does not join within
    ``start_timeout_s`` or the job makes no progress for ``timeout_s``."""
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    collective_s = start_timeout_s + timeout_s + COLLECTIVE_MARGIN_S
    if under_torchrun():
        return _launch_in_place(fn, world_size, args, collective_s, backend)
    with tempfile.TemporaryDirectory(prefix="kiln-launch-") as tmp:
        run_dir = Path(tmp)
        with open(run_dir / PAYLOAD_FILE, "wb") as f:
            pickle.dump((fn, tuple(args), backend, collective_s), f)
        procs = _start(run_dir, world_size)
        try:
            _watch(procs, run_dir, timeout_s, start_timeout_s)
        finally:
            _kill_all(procs)
        return [_read_result(run_dir, rank) for rank in range(world_size)]


def _launch_in_place(
    fn: Callable[..., Any],
    world_size: int,
    args: Sequence[Any],
    collective_timeout_s: float,
    backend: str,
) -> list[Any]:
    env_world = int(os.environ["WORLD_SIZE"])
    if env_world != world_size:
        raise ValueError(
            f"launched with WORLD_SIZE={env_world} but the job asks for {world_size} ranks"
        )
    rank = int(os.environ["RANK"])
    owns_group = not dist.is_initialized()
    if owns_group:
        timeout = timedelta(seconds=collective_timeout_s)
        dist.init_process_group(backend, rank=rank, world_size=world_size, timeout=timeout)
    try:
        mine = to_cpu(fn(rank, world_size, *args))
        gathered: list[Any] = [None] * world_size
        dist.all_gather_object(gathered, mine)
        return gathered
    finally:
        if owns_group:
            dist.destroy_process_group()


def _start(run_dir: Path, world_size: int) -> list[subprocess.Popen[bytes]]:
    threads = threads_per_rank(world_size)
    paths = [p for p in sys.path if p]
    base = dict(os.environ)
    base.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), WORLD_SIZE=str(world_size),
        KILN_RUN_DIR=str(run_dir), OMP_NUM_THREADS=str(threads),
        PYTHONPATH=os.pathsep.join([*paths, base.get("PYTHONPATH", "")]).rstrip(os.pathsep),
    )  # fmt: skip
    procs = []
    for rank in range(world_size):
        env = {**base, "RANK": str(rank), "LOCAL_RANK": str(rank)}
        cmd = [sys.executable, "-m", "kiln.parallel.worker", str(run_dir)]
        procs.append(subprocess.Popen(cmd, env=env, start_new_session=True))
    return procs


def _watch(
    procs: list[subprocess.Popen[bytes]], run_dir: Path, timeout_s: float, start_timeout_s: float
) -> None:
    """Return when every rank exited 0; raise RankFailed at the first failure or stall."""
    pids = [p.pid for p in procs]
    started = time.monotonic()
    while True:
        codes = [p.poll() for p in procs]
        if all(c == 0 for c in codes):
            return
        if any(c not in (None, 0) for c in codes):
            deadline = time.monotonic() + GRACE_S
            while time.monotonic() < deadline and any(p.poll() is None for p in procs):
                time.sleep(POLL_S)
            raise _blame([p.poll() for p in procs], run_dir, pids)
        times = [_progress_time(run_dir, r) for r in range(len(procs))]
        now = time.monotonic()
        if any(t is None for t in times):
            if now - started > start_timeout_s:
                late = [r for r, t in enumerate(times) if t is None]
                detail = f"did not join the process group within {start_timeout_s:g} s"
                raise RankFailed(late[0], codes[late[0]], f"{detail} (ranks {late})", pids)
        elif now - max(t for t in times if t is not None) > timeout_s:
            raise _blame_stall(codes, run_dir, pids, timeout_s)
        time.sleep(POLL_S)


def _progress_time(run_dir: Path, rank: int) -> float | None:
    """When ``rank`` last reported progress, on the monotonic clock (None: never)."""
    path = run_dir / PROGRESS_FILE.format(rank=rank)
    try:
        age = time.time() - path.stat().st_mtime
    except FileNotFoundError:
        return None
    return time.monotonic() - age


def _progress_count(run_dir: Path, rank: int) -> int:
    path = run_dir / PROGRESS_FILE.format(rank=rank)
    text = path.read_text().strip() if path.exists() else ""
    return int(text) if text else 0


def _blame(codes: list[int | None], run_dir: Path, pids: list[int]) -> RankFailed:
    """The first cause among failed ranks: one killed by a signal, else the one whose
    exception was recorded first (its peers' errors about a lost connection come later)."""
    failed = [r for r, c in enumerate(codes) if c not in (None, 0)]
    killed = [r for r in failed if (codes[r] or 0) < 0]
    rank = killed[0] if killed else min(failed, key=lambda r: (_error_time(run_dir, r), r))
    detail = _error_text(run_dir, rank) or "it left no exception (killed, or exited)"
    others = [f"rank {r}: {describe_exit(codes[r])}" for r in failed if r != rank]
    if others:
        detail += f" [also failed: {', '.join(others)}]"
    return RankFailed(rank, codes[rank], detail, pids)


def _blame_stall(
    codes: list[int | None], run_dir: Path, pids: list[int], timeout_s: float
) -> RankFailed:
    running = [r for r, c in enumerate(codes) if c is None]
    counts = {r: _progress_count(run_dir, r) for r in running}
    rank = min(running, key=lambda r: (counts[r], r))
    detail = f"no progress for {timeout_s:g} s: hung (progress reports per running rank: {counts})"
    return RankFailed(rank, None, detail, pids)


def _error_time(run_dir: Path, rank: int) -> int:
    path = run_dir / ERROR_FILE.format(rank=rank)
    return path.stat().st_mtime_ns if path.exists() else sys.maxsize


def _error_text(run_dir: Path, rank: int) -> str:
    path = run_dir / ERROR_FILE.format(rank=rank)
    return path.read_text().strip() if path.exists() else ""


def _read_result(run_dir: Path, rank: int) -> Any:
    path = run_dir / RESULT_FILE.format(rank=rank)
    if not path.exists():
        raise RankFailed(rank, 0, "exited 0 without writing its result", [])
    with open(path, "rb") as f:
        return pickle.load(f)


def _kill_all(procs: list[subprocess.Popen[bytes]]) -> None:
    """SIGKILL every rank's whole process group (its own children too), then reap."""
    for p in procs:
        with contextlib.suppress(ProcessLookupError):  # nothing left in that group
            os.killpg(p.pid, signal.SIGKILL)  # the group outlives its leader's exit
    for p in procs:
        p.wait()


def torchrun_command(
    nnodes: int,
    nproc_per_node: int,
    rdzv_endpoint: str,
    program: Sequence[str],
    node_rank: int | None = None,
    rdzv_id: str = "kiln",
) -> list[str]:
    """The torchrun line to run on each of ``nnodes`` machines for a multi-machine job.

    ``rdzv_endpoint``: ``HOST:PORT`` of one machine every other can reach (the c10d
    rendezvous store); ``program``: what each rank runs, e.g. ``["-m", "kiln.cli",
    "generate", CHECKPOINT, "--tp", "2", "--pp", "2"]``; ``node_rank`` pins this machine's
    place in the rank order (otherwise the rendezvous assigns one). Ranks are numbered
    node by node, so ranks of one machine are consecutive (keep a tensor-parallel group on
    one machine: tp <= nproc_per_node).
    """
    if nnodes < 1 or nproc_per_node < 1:
        raise ValueError(f"nnodes and nproc_per_node must be >= 1, got {nnodes}, {nproc_per_node}")
    if ":" not in rdzv_endpoint:
        raise ValueError(f"rdzv_endpoint must be HOST:PORT, got {rdzv_endpoint!r}")
    cmd = [
        "torchrun", f"--nnodes={nnodes}", f"--nproc-per-node={nproc_per_node}",
        "--rdzv-backend=c10d", f"--rdzv-endpoint={rdzv_endpoint}", f"--rdzv-id={rdzv_id}",
    ]  # fmt: skip
    if node_rank is not None:
        cmd.append(f"--node-rank={node_rank}")
    return [*cmd, *program]
