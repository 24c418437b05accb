"""Time to first token of long prompts: kiln's prefill before / after the packed GEMMs, and
llama.cpp's prompt processing on the same GGUF file (docs/benchmarks.md, "Timing protocol").

``python -m kiln.bench.prefill --lengths 128,512,2048 --repeats 5 [--profile] [--kernels]``

The model is SmolLM2-135M-Instruct as ``kiln generate smollm2`` runs it: the catalog GGUF
loaded packed (Q4_1 linear layers as ``Int4Linear``, the Q8_0 head as ``GgufLinear``),
``FastDecoder.prefill`` (the eager model for prompts over 32 rows, the head on the last
position only). TTFT = that prefill + the first argmax, on a prompt of L token ids drawn
with a fixed seed (the same ids for every contender), at batch 1. Contenders, each in its
own worker process with 2 threads:

* ``kiln-after``  -- this tree: linear layers over 16 rows run kiln's prefill GEMM
  (``kiln.kernels.cpu.packed_gemm``), a prompt from position 0 attends with SDPA's
  ``is_causal`` (torch's flash kernel).
* ``kiln-before`` -- the same tree forced onto the previous prefill path (``force_old_path``):
  INT4 / INT8 layers by the decode kernel up to 256 rows and dequantize-in-torch +
  ``F.linear`` above, GGUF layers by dequantized tiles + ``F.linear`` above 16 rows, and
  attention with an explicit (T, S) boolean mask. This is the option that forces the old path.
* ``llamacpp``    -- llama.cpp through ``llama-cpp-python`` (``kiln.bench.llm_decode_peers.
  LlamaCpp``: n_batch 512, 2 threads; TTFT = its first streamed token), when installed.
* ``llama-bench`` -- llama.cpp's ``llama-bench`` binary when on PATH (``-p L -n 0 -t 2``:
  prompt processing only, no sampling, reported by llama.cpp itself).

Rounds are interleaved (every contender x length once per round, the order rotated, each
after a wait for co-tenants to go quiet); a figure is the least TTFT over the rounds, the
median beside it. Ratios: ``speedup`` = kiln-before / kiln-after; ``vs_llamacpp`` = the
llama.cpp contender's TTFT / kiln's (> 1: kiln is faster). ``--profile`` adds, per kiln
contender and length, where the prefill time goes (forward hooks per layer type, the least
of ``--profile-reps`` prefills per category); ``--kernels`` times one linear layer of each
SmolLM2 shape through each kernel (1 thread, best of 20). Both kiln paths' first tokens are
compared (``same_token``). The result goes to ``results/prefill-<device>-<date>.json`` with a
markdown table beside it. ``--gguf q8_0`` (or ``q4_0``, ``q4_k_m``, ``q4_1``, a path: see
``kiln.bench.gguf_variants``) runs every contender on that file instead, kiln's packed as
stored, and puts its quant type in the file name (``prefill-...-q8_0``).
"""

from __future__ import annotations

import argparse
import datetime as dt
import importlib.util
import json
import shutil
import signal
import sys
import tempfile
import time
from collections import defaultdict
from collections.abc import Callable, Sequence
from functools import partial
from pathlib import Path
from typing import IO, Any

from kiln.bench import RESULTS_DIR, system
from kiln.bench.channel import reply_channel, send
from kiln.bench.gguf_variants import describe, gguf_arg, gguf_file
from kiln.bench.prefill_peers import SEED, THREADS, LlamaBench, LlamaCppPrefill, prompt_ids
from kiln.bench.prefill_report import KILN, render_markdown, summarize
from kiln.bench.suite_runner import Worker, timed_request, worker_env

CONTENDERS = ("kiln-before", "kiln-after", "llamacpp", "llama-bench")


