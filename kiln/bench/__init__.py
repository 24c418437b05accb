"""kiln's benchmarks: the small-model suite, the LLM decode and compression runs.

Everything here measures kiln side by side with its peers as ``docs/benchmarks.md``
prescribes (each runtime in its own process, interleaved rounds, ratios only). It may
import any part of kiln; nothing in the library imports it except the CLI's ``demo`` and
``bench`` sub-commands.

* ``suite``         -- the small-model registry (``MODELS``, ``DEFAULT_MODEL``).
* ``contenders``    -- one module per runtime (eager, inductor, ort, openvino, kiln; HF, kiln LLM).
* ``suite_worker``  -- the per-contender worker process the runner starts.
* ``suite_runner``  -- ``run_suite``: interleaved rounds, ratios, errors, roofline.
* ``suite_table``   -- ``render_table`` / ``update_readme``.
* ``gemm``, ``llm_decode``, ``prefill``, ``speculative_rounds``, ``quant_matmul``, ``compression``,
  ``offload_memory``, ``gpu_quant``, ``cost_accuracy`` (the CPU cost model, predicted vs
  measured per kernel), ``cost_ab`` (roofline vs calibrated costs, end to end) -- the other
  runs, each ``python -m kiln.bench.<name>``.

Results go to ``results/`` under the working directory (the repository root when run as
the README says): ``python -m kiln.bench --help``.
"""

from pathlib import Path

RESULTS_DIR = Path("results")
