"""Command line: ``python -m kiln.bench.gemm [--shapes tiny,8x256x688] [--rounds 3]``.

Runs the GEMM shape-class benchmark (every contender in its own process),
writes ``results/gemm-<device>-<yyyymmdd>.json`` and prints the
markdown table; ``--from-result FILE`` only renders a saved result.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from kiln.bench import RESULTS_DIR
from kiln.bench.gemm.gemm_contenders import NAMES
from kiln.bench.gemm.gemm_runner import run_gemm
from kiln.bench.gemm.gemm_table import render_table
from kiln.bench.gemm.shapes import CLASSES, EPILOGUES, parse_shapes


def _parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m kiln.bench.gemm", description=__doc__)
    p.add_argument("--shapes", nargs="+", default=["all"],
                   help=f"classes ({', '.join(CLASSES)}, all) and/or MxKxN, comma or space list")  # fmt: skip
    p.add_argument(
        "--contenders", default=",".join(NAMES), help="comma list of " + ", ".join(NAMES)
    )
    p.add_argument("--epilogues", default=",".join(EPILOGUES), help="comma list: gelu, bias")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--reps", type=int, default=10)
    p.add_argument("--rep-ms", type=float, default=5.0, help="length of one repetition")
    p.add_argument("--warmup-s", type=float, default=0.2, help="warm-up per case and contender")
    p.add_argument("--quiet-wait-s", type=float, default=1.0,
                   help="before each timing, wait up to this long for co-tenants to go quiet")  # fmt: skip
    p.add_argument("--retries", type=int, default=1,
                   help="repeat a timing disturbed by co-tenants up to this many times")  # fmt: skip
    p.add_argument("--out", default=str(RESULTS_DIR))
    p.add_argument("--from-result", default=None, help="render this result JSON, run nothing")
    return p.parse_args(argv)


def _progress(kind: str, info: dict[str, Any]) -> None:
    """One stderr line per step, so a long run shows where it is."""
    if kind == "prepare":
        msg = f"preparing {info['contender']}"
    elif kind == "prepared":
        bad = [n for n, f in info["cases"].items() if "error" in f]
        msg = f"{info['contender']} ready" + (f"; failed: {', '.join(bad)}" if bad else "")
    elif kind == "round":
        msg = f"round {info['round']}/{info['rounds']} done"
    elif kind == "export":
        msg = "exporting ONNX"
    else:
        return
    print(msg, file=sys.stderr, flush=True)


def main(argv: list[str] | None = None) -> int:
    """Entry point for ``python -m kiln.bench.gemm``."""
    args = _parse(argv)
    if args.from_result:
        result = json.loads(Path(args.from_result).read_text())
    else:
        shapes = parse_shapes(",".join(args.shapes))
        result = run_gemm(
            shapes, args.contenders.split(","), args.epilogues.split(","), rounds=args.rounds,
            reps=args.reps, out_dir=args.out, warmup_s=args.warmup_s, rep_ms=args.rep_ms,
            quiet_wait_s=args.quiet_wait_s, retries=args.retries, on_event=_progress,
        )  # fmt: skip
        print(f"wrote {result['path']}", file=sys.stderr)
    print(render_table(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