# ---------------------------------------------------------------- the old prefill path
def force_old_path(set_attr: Callable[[Any, str, Any], None] = setattr) -> None:
    """Put this process's kernels and attention back on the prefill path from before the
    packed GEMMs (call before the model's first forward: kernels are built lazily).
    ``set_attr``: how attributes are replaced (a test passes ``monkeypatch.setattr``)."""
    import warnings

    import torch.nn.functional as F

    from kiln.kernels.cpu import gguf_blocks, woq
    from kiln.models.transformer import Attention, attention_mask

    set_attr(woq, "KILN_MAX_ROWS", 256)  # the decode kernel up to 256 rows, ...
    set_attr(woq, "_large", lambda gemm, dequant: ("dequant", dequant))  # F.linear above

    def no_gemm(*args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("old prefill path")

    # GGUF layers: dequantized tiles + F.linear above 16 rows
    set_attr(gguf_blocks, "packed_gemm", type("NoGemm", (), {"GgufGemm": staticmethod(no_gemm)}))
    warnings.filterwarnings("ignore", message=".*old prefill path.*")

    def old_attend(self: Attention, q: Any, k: Any, v: Any, positions: Any,
                   static: bool = False) -> Any:  # fmt: skip
        assert self.softcap is None, "the old path is reproduced for soft-cap-free models"
        t, s = q.shape[2], k.shape[2]
        mask = None
        if static or t > 1 or (self.window is not None and s > self.window):
            mask = attention_mask(positions, s, self.window)  # (T, S)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=self.scale,
                                              enable_gqa=k.shape[1] != q.shape[1])  # fmt: skip

    set_attr(Attention, "_attend", old_attend)


# ---------------------------------------------------------------- contenders (workers)
class KilnPrefill:
    """SmolLM2 as ``kiln generate smollm2`` loads it (or the GGUF file ``gguf``, packed as
    stored), prefilled by ``FastDecoder``."""

    def __init__(self, old: bool, gguf: str | None = None) -> None:
        self.old, self.gguf = old, gguf

    def prepare(self, lengths: Sequence[int]) -> dict[str, Any]:
        import torch

        torch.set_num_threads(THREADS)
        if self.old:
            force_old_path()
        from kiln.bench.contenders.llm_kiln import packed_layers
        from kiln.llm.fast_decoder import FastDecoder
        from kiln.models.load import load_model

        loaded = load_model(self.gguf or "smollm2", torch.float32, packed=True,
                            with_tokenizer=False)  # fmt: skip
        self.model = loaded.model.eval()
        self.dec = FastDecoder(self.model, 1, max(lengths) + 1)
        for n in lengths:
            self.ttft(n)  # warm-up: kernels built, panels made
        kinds = sorted({type(m).__name__ for m in self.model.modules() if hasattr(m, "kind")})
        return {"runtime": f"kiln (torch {torch.__version__})", "threads": THREADS,
                "path": "before" if self.old else "after", "linear_kinds": kinds,
                "dtype": f"GGUF as stored, packed ({packed_layers(self.model)})"}  # fmt: skip

    def ttft(self, n: int) -> dict[str, Any]:
        import torch

        tokens = torch.tensor([prompt_ids(n, self.model.cfg.vocab_size)])
        with torch.inference_mode():
            t0 = time.perf_counter()
            tok = int(self.dec.prefill(tokens)[0, -1].argmax())
            t1 = time.perf_counter()
        return {"ttft_s": t1 - t0, "token": tok}

    def profile(self, n: int, reps: int) -> dict[str, float]:
        """Seconds per layer type (the least of ``reps`` prefills per category)."""
        return profile_prefill(self.model, lambda: self.ttft(n), reps)


def profile_prefill(model: Any, run: Callable[[], Any], reps: int) -> dict[str, float]:
    """Where a prefill's time goes: forward hooks time every compressed linear layer (by
    name: q/k/v/o, gate/up/down, head), the attention and MLP modules and the norms; the
    attention core (rope, cache write, SDPA) and the MLP's activation are the modules' time
    less their linear layers'. Each category: the least over ``reps`` runs."""
    from kiln.compress.modules import CompressedLinear
    from kiln.models.transformer import MLP, Attention, Norm

    acc: dict[str, float] = defaultdict(float)
    starts: dict[int, float] = {}
    handles = []
    for name, mod in model.named_modules():
        if isinstance(mod, CompressedLinear):
            key = "head" if name == "lm_head" else f"linear.{name.rsplit('.', 1)[-1]}"
        elif isinstance(mod, (Attention, MLP, Norm)):
            key = {Attention: "attention_module", MLP: "mlp_module", Norm: "norm"}[type(mod)]
        else:
            continue

        def pre(m: Any, args: Any) -> None:
            starts[id(m)] = time.perf_counter()

        def post(m: Any, args: Any, out: Any, key: str = key) -> None:
            acc[key] += time.perf_counter() - starts[id(m)]

        handles += [mod.register_forward_pre_hook(pre), mod.register_forward_hook(post)]
    best: dict[str, float] = {}
    try:
        for _ in range(reps):
            acc.clear()
            t0 = time.perf_counter()
            run()
            acc["total"] = time.perf_counter() - t0
            lin = sum(v for k, v in acc.items() if k.startswith("linear."))
            acc["linear_all"] = lin
            acc["attention_core"] = acc["attention_module"] - sum(
                acc.get(f"linear.{p}", 0.0) for p in "qkvo"
            )
            acc["mlp_activation"] = acc["mlp_module"] - sum(
                acc.get(f"linear.{p}", 0.0) for p in ("gate", "up", "down"))  # fmt: skip
            acc["other"] = acc["total"] - lin - acc["attention_core"] - acc["mlp_activation"] - (
                acc["norm"] + acc.get("head", 0.0))  # fmt: skip
            for k, v in acc.items():
                best[k] = min(best.get(k, v), v)
    finally:
        for h in handles:
            h.remove()
    return best


