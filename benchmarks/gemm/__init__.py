"""The GEMM shape-class benchmark: is kiln's kernel within 1.2x of the fastest
library routine on this machine, per shape class, fused epilogue included?

* ``benchmarks.gemm.shapes``      -- the cases (tiny / small / large shapes x gelu / bias).
* ``benchmarks.gemm.contenders``  -- kiln, oneDNN pre-packed, torch MKL, ONNX Runtime, numpy.
* ``benchmarks.gemm.worker``      -- the per-contender worker process.
* ``benchmarks.gemm.runner``      -- ``run_gemm``: interleaved rounds, ratios, verdicts, JSON.
* ``benchmarks.gemm.report``      -- ``render_table``.

Run ``python -m benchmarks.gemm --help`` for the command line. This ``__init__``
imports no runtime (the workers import it).
"""
