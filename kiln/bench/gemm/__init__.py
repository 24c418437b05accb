"""The GEMM shape-class benchmark: is kiln's kernel within 1.2x of the fastest
library routine on this machine, per shape class, fused epilogue included?

* ``kiln.bench.gemm.shapes``      -- the cases (tiny / small / large shapes x gelu / bias).
* ``kiln.bench.gemm.gemm_contenders``  -- kiln, oneDNN pre-packed, torch MKL, ONNX Runtime, numpy.
* ``kiln.bench.gemm.gemm_worker``      -- the per-contender worker process.
* ``kiln.bench.gemm.gemm_runner``      -- ``run_gemm``: interleaved rounds, ratios, verdicts, JSON.
* ``kiln.bench.gemm.gemm_table``      -- ``render_table``.

Run ``python -m kiln.bench.gemm --help`` for the command line. This ``__init__``
imports no runtime (the workers import it).
"""