def _contender(name: str, gguf: str | None) -> Any:
    if name in KILN:
        return KilnPrefill(old=name == "kiln-before", gguf=gguf)
    return {"llamacpp": LlamaCppPrefill, "llama-bench": LlamaBench}[name](gguf)


def serve(args: argparse.Namespace, chan: IO[str]) -> int:
    """Worker: prepare, reply ready, then answer ``round L`` / ``profile L R`` / ``kernels``
    / ``finish`` lines with one JSON line each."""
    lengths = [int(n) for n in args.lengths.split(",")]
    try:
        c = None if args.worker == "kernels" else _contender(args.worker, args.gguf)
        facts = {} if c is None else c.prepare(lengths)
    except Exception as e:  # noqa: BLE001 - every failure becomes a recorded error
        send(chan, {"error": f"{type(e).__name__}: {e}"[:2000]})
        return 1
    send(chan, {"ready": True, **facts})
    for line in sys.stdin:
        cmd = line.split()
        try:
            if cmd[0] == "round" and c is not None:
                send(chan, c.ttft(int(cmd[1])))
            elif cmd[0] == "profile" and isinstance(c, KilnPrefill):
                send(chan, c.profile(int(cmd[1]), int(cmd[2])))
            elif cmd[0] == "kernels":
                send(chan, {"kernels": kernel_table()})
            elif cmd[0] == "finish":
                send(chan, {"ok": True})
                return 0
            else:
                send(chan, {"error": f"unknown command {line.strip()!r}"})
        except Exception as e:  # noqa: BLE001
            send(chan, {"error": f"{type(e).__name__}: {e}"[:2000]})
    return 0


