"""kiln's benchmark suite: small models built in code and a side-by-side runner.

* ``benchmarks.models``      -- the model registry (``MODELS``, ``DEFAULT_MODEL``).
* ``benchmarks.contenders``  -- one module per runtime (eager, inductor, ort, openvino, kiln).
* ``benchmarks.worker``      -- the per-contender worker process the runner starts.
* ``benchmarks.runner``      -- ``run_suite``: interleaved rounds, ratios, errors, roofline.
* ``benchmarks.report``      -- ``render_table`` / ``update_readme``.

Run ``python -m benchmarks --help`` for the command line.
"""
