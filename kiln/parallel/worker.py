"""One rank started by ``kiln.parallel.launch``: ``python -m kiln.parallel.worker RUN_DIR``.

Reads ``RUN_DIR/payload.pkl`` (fn, args, backend, collective timeout), takes its rank and
world size from ``RANK``/``WORLD_SIZE``, runs ``launch.run_rank`` and leaves either
``result_{rank}.pkl`` (exit 0) or ``error_{rank}.txt`` with the traceback (exit 1) for the
parent. Nothing here is meant to be run by hand.
"""

from __future__ import annotations

import os
import pickle
import sys
import traceback
from pathlib import Path

import torch

from kiln.parallel.launch import (
    ERROR_FILE,
    PAYLOAD_FILE,
    RESULT_FILE,
    run_rank,
    threads_per_rank,
)


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print("usage: python -m kiln.parallel.worker RUN_DIR", file=sys.stderr)
        return 2
    run_dir = Path(argv[0])
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    try:
        with open(run_dir / PAYLOAD_FILE, "rb") as f:
            fn, args, backend, collective_timeout_s = pickle.load(f)
        torch.set_num_threads(threads_per_rank(world_size))
        result = run_rank(fn, rank, world_size, args, backend, collective_timeout_s)
        tmp = run_dir / f"{RESULT_FILE.format(rank=rank)}.tmp"
        with open(tmp, "wb") as f:
            pickle.dump(result, f)
        tmp.rename(run_dir / RESULT_FILE.format(rank=rank))  # appears whole or not at all
    except Exception:
        # The parent reports this text in RankFailed. Exit at once, without tearing down
        # the process group or the interpreter: waiting on peers could hang, and the
        # error file must be older than the errors this exit causes on the other ranks.
        (run_dir / ERROR_FILE.format(rank=rank)).write_text(traceback.format_exc())
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(1)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