# ---------------------------------------------------------------- kernel table
def kernel_table(rows: Sequence[int] = (8, 16, 24, 32, 64, 512), reps: int = 20
                 ) -> list[dict[str, Any]]:  # fmt: skip
    """One INT4 (group 32) layer of each SmolLM2 shape, 1 thread, best of ``reps``: ms of
    the decode kernel (woq.h), the prefill GEMM, the old large-M path (dequantize in torch
    + F.linear) and MKL's sgemm on the fp32 weight alone (F.linear)."""
    import torch
    import torch.nn.functional as F

    from kiln.kernels.cpu import packed_gemm, woq
    from kiln.kernels.formats import dequantize_int4

    torch.set_num_threads(1)
    out = []
    for k, n in ((576, 1536), (1536, 576), (576, 576), (576, 192)):
        gen = torch.Generator().manual_seed(k + n)
        packed = torch.randint(0, 256, (n, k // 2), dtype=torch.uint8, generator=gen)
        scale = (torch.rand(n, k // 32, generator=gen) * 0.02 + 1e-3).half()
        offset = (torch.randn(n, k // 32, generator=gen) * 0.1).half()
        w = dequantize_int4(packed, scale, offset, 32)
        fns: dict[str, Callable[[Any], Any]] = {"decode_kernel": woq.cpu_int4_kernel(packed, scale, offset, 32, "kiln"),
               "gemm": packed_gemm.Int4Gemm(packed, scale, offset, 32),
               "dequant_linear": woq.cpu_int4_kernel(packed, scale, offset, 32, "dequant")}  # fmt: skip
        for m in rows:
            x = torch.randn(m, k)
            calls: dict[str, Callable[[], Any]] = {
                **{name: partial(f, x) for name, f in fns.items()},
                "mkl_fp32": partial(F.linear, x, w),
            }
            best = {name: float("inf") for name in calls}
            for _ in range(reps):
                for name, f in calls.items():
                    t0 = time.perf_counter()
                    f()
                    best[name] = min(best[name], time.perf_counter() - t0)
            out.append({"k": k, "n": n, "m": m, **{f"{a}_ms": b * 1e3 for a, b in best.items()},
                        "gemm_gflops": 2 * m * k * n / best["gemm"] / 1e9})  # fmt: skip
    return out


# ---------------------------------------------------------------- driver
def _available(name: str) -> str | None:
    """Why contender ``name`` cannot run here (None: it can)."""
    if name == "llamacpp" and importlib.util.find_spec("llama_cpp") is None:
        return "llama-cpp-python is not installed (the bench-llamacpp extra)"
    if name == "llama-bench" and shutil.which("llama-bench") is None:
        return "llama-bench is not on PATH"
    return None


def run_prefill(
    contenders: Sequence[str] = CONTENDERS,
    lengths: Sequence[int] = (128, 512, 2048),
    repeats: int = 5,
    out_dir: str | Path = RESULTS_DIR,
    *,
    profile: bool = False,
    profile_reps: int = 3,
    kernels: bool = False,
    quiet_wait_s: float = 2.0,
    quiet_busy: float = 0.25,
    tag: str = "",
    gguf: str | None = None,
    log: Callable[[str], None] = print,
) -> dict[str, Any]:
    """Run the benchmark (module doc), write JSON + markdown, return the result (file
    prefill-DEVICE-DATE, then the quant type of ``gguf`` (a ``gguf_arg`` value) and ``-tag``
    when given, so a second run the same day keeps the first)."""
    cpu = system.cpu_info()
    now = dt.datetime.now(dt.timezone.utc)
    opts = {"quiet_wait_s": quiet_wait_s, "quiet_busy": quiet_busy, "round_timeout_s": 900.0}
    result: dict[str, Any] = {
        "schema": 1, "kind": "prefill", "date": now.isoformat(timespec="seconds"),
        "device": {**cpu, "slug": system.device_slug(cpu), "isa": _isa()},
        "versions": _versions(), "threads": THREADS, "lengths": list(lengths),
        "repeats": repeats, "prompt": f"random token ids, seed {SEED}", "batch": 1,
        "protocol": {**opts, "statistic": "least TTFT of the rounds (median beside it)",
                     "order": "rotated each round", "each runtime": "its own process"},
        "load_before": system.load_snapshot(), "contenders": {}, "results": [],
    }  # fmt: skip
    common = ["--lengths", ",".join(map(str, lengths))]
    if gguf is not None:  # made here, once, before any worker reads it
        path = gguf_file(gguf)
        result["gguf"] = describe(path)
        common += ["--gguf", str(path)]
        tag = "-".join(filter(None, (result["gguf"]["file_type"], tag)))
    with tempfile.TemporaryDirectory(prefix="kiln-prefill-") as tmp:
        env = worker_env(Path(tmp) / "inductor-cache")
        workers: dict[str, Worker] = {}
        for name in contenders:
            why = _available(name)
            if why is not None:
                result["contenders"][name] = {"error": f"not run: {why}"}
                log(f"{name}: not run ({why})")
                continue
            log(f"preparing {name}")
            w = Worker(["--worker", name, *common], env, Path(tmp) / f"{name}.log",
                       module="kiln.bench.prefill")  # fmt: skip
            msg = w.recv(900.0)
            result["contenders"][name] = msg
            if "error" in msg:
                log(f"  {name}: {msg['error'][:300]}")
                w.close()
            else:
                workers[name] = w
        try:
            rounds = _interleave(workers, lengths, repeats, opts, log)
            if profile:
                result["breakdown"] = _profiles(workers, lengths, profile_reps, log)
            if kernels:
                result["kernels"] = _kernels(env, Path(tmp), log)
        finally:
            for w in workers.values():
                if w.proc.poll() is None:
                    w.send("finish")
                    w.recv(30.0)
                w.close()
    result["results"] = summarize(rounds)
    result["load_after"] = system.load_snapshot()
    name = f"prefill-{result['device']['slug']}-{now:%Y%m%d}{'-' + tag if tag else ''}.json"
    return system.write_result(result, out_dir, name, render_markdown(result))


def _isa() -> str:
    from kiln.core import native

    return native.isa()


def _versions() -> dict[str, str | None]:
    from importlib import metadata

    out = system.versions()
    for pkg in ("llama_cpp_python", "gguf"):
        try:
            out[pkg] = metadata.version(pkg)
        except metadata.PackageNotFoundError:
            out[pkg] = None
    return out


def _interleave(
    workers: dict[str, Worker], lengths: Sequence[int], repeats: int, opts: dict[str, Any],
    log: Callable[[str], None],
) -> dict[tuple[str, int], list[dict[str, Any]]]:  # fmt: skip
    units = [(name, n) for n in lengths for name in workers]
    rounds: dict[tuple[str, int], list[dict[str, Any]]] = {u: [] for u in units}
    for r in range(repeats):
        k = r % max(len(units), 1)
        for name, n in units[k:] + units[:k]:
            if name not in workers:
                continue
            msg, other, quiet = timed_request(workers[name], f"round {n}", opts)
            msg.update(round=r, cotenant_busy=other, busy_before=quiet)
            rounds[(name, n)].append(msg)
            if "error" in msg:
                log(f"  {name} L{n} round {r}: {msg['error'][:300]}")
                workers.pop(name).close()
            else:
                log(f"  round {r} {name} L{n}: TTFT {msg['ttft_s'] * 1e3:.0f} ms")
    return rounds


def _profiles(workers: dict[str, Worker], lengths: Sequence[int], reps: int,
              log: Callable[[str], None]) -> dict[str, dict[str, dict[str, float]]]:  # fmt: skip
    out: dict[str, dict[str, dict[str, float]]] = {}
    for name in KILN:
        if name not in workers:
            continue
        for n in lengths:
            log(f"profiling {name} L{n}")
            workers[name].send(f"profile {n} {reps}")
            out.setdefault(name, {})[str(n)] = workers[name].recv(1800.0)
    return out


def _kernels(env: dict[str, str], tmp: Path, log: Callable[[str], None]) -> Any:
    log("timing the kernels of one layer (1 thread)")
    w = Worker(["--worker", "kernels", "--lengths", "1"], env, tmp / "kernels.log",
               module="kiln.bench.prefill")  # fmt: skip
    try:
        msg = w.recv(300.0)
        if "error" in msg:
            return msg
        w.send("kernels")
        table = w.recv(1800.0)
        w.send("finish")
        w.recv(30.0)
        return table.get("kernels", table)
    finally:
        w.close()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m kiln.bench.prefill", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    p.add_argument("--contenders", default=",".join(CONTENDERS),
                   help="comma list of " + ", ".join(CONTENDERS) + " (kiln-before: the old path)")  # fmt: skip
    p.add_argument("--lengths", default="128,512,2048", help="prompt lengths in tokens")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--profile", action="store_true", help="also break the kiln prefills down")
    p.add_argument("--profile-reps", type=int, default=3)
    p.add_argument("--kernels", action="store_true", help="also time one layer per kernel")
    p.add_argument("--quiet-wait-s", type=float, default=2.0,
                   help="before each round, wait up to this long for co-tenants to go quiet")  # fmt: skip
    p.add_argument("--out", default=str(RESULTS_DIR))
    p.add_argument("--tag", default="", help="file name suffix: prefill-DEVICE-DATE-TAG.json")
    p.add_argument("--gguf", type=gguf_arg, default=None,
                   help="a GGUF file, or q4_0 / q8_0 / q4_k_m (made from the catalog's) / q4_1")  # fmt: skip
    p.add_argument("--from-result", default=None, help="render this result JSON, run nothing")
    p.add_argument("--worker", default=None, help=argparse.SUPPRESS)  # internal: one contender
    args = p.parse_args(argv)
    if args.worker:
        return serve(args, reply_channel())
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    if args.from_result:
        result = json.loads(Path(args.from_result).read_text())
        rounds = {(e["contender"], e["length"]): e["rounds"] for e in result["results"]}
        result["results"] = summarize(rounds)  # (recomputed: files of older versions)
    else:
        result = run_prefill(
            [c for c in args.contenders.split(",") if c],
            [int(n) for n in args.lengths.split(",") if n], args.repeats, args.out,
            profile=args.profile, profile_reps=args.profile_reps, kernels=args.kernels,
            quiet_wait_s=args.quiet_wait_s, tag=args.tag, gguf=args.gguf,
        )  # fmt: skip
        print(f"wrote {result['path']} and {result['markdown_path']}")
    print(render_markdown(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
